#!/usr/bin/env python3
"""Write the bundled demo media deterministically: a 64x48 test pattern and a 0.5 s stereo tone."""

from pathlib import Path

import numpy as np
import soundfile as sf
from PIL import Image

OUT = Path(__file__).resolve().parent.parent / "apertus_plugins" / "assets"


def main() -> None:
    y, x = np.mgrid[0:48, 0:64]
    rgb = np.stack([x * 4, y * 5, ((x // 8 + y // 8) % 2) * 255], axis=-1).astype(np.uint8)
    Image.fromarray(rgb, "RGB").save(OUT / "demo.png", optimize=True)
    rate = 16_000
    t = np.arange(rate // 2) / rate
    left = 0.3 * np.sin(2 * np.pi * 440 * t)
    right = 0.2 * np.sin(2 * np.pi * 660 * t)
    sf.write(OUT / "demo.wav", np.stack([left, right], axis=1).astype(np.float32), rate, subtype="PCM_16")


if __name__ == "__main__":
    main()
