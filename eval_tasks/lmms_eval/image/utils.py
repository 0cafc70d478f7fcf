"""Image tasks: what the derived ChartQA, DocVQA, GQA, MMMU, AI2D... need beyond upstream's config.

- AI2D is scored as the report's table scores it, by upstream's own rule (a bare option letter is
  credited, prose is not); :class:`ProseTolerantChoice` is the report's aside, a second filter
  pipeline (``prose-tolerant``) that reads the option from a letter, a sentence or the option's
  text (:func:`apertus_plugins.posttrain.evaluation.extract_choice`).
- GQA joins its images from the local ``testdev_balanced_images`` configuration when a local
  copy is set (:func:`gqa_process_docs`).
- MathVista reads the answer from the reply with upstream's extraction prompt, sent to the judge the
  user names (:func:`mathvista_process_results`): ``APERTUS_EVAL_JUDGE_URL`` (its ``/v1`` URL),
  ``APERTUS_EVAL_JUDGE_MODEL`` (its served name) and, where it needs one, ``APERTUS_EVAL_JUDGE_API_KEY``;
  upstream's own extractor is OpenAI's API, set up from other variables when its module is imported.
"""

from __future__ import annotations

import os
from functools import cache
from typing import Any

from apertus_plugins.posttrain.evaluation import extract_choice
from eval_tasks.catalogue import JUDGE_KEY_ENV, JUDGE_MODEL_ENV, JUDGE_URL_ENV
from eval_tasks.data import load_split, local_path
from eval_tasks.lmms_eval.common import ApertusTask  # checks the lmms-eval version before lmms-eval loads

# isort: split
from lmms_eval.api.filter import Filter

__all__ = ["ApertusTask", "JUDGE_SETTINGS", "ProseTolerantChoice", "gqa_process_docs", "judge_server",
           "mathvista_process_results"]

#: the judge the user names: its ``/v1`` URL, its served model name, an API key where it needs one
JUDGE_SETTINGS = (JUDGE_URL_ENV, JUDGE_MODEL_ENV, JUDGE_KEY_ENV)


class ProseTolerantChoice(Filter):
    """The option letter read from a letter, a sentence or the option's own text (None -> the reply as is)."""

    def __init__(self, options_field: str = "options", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.options_field = options_field

    def apply(self, resps: Any, docs: Any) -> list[Any]:
        # lmms-eval's chat tasks hand a filter the task's documents in order, as many as there are
        # responses or more (--limit): the k-th response answers the k-th document, as upstream's filters read it
        out = []
        for replies, doc in zip(resps, docs, strict=False):
            options = [str(o) for o in doc[self.options_field]]
            reply = replies[0] if isinstance(replies, list) else replies
            out.append(extract_choice(reply, options=options) or reply)
        return out


def gqa_process_docs(dataset: Any) -> Any:
    """Attach each question's image (from ``testdev_balanced_images``, local copy or hub)."""
    if local_path("apertus_gqa", "gqa", required=False) is None:
        from lmms_eval.tasks.gqa.utils import gqa_process_docs as upstream

        return upstream(dataset)
    images = load_split("apertus_gqa", "gqa", "testdev", config="testdev_balanced_images", media_columns=("image",))
    import datasets

    if not isinstance(images.features["image"], datasets.Image):
        images = images.cast_column("image", datasets.Image())
    by_id = {row["id"]: row["image"].convert("RGB") for row in images}
    missing = sorted(set(dataset["imageId"]) - set(by_id))
    if missing:
        raise KeyError(f"task apertus_gqa: images {missing[:5]} are missing from testdev_balanced_images")
    return dataset.map(lambda doc: {"image": by_id[doc["imageId"]]})


def _preload_mathvista() -> None:
    """lmms-eval's MathVista module builds an OpenAI client when it is imported, which fails without an
    OpenAI key, before any task of it can load. Import it once with lmms-eval's credential-free provider
    (``API_TYPE=dummy``, the environment restored after): :func:`mathvista_process_results` replaces
    that provider by the named judge before any extraction. The derived task's YAML names this module
    before it includes upstream's, so this runs first."""
    import importlib.util
    import sys

    name = "lmms_eval.tasks.mathvista.mathvista_evals"
    if name in sys.modules or importlib.util.find_spec("Levenshtein") is None:
        return  # already loaded, or upstream's own import error names the missing package
    saved = os.environ.get("API_TYPE")
    os.environ["API_TYPE"] = "dummy"
    try:
        importlib.import_module(name)
    finally:
        if saved is None:
            os.environ.pop("API_TYPE", None)
        else:
            os.environ["API_TYPE"] = saved


_preload_mathvista()


@cache
def _judge(url: str, model: str, key: str) -> Any:
    """The project's judge client (:class:`~apertus_plugins.posttrain.judges.OpenAIJudge`) at the named URL,
    checked to answer and to serve ``model`` (upstream turns a failed extraction into an empty answer,
    scored wrong: the judge is checked before the first one)."""
    from apertus_plugins.posttrain.judges import JudgeError, JudgeUnavailableError, OpenAIJudge

    # only its chat completions are used: templates that read no charter
    judge = OpenAIJudge(base_url=url, model=model, api_key=key, feedback_template="{prompt}",
                        rating_template="{prompt}", pairwise_template="{prompt}", timeout=120, max_retries=2,
                        backoff=1.0)
    try:
        judge.check()
    except JudgeUnavailableError as exc:
        raise RuntimeError(f"the judge at {url} ({JUDGE_SETTINGS[0]}) is unreachable: {exc}") from exc
    except JudgeError as exc:
        raise RuntimeError(f"the judge at {url} cannot be used ({JUDGE_SETTINGS[1]}={model}): {exc}") from exc
    return judge


def judge_settings(task: str) -> tuple[str, str, str]:
    """``(url, model, key)`` of the judge the user names (:data:`JUDGE_SETTINGS`); a clear error naming
    ``task`` and the settings when none is named."""
    url_var, model_var, key_var = JUDGE_SETTINGS
    url, model = os.environ.get(url_var, "").strip(), os.environ.get(model_var, "").strip()
    if not url or not model:
        raise RuntimeError(f"task {task}: no judge; set {url_var} (the judge's /v1 URL) and {model_var} (its served "
                           "model name)")
    return url.rstrip("/"), model, os.environ.get(key_var, "").strip() or "EMPTY"


def judge_server(task: str) -> tuple[Any, str]:
    """``(judge, model)``: the judge client for the named judge, checked to answer and to serve the model
    (an error naming ``task`` and the setting otherwise)."""
    url, model, key = judge_settings(task)
    try:
        return _judge(url, model, key), model
    except RuntimeError as exc:
        raise RuntimeError(f"task {task}: {exc}") from exc


def mathvista_process_results(doc: dict[str, Any], results: list[str]) -> dict[str, Any]:
    """Upstream's MathVista scoring (its extraction prompt, normalisation and comparison) with the
    extraction sent to the named judge (a reply that already is an option or a number needs none). A
    failed extraction is an error: upstream would score it as an empty answer."""
    from lmms_eval.tasks.mathvista import utils as upstream

    task = "apertus_mathvista_testmini"
    judge_settings(task)  # named, even where this reply needs no extraction

    failures: list[RuntimeError] = []  # upstream logs a failed extraction and scores "": raise it instead

    def ask(prompt: str, temperature: float = 0, max_tokens: int = 256, **_: Any) -> str:
        try:
            server, _model = judge_server(task)
            out = server.chat(prompt, temperature=temperature, max_tokens=max_tokens)
        except Exception as exc:  # noqa: BLE001 - the judge's own failure, named
            failures.append(exc if isinstance(exc, RuntimeError) and str(exc).startswith(f"task {task}") else
                            RuntimeError(f"task {task}: the judge failed to extract the answer: {exc}"))
            raise failures[-1] from exc
        return (out["choices"][0].get("message", {}).get("content") or "").strip()

    evaluator = upstream.mathvista_evaluator
    evaluator.get_chat_response = ask
    scored = upstream.mathvista_process_results(doc, results)
    if failures:
        raise failures[0]
    return scored
