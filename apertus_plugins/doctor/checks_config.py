"""Config checks (SPEC.md sections 3.6 and 5): the text-only head, RoPE scaling, the generation stops."""

from __future__ import annotations

from typing import Any

from apertus_plugins.core.release import (
    ROPE_FACTOR,
    ROPE_ORIGINAL_CONTEXT,
    ROPE_THETA,
    ROPE_TYPE,
    STOP_TOKENS,
    TERMINATOR,
)
from apertus_plugins.core.tensor_names import LM_HEAD

from .registry import Context, check
from .report import FAIL, PASS, WARN

__all__ = ["rope_parameters"]


@check("config.output_vocab", "output_vocab_size equals the LM head's rows and the text ids")
def output_vocab(ctx: Context) -> tuple[str, str]:
    text = ctx.ckpt.text_config
    declared = text.get("output_vocab_size")
    rows = ctx.ckpt.tensor_rows(LM_HEAD)
    text_ids = ctx.ref.text_size
    problems = []
    if declared is None:
        problems.append("text_config has no output_vocab_size")
    if rows is None:
        problems.append("the weights have no lm_head.weight")
    if declared is not None and rows is not None and declared != rows:
        problems.append(f"output_vocab_size {declared:,} but lm_head.weight has {rows:,} rows")
    if rows is not None and rows != text_ids:
        problems.append(f"the head has {rows:,} rows, the text block {text_ids:,} ids (the head is text-only)")
    if problems:
        return FAIL, "; ".join(problems)
    return PASS, f"output_vocab_size {declared:,} = lm_head rows = text ids"


def rope_parameters(text_config: dict[str, Any]) -> dict[str, Any] | None:
    """The RoPE scaling of a text config (``rope_parameters`` of transformers 5, or ``rope_scaling``)."""
    rope = text_config.get("rope_parameters") or text_config.get("rope_scaling")
    if not isinstance(rope, dict):
        return None
    out = dict(rope)
    if "rope_type" not in out and "type" in out:
        out["rope_type"] = out.pop("type")
    if "rope_theta" not in out and "rope_theta" in text_config:
        out["rope_theta"] = text_config["rope_theta"]
    return out


@check("config.rope", "RoPE scaling is present: llama3 type with its factor and original context")
def rope(ctx: Context) -> tuple[str, str]:
    rp = rope_parameters(ctx.ckpt.text_config)
    if rp is None or rp.get("rope_type") in (None, "default"):
        return FAIL, ("no RoPE scaling in text_config (rope_parameters / rope_scaling): a conversion that drops it "
                      "silently degrades long context (report 3.4)")
    problems = []
    if rp.get("rope_type") != ROPE_TYPE:
        problems.append(f"rope_type {rp.get('rope_type')!r}, want {ROPE_TYPE!r}")
    factor, original, theta = rp.get("factor"), rp.get("original_max_position_embeddings"), rp.get("rope_theta")
    if not isinstance(factor, (int, float)) or factor <= 1:
        problems.append(f"factor {factor!r}, want a scaling factor above 1")
    if not isinstance(original, int) or original <= 0:
        problems.append(f"original_max_position_embeddings {original!r}")
    if problems:
        return FAIL, "; ".join(problems)
    found = f"llama3, factor {factor:g}, original context {original:,}, base {theta if theta is None else f'{theta:,.0f}'}"
    if (factor, original, theta) != (ROPE_FACTOR, ROPE_ORIGINAL_CONTEXT, ROPE_THETA):
        return WARN, (f"{found}; the release ends context extension at factor {ROPE_FACTOR:g}, original "
                      f"{ROPE_ORIGINAL_CONTEXT:,}, base {ROPE_THETA:,.0f}")
    return PASS, found


@check("config.generation_stops", "the generation config stops at </s>, <|assistant_end|> and after a tool call")
def generation_stops(ctx: Context) -> tuple[str, str]:
    gen = ctx.ckpt.json("generation_config.json")
    ref = ctx.ref
    if gen is None:
        return FAIL, ("no generation_config.json: nothing stops generation at <|assistant_end|> or after a tool call "
                      "(the model fabricates tool results, report 7.4)")
    eos = gen.get("eos_token_id")
    have = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    need = {name: ref.id(name) for name in (TERMINATOR, *STOP_TOKENS)}
    missing = [f"{ref.literal(n)} ({i})" for n, i in need.items() if i not in have]
    if missing:
        why = " (the model runs past a tool call and fabricates its result, report 7.4)" if ref.id(
            "tools_suffix") not in have else ""
        return FAIL, f"eos_token_id {have} lacks {', '.join(missing)}{why}"
    return PASS, "eos_token_id " + ", ".join(f"{i} {ref.literal(n)}" for n, i in need.items())
