"""``apertus manifest write|verify PREFIX... --out FILE``: freeze and check a stage's dataset list."""

from __future__ import annotations

import argparse

from apertus_plugins.data.manifest import verify_manifest, write_manifest


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "manifest",
        help="write or verify a dataset manifest (sizes, counts, sha256)",
        description="write: describe each PREFIX (.bin/.idx sizes, sequence, document and token counts, sha256) "
        "into FILE. verify: check the PREFIXes against FILE; exits 1 naming each prefix that is missing, "
        "extra or changed.",
    )
    p.add_argument("action", choices=("write", "verify"))
    p.add_argument("prefixes", nargs="*", metavar="PREFIX", help="dataset prefixes (verify: default, the manifest's)")
    p.add_argument("--out", required=True, metavar="FILE", help="the manifest file")
    p.add_argument("--no-checksums", action="store_true", help="verify: skip the sha256 (sizes and counts only)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.action == "write":
        if not args.prefixes:
            raise ValueError("manifest write needs at least one PREFIX")
        m = write_manifest(args.prefixes, args.out, progress=not args.no_progress)
        tokens = sum(e["tokens"] for e in m["datasets"])
        print(f"wrote {args.out}: {len(m['datasets'])} datasets, {tokens} tokens")
        return 0
    m = verify_manifest(args.out, args.prefixes or None, checksums=not args.no_checksums,
                        progress=not args.no_progress)
    print(f"{args.out}: {len(m['datasets'])} datasets match")
    return 0
