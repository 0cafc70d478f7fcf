"""Install the example third-party plugins of ``tests/_plugins`` the way a user would: with pip."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

#: The example ``video`` modality (frames coded by the vision tokenizer), a distribution of its own.
VIDEO_PLUGIN = Path(__file__).resolve().parent / "apertus_video"


def install_plugin(target: Path, source: Path = VIDEO_PLUGIN) -> dict[str, str]:
    """pip-install ``source`` into ``target``; returns the environment of a process that sees it."""
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--disable-pip-version-check", "--target", str(target), str(source)],
        check=True,
    )
    return {**os.environ, "PYTHONPATH": str(target), "HF_HUB_OFFLINE": "1"}
