"""Each trainer's per-step data flow on CPU, through verl's data structures and a real small model.

rollout batch (DataProto / nested TensorDict) -> judge -> teacher inputs or pairs -> loss inputs ->
the adapter's verl loss function -> loss and gradients through a tiny random causal LM over the
Apertus test vocabulary. The judge is the real HTTP client (``OpenAIJudge``) against the suite's
vLLM server (``judge_server`` in conftest.py: the tiny Apertus checkpoint through the vLLM plugin).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from verl import DataProto
from verl.utils import tensordict_utils as tu

from apertus_plugins.core.losses import topk_tail_reverse_kl
from apertus_plugins.posttrain.judges import Judge, OpenAIJudge
from verl_ext import dpo, sdpo


@pytest.fixture()
def judge(judge_server):
    """The judge client as the trainers build it (short feedback keeps the CPU server quick)."""
    return OpenAIJudge(charter="@sample", base_url=judge_server.url, model=judge_server.model, top_logprobs=judge_server.top_logprobs,
                       feedback_max_tokens=24, aspect="helpfulness", max_workers=4)


PROMPTS = [[{"role": "user", "content": "What is two plus two?"}],
           [{"role": "user", "content": "Name a colour."}]]
RESPONSES = [["It is 4.", "Four, since two and two make four.", "5"],
             ["Blue.", "Maybe red, or green, or blue.", "I cannot see colours."]]


def _rollout(ct, n=2):
    """Rows: prompt i repeated n times with different responses, as verl's rollout produces them."""
    prompts, responses, uids, raw = [], [], [], []
    for i, msgs in enumerate(PROMPTS):
        p_ids = [int(x) for x in ct.encode_conversation(msgs, add_generation_prompt=True).ids]
        for j in range(n):
            text = RESPONSES[i][j]
            prompts.append(p_ids)
            responses.append(ct.text_ids(text) + [ct.spec.id("assistant_end")])
            uids.append(f"u{i}")
            raw.append(msgs)
    return prompts, responses, uids, raw


def _packed_logits(model, prompts, responses):
    """Student logits in verl's packed layout (one row per token of prompt + response)."""
    outs = []
    for p, r in zip(prompts, responses, strict=True):
        ids = torch.tensor([p + r])
        outs.append(model(input_ids=ids).logits[0])
    return torch.cat(outs)


def _nested(rows):
    return torch.nested.as_nested_tensor([torch.tensor(r) for r in rows], layout=torch.jagged)


def test_sdpo_step_dataflow_loss_and_gradients(chat_tokenizer, policy_pair, judge):
    ct, (student, teacher) = chat_tokenizer, policy_pair
    prompts, responses, uids, raw = _rollout(ct)
    assert isinstance(judge, Judge)
    texts = [ct.decode(r) for r in responses]
    user_texts = [m[-1]["content"] for m in raw]
    feedback = sdpo.collect_feedback(judge, user_texts, texts)
    assert len(feedback) == len(texts) and all(isinstance(f, str) for f in feedback)
    # the batched requests return, in order, what single greedy requests return
    assert feedback[1] == judge.feedback(user_texts[1], texts[1])
    teacher_prompts = sdpo.build_teacher_prompts(ct, raw, feedback)
    # the teacher prompt is the student prompt with the feedback and the instruction in the user turn
    rendered = ct.decode(teacher_prompts[0])
    assert feedback[0] in rendered and "Do not mention the feedback" in rendered
    assert rendered.endswith(ct.spec.literal("assistant_start"))
    assert len(teacher_prompts[0]) > len(prompts[0])

    # verl's micro-batch: nested prompt/response/teacher tensors, old log-probs from the rollout
    resp_lens = [len(r) for r in responses]
    width = max(resp_lens)
    mask = torch.tensor([[1] * n + [0] * (width - n) for n in resp_lens])
    with torch.no_grad():
        full = _packed_logits(student, prompts, responses)
        lp_full = torch.log_softmax(full, -1)
    seqs = [p + r for p, r in zip(prompts, responses, strict=True)]
    labels = torch.cat([torch.tensor(s[1:] + [0]) for s in seqs])
    token_lp = lp_full.gather(-1, labels[:, None]).squeeze(-1)
    old = torch.zeros(len(seqs), width)
    off = 0
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        old[i, :len(r)] = token_lp[off + len(p) - 1: off + len(p) - 1 + len(r)] - 0.3 * (i % 2)
        off += len(p) + len(r)
    data = tu.get_tensordict({
        "prompts": _nested(prompts), "responses": _nested(responses), "teacher_prompts": _nested(teacher_prompts),
        "input_ids": _nested(seqs), "response_mask": mask, "old_log_probs": old,
    })
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=int(mask.sum()), global_batch_size=len(seqs))

    actor_cfg = SimpleNamespace(loss_agg_mode="token-mean", loss_scale_factor=None)
    loss_fn = sdpo.make_sdpo_loss_fn(actor_cfg, sdpo.padded_teacher_forward(teacher), k=16, is_clip=2.0)
    student.zero_grad()
    logits = _packed_logits(student, prompts, responses)
    proc = loss_fn(student_logits=logits.unsqueeze(0), data=data)  # verl's logits-processor call
    assert proc["sdpo_kl"].shape == (1, logits.shape[0])
    kl_nested = torch.nested.nested_tensor_from_jagged(proc["sdpo_kl"].squeeze(0), data["input_ids"].offsets())
    lp = torch.log_softmax(logits, -1).gather(-1, labels[:, None]).squeeze(-1)
    model_output = {"sdpo_kl": kl_nested,
                    "log_probs": torch.nested.nested_tensor_from_jagged(lp, data["input_ids"].offsets())}
    loss, metrics = loss_fn(model_output=model_output, data=data)

    # reference from the formulas: teacher logits per sequence, response rows, top-k + tail KL, ratio
    want_num = torch.zeros((), dtype=torch.float64)
    off = 0
    for i, (p, tp, r) in enumerate(zip(prompts, teacher_prompts, responses, strict=True)):
        s_rows = logits[off + len(p) - 1: off + len(p) - 1 + len(r)].detach()
        with torch.no_grad():
            t_rows = teacher(input_ids=torch.tensor([tp + r])).logits[0, len(tp) - 1: len(tp) - 1 + len(r)]
        kl = topk_tail_reverse_kl(s_rows.double(), t_rows.double(), k=16)
        ratio = torch.exp(lp[off + len(p) - 1: off + len(p) - 1 + len(r)].detach().double() - old[i, :len(r)].double())
        want_num += (ratio.clamp(max=2.0) * kl).sum()
        off += len(p) + len(r)
    assert float(loss) == pytest.approx(float(want_num / mask.sum()), rel=1e-4)
    assert float(loss) > 0  # the feedback changes the teacher's distribution
    assert 0.0 <= float(metrics["actor/sdpo_is_clip_frac"].aggregate()) <= 1.0
    loss.backward()
    grads = [p.grad for p in student.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert sum(float(g.abs().sum()) for g in grads) > 0
    assert all(p.grad is None for p in teacher.parameters())


def test_online_dpo_step_dataflow_loss_and_gradients(chat_tokenizer, policy_pair, judge):
    ct, (student, teacher) = chat_tokenizer, policy_pair
    prompts, responses, uids, raw = _rollout(ct, n=3)
    rows = len(prompts)
    width_p = max(len(p) for p in prompts)
    width_r = max(len(r) for r in responses)
    pt = torch.zeros(rows, width_p, dtype=torch.int64)
    rt = torch.zeros(rows, width_r, dtype=torch.int64)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        pt[i, width_p - len(p):] = torch.tensor(p)
        rt[i, :len(r)] = torch.tensor(r)
    batch = DataProto.from_dict(tensors={"prompts": pt, "responses": rt},
                                non_tensors={"uid": np.array(uids, dtype=object)})
    texts = [ct.decode(r) for r in responses]
    scores = dpo.judge_scores(judge, [m[-1]["content"] for m in raw], texts)
    assert all(1.0 <= x <= 5.0 for x in scores)  # expected ratings on the 1..5 scale
    pairs, metrics = dpo.maxmin_pairs(list(batch.non_tensor_batch["uid"]), scores)
    # one pair per prompt: its best and worst rated response (the ratings of a random judge are never tied)
    want = [(int(np.argmax(scores[i:i + 3])) + i, int(np.argmin(scores[i:i + 3])) + i) for i in (0, 3)]
    assert pairs == want and metrics["dpo/pairs"] == 2.0
    pb = dpo.build_pair_batch(batch, pairs)
    order = dpo.balance_pairs([len(prompts[r]) + len(responses[r]) for pr in pairs for r in pr], 1)
    pb = pb.select_idxs(np.asarray(order))
    idx = [r for pr in pairs for r in pr]
    idx = [idx[i] for i in order]
    sel_p = [prompts[i] for i in idx]
    sel_r = [responses[i] for i in idx]
    seqs = [p + r for p, r in zip(sel_p, sel_r, strict=True)]
    labels = torch.cat([torch.tensor(s[1:] + [0]) for s in seqs])
    offsets = _nested(seqs).offsets()
    with torch.no_grad():
        ref_lp_full = torch.log_softmax(_packed_logits(teacher, sel_p, sel_r), -1).gather(-1, labels[:, None]).squeeze(-1)
    mask = torch.tensor([[1] * len(r) + [0] * (width_r - len(r)) for r in sel_r])
    data = tu.get_tensordict({"prompts": _nested(sel_p), "responses": _nested(sel_r), "input_ids": _nested(seqs),
                              "response_mask": mask, "pair_id": pb.batch["pair_id"]})
    from verl.workers.utils.padding import no_padding_2_padding

    ref = no_padding_2_padding(torch.nested.nested_tensor_from_jagged(ref_lp_full, offsets), data)
    data["ref_log_prob"] = ref
    tu.assign_non_tensor(data, dp_size=1, global_batch_size=len(seqs))

    # the policy has moved away from the reference a little (otherwise the loss is exactly log 2)
    with torch.no_grad():
        for p in student.parameters():
            p.add_(torch.randn_like(p) * 1e-2)
    student.zero_grad()
    logits = _packed_logits(student, sel_p, sel_r)
    lp = torch.log_softmax(logits, -1).gather(-1, labels[:, None]).squeeze(-1)
    loss, m = dpo.dpo_loss_fn(None, {"log_probs": torch.nested.nested_tensor_from_jagged(lp, offsets)}, data, beta=0.1)
    pol = no_padding_2_padding(torch.nested.nested_tensor_from_jagged(lp.detach(), offsets), data)
    seq_pol = (pol * mask).sum(-1).double()
    seq_ref = (ref * mask).sum(-1).double()
    margin = 0.1 * ((seq_pol[0::2] - seq_ref[0::2]) - (seq_pol[1::2] - seq_ref[1::2]))
    assert float(loss) == pytest.approx(float(torch.nn.functional.softplus(-margin).mean()), rel=1e-4)
    loss.backward()
    grads = [p.grad for p in student.parameters() if p.grad is not None]
    assert grads and sum(float(g.abs().sum()) for g in grads) > 0

    # a broken pair (two chosen rows adjacent) is refused by the loss
    data["pair_id"] = torch.tensor([pb.batch["pair_id"][i] for i in (0, 2, 1, 3)])
    with pytest.raises(ValueError, match="pairs were separated"):
        dpo.dpo_loss_fn(None, {"log_probs": torch.nested.nested_tensor_from_jagged(lp.detach(), offsets)}, data)
