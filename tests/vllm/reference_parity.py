"""Expected outputs from the released ``transformers`` port, for the vLLM parity test.

Run with the ``reference`` environment's python (transformers 5.24)::

    python reference_parity.py REQUEST.json EXPECTED.json

REQUEST names the checkpoint, the prompt ids the vLLM server ran, the tokens it generated, an
image file and a 24 kHz clip (``.npy``). This script preprocesses the image with the port's own
image processor, encodes both media with the port's tokenizers, and runs the port in float32 over
vLLM's tokens: per step its greedy token, its log-probability of vLLM's token and its top-2
margin; and the media codes (without vocabulary offsets).
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
    req = json.loads(open(request_path).read())
    torch.manual_seed(0)
    model = Apertus1p5ForConditionalGeneration.from_pretrained(req["checkpoint"], dtype=torch.float32).eval()
    cfg = model.config
    inputs = {}
    image = Image.open(req["image"])
    pix = Apertus1p5ImageProcessor()(images=[image], return_tensors="pt")
    inputs["pixel_values"], inputs["image_sizes"] = pix["pixel_values"].float(), pix["image_sizes"]
    clip = torch.from_numpy(np.load(req["audio"]).astype(np.float32))[None]
    inputs["input_values"], inputs["padding_mask"] = clip[:, None], torch.ones_like(clip, dtype=torch.long)
    with torch.no_grad():
        image_codes = [(t - cfg.image_token_offset).tolist()
                       for t in model.model.get_image_tokens(inputs["pixel_values"], inputs["image_sizes"])]
        audio_codes = [(t - cfg.audio_token_offset).tolist()
                       for t in model.model.get_audio_tokens(inputs["input_values"], inputs["padding_mask"])]
        # teacher-forced on the tokens vLLM generated: at every step the port's own greedy choice, the
        # log-probability it gives vLLM's token, and its top-2 margin (a near-tie may pick either)
        ids = torch.tensor([req["prompt_ids"]])
        tokens, logprobs, margins = [], [], []
        for forced in req["tokens"]:
            logits = model(input_ids=ids, **inputs).logits[0, -1].float()
            lp = torch.log_softmax(logits, dim=-1)
            top = torch.topk(lp, 2)
            tokens.append(int(top.indices[0]))
            margins.append(float(top.values[0] - top.values[1]))
            logprobs.append(float(lp[forced]))
            ids = torch.cat([ids, torch.tensor([[forced]])], dim=1)
    with open(out_path, "w") as fh:
        json.dump({"tokens": tokens, "logprobs": logprobs, "margins": margins, "image_codes": image_codes, "audio_codes": audio_codes,
                   "head_rows": int(model.lm_head.out_features)}, fh)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
