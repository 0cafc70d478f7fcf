"""The released ``transformers`` port's logits on a checkpoint, for the parity tests (the ``reference`` env).

    python reference_forward.py HF_DIR REQUEST.json OUT.json

Runs ``Apertus1p5ForConditionalGeneration`` (transformers 5.24) in float32 on REQUEST's
``prompt_ids`` (media already as codes: the language model alone sees them) and writes the
logits of every position over the released head (``logits``) and the model's RoPE settings.
"""

from __future__ import annotations

import json
import sys

import torch
from transformers import Apertus1p5ForConditionalGeneration


def main(hf_dir: str, request_path: str, out_path: str) -> None:
    with open(request_path) as fh:
        req = json.load(fh)
    model = Apertus1p5ForConditionalGeneration.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(input_ids=torch.tensor([req["prompt_ids"]]), use_cache=False)
    logits = out.logits[0].float()
    text = model.config.text_config
    with open(out_path, "w") as fh:
        json.dump({"logits": logits.tolist(), "head_rows": int(logits.shape[-1]),
                   "rope": getattr(text, "rope_parameters", None)}, fh)


if __name__ == "__main__":
    main(*sys.argv[1:4])
