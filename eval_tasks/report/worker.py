"""``python -m eval_tasks.report.worker PLAN.json``: run a plan's tasks of one harness, one after
the other, in this process (the harness and its task index are loaded once).

Started by ``apertus eval report`` (:mod:`eval_tasks.report.runner`), one process per harness.
Each task goes through the harness's own ``simple_evaluate`` with the run's model and settings;
its results are written to ``<dir>/result.json`` (and the logged samples to
``<dir>/samples.jsonl``) under a temporary name renamed into place, so a task has a result only
once it finished, and a killed run leaves nothing half-written. A task that raises is recorded
in ``<dir>/error.txt`` and costs only itself. Progress goes to the plan's events file, one JSON
line per task start and end.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from apertus_plugins.infra.files import write_text_atomic

__all__ = ["main", "write_json"]


def write_json(path: Path, value: Any) -> None:
    """``value`` as JSON at ``path``, complete or not at all (a temporary file renamed into place)."""
    write_text_atomic(path, json.dumps(value, indent=1, sort_keys=True, default=str, ensure_ascii=False) + "\n")


def _write_samples(path: Path, samples: dict[str, list[Any]] | None) -> None:
    write_text_atomic(path, "".join(json.dumps({"task": task, **row}, default=str, ensure_ascii=False) + "\n"
                                    for task, rows in (samples or {}).items() for row in rows))


def _emit(events: Path, **event: Any) -> None:
    with open(events, "a", encoding="utf-8") as fh:
        fh.write(json.dumps({"time": time.time(), **event}) + "\n")
        fh.flush()


class _LmEval:
    def __init__(self, plan: dict[str, Any]) -> None:
        from lm_eval.tasks import TaskManager

        metadata: dict[str, Any] = {"max_seq_lengths": plan["lengths"]}
        if plan.get("tokenizer"):
            metadata["tokenizer"] = plan["tokenizer"]
        self.plan = plan
        self.manager = TaskManager(include_path=plan["include_path"], include_defaults=False, metadata=metadata)

    def run(self, item: dict[str, Any]) -> dict[str, Any]:
        from lm_eval import simple_evaluate

        p = self.plan
        common = f"model={p['model']},num_concurrent={p['num_concurrent']},max_retries=3,timeout={p['timeout']}"
        if item["kind"] == "chat" or item["kind"] == "handwritten":
            model = "local-chat-completions"
            args = f"base_url={p['base_url']}/chat/completions,{common},tokenizer_backend=none"
            chat = True
        else:
            model = "local-completions"
            args = f"base_url={p['base_url']}/completions,{common},tokenizer_backend=huggingface,tokenizer={p['tokenizer']}"
            chat = item["kind"] == "completions" and bool(item["chat"])  # the base-model rows: no chat template
        gen = {"max_gen_toks": p["max_new_tokens"]} if p.get("max_new_tokens") else None
        return simple_evaluate(model=model, model_args=args, tasks=[item["task"]], task_manager=self.manager,
                               limit=p.get("limit"), log_samples=True, apply_chat_template=chat,
                               fewshot_as_multiturn=chat and bool(item.get("multi_turn")), gen_kwargs=gen,
                               confirm_run_unsafe_code=bool(p.get("allow_code_execution")))


class _LmmsEval:
    def __init__(self, plan: dict[str, Any]) -> None:
        from lmms_eval.tasks import TaskManager

        self.plan = plan
        self.manager = TaskManager("WARNING", include_path=plan["include_path"], include_defaults=False,
                                   model_name="apertus")

    def run(self, item: dict[str, Any]) -> dict[str, Any]:
        from lmms_eval.evaluator import simple_evaluate

        p = self.plan
        args = (f"base_url={p['base_url']},model={p['model']},num_concurrent={p['num_concurrent']},"
                f"timeout={p['timeout']},max_retries=3")
        if p.get("max_new_tokens"):
            args += f",max_new_tokens={p['max_new_tokens']}"
        return simple_evaluate(model="apertus", model_args=args, tasks=[item["task"]], task_manager=self.manager,
                               limit=p.get("limit"), log_samples=True)


def _exit_with_parent() -> None:
    """End this process when the run that started it is gone (killed): a worker runs in its own session
    so that the run can stop it cleanly, and must not outlive it."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="apertus-worker-parent", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m eval_tasks.report.worker PLAN.json", file=sys.stderr)
        return 2
    plan = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
    events = Path(plan["events"])
    _exit_with_parent()
    if plan.get("allow_code_execution"):
        os.environ["HF_ALLOW_CODE_EVAL"] = "1"
    harness = _LmEval(plan) if plan["harness"] == "lm_eval" else _LmmsEval(plan)
    for item in plan["tasks"]:
        out = Path(item["dir"])
        out.mkdir(parents=True, exist_ok=True)
        (out / "error.txt").unlink(missing_ok=True)
        _emit(events, event="start", task=item["task"])
        t0 = time.time()
        try:
            results = harness.run(item)
            if not results or not results.get("results"):
                raise RuntimeError(f"{plan['harness']} returned no results for {item['task']}")
            samples = results.pop("samples", None)
            _write_samples(out / "samples.jsonl", samples)
            write_json(out / "result.json", {"task": item["task"], "harness": plan["harness"], "seconds": time.time() - t0,
                                             "limit": plan.get("limit"), **{k: results.get(k) for k in (
                                                 "results", "groups", "configs", "versions", "n-shot",
                                                 "higher_is_better", "n-samples")}})
            _emit(events, event="done", task=item["task"], ok=True, seconds=time.time() - t0)
        except Exception as exc:  # noqa: BLE001 - one task's failure costs only itself
            (out / "error.txt").write_text(f"{type(exc).__name__}: {exc}\n\n{traceback.format_exc()}", encoding="utf-8")
            _emit(events, event="done", task=item["task"], ok=False, error=f"{type(exc).__name__}: {exc}"[:500],
                  seconds=time.time() - t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
