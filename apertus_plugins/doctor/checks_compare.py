"""Across stages (``--compare OTHER``): tokenizer files, chat templates and RoPE scaling must be identical.

An inconsistent tokenizer configuration between two post-training stages caused a regression,
and a conversion that dropped the RoPE scaling went unnoticed (SPEC.md 8). The differences are
listed, not just flagged.
"""

from __future__ import annotations

import json
from typing import Any

from .checkpoint_files import TOKENIZER_FILES, CheckpointFiles
from .checks_config import rope_parameters
from .registry import Context, check, short
from .report import FAIL, PASS

__all__ = ["tokenizer_differences", "template_differences"]


def _other(ctx: Context) -> CheckpointFiles:
    if ctx.other is None:
        raise ValueError("no checkpoint to compare with (--compare OTHER)")
    return ctx.other


def _key_differences(a: dict[str, Any], b: dict[str, Any], skip: tuple[str, ...] = ()) -> list[str]:
    out = []
    for key in sorted(set(a) | set(b)):
        if key in skip or a.get(key) == b.get(key):
            continue
        if key not in a or key not in b:
            out.append(f"{key} {'only in the other' if key not in a else 'missing in the other'}")
        else:
            out.append(f"{key} {short(a[key], 40)} vs {short(b[key], 40)}")
    return out


def _tokenizer_json_differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    out = []
    added_a = {int(t["id"]): t for t in a.get("added_tokens") or []}
    added_b = {int(t["id"]): t for t in b.get("added_tokens") or []}
    for tid in sorted(set(added_a) | set(added_b)):
        ta, tb = added_a.get(tid), added_b.get(tid)
        if ta == tb:
            continue
        if ta is None or tb is None:
            t = ta or tb
            out.append(f"added token {tid} {t.get('content')!r} {'only in this one' if tb is None else 'only in the other'}")
            continue
        fields = [f"{k} {ta.get(k)!r} vs {tb.get(k)!r}" for k in sorted(set(ta) | set(tb)) if ta.get(k) != tb.get(k)]
        out.append(f"added token {tid} {ta.get('content')!r}: {', '.join(fields)}")
    model_a, model_b = a.get("model") or {}, b.get("model") or {}
    if model_a != model_b:
        va, vb = model_a.get("vocab") or {}, model_b.get("vocab") or {}
        if va != vb:
            out.append(f"model vocabulary differs ({len(va)} vs {len(vb)} entries)")
        if model_a.get("merges") != model_b.get("merges"):
            out.append(f"merges differ ({len(model_a.get('merges') or [])} vs {len(model_b.get('merges') or [])})")
        out += [f"model.{d}" for d in _key_differences(model_a, model_b, skip=("vocab", "merges"))]
    out += _key_differences(a, b, skip=("added_tokens", "model"))
    return out


def tokenizer_differences(a: CheckpointFiles, b: CheckpointFiles) -> dict[str, list[str]]:
    """File name -> the differences between two checkpoints' tokenizer files (empty when identical).

    ``tokenizer_config.json``'s ``chat_template`` is left to :func:`template_differences`.
    """
    out: dict[str, list[str]] = {}
    for name in TOKENIZER_FILES:
        ha, hb = a.sha256(name), b.sha256(name)
        if ha == hb:
            continue
        if ha is None or hb is None:
            out[name] = ["only in the other checkpoint" if ha is None else "missing in the other checkpoint"]
            continue
        if not name.endswith(".json"):
            out[name] = [f"contents differ (sha256 {ha[:12]} vs {hb[:12]})"]
            continue
        ja, jb = a.json(name), b.json(name)
        if name == "tokenizer.json":
            diffs = _tokenizer_json_differences(ja, jb)
        elif isinstance(ja, dict) and isinstance(jb, dict):
            diffs = _key_differences(ja, jb, skip=("chat_template",) if name == "tokenizer_config.json" else ())
        else:
            diffs = [] if ja == jb else ["contents differ"]
        if diffs:  # the same JSON written differently is no difference
            out[name] = diffs
    return out


def _first_line_difference(a: str, b: str) -> str:
    la, lb = a.splitlines(), b.splitlines()
    for k, (x, y) in enumerate(zip(la, lb, strict=False)):
        if x != y:
            return f"line {k + 1}: {short(x.strip(), 50)} vs {short(y.strip(), 50)}"
    return f"{len(la)} vs {len(lb)} lines"


def template_differences(a: CheckpointFiles, b: CheckpointFiles) -> dict[str, str]:
    """Template name -> where two checkpoints' chat templates differ (empty when identical)."""
    ta, tb = a.chat_templates, b.chat_templates
    out = {}
    for name in sorted(set(ta) | set(tb)):
        if ta.get(name) == tb.get(name):
            continue
        if name not in ta or name not in tb:
            out[name] = "only in the other checkpoint" if name not in ta else "missing in the other checkpoint"
        else:
            out[name] = _first_line_difference(ta[name], tb[name])
    return out


@check("compare.tokenizer", "the two checkpoints' tokenizer files are identical")
def compare_tokenizer(ctx: Context) -> tuple[str, str, dict[str, Any]]:
    other = _other(ctx)
    diffs = tokenizer_differences(ctx.ckpt, other)
    if diffs:
        shown = "; ".join(f"{name}: {', '.join(d[:2])}" + (" ..." if len(d) > 2 else "") for name, d in diffs.items())
        return FAIL, f"{len(diffs)} tokenizer file(s) differ: {shown}", {"differences": diffs}
    present = [n for n in TOKENIZER_FILES if ctx.ckpt.sha256(n)]
    return PASS, f"identical: {', '.join(present)}", {}


@check("compare.template", "the two checkpoints' chat templates are identical")
def compare_template(ctx: Context) -> tuple[str, str, dict[str, Any]]:
    diffs = template_differences(ctx.ckpt, _other(ctx))
    if diffs:
        shown = "; ".join(f"{name}: {where}" for name, where in diffs.items())
        return FAIL, f"{len(diffs)} chat template(s) differ: {shown}", {"differences": diffs}
    return PASS, f"identical: {', '.join(sorted(ctx.ckpt.chat_templates)) or 'no templates in either'}", {}


@check("compare.rope", "the two checkpoints carry the same RoPE scaling")
def compare_rope(ctx: Context) -> tuple[str, str]:
    a = rope_parameters(ctx.ckpt.text_config)
    b = rope_parameters(_other(ctx).text_config)
    if a != b:
        if a is None or b is None:
            return FAIL, f"RoPE scaling {'missing in the other' if b is None else 'only in the other'} checkpoint: {json.dumps(a or b)}"
        return FAIL, "RoPE scaling differs: " + "; ".join(_key_differences(a, b))
    return PASS, f"identical: {json.dumps(a, sort_keys=True) if a else 'none in either'}"
