"""What one hostile media item can cost: a maximal accepted image before and after the media limits,
a small request's latency while such an image is processed, the server's memory after a burst.

Run in the vllm environment (``python3 tools/dev.py run vllm python benchmarks/bench_media_limits.py``;
``--skip-served`` for the in-process part alone, which the core environment runs too). In one run:

1. Processing (each measurement in its own child process: wall and CPU seconds, the CPU time being
   what a loaded machine does not blur, and the peak RSS it added): the largest image the default
   limits accept (8192 x 8192 = 67,108,864 pixels; a uniform PNG of about 1 MB and a photo-like
   JPEG), bytes to ``pixel_values``:
   ``before``: the pipeline before the limits (decode everything, then the exact resize on every
   pixel, as an int32 tap loop over a copy of the whole image; kept here as the reference);
   ``after``: :func:`apertus_plugins.core.media.image.preprocess_image` (the header checked first, a JPEG
   decoded in draft mode, ``Image.reduce``, then the chunked exact resize). Also a 12-megapixel photo
   (4000 x 3000, below ``reduce_above_pixels``: bit-exact on both paths, checked), and an image just
   above the limit (refused from its header).
2. Served (``vllm serve`` with the plugin, 4,096 tokens of context: a maximal image's 7,817 ids do not
   fit, so it is refused after it was processed and the CPU engine's encoder never runs): a 64 x 48
   image request's latency alone (median of 5) and while a maximal image is processed (the median and
   the worst of the requests sent one after the other meanwhile), the maximal request's own time, and
   the API server's RSS at the start, before a burst of 6 concurrent maximal images, right after it
   and 10 s later.

Run it with another checkout first on ``PYTHONPATH`` (``PYTHONPATH=OLD_TREE python
benchmarks/bench_media_limits.py --skip-processing``) to measure that tree's server; the ``before``
column of part 1 is always the reference pipeline above.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

MAX_SIDE = 8192


def _image_bytes(kind: str) -> bytes:
    import numpy as np
    from PIL import Image

    if kind == "png-max":
        img = Image.new("RGB", (MAX_SIDE, MAX_SIDE), (120, 30, 200))
        fmt = "PNG"
    elif kind == "png-over":
        img = Image.new("RGB", (MAX_SIDE + 1, MAX_SIDE), (120, 30, 200))
        fmt = "PNG"
    else:
        w, h = (MAX_SIDE, MAX_SIDE) if kind == "jpeg-max" else (4000, 3000)
        y, x = np.mgrid[0:h, 0:w].astype(np.float32)
        arr = np.stack([x * 255 / w, y * 255 / h, 127 + 127 * np.sin(x / 37) * np.cos(y / 53)], -1)
        img = Image.fromarray(arr.astype(np.uint8))
        fmt = "JPEG"
    buf = io.BytesIO()
    img.save(buf, fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buf.getvalue()


# ---------------------------------------------------------------------- the pipeline before the limits
def _before(data: bytes):
    """Decode every pixel, convert, then the exact resize as it ran before: an int32 copy of the whole
    image and one gather per filter tap (torch's fixed-point antialiased bicubic)."""
    import numpy as np
    from PIL import Image, ImageOps

    from apertus_plugins.core.media import image as mi
    from apertus_plugins.testing.references import tap_loop_resize

    img = ImageOps.exif_transpose(Image.open(io.BytesIO(data)))
    img.load()
    rgb = np.asarray(img.convert("RGB"), dtype=np.uint8)

    h, w = mi.resized_size(rgb.shape[0], rgb.shape[1])
    return mi.normalize_pixels(tap_loop_resize(tap_loop_resize(rgb, w, 1), h, 0)).transpose(2, 0, 1)


def _after(data: bytes):
    from apertus_plugins.core.media import image as mi

    return mi.preprocess_image(data).pixels


def _status_mib(key: str, pid: int | str = "self") -> float:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _child(path: str, which: str) -> None:
    """One measurement in this process: prints wall and CPU seconds, the peak RSS over what the
    interpreter held before (MiB, ``VmHWM``: this process's own) and a digest of the pixels."""
    import hashlib

    import numpy as np

    data = Path(path).read_bytes()
    base = _status_mib("VmRSS")
    start, cpu = time.perf_counter(), time.process_time()
    try:
        pixels = (_before if which == "before" else _after)(data)
        digest = hashlib.sha256(np.ascontiguousarray(pixels).tobytes()).hexdigest()[:12]
    except ValueError as exc:
        digest = f"refused: {str(exc)[:70]}"
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    print(json.dumps({"seconds": seconds, "cpu_seconds": cpu, "peak_mib": _status_mib("VmHWM") - base,
                      "digest": digest}))


def processing(workdir: Path) -> list[dict]:
    rows = []
    for kind, label in (("png-max", "8192x8192 PNG (uniform, 1 MB)"), ("jpeg-max", "8192x8192 JPEG (photo-like)"),
                        ("jpeg-12mp", "4000x3000 JPEG (below the reduction threshold)"),
                        ("png-over", "8193x8192 PNG (one column above the limit)")):
        path = workdir / f"{kind}.bin"
        path.write_bytes(_image_bytes(kind))
        row: dict = {"image": label}
        for which in ("before", "after"):
            if which == "before" and kind == "png-over":
                row[which] = None  # before the limits it was processed like any other: see the max row
                continue
            out = subprocess.run([sys.executable, __file__, "--child", str(path), which], capture_output=True,
                                 text=True, check=True)
            row[which] = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append(row)
        b, a = row["before"], row["after"]
        exact = "" if b is None else ("  (same pixels)" if b["digest"] == a["digest"] else "")
        ratio = f"{b['cpu_seconds'] / a['cpu_seconds']:6.1f}x" if b else "      "
        nan = float("nan")
        print(f"{label:48s} before {b['seconds'] if b else nan:6.2f} s ({b['cpu_seconds'] if b else nan:6.2f} s CPU) "
              f"{b['peak_mib'] if b else nan:5.0f} MiB | after {a['seconds']:5.2f} s ({a['cpu_seconds']:5.2f} s CPU) "
              f"{a['peak_mib']:5.0f} MiB | CPU {ratio}{exact}"
              + (f"  [{a['digest']}]" if a["digest"].startswith("refused") else ""), flush=True)
    return rows


# ---------------------------------------------------------------------- served
def _rss_mib(pid: int) -> float:
    return _status_mib("VmRSS", pid)


def served(workdir: Path) -> dict:
    from apertus_plugins.infra.client import NO_RETRY, http_json
    from apertus_plugins.testing.checkpoint import write_checkpoint
    from apertus_plugins.testing.serve import CPU_ARGS, VLLMServer

    ckpt = write_checkpoint(workdir / "ckpt", size="tiny", init="varied")
    maximal = "data:image/png;base64," + base64.b64encode(_image_bytes("png-max")).decode()
    buf = io.BytesIO()
    from PIL import Image

    Image.new("RGB", (64, 48), (10, 200, 30)).save(buf, "PNG")
    small = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    args = [*CPU_ARGS, "--served-model-name", "apertus", "--limit-mm-per-prompt", json.dumps({"image": 2})]
    with VLLMServer(ckpt, args=args, log_path=workdir / "server.log") as srv:
        def chat(url: str) -> tuple[int, float]:
            start = time.perf_counter()
            status, _ = http_json(srv.url("/v1/chat/completions"), {
                "model": "apertus", "max_tokens": 1, "temperature": 0,
                "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]},
                timeout=600, retry=NO_RETRY)
            return status, time.perf_counter() - start

        chat(small)
        start_rss = _rss_mib(srv.proc.pid)
        alone = statistics.median(chat(small)[1] for _ in range(5))
        result: dict = {}
        big = threading.Thread(target=lambda: result.setdefault("big", chat(maximal)))
        big.start()
        time.sleep(0.5)
        during = []
        while big.is_alive() or not during:
            during.append(chat(small)[1])
        big.join()
        pid = srv.proc.pid
        before = _rss_mib(pid)
        with ThreadPoolExecutor(6) as pool:
            statuses = [s for s, _ in pool.map(lambda _: chat(maximal), range(6))]
        right_after = _rss_mib(pid)
        time.sleep(10)
        later = _rss_mib(pid)
    out = {"small_alone_s": alone, "small_during_max_s": max(during), "small_during_median_s": statistics.median(during),
           "small_during_requests": len(during),
           "maximal_request_s": result["big"][1], "maximal_status": result["big"][0], "burst_statuses": statuses,
           "rss_start_mib": start_rss, "rss_before_mib": before, "rss_after_burst_mib": right_after, "rss_10s_later_mib": later}
    print(f"small image alone {alone:.2f} s | while a maximal image is processed: median {statistics.median(during):.2f} s, "
          f"worst {max(during):.2f} s of {len(during)} requests | the maximal request {result['big'][1]:.2f} s "
          f"(status {result['big'][0]})")
    print(f"API server RSS: {start_rss:.0f} MiB at the start, {before:.0f} MiB after the maximal image above and "
          f"before a burst of 6 more, {right_after:.0f} MiB right after, {later:.0f} MiB 10 s later "
          f"(statuses {sorted(set(statuses))})")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", nargs=2, metavar=("FILE", "WHICH"), help=argparse.SUPPRESS)
    ap.add_argument("--skip-served", action="store_true", help="only the in-process processing part")
    ap.add_argument("--skip-processing", action="store_true", help="only the served part (e.g. another tree's server)")
    ap.add_argument("--json", type=Path, help="also write the numbers to this file")
    args = ap.parse_args(argv)
    if args.child:
        _child(*args.child)
        return 0
    print(f"machine: {os.cpu_count()} CPUs; python {sys.version.split()[0]}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        report: dict = {} if args.skip_processing else {"processing": processing(work)}
        if not args.skip_served:
            report["served"] = served(work)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
