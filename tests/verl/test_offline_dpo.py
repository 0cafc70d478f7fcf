"""Offline DPO data preparation: pair file -> ids through the core chat template -> one step's rows for verl.

The ids are checked against the core's :class:`~apertus_plugins.core.chat.ChatTokenizer` on the tiny
checkpoint's tokenizer and the loss masks against the core's SFT target mask; the rows go through
verl's own padding, balancing and micro-batching utilities and the adapter's DPO loss on a tiny
random causal LM. The trainer's Ray / TransferQueue / FSDP orchestration is not driven here (see
the README's verl section).
"""

from __future__ import annotations

import json

import pytest
import torch
from verl.utils import tensordict_utils as tu
from verl.workers.engine.utils import prepare_micro_batches
from verl.workers.utils.padding import response_from_nested

from apertus_plugins.core.targets import sft_mask
from verl_ext import dpo

RECORDS = [
    {"prompt": [{"role": "user", "content": "What is two plus two?"}], "chosen": "It is 4.", "rejected": "5"},
    {"prompt": [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a colour."}],
     "chosen": "Blue.", "rejected": "I would rather not say which colour I like most."},
    {"prompt": [{"role": "user", "content": "Say hi."}], "chosen": "Hi!", "rejected": "Goodbye, see you."},
]


def _write(path, lines):
    path.write_text("".join(ln + "\n" for ln in lines), encoding="utf-8")
    return path


def _many(n):
    """n pair records of varied lengths (the balancing has something to balance)."""
    return [{"prompt": [{"role": "user", "content": "Question " + "x" * (3 * k)}],
             "chosen": "Yes " * (1 + k % 4), "rejected": "No " * (1 + (7 * k) % 5)} for k in range(n)]


def test_encode_pair_matches_the_core_chat_template_and_sft_mask(chat_tokenizer):
    ct = chat_tokenizer
    end = ct.spec.id("assistant_end")
    for rec in RECORDS:
        prompt, chosen, rejected = dpo.encode_pair(ct, rec)
        assert prompt == [int(i) for i in ct.encode_conversation(rec["prompt"], add_generation_prompt=True).ids]
        assert prompt[-1] == ct.spec.id("assistant_start")
        for key, resp in (("chosen", chosen), ("rejected", rejected)):
            full = ct.encode_conversation([*rec["prompt"], {"role": "assistant", "content": rec[key]}]).ids
            assert prompt + resp == [int(i) for i in full]
            assert resp[-1] == end and ct.decode(resp) == rec[key] + ct.decode([end])
            # the response is exactly what the core's SFT mask trains on in the whole conversation
            labels = sft_mask(prompt + resp, ct.spec)
            assert list(map(bool, labels)) == [False] * (len(prompt) - 1) + [True] * len(resp)
    # thinking on renders another developer turn: the prompt changes, the response ids stay a continuation
    p_on, c_on, _ = dpo.encode_pair(ct, RECORDS[0], enable_thinking=True)
    assert p_on == [int(i) for i in ct.encode_conversation(RECORDS[0]["prompt"], add_generation_prompt=True,
                                                           enable_thinking=True).ids]
    assert p_on != dpo.encode_pair(ct, RECORDS[0])[0]


def test_encode_pairs_limits_and_drop_overlong(chat_tokenizer, caplog):
    ct = chat_tokenizer
    ids = [dpo.encode_pair(ct, r) for r in RECORDS]
    plen = [len(p) for p, _, _ in ids]
    rlen = [max(len(c), len(r)) for _, c, r in ids]
    pairs = dpo.encode_pairs(RECORDS, ct, max(plen), max(rlen))
    assert [p.index for p in pairs] == [0, 1, 2]
    assert [(list(p.prompt), list(p.chosen), list(p.rejected)) for p in pairs] == ids
    assert pairs[1].tokens == 2 * plen[1] + len(ids[1][1]) + len(ids[1][2])

    # a response one token too long: an error naming the pair and the limit ...
    with pytest.raises(ValueError, match=rf"pair 1: rejected response has {rlen[1]} tokens, more than "
                                         rf"max_response_len={rlen[1] - 1} \(drop such pairs with drop_overlong\)"):
        dpo.encode_pairs(RECORDS, ct, max(plen), rlen[1] - 1)
    # ... or, with drop_overlong, that pair left out (the rest keep their file positions) and counted
    with caplog.at_level("WARNING", logger="verl_ext.dpo"):
        kept = dpo.encode_pairs(RECORDS, ct, max(plen), rlen[1] - 1, drop_overlong=True)
    assert [p.index for p in kept] == [0, 2] and "left out 1 of 3 pairs" in caplog.text
    with pytest.raises(ValueError, match=rf"pair 0: prompt has {plen[0]} tokens, more than max_prompt_len=5"):
        dpo.encode_pairs(RECORDS, ct, 5, max(rlen))
    # the total length of a row (SPEC: 4,096 tokens per offline DPO sequence)
    total = plen[0] + len(ids[0][1])
    with pytest.raises(ValueError, match=rf"pair 0: prompt \+ chosen response have {total} tokens, "
                                         rf"more than max_length={total - 1}"):
        dpo.encode_pairs(RECORDS, ct, max(plen), max(rlen), max_length=total - 1)
    with pytest.raises(ValueError, match="no pair of 3 fits 5 prompt"):
        dpo.encode_pairs(RECORDS, ct, 5, max(rlen), drop_overlong=True)


def test_load_pair_file_reads_records_and_names_file_and_line_of_bad_input(tmp_path):
    good = _write(tmp_path / "pairs.jsonl", [json.dumps(RECORDS[0]), "",
                                              json.dumps({"prompt": "Say hi.", "chosen": "Hi!", "rejected": "No."})])
    recs = dpo.load_pair_file(good)
    assert len(recs) == 2 and recs[0] == RECORDS[0]
    assert recs[1]["prompt"] == [{"role": "user", "content": "Say hi."}]  # a string prompt is one user turn
    ok = json.dumps(RECORDS[0])
    cases = [
        ([ok, '{"prompt": "x", "chosen": "a"'], r"bad.jsonl:2: not JSON"),
        ([ok, ok, '{"prompt": "x", "chosen": "a"}'], r"bad.jsonl:3: missing 'rejected'"),
        (['["x", "a", "b"]'], r"bad.jsonl:1: a pair is a JSON object, got list"),
        (['{"prompt": 3, "chosen": "a", "rejected": "b"}'], r"bad.jsonl:1: prompt must be a string or a non-empty"),
        (['{"prompt": [], "chosen": "a", "rejected": "b"}'], r"bad.jsonl:1: prompt must be"),
        (['{"prompt": [{"content": "x"}], "chosen": "a", "rejected": "b"}'], r"bad.jsonl:1: prompt must be"),
        (['{"prompt": "x", "chosen": "", "rejected": "b"}'], r"bad.jsonl:1: chosen and rejected must be non-empty"),
        (['{"prompt": "x", "chosen": "a", "rejected": 7}'], r"bad.jsonl:1: chosen and rejected must be non-empty"),
        (["", "  "], r"pair file .*bad.jsonl holds no pairs"),
    ]
    for lines, message in cases:
        bad = _write(tmp_path / "bad.jsonl", lines)
        with pytest.raises(ValueError, match=message):
            dpo.load_pair_file(bad)
    with pytest.raises(FileNotFoundError, match=r"pair file .*missing.jsonl does not exist"):
        dpo.load_pair_file(tmp_path / "missing.jsonl")


def test_pair_rows_interleave_pairs_in_verls_nested_layout(chat_tokenizer):
    pairs = dpo.encode_pairs(RECORDS, chat_tokenizer, 4096, 4096)
    td, tags = dpo.pair_rows(pairs)
    assert td.batch_size[0] == 6
    assert td["pair_id"].tolist() == [0, 0, 1, 1, 2, 2] and td["is_chosen"].tolist() == [True, False] * 3
    for row, (pair, side) in enumerate((p, s) for p in pairs for s in ("chosen", "rejected")):
        resp = list(getattr(pair, side))
        assert td["prompts"][row].tolist() == list(pair.prompt) and td["responses"][row].tolist() == resp
        seq = list(pair.prompt) + resp
        assert td["input_ids"][row].tolist() == seq and td["position_ids"][row].tolist() == list(range(len(seq)))
        assert td["response_mask"][row].tolist() == [1] * len(resp) == td["loss_mask"][row].tolist()
        # the trained labels of the row, shifted to label positions, are the core's SFT mask of the conversation
        trained = [0] * len(pair.prompt) + td["loss_mask"][row].tolist()
        assert trained[1:] == [int(x) for x in sft_mask(seq, chat_tokenizer.spec)]
        assert tags[row] == {"prompt_len": len(pair.prompt), "response_len": len(resp), "seq_len": len(seq)}
    with pytest.raises(ValueError, match="no preference pairs"):
        dpo.pair_rows([])
    with pytest.raises(ValueError, match="pair 7: empty prompt or response"):
        dpo.pair_rows([dpo.EncodedPair(7, (1, 2), (), (3,))])


@pytest.mark.parametrize("dp_size", [1, 2, 4])
def test_offline_step_rows_keep_whole_pairs_per_rank_and_unique_keys(chat_tokenizer, dp_size):
    pairs = dpo.encode_pairs(_many(8), chat_tokenizer, 4096, 4096)
    fields, tags, keys = dpo.offline_step_rows(pairs, dp_size, step=3)
    assert fields.batch_size[0] == len(tags) == len(keys) == 16
    pid = fields["pair_id"]
    # interleaved: every even row is a chosen row, its partner the next row
    assert bool((pid[0::2] == pid[1::2]).all()) and fields["is_chosen"].tolist() == [True, False] * 8
    assert sorted(pid[0::2].tolist()) == list(range(8))
    by_index = {p.index: p for p in pairs}
    for row in range(16):
        p = by_index[int(pid[row])]
        want = p.chosen if row % 2 == 0 else p.rejected
        assert fields["responses"][row].tolist() == list(want)
        assert tags[row]["global_steps"] == 3 and tags[row]["status"] == "success"
    # verl's dp dispatch splits the rows contiguously: each rank gets whole pairs, balanced in tokens
    chunks = tu.chunk_tensordict(fields, dp_size)
    loads = []
    for chunk in chunks:
        cp = chunk["pair_id"]
        assert len(cp) == 16 // dp_size and bool((cp[0::2] == cp[1::2]).all())
        loads.append(sum(by_index[int(i)].tokens for i in cp[0::2]))
    assert max(loads) - min(loads) <= max(p.tokens for p in pairs)
    # inside a rank, verl's micro-batching with force_group_size=2 keeps the pairs whole
    rank = chunks[0]
    tu.assign_non_tensor(rank, use_dynamic_bsz=True, force_group_size=dpo.PAIR_GROUP_SIZE,
                         micro_batch_size_per_gpu=1, max_token_len_per_gpu=2 * max(t["seq_len"] for t in tags))
    micro, _ = prepare_micro_batches(rank)
    for mb in micro:
        assert len(mb["pair_id"]) % 2 == 0 and bool((mb["pair_id"][0::2] == mb["pair_id"][1::2]).all())
    # keys: unique within the step and different in the next step (the TransferQueue is keyed by them)
    assert len(set(keys)) == 16
    _, _, next_keys = dpo.offline_step_rows(pairs, dp_size, step=4)
    assert not set(keys) & set(next_keys)
    assert keys[0] == f"pair{int(pid[0])}_c_3" and keys[1] == f"pair{int(pid[0])}_r_3"


def test_offline_step_rows_need_whole_pairs_per_rank(chat_tokenizer):
    pairs = dpo.encode_pairs(_many(3), chat_tokenizer, 4096, 4096)
    with pytest.raises(ValueError, match="3 pairs cannot be split evenly over 2 data-parallel ranks"):
        dpo.offline_step_rows(pairs, 2)


def test_offline_step_loss_on_the_rows_with_a_real_model(chat_tokenizer, policy_pair):
    """One offline step's rows -> reference log-probs in verl's layout -> length-normalized DPO loss and gradients."""
    student, reference = policy_pair
    pairs = dpo.encode_pairs(RECORDS + _many(1), chat_tokenizer, 4096, 4096)
    fields, _, _ = dpo.offline_step_rows(pairs, 2, step=1)
    rank = tu.chunk_tensordict(fields, 2)[0]  # what one data-parallel rank receives

    def log_probs(model):
        """Token log-probs of the next token, packed as verl's engine returns them (nested over prompt + response)."""
        rows = []
        for seq in rank["input_ids"].unbind():
            logits = model(input_ids=seq[None]).logits[0]
            nxt = torch.cat([seq[1:], seq[:1]])  # the last position's label is never read
            rows.append(torch.log_softmax(logits.float(), -1).gather(-1, nxt[:, None]).squeeze(-1))
        return torch.nested.as_nested_tensor(rows, layout=torch.jagged)

    with torch.no_grad():
        ref = log_probs(reference)
    rank["ref_log_prob"] = response_from_nested(ref, rank["response_mask"])  # as verl's trainer stores it
    n_rows = len(rank["pair_id"])
    tu.assign_non_tensor(rank, dp_size=2, global_batch_size=2 * n_rows)
    out = log_probs(student)
    loss, metrics = dpo.dpo_loss_fn(None, {"log_probs": out}, rank, beta=25.0, length_normalize=True)
    # the policy equals the reference: every pair's margin is 0, its loss log 2; the rank holds half the
    # global pairs and the loss is scaled by dp size over the global pair count: log 2 in total
    assert float(loss) == pytest.approx(float(torch.log(torch.tensor(2.0))), rel=1e-5)
    loss.backward()
    assert sum(float(p.grad.abs().sum()) for p in student.parameters() if p.grad is not None) > 0

    # length normalization: the margin uses each sequence's mean token log-prob (moved policy, beta 25)
    with torch.no_grad():
        for p in student.parameters():
            p.add_(torch.randn_like(p) * 1e-2)
    pol = log_probs(student).detach()
    loss, _ = dpo.dpo_loss_fn(None, {"log_probs": pol}, rank, beta=25.0, length_normalize=True)
    pol_r = response_from_nested(pol, rank["response_mask"])
    mean = [float((a - b).double().mean()) for a, b in zip(pol_r.unbind(), rank["ref_log_prob"].unbind(), strict=True)]
    margins = torch.tensor([25.0 * (mean[i] - mean[i + 1]) for i in range(0, n_rows, 2)], dtype=torch.float64)
    want = float(torch.nn.functional.softplus(-margins).sum() / n_rows * 2)  # n_rows pairs in all, dp 2
    assert float(loss) == pytest.approx(want, rel=1e-4)
    assert "actor/dpo_loss" in metrics
