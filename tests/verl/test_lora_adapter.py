"""The LoRA adapter the vLLM LoRA test serves is what PEFT writes and reads for the verl policy class.

``apertus_plugins.testing.lora.write_peft_adapter`` writes a random adapter in PEFT's format for the
text-only causal LM verl trains (:class:`apertus_plugins.hf.modeling.Apertus1p5ForCausalLM`). Here PEFT
itself (1) wraps that class with the same LoRA targets and saves an adapter with the same tensor names
and shapes, and (2) loads the written adapter and merges it into weights equal to
``write_merged_checkpoint``'s (``W + alpha / r * B @ A`` on the released names), so the merged
checkpoint the vLLM test compares against is PEFT's own merge.
"""

from __future__ import annotations

import json

import peft  # a dependency of verl
import pytest
import torch
from safetensors import safe_open

from apertus_plugins.hf.modeling import Apertus1p5ForCausalLM
from apertus_plugins.testing.checkpoint import write_checkpoint
from apertus_plugins.testing.lora import LORA_TARGETS, write_merged_checkpoint, write_peft_adapter

RANK, ALPHA = 8, 16


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", size="tiny", init="varied")


def _shapes(path) -> dict[str, tuple[int, ...]]:
    with safe_open(str(path / "adapter_model.safetensors"), framework="pt") as fh:
        return {k: tuple(fh.get_slice(k).get_shape()) for k in fh.keys()}


def test_peft_saves_the_same_tensor_names_and_shapes(ckpt, tmp_path):
    write_peft_adapter(ckpt, tmp_path / "ours", rank=RANK, alpha=ALPHA)
    model = Apertus1p5ForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=list(LORA_TARGETS), lora_dropout=0.0,
                             task_type="CAUSAL_LM")
    peft.get_peft_model(model, config).save_pretrained(tmp_path / "peft")
    assert _shapes(tmp_path / "ours") == _shapes(tmp_path / "peft")
    ours = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    theirs = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    for key in ("peft_type", "task_type", "r", "lora_alpha", "bias", "fan_in_fan_out", "use_rslora", "use_dora"):
        assert ours[key] == theirs[key], key
    assert sorted(ours["target_modules"]) == sorted(theirs["target_modules"])


def test_peft_merge_equals_the_merged_checkpoint(ckpt, tmp_path):
    deltas = write_peft_adapter(ckpt, tmp_path / "adapter", rank=RANK, alpha=ALPHA)
    merged_dir = write_merged_checkpoint(ckpt, deltas, tmp_path / "merged")
    base = Apertus1p5ForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    merged_by_peft = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").merge_and_unload()
    ours = Apertus1p5ForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).state_dict()
    theirs = merged_by_peft.state_dict()
    assert set(ours) == set(theirs)
    changed = 0
    for name, tensor in ours.items():
        torch.testing.assert_close(theirs[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
        changed += name in deltas
    assert changed == len(deltas) == len(LORA_TARGETS) * base.config.text_config.num_hidden_layers
