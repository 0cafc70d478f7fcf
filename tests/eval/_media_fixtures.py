"""Small local copies of the image and audio datasets (tiny PNGs and WAVs, made here).

Images of several sizes (each resized to the model's grid on the server) and clips at 8, 16,
22.05 and 44.1 kHz, one in stereo (the ``apertus`` model downmixes and resamples them to 24 kHz).

Each in its upstream dataset's layout and fields, as JSON lines with media paths relative to
the file, so the wrapped lmms-eval tasks read them like their hub datasets.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np


def _png(path: Path, seed: int, size: tuple[int, int] = (40, 56)) -> str:
    """A random RGB PNG of ``size`` (height, width): every image of the fixtures differs."""
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 255, (*size, 3), dtype=np.uint8)).save(path)
    return path.name


def _wav(path: Path, seconds: float, rate: int, seed: int, channels: int = 1) -> str:
    """A tone with a little noise at ``rate`` Hz (never the model's 24 kHz), 16-bit PCM."""
    import soundfile as sf

    path.parent.mkdir(parents=True, exist_ok=True)
    t = np.arange(int(seconds * rate)) / rate
    tone = 0.3 * np.sin(2 * np.pi * (220 + 40 * seed) * t) + 0.05 * np.random.default_rng(seed).standard_normal(t.size)
    wave = np.stack([tone * (1.0 - 0.3 * c) for c in range(channels)], axis=1)
    sf.write(path, wave.astype(np.float32), rate, subtype="PCM_16")
    return path.name


def _jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")


def write_media_fixtures(root: Path) -> Path:
    """Write the lmms-eval tasks' local data under ``root`` (the ``APERTUS_EVAL_DATA`` folder)."""
    d = root / "chartqa"
    _jsonl(d / "test.jsonl", [
        {"image": "img/" + _png(d / "img" / "c0.png", 0), "question": "What is the highest bar?", "answer": "12",
         "type": "human_test"},
        {"image": "img/" + _png(d / "img" / "c1.png", 1, (33, 70)), "question": "Which year?", "answer": "2020",
         "type": "augmented_test"}])
    d = root / "ai2d"
    _jsonl(d / "test.jsonl", [
        {"image": "img/" + _png(d / "img" / "a0.png", 2, (64, 48)), "question": "Which organism is a producer?",
         "options": ["fox", "grass", "hawk", "snake"], "answer": "1"},
        {"image": "img/" + _png(d / "img" / "a1.png", 3, (90, 200)), "question": "What does the arrow show?",
         "options": ["energy flow", "water"], "answer": "0"}])
    d = root / "docvqa" / "DocVQA"
    _jsonl(d / "validation.jsonl", [
        {"image": "img/" + _png(d / "img" / "d0.png", 4), "question": "What is the date?", "answers": ["1 May 2020"],
         "questionId": 1, "docId": 7, "question_types": ["form"]}])
    d = root / "gqa"
    _jsonl(d / "testdev_balanced_images" / "testdev.jsonl", [
        {"id": "g1", "image": "img/" + _png(d / "testdev_balanced_images" / "img" / "g1.png", 5)}])
    _jsonl(d / "testdev_balanced_instructions" / "testdev.jsonl", [
        {"id": "q1", "imageId": "g1", "question": "Is the sky blue?", "answer": "yes", "fullAnswer": "Yes."}])
    d = root / "vstar_bench"
    _jsonl(d / "test.jsonl", [
        {"image": "img/" + _png(d / "img" / "s0.png", 6, (72, 96)), "question_id": 0, "category": "direct_attributes",
         "text": "What is the color of the cup? (A) red (B) blue (C) green (D) white", "label": "B"},
        {"image": "img/" + _png(d / "img" / "s1.png", 7, (50, 50)), "question_id": 1, "category": "relative_position",
         "text": "Is the cat left or right of the dog? (A) left (B) right", "label": "A"}])
    d = root / "mathvista"
    meta = {"split": "testmini", "language": "english", "source": "fixture", "category": "math-targeted-vqa",
            "task": "figure question answering", "context": "synthetic scene", "grade": "elementary school",
            "skills": ["arithmetic reasoning"], "img_height": 40, "img_width": 56}
    _jsonl(d / "testmini.jsonl", [
        {"pid": "1", "decoded_image": "img/" + _png(d / "img" / "m1.png", 8), "image": "images/1.jpg",
         "question": "What colour is the largest shape?", "choices": ["red", "blue", "green"], "unit": None,
         "precision": None, "answer": "blue", "question_type": "multi_choice", "answer_type": "text",
         "query": "Question: What colour is the largest shape?\nChoices:\n(A) red\n(B) blue\n(C) green",
         "metadata": meta},
        {"pid": "2", "decoded_image": "img/" + _png(d / "img" / "m2.png", 9), "image": "images/2.jpg",
         "question": "How many dots are there?", "choices": None, "unit": None, "precision": None, "answer": "42",
         "question_type": "free_form", "answer_type": "integer",
         "query": "Question: How many dots are there?", "metadata": meta}])
    d = root / "vqa_rad"  # the hub copy's fields (image, question, answer): two closed questions, one open
    _jsonl(d / "test.jsonl", [
        {"image": "img/" + _png(d / "img" / "r0.png", 10, (48, 48)), "question": "is there a pneumothorax?",
         "answer": "yes"},
        {"image": "img/" + _png(d / "img" / "r1.png", 11, (36, 60)), "question": "Is the liver enlarged?",
         "answer": "no"},
        {"image": "img/" + _png(d / "img" / "r2.png", 12, (64, 40)), "question": "what imaging modality was used?",
         "answer": "x-ray"}])
    d = root / "librispeech" / "librispeech_test_clean"
    _jsonl(d / "librispeech_test_clean.jsonl", [
        {"audio": "wav/" + _wav(d / "wav" / "l0.wav", 0.4, 16000, 0), "gt": "hello world",
         "source": "librispeech_test_clean", "task": "asr_en"},
        {"audio": "wav/" + _wav(d / "wav" / "l1.wav", 0.3, 8000, 4), "gt": "good night",
         "source": "librispeech_test_clean", "task": "asr_en"}])
    d = root / "fleurs" / "en_us"
    _jsonl(d / "test.jsonl", [
        {"audio": "wav/" + _wav(d / "wav" / "f0.wav", 0.3, 16000, 1), "transcription": "good morning",
         "path": "f0.wav", "language": "English"}])
    d = root / "tedlium" / "tedlium_long_form"
    _jsonl(d / "val.jsonl", [
        {"audio": "wav/" + _wav(d / "wav" / "t0.wav", 0.5, 16000, 2), "gt": "a long talk about science",
         "source": "tedlium", "task": "asr_en"}])
    d = root / "vocalsound"
    _jsonl(d / "test.jsonl", [
        {"audio": "wav/" + _wav(d / "wav" / "v0.wav", 0.25, 44100, 3), "answer": "Laughter", "age_group": "adult",
         "spk_id": "s1"},
        {"audio": "wav/" + _wav(d / "wav" / "v1.wav", 0.35, 22050, 5, channels=2), "answer": "Cough",
         "age_group": "child", "spk_id": "s2"}])
    return root
