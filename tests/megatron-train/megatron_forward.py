"""Megatron's forward of the Apertus spec on a checkpoint, for the parity tests (run with the CPU harness).

    APERTUS_MEGATRON_CPU=1 APERTUS_MEGATRON_CPU_ALL=1 python megatron_forward.py CKPT REQUEST.json OUT.json

CKPT is a Megatron ``torch_dist`` checkpoint (``apertus convert to-megatron`` output, or a
``--save`` directory of a training run). The model is built by the adapter
(:func:`megatron_patches.checkpoint.build_cpu_model`, the Apertus layer spec) in float32 and takes
the checkpoint's tensors by their checkpoint names. REQUEST holds ``prompt_ids``, ``head_rows``
(the released head's rows: logits and log-probabilities are over those) and ``max_tokens``.
OUT gets the prompt's logits over the head rows (``logits``, one row per position), and greedy
decoding by full forward passes: ``tokens``, their ``logprobs`` and top-2 ``margins``.
"""

from __future__ import annotations

import json
import sys

import torch
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

from megatron_patches.checkpoint import build_cpu_model, load_megatron
from megatron_patches.convert import ModelShape
from megatron_patches.spec import apertus_layer_spec, local_to_checkpoint_name


def main(ckpt: str, request_path: str, out_path: str) -> None:
    with open(request_path) as fh:
        req = json.load(fh)
    tensors, margs = load_megatron(ckpt)  # also sets up the one-process gloo group
    model_parallel_cuda_manual_seed(0)  # the RNG tracker that attention forks (dropout is off in eval)
    shape = ModelShape.from_megatron_args(margs)
    model = build_cpu_model(shape, torch.float32)
    spec = apertus_layer_spec()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(tensors[local_to_checkpoint_name(name, spec)].float())
    model.eval()
    head = int(req["head_rows"])

    def logits_of(ids: list[int]) -> torch.Tensor:
        tokens = torch.tensor([ids])
        positions = torch.arange(len(ids))[None]
        with torch.no_grad():
            out = model(tokens, positions, None)  # [b, s, vocab]; causal attention, no mask needed
        return out[0, :, :head].float()

    prompt = [int(t) for t in req["prompt_ids"]]
    logits = logits_of(prompt)
    ids, tokens, logprobs, margins = list(prompt), [], [], []
    last = logits[-1]
    for _ in range(int(req["max_tokens"])):
        lp = torch.log_softmax(last, dim=-1)
        top = torch.topk(lp, 2)
        t = int(top.indices[0])
        tokens.append(t)
        logprobs.append(float(lp[t]))
        margins.append(float(top.values[0] - top.values[1]))
        ids.append(t)
        last = logits_of(ids)[-1]
    with open(out_path, "w") as fh:
        json.dump({"logits": logits.tolist(), "tokens": tokens, "logprobs": logprobs, "margins": margins,
                   "rope": [shape.rope.rope_type, shape.rope.theta, shape.rope.factor]}, fh)


if __name__ == "__main__":
    main(*sys.argv[1:4])
