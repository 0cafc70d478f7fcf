"""Audio tasks: upstream LibriSpeech, VoxPopuli, FLEURS, TED-LIUM, CoVoST2, MMAU, MuChoMusic,
Clotho-AQA and VocalSound under ``apertus_`` names (WER with upstream's Whisper-style
normalization). The ``apertus`` model sends every clip at 24 kHz."""

from __future__ import annotations

from eval_tasks.lmms_eval.common import ApertusTask

__all__ = ["ApertusTask"]
