"""``apertus render FILE``: render one conversation exactly as the 1.5 chat template does."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from apertus_plugins import plugins

KEYS = ("messages", "tools", "add_generation_prompt", "enable_thinking", "continue_assistant_message")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("render", help="render a conversation with the 1.5 chat template",
                       description="FILE holds one JSON object with the keys messages, tools, "
                                   "add_generation_prompt, enable_thinking, continue_assistant_message. "
                                   "Prints the rendered string exactly and nothing else ('-' reads stdin).")
    p.add_argument("file")
    p.add_argument("--variant", choices=["inference", "training"], default="inference")
    p.add_argument("--ids", action="store_true", help="print the token ids grouped by role instead")
    p.add_argument("--tokenizer", help="tokenizer directory for --ids (default: the embedded test tokenizer)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from apertus_plugins.core.chat import ChatTokenizer, render

    raw = sys.stdin.read() if args.file == "-" else Path(args.file).read_text(encoding="utf-8")
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{args.file}: not a JSON object ({exc})") from exc
    if not isinstance(obj, dict) or "messages" not in obj:
        raise ValueError(f"{args.file}: expected a JSON object with 'messages'")
    unknown = sorted(set(obj) - set(KEYS))
    if unknown:
        raise ValueError(f"{args.file}: unknown keys {unknown}; allowed: {', '.join(KEYS)}")
    kwargs = {k: obj[k] for k in KEYS if k in obj}
    if not args.ids:
        sys.stdout.write(render(**kwargs, variant=args.variant, spec=plugins.spec()))
        sys.stdout.flush()
        return 0
    with tempfile.TemporaryDirectory(prefix="apertus-render-") as tmp:
        if args.tokenizer:
            tok_dir = Path(args.tokenizer)
        else:
            from apertus_plugins.testing.tokenizer_builder import build_test_tokenizer

            tok_dir = build_test_tokenizer(Path(tmp) / "tok", plugins.spec(), with_templates=False)
        chat = ChatTokenizer(tok_dir, plugins.spec_from_tokenizer_dir(tok_dir))
        enc = chat.encode_conversation(**kwargs, variant=args.variant)
        for seg in chat.ids_by_role(enc):
            print(f"{seg['role']}\t{' '.join(map(str, seg['ids']))}")
    return 0
