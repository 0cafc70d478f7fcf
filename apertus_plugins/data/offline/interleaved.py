"""Interleaved speech-text documents (report section 2.2.4): recordings in, the report's runs out.

Input (``apertus tokenize interleaved RECORDINGS.jsonl --out PREFIX``): JSONL, one recording per
line, its consecutive clips in recording order, each an audio file (a path, absolute or relative to
``--media-root`` / the JSONL's folder) and its transcript::

    {"id": "session-7", "clips": [{"audio": "s7/000.wav", "text": "Good morning."},
                                  {"audio": "s7/001.wav", "text": "Let us begin."}, ...]}

The documents of a recording are the core's
:func:`~apertus_plugins.core.media.audio.interleaved_sequences` over its clips: the run alternates
the audio of one clip, ``<|stt_continue|>``, the transcript of the next, ``<|tts_continue|>``, the
audio of the one after, ...; every sequence ends with text; the run is built twice, one clip
apart; a single-clip copy and the clip left over at the end of a copy become transcription
sequences ``[audio] <|stt_transcribe|> text``. Each sequence is one document (BOS + sequence + EOS,
as pretraining documents). The loss targets are the core's pretraining targets computed from
the ids at training time (:func:`apertus_plugins.core.targets.pretraining_targets`: the stage's
preset decides whether audio codes and markers are trained), so no mask is stored.

The report sends sequences of up to 8,192 tokens to stage 2 and longer ones to the long-context
extension; ``--split-tokens 8192`` writes the longer ones to ``PREFIX.long`` (default: no cut,
every sequence in ``PREFIX``).

The lines are read by :func:`.sources.parse_recording`. A recording is one item: a missing or undecodable clip, an empty transcript or a malformed line
skips that recording, named (the file, its line and the clip) and counted by reason.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["recording_documents", "route_by_length"]


def recording_documents(codes: Sequence[np.ndarray], transcripts: Sequence[Sequence[int]], spec: Any,
                        bos: bool = True, eos: bool = True) -> list[np.ndarray]:
    """The documents of one recording: the core's interleaved sequences over its clips, each framed
    by BOS / EOS as a pretraining document.

    Args:
        codes: each clip's audio codes (no vocabulary offset), in recording order.
        transcripts: each clip's transcript as text token ids, in the same order.
        spec: the run's :class:`~apertus_plugins.core.vocab.VocabSpec`.
    """
    from apertus_plugins.core.media.audio import interleaved_sequences

    if len(codes) != len(transcripts):
        raise ValueError(f"{len(codes)} clips of codes but {len(transcripts)} transcripts")
    head = np.asarray([spec.bos_id] if bos else [], np.int64)
    tail = np.asarray([spec.eos_id] if eos else [], np.int64)
    seqs = interleaved_sequences(list(zip(codes, transcripts, strict=True)), spec)
    return [np.concatenate([head, s, tail]) for s in seqs]


def route_by_length(docs: Sequence[np.ndarray], split_tokens: int) -> list[tuple[str, np.ndarray]]:
    """``(stream suffix, document)``: ``""`` (stage 2), or ``".long"`` for a document longer than
    ``split_tokens`` tokens (the long-context extension); ``split_tokens`` 0 keeps every one in ``""``."""
    return [(".long" if split_tokens and d.size > split_tokens else "", d) for d in docs]
