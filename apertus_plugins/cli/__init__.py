"""The ``apertus`` command. Each subcommand lives in a module of this package with
``add_parser(subparsers)`` that registers it and sets ``func`` on its parser."""

from __future__ import annotations

import argparse
import importlib
import sys

#: Subcommand modules, in the order ``apertus --help`` lists them.
COMMANDS = ["render", "vocab", "make_tokenizer", "demo", "inspect", "manifest"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="apertus", description="Apertus 1.5 tools (apertus-plugins)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        try:
            mod = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"{__name__}.{name}":
                continue
            raise
        mod.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:
        return 0
    except (ValueError, OSError, KeyError) as exc:
        print(f"apertus {args.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
