"""Build a Hugging Face fast tokenizer with the exact Apertus 1.5 id layout.

The released tokenizer cannot be downloaded here, so tests and the demo use this one: a small
byte-level BPE (every string encodes, merges learned deterministically from a short embedded
corpus) with the chat tokens, the thinking delimiters, the tool-output markers, the omni block
and the code tokens at their released ids. Everything that reads a tokenizer directory
(:meth:`VocabSpec.from_tokenizer_dir`, the chat tokenizer, the adapters) takes this directory and
the released one through the same code paths.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from apertus_plugins import plugins
from apertus_plugins.core.release import CONTEXT_LENGTH
from apertus_plugins.core.vocab import ALIASES, CHAT_TOKENS, LEGACY_REWRITES, NON_SPECIAL_CHAT, VocabSpec
from apertus_plugins.infra.files import write_text_atomic

__all__ = ["build_test_tokenizer", "byte_to_unicode", "SAMPLE_CORPUS"]

#: A short multilingual corpus; the learned merges only make ordinary text shorter.
SAMPLE_CORPUS = """
The Swiss AI Initiative trains open models. Apertus reads images and audio as discrete tokens and
answers in text. What is the weather in Bern today? It is three degrees and sunny. Describe the
picture and transcribe the audio clip. The model thinks before it answers when deliberation is
enabled. Die Schweiz hat vier Landessprachen: Deutsch, Franzoesisch, Italienisch und Raetoromanisch.
La Suisse a quatre langues nationales. La Svizzera ha quattro lingue nazionali. {"city": "Bern",
"temp": 3, "unit": "celsius"} def function(value): return value + 1  # the answer is 42.
Hello! How are you? I am fine, thank you. Please call the tool and report the result.
"""

#: Ids reserved below the byte tokens: chat tokens where the release puts them, `<SPECIAL_N>` elsewhere.
_FIRST_BYTE_ID = 80


def byte_to_unicode() -> dict[int, str]:
    """The byte-level alphabet of GPT-2-style tokenizers: each byte -> one printable character."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    mapping = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _pretokenize(text: str) -> list[str]:
    from tokenizers import pre_tokenizers

    pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return [piece for piece, _ in pre.pre_tokenize_str(text)]


def _learn_merges(corpus: str, n_merges: int) -> list[tuple[str, str]]:
    """Plain BPE on the corpus: merge the most frequent pair, ties broken by the pair's text."""
    words = Counter(tuple(piece) for piece in _pretokenize(corpus))
    merges: list[tuple[str, str]] = []
    for _ in range(n_merges):
        pairs: Counter = Counter()
        for word, count in words.items():
            for a, b in zip(word, word[1:], strict=False):
                pairs[(a, b)] += count
        if not pairs:
            break
        best = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))[0]
        merges.append(best)
        merged: Counter = Counter()
        for word, count in words.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    out.append(word[i] + word[i + 1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += count
        words = merged
    return merges


def build_test_tokenizer(out_dir: str | Path, spec: VocabSpec | None = None, n_merges: int | None = None,
                         with_templates: bool = True) -> Path:
    """Write a tokenizer directory with ``spec``'s layout (default: a scaled-down spec with the installed modalities' omni slots).

    Writes ``tokenizer.json``, ``tokenizer_config.json`` (with ``omnimodal_config``, the SFT
    boundaries and the processor's media tokens), ``special_tokens_map.json`` and, unless
    ``with_templates`` is false, the inference chat template (``chat_template.jinja``) and the
    training one (``additional_chat_templates/training.jinja``).
    """
    from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import BPE

    spec = spec or plugins.spec(VocabSpec.scaled())
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    alphabet = byte_to_unicode()
    reserved = set(spec.chat_ids.values())
    vocab: dict[str, int] = {}
    for tid in range(_FIRST_BYTE_ID):
        if tid not in reserved:
            vocab[f"<SPECIAL_{tid}>"] = tid
    for name, tid in spec.chat_ids.items():
        vocab[CHAT_TOKENS[name][0]] = tid
    next_id = _FIRST_BYTE_ID
    for b in range(256):
        vocab[alphabet[b]] = next_id
        next_id += 1
    room = spec.text_size - next_id
    if room < 0:
        raise ValueError(f"text_size {spec.text_size} too small: the byte alphabet needs ids up to {next_id - 1}")
    merges = _learn_merges(SAMPLE_CORPUS, min(room, 400) if n_merges is None else min(n_merges, room))
    for a, b in merges:
        if a + b not in vocab:
            vocab[a + b] = next_id
            next_id += 1
    while next_id < spec.text_size:  # unreachable fillers keep the text block at its full size
        vocab[f"<|text_reserved_{next_id}|>"] = next_id
        next_id += 1

    model = BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False)
    tok = Tokenizer(model)
    rewrites = [(alias, spec.literal(name)) for alias, name in ALIASES.items()]
    rewrites += [(lit, spec.literal(name) if name else "") for lit, name in LEGACY_REWRITES.items()]
    tok.normalizer = normalizers.Sequence([normalizers.Replace(a, b) for a, b in rewrites])
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()

    from tokenizers import AddedToken

    added: list[tuple[int, AddedToken]] = []
    for tid in range(_FIRST_BYTE_ID):
        if tid not in reserved:
            added.append((tid, AddedToken(f"<SPECIAL_{tid}>", special=True, normalized=False)))
    for name, tid in spec.chat_ids.items():
        special = name not in NON_SPECIAL_CHAT
        # the delimiters are matched after normalization so that their aliases reach them
        added.append((tid, AddedToken(CHAT_TOKENS[name][0], special=special, normalized=not special)))
    alias_targets = {spec.literal(n) for n in ALIASES.values()}
    for slot in range(spec.omni_size):
        tid = spec.omni_offset + slot
        if slot in spec.slots:
            literal = spec.slots[slot][1]
        else:
            literal = f"<|omni_reserved_{slot}|>"
        added.append((tid, AddedToken(literal, special=True, normalized=literal in alias_targets)))
    for m in spec.modalities:
        for i in range(m.size):
            added.append((m.offset + i, AddedToken(spec.code_literal(m.name, i), special=True, normalized=False)))
    added.sort(key=lambda x: x[0])
    # add_tokens assigns ids in order after the model vocabulary; the omni block starts right after it
    below = [t for tid, t in added if tid < spec.text_size]
    above = [t for tid, t in added if tid >= spec.text_size]
    tok.add_special_tokens([t for t in below if t.special])
    tok.add_tokens([t for t in below if not t.special])
    tok.add_tokens(above)
    bos, eos = spec.literal("bos"), spec.literal("eos")
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, spec.bos_id)]
    )
    for tid, t in added:
        got = tok.token_to_id(t.content)
        if got != tid:
            raise AssertionError(f"builder bug: {t.content} landed at {got}, expected {tid}")
    if tok.get_vocab_size(with_added_tokens=True) != spec.size:
        raise AssertionError(f"builder bug: {tok.get_vocab_size(with_added_tokens=True)} entries, spec {spec.size}")

    write_text_atomic(out / "tokenizer.json", tok.to_str())
    media = {
        "image_token": spec.literal("image"),
        "audio_token": spec.literal("audio"),
        "boi_token": spec.literal("img_start"),
        "eoi_token": spec.literal("img_end"),
        "image_wrapper_token": spec.literal("img_token_start"),
        "eol_token": spec.literal("img_end_of_row"),
        "boa_token": spec.literal("audio_start"),
        "eoa_token": spec.literal("audio_end"),
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": spec.literal("unk"),
        "pad_token": spec.literal("pad"),
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": CONTEXT_LENGTH,
        "vocab_size": spec.text_size,
        "extra_special_tokens": media,
        "omnimodal_config": spec.omnimodal_config(),
        "sft_assistant_begin_sequence": spec.literal("assistant_start"),
        "sft_eot_token": spec.literal("assistant_end"),
        "sft_user_begin_sequence": spec.literal("user_start"),
    }
    write_text_atomic(out / "tokenizer_config.json", json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    special_map = {"bos_token": bos, "eos_token": eos, "unk_token": config["unk_token"],
                   "pad_token": config["pad_token"]}
    write_text_atomic(out / "special_tokens_map.json", json.dumps(special_map, indent=2) + "\n")
    if with_templates:
        from apertus_plugins.core.chat.template import jinja_template

        write_text_atomic(out / "chat_template.jinja", jinja_template("inference", spec))
        (out / "additional_chat_templates").mkdir(exist_ok=True)
        write_text_atomic(out / "additional_chat_templates" / "training.jinja", jinja_template("training", spec))
    return out
