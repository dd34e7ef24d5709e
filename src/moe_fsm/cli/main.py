"""The `moe-fsm` command: select, explain, replay, diagram, golden, plan (and run).

Each subcommand module exposes ``register(subparsers)``, which adds its parser
and sets ``func`` to a handler returning the exit status. ``main`` never lets a
user error out as a traceback: malformed input (a flag, a file, an env value, a
preset name) prints one line naming the problem and exits 2.
"""

from __future__ import annotations

import argparse
import sys

from moe_fsm import __version__
from moe_fsm.errors import MoeFsmError


def build_parser() -> argparse.ArgumentParser:
    from moe_fsm.cli import diagram, explain, golden_cmd, plan_cmd, replay, run_cmd, select_cmd

    parser = argparse.ArgumentParser(
        prog="moe-fsm",
        description="Choose the experts kernel backend of MoE layers with an explicit state machine, and explain, "
                    "replay and check the decision traces it records.",
    )
    parser.add_argument("--version", action="version", version=f"moe-fsm {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in (select_cmd, explain, replay, diagram, golden_cmd, run_cmd, plan_cmd):
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            try:
                reconfigure(errors="backslashreplace")
            except (ValueError, OSError):  # pragma: no cover - a stream that cannot change
                pass
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse's usage errors (exit 2) and --help/--version (exit 0)
        return exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 2)
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except MoeFsmError as err:
        print(f"moe-fsm {args.command}: error: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `moe-fsm select --json | head`
        return 0
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
