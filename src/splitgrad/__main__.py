"""Command line: ``python -m splitgrad <command> ...`` (also installed as ``splitgrad``).

Each command lives in its own module under :mod:`splitgrad.cli` and exposes ``add_parser(subparsers)``,
which registers its sub-parser and sets ``func`` to the callable that runs it. Commands are imported here,
not at package import, so ``import splitgrad`` stays light.
"""

from __future__ import annotations

import argparse
import importlib
import sys

__all__ = ["main"]

# Command name -> module implementing it (kept as data so `--help` lists them without importing torch twice).
_COMMANDS = {
    "demo": "splitgrad.cli.demo",
    "schedule": "splitgrad.cli.schedule",
    "split": "splitgrad.cli.split_demo",
}


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run the chosen command; returns the process exit code.

    Usage mistakes exit 2 (argparse's ``error:`` line, raised as ``SystemExit``); Ctrl-C returns 130.
    """
    parser = argparse.ArgumentParser(prog="splitgrad", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for module_name in _COMMANDS.values():
        importlib.import_module(module_name).add_parser(sub)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        # Ctrl-C is how people stop a long run: one line and the shell's conventional 128 + SIGINT.
        print(f"\nsplitgrad {args.command}: interrupted", file=sys.stderr, flush=True)
        return 130


if __name__ == "__main__":
    sys.exit(main())
