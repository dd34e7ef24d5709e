"""`moe-fsm run`: the main job (written by the engine work; registered here so the CLI can list it)."""

from __future__ import annotations


def register(subparsers) -> None:
    parser = subparsers.add_parser("run", help="select, run and check every MoE layer of a model preset")
    parser.set_defaults(func=_not_ready)


def _not_ready(args) -> int:
    raise SystemExit("moe-fsm run is being written; see issue 3")
