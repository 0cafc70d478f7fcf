"""SDPO on verl: judge feedback, teacher inputs, and the loss as a verl loss function.

The per-step data flow (SPEC section 6)::

    rollout batch (student samples a response to the original prompt)
      -> judge feedback on each response (a judge that sees the charter)    collect_feedback()
      -> teacher prompt = original prompt + feedback, rendered by the core
         chat template with the teacher instruction not to mention it      teacher_messages()
      -> teacher inputs: teacher prompt ids + the SAME response ids          build_teacher_prompts()
      -> in the actor update: the frozen initial policy (verl's reference
         model) scores the response under the teacher prompt; the student
         logits arrive through verl's logits-processor hook; per response
         token the top-64 + tail reverse KL                                 packed_token_kl()
      -> clipped token-level importance ratio, aggregation                  make_sdpo_loss_fn()

Chat rendering comes from :mod:`apertus_plugins.core.chat`; the loss from :mod:`apertus_plugins.core.losses`.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from apertus_plugins.core.losses import sdpo_loss, topk_tail_reverse_kl
from apertus_plugins.posttrain.judges import Judge, fill_template

__all__ = [
    "DEFAULT_TEACHER_TEMPLATE",
    "teacher_messages",
    "collect_feedback",
    "build_teacher_prompts",
    "response_rows",
    "packed_token_kl",
    "make_sdpo_loss_fn",
]

DEFAULT_TEACHER_TEMPLATE = """{prompt}

Feedback on an earlier answer to this request:
{feedback}

Answer the request again, taking the feedback into account. Do not mention the feedback, the earlier \
answer or this instruction in your answer."""


def teacher_messages(messages: Sequence[dict[str, Any]], feedback: str,
                     template: str = DEFAULT_TEACHER_TEMPLATE) -> list[dict[str, Any]]:
    """The teacher's conversation: the last user turn rewritten by ``template`` (``{prompt}``, ``{feedback}``).

    String content is substituted; for a list of content parts, the text parts are joined as
    ``{prompt}`` and media parts are kept in front. The input is not modified.
    """
    msgs = copy.deepcopy(list(messages))
    users = [i for i, m in enumerate(msgs) if m.get("role") == "user"]
    if not users:
        raise ValueError("the prompt has no user turn to attach the judge's feedback to")
    last = msgs[users[-1]]
    content = last.get("content")
    if isinstance(content, str):
        text, media = content, []
    elif isinstance(content, list):
        text = "\n".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
        media = [p for p in content if not (isinstance(p, dict) and p.get("type") == "text")]
    else:
        raise ValueError(f"user content must be a string or a list of parts, got {type(content).__name__}")
    filled = template.replace("{feedback}", "\x00FEEDBACK\x00")
    filled = fill_template(filled, prompt=text).replace("\x00FEEDBACK\x00", feedback)
    last["content"] = filled if not media else [*media, {"type": "text", "text": filled}]
    return msgs


def collect_feedback(judge: Judge, prompts: Sequence[str], responses: Sequence[str]) -> list[str]:
    """The judge's feedback on every response (:meth:`Judge.feedback_batch`, in order)."""
    return list(judge.feedback_batch(list(prompts), list(responses)))


def build_teacher_prompts(chat_tokenizer: Any, raw_prompts: Sequence[Sequence[dict[str, Any]]],
                          feedbacks: Sequence[str], template: str = DEFAULT_TEACHER_TEMPLATE,
                          enable_thinking: bool = False) -> list[list[int]]:
    """Token ids of each teacher prompt (with the generation prompt), rendered by the core.

    ``chat_tokenizer`` is an :class:`apertus_plugins.core.chat.ChatTokenizer`; thinking is disabled as
    in the SDPO stage.
    """
    if len(raw_prompts) != len(feedbacks):
        raise ValueError(f"{len(raw_prompts)} prompts but {len(feedbacks)} feedbacks")
    out = []
    for msgs, fb in zip(raw_prompts, feedbacks, strict=True):
        enc = chat_tokenizer.encode_conversation(teacher_messages(msgs, fb, template), add_generation_prompt=True,
                                                 enable_thinking=enable_thinking)
        out.append([int(i) for i in enc.ids])
    return out


def response_rows(seq_lens: torch.Tensor, prompt_lens: torch.Tensor, response_lens: torch.Tensor) -> torch.Tensor:
    """Rows of a packed (prompt + response) logits tensor that predict the response tokens.

    Sequence ``i`` occupies rows ``cu[i] .. cu[i+1]-1``; the row predicting response token ``t``
    is ``cu[i] + prompt_len[i] + t - 1`` (the convention of verl's ``no_padding_2_padding``).
    """
    if not bool((prompt_lens > 0).all()):
        raise ValueError("every sequence needs a non-empty prompt")
    starts = torch.cumsum(seq_lens, 0) - seq_lens + prompt_lens - 1
    return torch.cat([s + torch.arange(int(n), device=seq_lens.device) for s, n in zip(starts, response_lens,
                                                                                       strict=True)])


def packed_token_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                    student_prompt_lens: torch.Tensor, teacher_prompt_lens: torch.Tensor,
                    response_lens: torch.Tensor, k: int = 64, chunk_size: int | None = 4096) -> torch.Tensor:
    """Per-token SDPO KL in the student's packed layout.

    Args:
        student_logits: ``(nnz_s, V)``: packed student logits over prompt + response.
        teacher_logits: ``(nnz_t, V)``: packed teacher logits over teacher prompt + the same responses.
        student_prompt_lens / teacher_prompt_lens / response_lens: ``(B,)``.

    Returns:
        ``(nnz_s,)``: the KL at the rows that predict response tokens, zero elsewhere
        (differentiable with respect to ``student_logits``).
    """
    s_rows = response_rows(student_prompt_lens + response_lens, student_prompt_lens, response_lens)
    t_rows = response_rows(teacher_prompt_lens + response_lens, teacher_prompt_lens, response_lens)
    if len(s_rows) and (int(s_rows.max()) >= student_logits.shape[0] or int(t_rows.max()) >= teacher_logits.shape[0]):
        raise ValueError("logits are shorter than the prompt and response lengths say")
    kl = topk_tail_reverse_kl(student_logits.index_select(0, s_rows),
                              teacher_logits.index_select(0, t_rows.to(teacher_logits.device)), k=k,
                              chunk_size=chunk_size)
    out = torch.zeros(student_logits.shape[0], dtype=kl.dtype, device=kl.device)
    return out.index_copy(0, s_rows, kl)


def _lens(x: torch.Tensor) -> torch.Tensor:
    return x.offsets().diff() if x.is_nested else torch.tensor([len(r) for r in x])


def make_sdpo_loss_fn(actor_config: Any, teacher_forward: Callable[[Any], torch.Tensor], k: int = 64,
                      is_clip: float | None = 2.0, chunk_size: int | None = 4096) -> Callable[..., Any]:
    """A verl loss function for SDPO (install with the worker's ``set_loss_fn``).

    verl's engine calls it twice per micro-batch when the batch carries
    ``distillation_use_topk=True``: first as a logits processor
    (``student_logits=(1, nnz, V)``), where it runs ``teacher_forward(micro_batch) -> (nnz_t, V)``
    (the frozen initial policy on ``teacher_prompts`` + ``responses``, no gradient) and returns
    the per-token KL; then with ``model_output`` to reduce it with the clipped importance ratio
    (``old_log_probs`` are the rollout policy's) using verl's global-batch aggregation.
    ``actor/sdpo_teacher_s`` is the time spent in ``teacher_forward``.
    """

    teacher_seconds = [0.0]  # the teacher forward of the micro-batch, reported with its loss

    def loss_fn(model_output: dict | None = None, data: Any = None, dp_group: Any = None,
                student_logits: torch.Tensor | None = None, data_format: str = "thd", **_: Any) -> Any:
        from verl.trainer.ppo.core_algos import agg_loss
        from verl.utils.metric import AggregationType, Metric
        from verl.workers.utils.padding import no_padding_2_padding

        if student_logits is not None:
            t0 = time.perf_counter()
            with torch.no_grad():
                teacher_logits = teacher_forward(data)
            teacher_seconds[0] += time.perf_counter() - t0
            kl = packed_token_kl(student_logits.squeeze(0), teacher_logits, _lens(data["prompts"]),
                                 _lens(data["teacher_prompts"]), _lens(data["responses"]), k=k, chunk_size=chunk_size)
            return {"sdpo_kl": kl.unsqueeze(0)}

        kl = no_padding_2_padding(model_output["sdpo_kl"], data)
        log_prob = no_padding_2_padding(model_output["log_probs"], data)
        fields = data.select("response_mask", "old_log_probs")
        fields = fields.to_padded_tensor() if fields["response_mask"].is_nested else fields
        mask = fields["response_mask"].to(torch.bool)
        info = {"dp_size": data["dp_size"], "batch_num_tokens": data["batch_num_tokens"],
                "global_batch_size": data["global_batch_size"],
                "loss_scale_factor": getattr(actor_config, "loss_scale_factor", None)}
        mode = getattr(actor_config, "loss_agg_mode", "token-mean")
        loss, metrics = sdpo_loss(kl, log_prob, fields["old_log_probs"], mask, is_clip=is_clip,
                                  agg=lambda m, msk: agg_loss(loss_mat=m, loss_mask=msk, loss_agg_mode=mode, **info))
        out = {f"actor/sdpo_{name}": Metric(AggregationType.MEAN, v) for name, v in metrics.items()}
        out["actor/sdpo_loss"] = Metric(AggregationType.SUM, loss.detach())
        out["actor/sdpo_teacher_s"] = Metric(AggregationType.SUM, torch.tensor(teacher_seconds[0]))
        teacher_seconds[0] = 0.0
        return loss, out

    return loss_fn


def padded_teacher_forward(module: torch.nn.Module, pad_id: int = 0) -> Callable[[Any], torch.Tensor]:
    """``teacher_forward`` that runs ``module`` on right-padded (teacher prompt + response) rows.

    Works with any attention implementation (CPU included); returns packed ``(nnz_t, V)`` logits
    in the order of the micro-batch. The GPU trainer uses the packed variant
    (:func:`packed_teacher_forward`), which needs a varlen attention kernel.
    """

    def forward(data: Any) -> torch.Tensor:
        seqs = _teacher_sequences(data)
        width = max(len(s) for s in seqs)
        device = next(module.parameters()).device
        ids = torch.full((len(seqs), width), pad_id, dtype=torch.long, device=device)
        att = torch.zeros((len(seqs), width), dtype=torch.long, device=device)
        for i, s in enumerate(seqs):
            ids[i, :len(s)] = s.to(device)
            att[i, :len(s)] = 1
        logits = module(input_ids=ids, attention_mask=att, use_cache=False).logits
        return torch.cat([logits[i, :len(s)] for i, s in enumerate(seqs)])

    return forward


def packed_teacher_forward(module: torch.nn.Module) -> Callable[[Any], torch.Tensor]:
    """``teacher_forward`` on one packed row with per-sequence position ids (flash-attention varlen,
    as verl runs its models with ``use_remove_padding``)."""

    def forward(data: Any) -> torch.Tensor:
        seqs = _teacher_sequences(data)
        device = next(module.parameters()).device
        ids = torch.cat(seqs).to(device).unsqueeze(0)
        pos = torch.cat([torch.arange(len(s)) for s in seqs]).to(device).unsqueeze(0)
        return module(input_ids=ids, position_ids=pos, attention_mask=None, use_cache=False).logits.squeeze(0)

    return forward


def _teacher_sequences(data: Any) -> list[torch.Tensor]:
    tp, rs = data["teacher_prompts"], data["responses"]
    tp = tp.unbind() if tp.is_nested else list(tp)
    rs = rs.unbind() if rs.is_nested else list(rs)
    return [torch.cat([a, b]) for a, b in zip(tp, rs, strict=True)]
