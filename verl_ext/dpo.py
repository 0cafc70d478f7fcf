"""Online and offline DPO on verl: MaxMin pairs, pair-preserving balancing, the DPO loss function.

The per-step data flow of online DPO (SPEC section 6)::

    rollout batch (N responses per prompt, DataProto with "uid")
      -> judge scores (expected rating, 1..5)                      judge_scores()
      -> one MaxMin pair per prompt (best chosen, worst rejected)  maxmin_pairs()
      -> interleaved pair batch [c0, r0, c1, r1, ...]             build_pair_batch()
      -> pair-preserving dp balancing                              balance_pairs()
      -> micro-batches with verl's force_group_size=2 (pairs never split)
      -> reference log-probs (verl's ref worker), then dpo_loss_fn  (the worker's loss)

Offline DPO (SPEC section 6) reads a static pair file and uses the length-normalized loss::

    pair file (JSON lines)                                         load_pair_file()
      -> prompt / chosen / rejected ids rendered by the core       encode_pairs()
      -> interleaved rows in verl's nested layout (the fields an
         agent-loop trajectory carries), whole pairs per step       pair_rows()
      -> pair-preserving dp balancing                              balance_pairs()
      -> reference log-probs (verl's ref worker), then dpo_loss_fn with length_normalize=True
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from apertus_plugins.core.losses import dpo_loss_from_tokens
from apertus_plugins.posttrain.judges import Judge

__all__ = [
    "PAIR_GROUP_SIZE",
    "maxmin_pairs",
    "build_pair_batch",
    "balance_pairs",
    "judge_scores",
    "dpo_loss_fn",
    "load_pair_file",
    "EncodedPair",
    "encode_pair",
    "encode_pairs",
    "pair_rows",
    "offline_step_rows",
]

logger = logging.getLogger(__name__)

#: rows per preference pair; passed to verl as ``force_group_size`` so micro-batches keep pairs whole
PAIR_GROUP_SIZE = 2


def maxmin_pairs(uids: Sequence[Any], scores: Sequence[float], min_margin: float = 0.0,
                 ) -> tuple[list[tuple[int, int]], dict[str, float]]:
    """One MaxMin pair per prompt: the highest-scored response chosen, the lowest rejected.

    The rule is the one the offline pairs are built with (:func:`apertus_plugins.posttrain.prefs.maxmin`).

    Args:
        uids: prompt id of each row (rows of one prompt share it).
        scores: judge score of each row.
        min_margin: skip prompts whose best and worst differ by no more than this (ties carry no
            preference).

    Returns:
        ``(pairs, metrics)``: ``(chosen_row, rejected_row)`` in order of each prompt's first row
        (ties broken by the earlier row), and counts of prompts and skipped prompts.
    """
    from apertus_plugins.posttrain.prefs import maxmin

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
        pick = maxmin(vals, min_margin)
        if pick is None:
            skipped += 1
            continue
        pairs.append((rows[pick[0]], rows[pick[1]]))
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


def judge_scores(judge: Judge, prompts: Sequence[str], responses: Sequence[str]) -> list[float]:
    """The judge's expected rating of every response (:meth:`Judge.rate_batch`, in order)."""
    return [float(s) for s in judge.rate_batch(list(prompts), list(responses))]


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

    ``prompt`` is a list of chat messages (``{"role": ..., "content": ...}``) or a string (one user
    turn, turned into that list). Blank lines are skipped. Every record is checked; an error names
    the file and the line.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"pair file {path} does not exist")
    records = []
    with path.open(encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: not JSON: {exc}") from exc
            if not isinstance(rec, dict):
                raise ValueError(f"{where}: a pair is a JSON object, got {type(rec).__name__}")
            for key in ("prompt", "chosen", "rejected"):
                if key not in rec:
                    raise ValueError(f"{where}: missing {key!r}")
            prompt = rec["prompt"]
            if isinstance(prompt, str):
                prompt = [{"role": "user", "content": prompt}]
            if (not isinstance(prompt, list) or not prompt
                    or not all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt)):
                raise ValueError(f"{where}: prompt must be a string or a non-empty list of messages "
                                 "with 'role' and 'content'")
            if not all(isinstance(rec[k], str) and rec[k] for k in ("chosen", "rejected")):
                raise ValueError(f"{where}: chosen and rejected must be non-empty strings")
            records.append({**rec, "prompt": prompt})
    if not records:
        raise ValueError(f"pair file {path} holds no pairs")
    return records


@dataclass(frozen=True)
class EncodedPair:
    """One offline preference pair as token ids: the prompt (with the generation prompt) and both responses.

    ``index`` is the pair's position in the pair file (its ``pair_id`` in every batch).
    """

    index: int
    prompt: tuple[int, ...]
    chosen: tuple[int, ...]
    rejected: tuple[int, ...]

    @property
    def tokens(self) -> int:
        """Tokens of both rows (prompt counted twice): the pair's workload for balancing."""
        return 2 * len(self.prompt) + len(self.chosen) + len(self.rejected)


def encode_pair(chat_tokenizer: Any, record: dict[str, Any], enable_thinking: bool = False,
                ) -> tuple[list[int], list[int], list[int]]:
    """``(prompt, chosen, rejected)`` ids of a pair record, rendered by the core chat template.

    The prompt is the conversation with the generation prompt; each response is the assistant turn
    the template appends to it (content, thinking delimiters if the text has a thinking span, and
    the end-of-turn token), i.e. the ids after the prompt in the rendering of the conversation with
    that assistant message. ``chat_tokenizer`` is an :class:`apertus_plugins.core.chat.ChatTokenizer`.
    """
    messages = list(record["prompt"])
    prompt = [int(i) for i in chat_tokenizer.encode_conversation(messages, add_generation_prompt=True,
                                                                 enable_thinking=enable_thinking).ids]
    out = []
    for key in ("chosen", "rejected"):
        full = [int(i) for i in chat_tokenizer.encode_conversation(
            [*messages, {"role": "assistant", "content": record[key]}], enable_thinking=enable_thinking).ids]
        if full[:len(prompt)] != prompt or len(full) == len(prompt):
            raise ValueError(f"the chat template does not render the {key} response as a continuation of its prompt "
                             f"(prompt {messages!r:.200})")
        out.append(full[len(prompt):])
    return prompt, out[0], out[1]


def encode_pairs(records: Sequence[dict[str, Any]], chat_tokenizer: Any, max_prompt_len: int, max_response_len: int,
                 max_length: int | None = None, enable_thinking: bool = False, drop_overlong: bool = False,
                 progress: bool = False) -> list[EncodedPair]:
    """Encode every record of a pair file (:func:`load_pair_file`) with :func:`encode_pair`.

    A prompt longer than ``max_prompt_len``, a response longer than ``max_response_len``, or a row
    (prompt + response) longer than ``max_length`` is an error naming the pair, or, with
    ``drop_overlong``, the pair is left out (the count is logged).
    """
    from tqdm import tqdm

    pairs: list[EncodedPair] = []
    dropped = 0
    for n, rec in enumerate(tqdm(records, desc="encoding pairs", unit="pair", disable=not progress)):
        prompt, chosen, rejected = encode_pair(chat_tokenizer, rec, enable_thinking=enable_thinking)
        problem = None
        if len(prompt) > max_prompt_len:
            problem = f"prompt has {len(prompt)} tokens, more than max_prompt_len={max_prompt_len}"
        for key, ids in (("chosen", chosen), ("rejected", rejected)):
            if problem is None and len(ids) > max_response_len:
                problem = f"{key} response has {len(ids)} tokens, more than max_response_len={max_response_len}"
            if problem is None and max_length is not None and len(prompt) + len(ids) > max_length:
                problem = (f"prompt + {key} response have {len(prompt) + len(ids)} tokens, "
                           f"more than max_length={max_length}")
        if problem is not None:
            if not drop_overlong:
                raise ValueError(f"pair {n}: {problem} (drop such pairs with drop_overlong)")
            dropped += 1
            continue
        pairs.append(EncodedPair(n, tuple(prompt), tuple(chosen), tuple(rejected)))
    limits = f"{max_prompt_len} prompt / {max_response_len} response / {max_length} total tokens"
    if dropped:
        logger.warning("left out %d of %d pairs longer than %s", dropped, len(records), limits)
    if not pairs:
        raise ValueError(f"no pair of {len(records)} fits {limits}")
    return pairs


def pair_rows(pairs: Sequence[EncodedPair]) -> tuple[Any, list[dict[str, Any]]]:
    """The rows of ``pairs`` in verl's nested layout, interleaved (chosen, rejected), and their tags.

    Returns ``(TensorDict, tags)``: per row the fields a verl agent-loop trajectory carries into the
    TransferQueue (``prompts``, ``responses``, ``input_ids``, ``position_ids``, ``response_mask``,
    ``loss_mask``; jagged nested tensors) plus ``pair_id`` (int64) and ``is_chosen`` (bool); the tags
    hold ``prompt_len``, ``response_len`` and ``seq_len`` as verl's replay buffer tags do.
    """
    from verl.utils import tensordict_utils as tu

    if not pairs:
        raise ValueError("no preference pairs")
    prompts, responses, pair_ids, chosen, tags = [], [], [], [], []
    for pair in pairs:
        for is_chosen, resp in ((True, pair.chosen), (False, pair.rejected)):
            if not resp or not pair.prompt:
                raise ValueError(f"pair {pair.index}: empty prompt or response")
            prompts.append(torch.tensor(pair.prompt, dtype=torch.int64))
            responses.append(torch.tensor(resp, dtype=torch.int64))
            pair_ids.append(pair.index)
            chosen.append(is_chosen)
            tags.append({"prompt_len": len(pair.prompt), "response_len": len(resp),
                         "seq_len": len(pair.prompt) + len(resp)})

    def nested(rows: list[torch.Tensor]) -> torch.Tensor:
        return torch.nested.as_nested_tensor(rows, layout=torch.jagged)

    seqs = [torch.cat([p, r]) for p, r in zip(prompts, responses, strict=True)]
    ones = [torch.ones(len(r), dtype=torch.int64) for r in responses]
    td = tu.get_tensordict({
        "prompts": nested(prompts), "responses": nested(responses), "input_ids": nested(seqs),
        "position_ids": nested([torch.arange(len(s)) for s in seqs]),
        "response_mask": nested(ones), "loss_mask": nested([o.clone() for o in ones]),
        "pair_id": torch.tensor(pair_ids, dtype=torch.int64), "is_chosen": torch.tensor(chosen),
    })
    return td, tags


def offline_step_rows(pairs: Sequence[EncodedPair], dp_size: int, step: int = 0,
                      ) -> tuple[Any, list[dict[str, Any]], list[str]]:
    """One offline DPO step's rows, ordered for ``dp_size`` data-parallel ranks: ``(fields, tags, keys)``.

    Whole pairs are balanced over the ranks by tokens (:func:`balance_pairs`), so verl's
    contiguous split gives each rank whole pairs, chosen row first; ``keys`` name each row in the
    TransferQueue (``pair<index>_<c|r>_<step>``, unique within and across steps).
    """
    seqlens = [n for p in pairs for n in (len(p.prompt) + len(p.chosen), len(p.prompt) + len(p.rejected))]
    order = balance_pairs(seqlens, dp_size)
    ordered = [pairs[order[2 * k] // PAIR_GROUP_SIZE] for k in range(len(pairs))]
    fields, tags = pair_rows(ordered)
    for tag in tags:
        tag.update(global_steps=step, status="success")
    keys = [f"pair{p.index}_{side}_{step}" for p in ordered for side in ("c", "r")]
    return fields, tags, keys
