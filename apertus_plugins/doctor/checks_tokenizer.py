"""Tokenizer checks (SPEC.md section 1): length, encode pins, thinking delimiters, EOS, omnimodal_config."""

from __future__ import annotations

from typing import Any

from apertus_plugins.core.tensor_names import EMBEDDING
from apertus_plugins.core.vocab import ALIASES, VocabError, VocabSpec

from .checkpoint_files import DoctorError, token_literal
from .registry import Context, check, short
from .report import FAIL, PASS, WARN


def _embedding_rows(ctx: Context) -> int | None:
    """Rows of the input embedding: the tensor when the weights are there, else ``text_config.vocab_size``."""
    if (ctx.ckpt.path / "config.json").is_file():
        try:
            rows = ctx.ckpt.tensor_rows(EMBEDDING)
        except DoctorError:
            rows = None
        return rows if rows is not None else ctx.ckpt.text_config.get("vocab_size")
    return None


@check("tokenizer.length", "the tokenizer holds exactly the layout's ids, and the embedding holds them all")
def length(ctx: Context) -> tuple[str, str]:
    ref = ctx.ref
    n = ctx.ckpt.tokenizer.get_vocab_size(with_added_tokens=True)
    parts = " + ".join([f"text {ref.text_size:,}", f"omni {ref.omni_size:,}"]
                       + [f"{m.name} {m.size:,}" for m in ref.modalities])
    problems = []
    if n != ref.size:
        problems.append(f"{n:,} entries, but the layout ({parts}) has {ref.size:,}")
    rows = _embedding_rows(ctx)
    if rows is not None and n > rows:
        problems.append(f"{n:,} entries do not fit the {rows:,} embedding rows")
    if problems:
        return FAIL, "; ".join(problems)
    return PASS, f"{n:,} entries = {parts}" + (f"; embedding {rows:,} rows" if rows is not None else "")


def _pins(ref: VocabSpec) -> list[tuple[str, int]]:
    cases = [(ref.literal(name), tid) for name, tid in ref.name_to_id.items()]
    cases += [(alias, ref.id(name)) for alias, name in ALIASES.items()]
    for m in ref.modalities:
        cases += [(ref.code_literal(m.name, 0), m.offset), (ref.code_literal(m.name, m.size - 1), m.end - 1)]
    return cases


@check("tokenizer.pins", "every structure literal, alias and the first and last code of each modality encode to their ids")
def pins(ctx: Context) -> tuple[str, str, dict[str, Any]]:
    ref, tok = ctx.ref, ctx.ckpt.tokenizer
    cases = _pins(ref)
    wrong = {}
    for literal, want in cases:
        got = tok.encode(literal, add_special_tokens=False).ids
        if got != [want]:
            wrong[literal] = {"got": got, "want": [want]}
    if wrong:
        shown = "; ".join(f"{lit} -> {short(v['got'], 30)} (want {v['want'][0]})" for lit, v in list(wrong.items())[:4])
        return FAIL, f"{len(wrong)} of {len(cases)} literals encode wrong: {shown}", {"wrong": wrong}
    image, audio = ref.modality("image"), ref.modality("audio")
    return PASS, (f"{len(cases)} literals encode to their ids: <think> and <|inner_prefix|> -> {ref.id('inner_prefix')}, "
                  f"<image> -> {ref.id('image')}, <audio> -> {ref.id('audio')}, "
                  f"{ref.code_literal('image', 0)} -> {image.offset}, {ref.code_literal('audio', 0)} -> {audio.offset}"), {}


def _listed_special(ctx: Context) -> set[str]:
    """Literals a config lists as special tokens (``additional_special_tokens``, ``extra_special_tokens``)."""
    out: set[str] = set()
    for cfg in (ctx.ckpt.tokenizer_config, ctx.ckpt.json("special_tokens_map.json") or {}):
        for key in ("additional_special_tokens", "extra_special_tokens"):
            value = cfg.get(key)
            items = value.values() if isinstance(value, dict) else (value or [])
            out.update(lit for lit in (token_literal(v) for v in items) if lit)
    return out


@check("tokenizer.thinking_delimiters", "<|inner_prefix|> and <|inner_suffix|> are not special and survive skip_special_tokens")
def thinking_delimiters(ctx: Context) -> tuple[str, str]:
    ref, tok = ctx.ref, ctx.ckpt.tokenizer
    names = ("inner_prefix", "inner_suffix")
    added = tok.get_added_tokens_decoder()
    decoder = ctx.ckpt.tokenizer_config.get("added_tokens_decoder") or {}
    listed = _listed_special(ctx)
    problems = []
    for name in names:
        tid, lit = ref.id(name), ref.literal(name)
        if tid in added and added[tid].special:
            problems.append(f"{lit} ({tid}) is special in tokenizer.json")
        if (decoder.get(str(tid)) or {}).get("special"):
            problems.append(f"{lit} ({tid}) is special in tokenizer_config.json added_tokens_decoder")
        if lit in listed:
            problems.append(f"{lit} is listed among the special tokens")
    ids = ([ref.id("inner_prefix")] + tok.encode("Let me think.", add_special_tokens=False).ids
           + [ref.id("inner_suffix")] + tok.encode("Hello.", add_special_tokens=False).ids)
    text = tok.decode(ids, skip_special_tokens=True)
    lost = [ref.literal(n) for n in names if ref.literal(n) not in text]
    if lost:
        problems.append(f"decode(skip_special_tokens=True) drops {', '.join(lost)}: {short(text)}")
    if problems:
        return FAIL, "; ".join(problems)
    return PASS, f"not special; decode(skip_special_tokens=True) keeps them: {short(text)}"


@check("tokenizer.eos", "the tokenizer's eos_token is </s>; turn and tool stops live in the generation config")
def eos(ctx: Context) -> tuple[str, str]:
    ref = ctx.ref
    want = ref.literal("eos")
    found = {}
    for source, cfg in (("tokenizer_config.json", ctx.ckpt.tokenizer_config),
                        ("special_tokens_map.json", ctx.ckpt.json("special_tokens_map.json") or {})):
        if cfg.get("eos_token") is not None:
            found[source] = token_literal(cfg["eos_token"])
    if not found:
        return FAIL, f"no eos_token in tokenizer_config.json or special_tokens_map.json (want {want})"
    wrong = {s: v for s, v in found.items() if v != want}
    if wrong:
        return FAIL, "; ".join(f"{s}: eos_token {v!r}, want {want!r} (id {ref.eos_id})" for s, v in wrong.items())
    tid = ctx.ckpt.tokenizer.token_to_id(want)
    if tid != ref.eos_id:
        return FAIL, f"eos_token {want} is id {tid}, want {ref.eos_id}"
    return PASS, f"eos_token {want} (id {tid}) in {', '.join(found)}"


@check("tokenizer.omnimodal_config", "omnimodal_config matches the tokenizer, the config's ids and offsets and the embedding")
def omnimodal_config(ctx: Context) -> tuple[str, str]:
    ref, ck = ctx.ref, ctx.ckpt
    omni = ck.tokenizer_config.get("omnimodal_config")
    if not omni:
        return WARN, "no omnimodal_config in tokenizer_config.json: readers must infer the layout from the marker tokens"
    try:
        spec = VocabSpec.from_tokenizer_dir(ck.path)
    except VocabError as exc:
        message = str(exc).replace(str(ck.path) + "/", "").replace(str(ck.path) + ": ", "")
        return FAIL, message if "tokenizer_config.json" in message else f"omnimodal_config: {message}"
    problems = []
    have, want = spec.omnimodal_config(), ref.omnimodal_config()
    for key in ("text_vocab_size", "special_token_offset", "num_special_tokens"):
        if have[key] != want[key]:
            problems.append(f"{key} {have[key]}, the tokenizer's markers say {want[key]}")
    if have["modalities"] != want["modalities"]:
        problems.append(f"modalities {have['modalities']}, the code tokens say {want['modalities']}")
    evidence = [f"offsets omni {want['special_token_offset']}, "
                + ", ".join(f"{m['name']} {m['offset']} (+{m['size']})" for m in want["modalities"])]
    if (ck.path / "config.json").is_file():
        cfg = ck.config
        expect = {"image_token_id": ref.id("image"), "audio_token_id": ref.id("audio"),
                  "image_token_offset": ref.modality("image").offset, "audio_token_offset": ref.modality("audio").offset}
        for key, value in expect.items():
            if key in cfg and cfg[key] != value:
                problems.append(f"config.json {key} {cfg[key]}, the tokenizer says {value}")
        for key, modality in (("vision_config", "image"), ("audio_config", "audio")):
            size = (cfg.get(key) or {}).get("codebook_size")
            if size is not None and size != ref.modality(modality).size:
                problems.append(f"config.json {key}.codebook_size {size}, the tokenizer has {ref.modality(modality).size} "
                                f"{modality} codes")
        declared = ck.text_config.get("vocab_size")
        try:
            rows = ck.tensor_rows(EMBEDDING)
        except DoctorError:
            rows = None
        if rows is not None and declared is not None and rows != declared:
            problems.append(f"text_config.vocab_size {declared}, the embedding tensor has {rows} rows")
        rows = rows if rows is not None else declared
        if rows is not None:
            try:
                spec.check_embedding(int(rows))
            except VocabError as exc:
                problems.append(str(exc))
            evidence.append(f"embedding {rows:,} rows >= {spec.size:,}")
        evidence.append("config ids and offsets agree")
    if problems:
        return FAIL, "; ".join(problems)
    return PASS, "; ".join(evidence)
