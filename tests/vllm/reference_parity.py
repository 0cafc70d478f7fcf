"""Expected outputs from the released ``transformers`` port, for the vLLM parity test.

Run with the ``reference`` environment's python (transformers 5.24)::

    python reference_parity.py REQUEST.json EXPECTED.json

REQUEST names the checkpoint, the prompt ids the vLLM server ran (media positions hold the
placeholder ids), the number of tokens to generate, an image file and a 24 kHz clip (``.npy``).
This script preprocesses the image with the port's own image processor, encodes both media with
the port's tokenizers, and runs the port in float32 (the prompt with its media in one forward
pass, then the port's own cached decoding):

- ``prompt_logprobs``: for every prompt position after the first, the log-probability the port
  gives the prompt's next id (``None`` where that id is outside the LM head: media ids);
- ``tokens`` / ``logprobs`` / ``margins``: the port's own greedy decoding (each step feeds back the
  port's choice), the log-probability of each chosen token and its top-2 margin;
- ``image_codes`` / ``audio_codes``: the media codes (without vocabulary offsets).
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch
from PIL import Image
from transformers import Apertus1p5ForConditionalGeneration
from transformers.models.apertus1p5.image_processing_apertus1p5 import Apertus1p5ImageProcessor


def main(request_path: str, out_path: str) -> None:
    with open(request_path) as fh:
        req = json.load(fh)
    model = Apertus1p5ForConditionalGeneration.from_pretrained(req["checkpoint"], dtype=torch.float32).eval()
    cfg = model.config
    pix = Apertus1p5ImageProcessor()(images=[Image.open(req["image"])], return_tensors="pt")
    clip = torch.from_numpy(np.load(req["audio"]).astype(np.float32))[None]
    media = {"pixel_values": pix["pixel_values"].float(), "image_sizes": pix["image_sizes"],
             "input_values": clip[:, None], "padding_mask": torch.ones_like(clip, dtype=torch.long)}
    prompt = list(req["prompt_ids"])
    head = model.lm_head.out_features
    with torch.no_grad():
        # the prompt with its media, once; then the port's own cached decoding, each step feeding back its choice
        out = model(input_ids=torch.tensor([prompt]), **media, use_cache=True)
        image_codes = [(t - cfg.image_token_offset).tolist() for t in out.image_outputs.image_tokens]
        audio_codes = [(t - cfg.audio_token_offset).tolist() for t in out.audio_outputs.audio_tokens]
        lp = torch.log_softmax(out.logits[0].float(), dim=-1)
        prompt_logprobs = [float(lp[i - 1, t]) if t < head else None for i, t in enumerate(prompt) if i > 0]
        tokens, logprobs, margins = [], [], []
        last = lp[-1]
        for _ in range(int(req["max_tokens"])):
            top = torch.topk(last, 2)
            tokens.append(int(top.indices[0]))
            logprobs.append(float(top.values[0]))
            margins.append(float(top.values[0] - top.values[1]))
            out = model(input_ids=top.indices[:1].view(1, 1), cache=out.cache, use_cache=True)
            last = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
    with open(out_path, "w") as fh:
        json.dump({"prompt_logprobs": prompt_logprobs, "tokens": tokens, "logprobs": logprobs, "margins": margins,
                   "image_codes": image_codes, "audio_codes": audio_codes, "head_rows": int(head)}, fh)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
