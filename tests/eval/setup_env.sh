#!/usr/bin/env bash
# lmms-eval pulls PyPI's torchvision, which does not load beside the CPU torch 2.13.0
# ('operator torchvision::nms does not exist') and breaks every import of transformers' image
# utilities. Nothing here needs it: images and audio go through the core and the served model.
set -euo pipefail
"$1" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
# lm-eval's Minerva MATH prompts (MATH-500 (Minerva), Minerva MATH) assert antlr4 4.11 when they load
# and score with Math-Verify, whose 0.1.0 (lmms-eval's unpinned pull) misses its LaTeX parser;
# lmms-eval's latex2sympy2 pins antlr4 4.7.2 for its own LaTeX parsing, which none of the tasks here
# use. pip cannot resolve both pins, so these three are installed over them, without dependencies.
"$1" -m pip install -q --disable-pip-version-check --no-deps antlr4-python3-runtime==4.11.0 \
    math-verify==0.9.0 latex2sympy2_extended==1.11.0
