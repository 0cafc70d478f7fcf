"""Online and offline DPO on verl: MaxMin pairs, pair-preserving balancing, the DPO loss function.

The per-step data flow of online DPO (SPEC section 6)::

    rollout batch (N responses per prompt, DataProto with "uid")
      -> judge scores (expected rating, 1..5)                      judge_scores()
      -> one MaxMin pair per prompt (best chosen, worst rejected)  maxmin_pairs()
      -> interleaved pair batch [c0, r0, c1, r1, ...]             build_pair_batch()
      -> pair-preserving dp balancing                              balance_pairs()
      -> micro-batches with verl's force_group_size=2 (pairs never split)
      -> reference log-probs (verl's ref worker), then dpo_loss_fn  (the worker's loss)

Offline DPO reads the same interleaved layout from a static pair file (:func:`load_pair_file`,
:func:`pairs_to_batch`) and uses the length-normalized loss.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from apertus_plugins.losses import dpo_loss_from_tokens

__all__ = [
    "PAIR_GROUP_SIZE",
    "maxmin_pairs",
    "build_pair_batch",
    "balance_pairs",
    "judge_scores",
    "dpo_loss_fn",
    "load_pair_file",
    "pairs_to_batch",
]

#: rows per preference pair; passed to verl as ``force_group_size`` so micro-batches keep pairs whole
PAIR_GROUP_SIZE = 2


def maxmin_pairs(uids: Sequence[Any], scores: Sequence[float], min_margin: float = 0.0,
                 ) -> tuple[list[tuple[int, int]], dict[str, float]]:
    """One MaxMin pair per prompt: the highest-scored response chosen, the lowest rejected.

    Args:
        uids: prompt id of each row (rows of one prompt share it).
        scores: judge score of each row.
        min_margin: skip prompts whose best and worst differ by no more than this (ties carry no
            preference).

    Returns:
        ``(pairs, metrics)``: ``(chosen_row, rejected_row)`` in order of each prompt's first row
        (ties broken by the earlier row), and counts of prompts and skipped prompts.
    """
    if len(uids) != len(scores):
        raise ValueError(f"{len(uids)} uids but {len(scores)} scores")
    groups: dict[Any, list[int]] = {}
    for i, u in enumerate(uids):
        groups.setdefault(u, []).append(i)
    pairs: list[tuple[int, int]] = []
    skipped = 0
    for rows in groups.values():
        vals = [float(scores[i]) for i in rows]
        if any(math.isnan(v) for v in vals):
            raise ValueError(f"NaN judge score among rows {rows}")
        best = rows[int(np.argmax(vals))]
        worst = rows[int(np.argmin(vals))]
        if len(rows) < 2 or max(vals) - min(vals) <= min_margin:
            skipped += 1
            continue
        pairs.append((best, worst))
    return pairs, {"dpo/prompts": float(len(groups)), "dpo/pairs": float(len(pairs)),
                   "dpo/skipped_prompts": float(skipped)}


def build_pair_batch(batch: Any, pairs: Sequence[tuple[int, int]]) -> Any:
    """Select the pairs' rows of a :class:`verl.DataProto` in interleaved order.

    Row ``2p`` is the chosen and ``2p + 1`` the rejected response of pair ``p``; the tensors
    ``pair_id`` (int64) and ``is_chosen`` (bool) are added so every later stage can check that
    the pairs are still whole.
    """
    if not pairs:
        raise ValueError("no preference pairs in this batch (every prompt's responses were tied)")
    rows = [r for pair in pairs for r in pair]
    out = batch.select_idxs(np.asarray(rows, dtype=np.int64))
    n = len(pairs)
    out.batch["pair_id"] = torch.arange(n, dtype=torch.int64).repeat_interleave(PAIR_GROUP_SIZE)
    out.batch["is_chosen"] = torch.tensor([True, False] * n)
    return out


def balance_pairs(seqlens: Sequence[int], k_partitions: int) -> list[int]:
    """A row order that balances tokens over ``k_partitions`` data-parallel ranks without splitting pairs.

    verl's balancing (Karmarkar-Karp over single rows) would scatter the two rows of a pair;
    here the unit is the pair (its workload the sum of its rows), partitioned with verl's own
    :func:`get_seqlen_balanced_partitions`. Returns the new row order: partition after
    partition, each pair's rows adjacent (chosen first), so verl's contiguous dp split and
    ``force_group_size=2`` micro-batching keep every pair whole.
    """
    from verl.utils.seqlen_balancing import get_seqlen_balanced_partitions

    if len(seqlens) % PAIR_GROUP_SIZE:
        raise ValueError(f"{len(seqlens)} rows do not form whole pairs")
    n_pairs = len(seqlens) // PAIR_GROUP_SIZE
    if n_pairs % k_partitions:
        raise ValueError(f"{n_pairs} pairs cannot be split evenly over {k_partitions} data-parallel ranks")
    work = [int(seqlens[2 * p]) + int(seqlens[2 * p + 1]) for p in range(n_pairs)]
    parts = get_seqlen_balanced_partitions(work, k_partitions=k_partitions, equal_size=True)
    return [2 * p + j for part in parts for p in part for j in range(PAIR_GROUP_SIZE)]


def judge_scores(judge: Any, prompts: Sequence[str], responses: Sequence[str]) -> list[float]:
    """The judge's expected rating of every response (batched, in order)."""
    if hasattr(judge, "rate_batch"):
        return [float(s) for s in judge.rate_batch(list(prompts), list(responses))]
    return [float(judge.rate(p, r)) for p, r in zip(prompts, responses, strict=True)]


def dpo_loss_fn(config: Any, model_output: dict, data: Any, dp_group: Any = None, beta: float = 0.1,
                length_normalize: bool = False) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl loss function (``TrainingWorker.set_loss_fn``) for DPO on an interleaved micro-batch.

    ``model_output["log_probs"]`` are the policy's token log-probs (nested, prompt + response);
    ``data`` carries ``response_mask``, ``ref_log_prob`` and ``pair_id``. The micro-batch loss is
    the sum of its pairs' losses divided by the global number of pairs of the mini-batch and
    multiplied by the dp size, so the gradients accumulated over micro-batches and averaged over
    ranks equal the gradient of the mean pair loss (verl's ``agg_loss`` convention).
    """
    from verl.utils.metric import AggregationType, Metric
    from verl.workers.utils.padding import no_padding_2_padding

    log_prob = no_padding_2_padding(model_output["log_probs"], data)
    dp_size = int(data["dp_size"]) if "dp_size" in data.keys() else 1
    global_rows = data["global_batch_size"] if "global_batch_size" in data.keys() else None
    fields = data.select("response_mask", "ref_log_prob", "pair_id")
    fields = fields.to_padded_tensor() if fields["response_mask"].is_nested else fields
    mask = fields["response_mask"].to(log_prob.dtype)
    ref = fields["ref_log_prob"].to(log_prob.dtype)
    losses, metrics = dpo_loss_from_tokens(log_prob, ref, mask, beta=beta, length_normalize=length_normalize,
                                           pair_ids=fields["pair_id"])
    n_global = (int(global_rows) // 2) if global_rows else losses.shape[0] * dp_size
    loss = losses.sum() / n_global * dp_size
    out = {f"actor/dpo_{k}": Metric(AggregationType.MEAN, v.detach().float()) for k, v in metrics.items()}
    out["actor/dpo_loss"] = Metric(AggregationType.SUM, loss.detach())
    return loss, out


# ---------------------------------------------------------------------------------- offline pairs
def load_pair_file(path: str | Path) -> list[dict[str, Any]]:
    """Read a static pair file (JSON lines): ``{"prompt": messages, "chosen": str, "rejected": str}``.

    ``prompt`` is a list of chat messages (or a string, one user turn). Every record is checked;
    the error names the line.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"pair file {path} does not exist")
    records = []
    with path.open(encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n}: not JSON: {exc}") from exc
            for key in ("prompt", "chosen", "rejected"):
                if key not in rec:
                    raise ValueError(f"{path}:{n}: missing {key!r}")
            if isinstance(rec["prompt"], str):
                rec["prompt"] = [{"role": "user", "content": rec["prompt"]}]
            if not all(isinstance(rec[k], str) and rec[k] for k in ("chosen", "rejected")):
                raise ValueError(f"{path}:{n}: chosen and rejected must be non-empty strings")
            records.append(rec)
    if not records:
        raise ValueError(f"pair file {path} holds no pairs")
    return records


def pairs_to_batch(records: Sequence[dict[str, Any]], encode_prompt: Callable[[list[dict[str, Any]]], list[int]],
                   encode_response: Callable[[str], list[int]], max_prompt_len: int, max_response_len: int,
                   pad_id: int = 0) -> Any:
    """Interleaved :class:`verl.DataProto` of offline pairs in verl's padded layout.

    ``encode_prompt(messages)`` renders a prompt with the generation prompt (the core's
    :class:`~apertus_plugins.chat.ChatTokenizer`); ``encode_response(text)`` tokenizes a
    response including its end-of-turn token. Prompts are left-padded to ``max_prompt_len``,
    responses right-padded to ``max_response_len``; longer ones are an error naming the pair.
    Tensors: ``input_ids``, ``attention_mask``, ``position_ids``, ``prompts``, ``responses``,
    ``response_mask``, ``pair_id``, ``is_chosen``.
    """
    from verl import DataProto

    rows_p, rows_r, pair_ids, chosen = [], [], [], []
    for p, rec in enumerate(records):
        prompt = list(encode_prompt(rec["prompt"]))
        if len(prompt) > max_prompt_len:
            raise ValueError(f"pair {p}: prompt has {len(prompt)} tokens, more than max_prompt_len={max_prompt_len}")
        for key in ("chosen", "rejected"):
            resp = list(encode_response(rec[key]))
            if not resp or len(resp) > max_response_len:
                raise ValueError(f"pair {p}: {key} response has {len(resp)} tokens (1..{max_response_len} allowed)")
            rows_p.append(prompt)
            rows_r.append(resp)
            pair_ids.append(p)
            chosen.append(key == "chosen")
    n = len(rows_p)
    prompts = torch.full((n, max_prompt_len), pad_id, dtype=torch.int64)
    responses = torch.full((n, max_response_len), pad_id, dtype=torch.int64)
    pmask = torch.zeros((n, max_prompt_len), dtype=torch.int64)
    rmask = torch.zeros((n, max_response_len), dtype=torch.int64)
    for i, (pr, rs) in enumerate(zip(rows_p, rows_r, strict=True)):
        prompts[i, max_prompt_len - len(pr):] = torch.tensor(pr)
        pmask[i, max_prompt_len - len(pr):] = 1
        responses[i, :len(rs)] = torch.tensor(rs)
        rmask[i, :len(rs)] = 1
    attention = torch.cat([pmask, rmask], dim=1)
    position = (attention.cumsum(1) - 1).clamp_min(0)
    return DataProto.from_dict(tensors={
        "input_ids": torch.cat([prompts, responses], dim=1), "attention_mask": attention,
        "position_ids": position, "prompts": prompts, "responses": responses, "response_mask": rmask,
        "pair_id": torch.tensor(pair_ids, dtype=torch.int64), "is_chosen": torch.tensor(chosen),
    })
