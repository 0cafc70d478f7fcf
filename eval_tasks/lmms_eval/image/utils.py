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
from eval_tasks.data import load_split, local_path
from eval_tasks.lmms_eval.common import ApertusTask  # checks the lmms-eval version before lmms-eval loads

# isort: split
from lmms_eval.api.filter import Filter

__all__ = ["ApertusTask", "JUDGE_SETTINGS", "ProseTolerantChoice", "gqa_process_docs", "judge_server",
           "mathvista_process_results"]

#: the judge the user names: its ``/v1`` URL, its served model name, an API key where it needs one
JUDGE_SETTINGS = ("APERTUS_EVAL_JUDGE_URL", "APERTUS_EVAL_JUDGE_MODEL", "APERTUS_EVAL_JUDGE_API_KEY")


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


@cache
def _judge(url: str, model: str, key: str) -> Any:
    from lmms_eval.llm_judge.protocol import ServerConfig
    from lmms_eval.llm_judge.providers import OpenAIProvider
    from openai import OpenAI

    server = OpenAIProvider(ServerConfig(model_name=model, temperature=0.0, max_tokens=256, timeout=60, num_retries=3,
                                         retry_delay=2))
    server.api_key, server.base_url = key, url
    server.client, server.use_client = OpenAI(api_key=key, base_url=url), True
    return server


def judge_server(task: str) -> tuple[Any, str]:
    """``(server, model)``: lmms-eval's OpenAI-compatible judge client for the judge the user names
    (:data:`JUDGE_SETTINGS`); a clear error naming ``task`` and the settings when none is named."""
    url_var, model_var, key_var = JUDGE_SETTINGS
    url, model = os.environ.get(url_var, "").strip(), os.environ.get(model_var, "").strip()
    if not url or not model:
        raise RuntimeError(f"task {task}: no judge; set {url_var} (the judge's /v1 URL) and {model_var} (its served "
                           "model name)")
    return _judge(url.rstrip("/"), model, os.environ.get(key_var, "").strip() or "EMPTY"), model


def mathvista_process_results(doc: dict[str, Any], results: list[str]) -> dict[str, Any]:
    """Upstream's MathVista scoring (its extraction prompt, normalisation and comparison) with the
    extraction sent to the named judge (a reply that already is an option or a number needs none)."""
    from lmms_eval.tasks.mathvista import utils as upstream

    server, model = judge_server("apertus_mathvista_testmini")
    evaluator = upstream.mathvista_evaluator
    evaluator.server, evaluator.gpt_model = server, model
    return upstream.mathvista_process_results(doc, results)
