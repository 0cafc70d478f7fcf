#!/usr/bin/env bash
# Megatron-Bridge without its dependencies (see requirements.txt): its conversion path runs on what the
# requirements install; a GPU user installs `megatron-bridge==0.6.2` with its dependencies instead.
set -euo pipefail
"$1" -m pip install --disable-pip-version-check -q --no-deps "megatron-bridge==0.6.2"
