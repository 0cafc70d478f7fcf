#!/usr/bin/env bash
# lmms-eval pulls PyPI's torchvision, which does not load beside the CPU torch 2.13.0
# ('operator torchvision::nms does not exist') and breaks every import of transformers' image
# utilities. Nothing here needs it: images and audio go through the core and the served model.
set -euo pipefail
"$1" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
