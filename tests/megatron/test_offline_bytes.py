"""The offline pipeline's outputs, byte for byte, against digests frozen before the pipeline was restructured.

``data/offline_digests.json`` holds the sha256 of every file a few fixed runs write (the merged
datasets of every stream, the ``--merge parts`` datasets and their ``data-args`` file, with the
run's directory replaced by ``OUT``) and the items each run wrote and skipped (name, reason,
stage). They were computed with the pipeline as it was before it was cut into typed steps; the
test asserts that the pipeline of today writes the same bytes and skips the same items on the same
inputs (the inputs, tokenizer and checkpoint are generated deterministically by ``_offline_data``).

Regenerate (only when an output format changes on purpose)::

    python3 tools/dev.py run megatron python tests/megatron/test_offline_bytes.py --write
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from _offline_data import workspace  # noqa: E402

DIGESTS = Path(__file__).parent / "data" / "offline_digests.json"


def _runs(root: Path) -> dict[str, dict[str, Any]]:
    ws = workspace()
    common = {"tokenizer": str(ws.tokenizer), "checkpoint": str(ws.checkpoint), "workers": 0, "progress": False, "device": "cpu",
              "max_bad_fraction": 1.0}
    return {
        "pretrain": dict(common, kind="pretrain", sources=[str(ws.folder), str(ws.shard)], batch_size=4,
                         out=str(root / "pretrain" / "out")),
        "pretrain-parts": dict(common, kind="pretrain", sources=[str(ws.folder), str(ws.shard)], batch_size=3,
                               window=5, plan_files=2, merge="parts", captions="before",
                               out=str(root / "parts" / "out")),
        "sft": dict(common, kind="sft", sources=[str(ws.conversations)], batch_size=2, without_reasoning=True,
                    mask_stream=True, out=str(root / "sft" / "out")),
        "sft-parts": dict(common, kind="sft", sources=[str(ws.conversations)], batch_size=3, plan_bytes=700,
                          merge="parts", mask_stream=True, out=str(root / "sft-parts" / "out")),
        "faulty": dict(common, kind="pretrain", sources=[str(ws.faulty["media"])], batch_size=8,
                       out=str(root / "faulty" / "out")),
    }


def _digest_run(settings: dict[str, Any]) -> dict[str, Any]:
    from apertus_plugins.data.offline import TokenizeConfig, tokenize

    kind = settings.pop("kind")
    sources = settings.pop("sources")
    out = Path(settings["out"])
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
        report = tokenize(TokenizeConfig(kind, sources, **settings))
    files: dict[str, str] = {}
    for path in sorted(out.parent.iterdir()):
        name = path.name.replace(out.name, "OUT", 1)
        if path.suffix in (".bin", ".idx"):
            files[name] = hashlib.sha256(path.read_bytes()).hexdigest()
        elif path.name.endswith(".data-args.txt"):
            text = path.read_text().replace(str(out), "OUT")
            files[name] = hashlib.sha256(text.encode()).hexdigest()
    skipped = [[Path(s["source"]).name, s["reason"], s["stage"]] for s in report["skipped"]]
    return {"files": files, "items": report["items"], "tokens": report["tokens"], "media": report["media"],
            "skipped": sorted(skipped)}


def compute(root: Path) -> dict[str, Any]:
    """The digests of every run in ``_runs`` (written under ``root``)."""
    return {name: _digest_run(settings) for name, settings in _runs(root).items()}


def test_outputs_equal_the_digests_frozen_before_the_restructuring(tmp_path: Path) -> None:
    want = json.loads(DIGESTS.read_text())
    got = compute(tmp_path)
    assert set(got) == set(want)
    for name in want:
        assert got[name]["files"] == want[name]["files"], name
        assert got[name] == want[name], name


if __name__ == "__main__":
    import tempfile

    if sys.argv[1:] != ["--write"]:
        raise SystemExit("usage: test_offline_bytes.py --write")
    with tempfile.TemporaryDirectory() as tmp:
        DIGESTS.parent.mkdir(exist_ok=True)
        DIGESTS.write_text(json.dumps(compute(Path(tmp)), indent=1, sort_keys=True) + "\n")
    print(f"wrote {DIGESTS}")
