"""`moe-fsm diagram`: the selection machine as Mermaid, read from the machine itself.

Docs embed the output in a ```mermaid block; ``--check FILE`` fails when that
block differs from the machine (so the picture never drifts) and ``--update
FILE`` rewrites it.
"""

from __future__ import annotations

import difflib
import re
import sys
from pathlib import Path

from moe_fsm.errors import InputError
from moe_fsm.fsm.machine import mermaid

_BLOCK = re.compile(r"```mermaid[ \t]*\n(.*?)```", re.DOTALL)


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "diagram",
        help="print the selection state machine as a Mermaid state diagram",
        description="Print the FSM as Mermaid, generated from the transitions machine. With --check FILE, exit 1 "
                    "(with a diff) if the first ```mermaid block of FILE differs; with --update FILE, rewrite it.",
    )
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--check", metavar="FILE", help="compare FILE's embedded mermaid block with the machine")
    group.add_argument("--update", metavar="FILE", help="replace FILE's embedded mermaid block with the machine's")
    parser.set_defaults(func=run)


def embedded_block(text: str, path: str) -> re.Match:
    match = _BLOCK.search(text)
    if match is None:
        raise InputError(f"{path} has no ```mermaid block")
    return match


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except FileNotFoundError:
        raise InputError(f"{path} does not exist") from None


def run(args) -> int:
    current = mermaid()
    if args.check:
        block = embedded_block(_read(args.check), args.check).group(1)
        if block.rstrip() == current.rstrip():
            print(f"{args.check}: the state diagram matches the machine")
            return 0
        diff = difflib.unified_diff(block.rstrip().splitlines(keepends=False), current.rstrip().splitlines(keepends=False),
                                    fromfile=f"{args.check} (embedded)", tofile="moe-fsm diagram", lineterm="")
        print(f"{args.check}: the state diagram differs from the machine; run moe-fsm diagram --update {args.check}")
        print("\n".join(diff))
        return 1
    if args.update:
        text = _read(args.update)
        match = embedded_block(text, args.update)
        new = text[: match.start(1)] + current + text[match.end(1):]
        if new != text:
            Path(args.update).write_text(new)
            print(f"{args.update}: state diagram updated")
        else:
            print(f"{args.update}: already up to date")
        return 0
    sys.stdout.write(current)
    return 0
