"""The ``apertus`` command. Each subcommand lives in a module of this package with
``add_parser(subparsers)`` that registers it and sets ``func`` on its parser; a new module is
picked up by itself (listed after the ones named in :data:`COMMANDS`, alphabetically). Adapters
and third-party plugins add subcommands through the ``apertus_commands`` plugin hook (the
Megatron adapter's ``convert``, for one)."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

#: Subcommand modules listed first, in this order, by ``apertus --help``.
COMMANDS = ["demo", "render", "vocab", "make_tokenizer", "inspect", "manifest"]


def _command_modules() -> list[str]:
    found = sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))
    return [n for n in COMMANDS if n in found] + [n for n in found if n not in COMMANDS]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="apertus", description="Apertus 1.5 tools (apertus-plugins)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _command_modules():
        try:
            mod = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"{__name__}.{name}":
                continue
            raise
        mod.add_parser(sub)
    from apertus_plugins.plugins import registry

    for name, add_parser in sorted(registry().commands.items()):
        if name in sub.choices:
            raise ValueError(f"a plugin's command {name!r} clashes with a built-in apertus command")
        add_parser(sub)
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
