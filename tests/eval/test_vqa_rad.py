"""VQA-RAD (Table 34, Medical Imaging): this package's lmms-eval task, its scoring on hand-written answers,
and a run of the real harness over tiny local images through the suite's served checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest

from apertus_plugins.testing.serve import VLLMServer
from eval_tasks.catalogue import by_id, mismatches
from eval_tasks.derive import include_path
from eval_tasks.lmms_eval.vqa_rad.utils import (
    METRICS,
    accuracy,
    answer_type,
    closed_accuracy,
    is_correct,
    normalize,
    open_accuracy,
    process_results,
)

#: (reply, reference, correct): closed and open questions, right and wrong, as the model may phrase them
ANSWERS = [
    ("Yes", "yes", True), ("yes.", "yes", True), ("Yeah", "yes", True), ("TRUE", "yes", True),
    ("No", "yes", False), ("Yes, there is a pneumothorax.", "yes", False), ("", "no", False),
    ("nope", "no", True), ("false", "no", True), ("no", "no", True), ("Maybe", "no", False),
    ("X-ray", "x-ray", True), ("xray", "x-ray", True), ("x ray", "x-ray", True),
    ("Right lower lobe.", "right lower lobe", True), ("CT (computed tomography)", "ct", True),
    ("computed tomography", "ct", False), ("left", "right", False), ("the right kidney", "right kidney", False),
    ("Axial", "axial", True), ("  Brain  ", "brain", True),
]


def test_the_scoring_on_hand_written_answers() -> None:
    """Closed (yes/no) and open answers by exact match after SLAKE's normalisation: synonyms of yes and
    no count, punctuation, case and parentheses do not; a sentence around the right word, a synonym of an
    open answer or an empty reply is wrong."""
    for reply, reference, correct in ANSWERS:
        assert is_correct(reply, reference) is correct, (reply, reference)
    assert normalize(None) == "" and normalize("Is it?  (maybe)  No") == "is it no"
    assert [answer_type(a) for a in ("yes", "No", "x-ray", "yes and no")] == ["closed", "closed", "open", "open"]
    # per question: one record per metric; the aggregations split closed and open
    docs = [{"question": "is there a mass?", "answer": "yes"}, {"question": "is it normal?", "answer": "no"},
            {"question": "which plane?", "answer": "axial"}, {"question": "which organ?", "answer": "liver"}]
    replies = ["Yes.", "yes", "Axial", "spleen"]
    scored = [process_results(doc, [reply]) for doc, reply in zip(docs, replies, strict=True)]
    assert all(set(s) == set(METRICS) for s in scored)
    records = [s["vqa_rad_accuracy"] for s in scored]
    assert [r["correct"] for r in records] == [True, False, True, False]
    assert [r["answer_type"] for r in records] == ["closed", "closed", "open", "open"]
    assert accuracy(records) == 0.5 and closed_accuracy(records) == 0.5 and open_accuracy(records) == 0.5
    assert open_accuracy(records[:2]) == 0.0 and process_results(docs[0], [])["vqa_rad_accuracy"]["correct"] is False


def test_the_normalisation_is_slakes() -> None:
    """The rule the row names: lmms-eval's SLAKE normalisation of English answers, answer for answer."""
    from lmms_eval.tasks.slake.utils import normalize_answer

    for reply, reference, _ in ANSWERS:
        assert normalize(reply) == normalize_answer(reply) and normalize(reference) == normalize_answer(reference)


def test_the_row_runs_in_the_image_suite_like_for_like() -> None:
    """The catalogue's row: this package's lmms-eval task (thinking off and on), in the image suite, each
    task against Table 34's column of its thinking mode."""
    from eval_tasks.report.runner import plan

    b = by_id()["vqa_rad"]
    assert b.runnable and b.kind == "lmms" and b.template and b.upstream is None
    assert b.tasks == {"off": "apertus_vqa_rad", "think": "apertus_vqa_rad_think"}
    assert [(i.task, i.mode) for i in plan("image", ["vqa_rad"])] == [("apertus_vqa_rad", "off"),
                                                                      ("apertus_vqa_rad_think", "think")]
    refs = b.rows[0].reference
    assert (refs["off"].value, refs["think"].value, b.reference_70b["off"].value) == (68.1, 66.5, 68.1)
    assert not mismatches(b, "off", refs["off"]) and not mismatches(b, "think", refs["think"])


def test_vqa_rad_runs_on_local_images_through_the_served_checkpoint(vllm_server: VLLMServer, data_env: Path) -> None:
    """The real harness (lmms-eval's evaluator, the ``apertus`` model, as the report runner calls it) runs the
    task over three local PNGs through the served checkpoint; each answer reaches the scoring as the server
    gave it and the accuracies are the shares of the task's own verdicts."""
    from lmms_eval.evaluator import simple_evaluate
    from lmms_eval.tasks import TaskManager, get_task_dict
    from PIL import Image

    from eval_tasks.lmms_model import Apertus

    folder = include_path("lmms_eval")
    manager = TaskManager("WARNING", include_path=str(folder), include_defaults=False, model_name="apertus")
    task = get_task_dict(["apertus_vqa_rad"], manager, "chat")["apertus_vqa_rad"]
    docs = list(task.test_docs())
    assert [d["answer"] for d in docs] == ["yes", "no", "x-ray"]
    (image,) = task.doc_to_visual(docs[2])
    assert isinstance(image, Image.Image) and image.size == (40, 64) and image.mode == "RGB"
    assert task.doc_to_text(docs[0]) == "is there a pneumothorax?\nAnswer the question using a single word or phrase."
    model = Apertus(base_url=vllm_server.base_url)
    body = model.payload(task.doc_to_messages(docs[0]), task.config.generation_kwargs)
    assert [p["type"] for p in body["messages"][0]["content"]] == ["image_url", "text"]
    assert body["max_tokens"] == 16384 and body["temperature"] == 0  # the report's greedy 16,384 tokens
    out = simple_evaluate(model="apertus", model_args=f"base_url={vllm_server.base_url},max_new_tokens=6",
                          tasks=["apertus_vqa_rad"], task_manager=manager, log_samples=True)
    results = out["results"]["apertus_vqa_rad"]
    samples = out["samples"]["apertus_vqa_rad"]
    assert sorted(s["doc_id"] for s in samples) == [0, 1, 2]
    verdicts = {"closed": [], "open": []}
    for sample in samples:
        record = sample["vqa_rad_accuracy"]
        reply = sample["filtered_resps"][0]
        while isinstance(reply, list):
            (reply,) = reply
        assert record["prediction"] == reply and record["target"] == sample["target"]
        assert record["correct"] == is_correct(reply, sample["target"])
        verdicts[record["answer_type"]].append(record["correct"])
    assert len(verdicts["closed"]) == 2 and len(verdicts["open"]) == 1
    every = verdicts["closed"] + verdicts["open"]
    assert results["vqa_rad_accuracy,none"] == pytest.approx(sum(every) / 3)
    assert results["vqa_rad_closed_accuracy,none"] == pytest.approx(sum(verdicts["closed"]) / 2)
    assert results["vqa_rad_open_accuracy,none"] == pytest.approx(float(verdicts["open"][0]))
