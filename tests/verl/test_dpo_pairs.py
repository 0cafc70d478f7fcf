"""MaxMin pairing and pair integrity through verl's own batch utilities (DataProto, balancing, micro-batching)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from verl import DataProto
from verl.utils import tensordict_utils as tu
from verl.utils.seqlen_balancing import get_seqlen_balanced_partitions
from verl.workers.engine.utils import prepare_micro_batches

from verl_ext import dpo


def test_maxmin_pairs_picks_best_and_worst_per_prompt():
    uids = ["a", "a", "a", "b", "b", "b", "c", "c"]
    scores = [3.2, 4.9, 1.1, 2.0, 2.0, 2.0, 1.5, 4.0]
    pairs, metrics = dpo.maxmin_pairs(uids, scores)
    assert pairs == [(1, 2), (7, 6)]  # prompt b is all ties: no preference
    assert metrics == {"dpo/prompts": 3.0, "dpo/pairs": 2.0, "dpo/skipped_prompts": 1.0}
    with pytest.raises(ValueError, match="NaN"):
        dpo.maxmin_pairs(["a", "a"], [1.0, float("nan")])
    with pytest.raises(ValueError, match="2 uids but 1 scores"):
        dpo.maxmin_pairs(["a", "a"], [1.0])


def _rollout_batch(n_prompts=8, n=4, seed=0):
    rng = np.random.default_rng(seed)
    rows = n_prompts * n
    lengths = rng.integers(3, 40, size=rows)
    width = int(lengths.max())
    ids = torch.zeros(rows, width, dtype=torch.int64)
    mask = torch.zeros(rows, width, dtype=torch.int64)
    for i, ln in enumerate(lengths):
        ids[i, :ln] = torch.arange(1, ln + 1) + 1000 * i
        mask[i, :ln] = 1
    batch = DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": mask},
                                non_tensors={"uid": np.array([f"p{i // n}" for i in range(rows)], dtype=object)})
    scores = rng.normal(size=rows)
    return batch, scores, lengths


def test_pairs_stay_whole_through_balancing_dispatch_minibatches_and_microbatches():
    batch, scores, _ = _rollout_batch(n_prompts=16, n=4)
    pairs, _ = dpo.maxmin_pairs(list(batch.non_tensor_batch["uid"]), scores)
    assert len(pairs) == 16
    pb = dpo.build_pair_batch(batch, pairs)
    assert pb.batch["pair_id"].tolist() == [p for p in range(16) for _ in range(2)]
    # the selected rows are the chosen/rejected rows of the rollout batch
    torch.testing.assert_close(pb.batch["input_ids"][0], batch.batch["input_ids"][pairs[0][0]])
    torch.testing.assert_close(pb.batch["input_ids"][1], batch.batch["input_ids"][pairs[0][1]])

    seqlens = pb.batch["attention_mask"].sum(-1).tolist()
    # verl's per-row balancing splits pairs across ranks on this batch ...
    parts = get_seqlen_balanced_partitions(seqlens, k_partitions=4, equal_size=True)
    where = {r: k for k, part in enumerate(parts) for r in part}
    assert any(where[2 * p] != where[2 * p + 1] for p in range(16))
    # ... the pair-level balancing keeps them whole and still balances the tokens
    order = dpo.balance_pairs(seqlens, k_partitions=4)
    assert sorted(order) == list(range(32))
    balanced = pb.select_idxs(np.asarray(order))
    per_rank = balanced.chunk(4)  # verl's contiguous dp dispatch
    loads = [int(c.batch["attention_mask"].sum()) for c in per_rank]
    assert max(loads) - min(loads) <= max(seqlens) * 2
    for rank in per_rank:
        pid = rank.batch["pair_id"]
        assert bool((pid[0::2] == pid[1::2]).all()) and bool(rank.batch["is_chosen"][0::2].all())

        # micro-batching inside the engine: verl's prepare_micro_batches with force_group_size=2
        rows = len(rank)
        nested = torch.nested.as_nested_tensor(
            [rank.batch["input_ids"][i, : int(rank.batch["attention_mask"][i].sum())] for i in range(rows)],
            layout=torch.jagged)
        td = tu.get_tensordict({"input_ids": nested, "pair_id": rank.batch["pair_id"]})
        for dynamic in (False, True):
            tu.assign_non_tensor(td, use_dynamic_bsz=dynamic, force_group_size=dpo.PAIR_GROUP_SIZE,
                                 micro_batch_size_per_gpu=1, max_token_len_per_gpu=90)
            micro, _ = prepare_micro_batches(td)
            assert len(micro) > 1
            seen = []
            for mb in micro:
                pid = mb["pair_id"]
                assert len(pid) % 2 == 0 and bool((pid[0::2] == pid[1::2]).all())
                seen.extend(pid.tolist())
            assert sorted(seen) == sorted(rank.batch["pair_id"].tolist())

        # mini-batches: verl's iterator without shuffling keeps even, contiguous slices
        it = tu.make_iterator(td, mini_batch_size=4, epochs=1, seed=0, dataloader_kwargs={"shuffle": False})
        for mini in it:
            pid = mini["pair_id"]
            assert bool((pid[0::2] == pid[1::2]).all())


def test_balance_pairs_rejects_odd_rows_and_uneven_ranks():
    with pytest.raises(ValueError, match="whole pairs"):
        dpo.balance_pairs([3, 4, 5], 1)
    with pytest.raises(ValueError, match="evenly"):
        dpo.balance_pairs([3, 4, 5, 6, 7, 8], 2)
    with pytest.raises(ValueError, match="no preference pairs"):
        dpo.build_pair_batch(_rollout_batch()[0], [])
