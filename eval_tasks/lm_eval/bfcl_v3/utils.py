"""BFCL v3 single turn in the Apertus call format.

The tools of each item go into the developer block through the chat template (the request's
``chat_template_kwargs.tools``); the model's calls are parsed with the core's Apertus parser
(one JSON array between the tool-call markers, calls inside thinking included) and scored with
BFCL's AST rules (:func:`apertus_plugins.posttrain.evaluation.score_calls`). Generation stops after a
complete call, the stop kept in the output.

Data in BFCL's published layout (the files of the gorilla-llm/Berkeley-Function-Calling-Leaderboard
repository): ``BFCL_v3_<category>.json`` (JSON lines with ``id``, ``question``, ``function``) and
``possible_answer/BFCL_v3_<category>.json`` (``id``, ``ground_truth``), in the folder given by
``APERTUS_EVAL_DATA_BFCL_V3`` (or ``APERTUS_EVAL_DATA/bfcl_v3``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lm_eval.api.task import ConfigurableTask

from apertus_plugins.posttrain.evaluation import bfcl_tools, parse_calls, score_calls
from eval_tasks.data import DataPathError, local_path
from eval_tasks.lm_eval.common import with_degeneration

KEY = "bfcl_v3"
#: category -> how it is scored: "ast" (calls against the ground truth), "irrelevance" (no call is
#: correct), "relevance" (any call is correct)
CATEGORIES = {
    "simple": "ast", "multiple": "ast", "parallel": "ast", "parallel_multiple": "ast", "irrelevance": "irrelevance",
    "live_simple": "ast", "live_multiple": "ast", "live_parallel": "ast", "live_parallel_multiple": "ast",
    "live_irrelevance": "irrelevance", "live_relevance": "relevance",
}


def _read_jsonl(path: Path, task: str) -> list[dict[str, Any]]:
    rows = []
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise DataPathError(f"task {task}: {path} line {n} is not JSON ({exc})") from exc
    return rows


def load(bfcl_category: str = "", task: str = "", **kwargs: Any):
    """One category as a ``DatasetDict`` with a ``test`` split (JSON-encoded nested fields)."""
    import datasets

    task = task or f"apertus_bfcl_v3_{bfcl_category}"
    if bfcl_category not in CATEGORIES:
        raise ValueError(f"task {task}: unknown BFCL v3 category {bfcl_category!r}; known: {', '.join(CATEGORIES)}")
    path, source = local_path(task, KEY, required=True,
                              why="the folder with BFCL_v3_<category>.json and possible_answer/")
    questions = path / f"BFCL_v3_{bfcl_category}.json"
    if not questions.is_file():
        raise DataPathError(f"task {task}: {questions} (under {source}) does not exist")
    answers: dict[str, Any] = {}
    if CATEGORIES[bfcl_category] == "ast":
        answer_file = path / "possible_answer" / f"BFCL_v3_{bfcl_category}.json"
        if not answer_file.is_file():
            raise DataPathError(f"task {task}: {answer_file} (under {source}) does not exist")
        answers = {row["id"]: row["ground_truth"] for row in _read_jsonl(answer_file, task)}
    rows = []
    for item in _read_jsonl(questions, task):
        turns = item["question"]
        messages = turns[0] if turns and isinstance(turns[0], list) else turns
        if CATEGORIES[bfcl_category] == "ast" and item["id"] not in answers:
            raise DataPathError(f"task {task}: no ground truth for {item['id']!r} in possible_answer/")
        rows.append({"id": item["id"], "category": bfcl_category, "messages": json.dumps(messages, ensure_ascii=False),
                     "functions": json.dumps(item["function"], ensure_ascii=False),
                     "ground_truth": json.dumps(answers.get(item["id"], []), ensure_ascii=False)})
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def doc_to_text(doc: dict[str, Any]) -> str:
    """The last user message (the request itself is built from all of the item's messages)."""
    users = [m["content"] for m in json.loads(doc["messages"]) if m.get("role") == "user"]
    return users[-1] if users else ""


def tools_of(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return bfcl_tools(json.loads(doc["functions"]))


class BFCLTask(ConfigurableTask):
    """A BFCL category: the item's own messages and tools make each request."""

    def __init__(self, config: dict[str, Any] | None = None, **kwargs: Any) -> None:
        # lm-eval hands a Python task its whole YAML, the ``class`` key included
        super().__init__(config={k: v for k, v in (config or {}).items() if k != "class"}, **kwargs)

    def fewshot_context(self, doc: dict, num_fewshot: int, system_instruction: str | None = None,
                        apply_chat_template: bool = False, fewshot_as_multiturn: bool = False,
                        chat_template: Any = None, gen_prefix: str | None = None, **kwargs: Any) -> Any:
        if not apply_chat_template or chat_template is None:
            raise ValueError(f"task {self.config.task}: BFCL runs through the chat template; "
                             "run lm-eval with --apply_chat_template (model local-chat-completions)")
        messages = json.loads(doc["messages"])
        if system_instruction:
            if messages and messages[0].get("role") == "system":
                messages[0] = {"role": "system", "content": f"{system_instruction}\n\n{messages[0]['content']}"}
            else:
                messages.insert(0, {"role": "system", "content": system_instruction})
        return chat_template(messages, add_generation_prompt=True)

    def construct_requests(self, doc: dict, ctx: Any, **kwargs: Any) -> Any:
        requests = super().construct_requests(doc, ctx, **kwargs)
        for inst in requests if isinstance(requests, list) else [requests]:
            context, gen_kwargs, *rest = inst.arguments
            gen_kwargs = dict(gen_kwargs)
            gen_kwargs["chat_template_kwargs"] = {**gen_kwargs.get("chat_template_kwargs", {}), "tools": tools_of(doc)}
            # one request group per item: lm-eval batches requests whose generation settings are equal
            gen_kwargs["user"] = f"{self.config.task}/{doc['id']}"
            inst.arguments = (context, gen_kwargs, *rest)
        return requests


def process_results(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    """``acc`` by the category's rule, and ``degenerate``."""
    response = results[0]
    mode = CATEGORIES[doc["category"]]
    truth = json.loads(doc["ground_truth"])
    if mode == "relevance":
        correct = bool(parse_calls(response))
    else:  # "ast"; an empty ground truth is an irrelevance item
        correct = score_calls(response, truth, json.loads(doc["functions"])).correct
    return with_degeneration(response, {"acc": float(correct)})
