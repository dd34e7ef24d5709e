"""`moe-fsm diagram`: each family's machine per policy profile, as Mermaid, read from the machines.

Without arguments it prints one section per profile and family (a heading and
a ```mermaid block); ``--profile`` / ``--family`` narrow it (both: the bare
Mermaid of that one machine). Docs embed the full output between two marker
lines; ``--check FILE`` fails when that part differs from the machines (so the
pictures never drift) and ``--update FILE`` rewrites it.
"""

from __future__ import annotations

import difflib
import sys
from pathlib import Path

from moe_fsm.cli.exit_codes import EXIT_DIFFERS, EXIT_OK
from moe_fsm import profiles
from moe_fsm.errors import InputError
from moe_fsm.trace.document import read_text, write_atomic
from moe_fsm.fsm.machine import mermaid
from moe_fsm.inputs.quant import QuantFamily

BEGIN = "<!-- moe-fsm diagram: generated from the machines, do not edit by hand -->"
END = "<!-- end of moe-fsm diagram -->"


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "diagram",
        help="print each family's selection machine, per policy profile, as Mermaid state diagrams",
        description="Print the machines as Mermaid, generated from the transitions machines (one per family and "
                    "policy profile). With --check FILE, exit 1 (with a diff) if FILE's generated part differs; "
                    "with --update FILE, rewrite it.",
    )
    parser.add_argument("--profile", metavar="NAME", help=f"only this policy profile ({', '.join(profiles.names())})")
    parser.add_argument("--family", choices=[f.value for f in QuantFamily], help="only this family")
    parser.add_argument("--list", action="store_true", help="list the policy profiles and their families")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--check", metavar="FILE", help="compare FILE's generated diagrams with the machines")
    group.add_argument("--update", metavar="FILE", help="replace FILE's generated diagrams with the machines'")
    parser.set_defaults(func=run)


def _machines(profile: str | None, family: str | None):
    chosen = [profiles.get(profile)] if profile else [profiles.get(n) for n in profiles.names()]
    for p in chosen:
        for fam, policy in p.policies.items():
            if family is None or fam.value == family:
                yield p, fam, policy


def document(profile: str | None = None, family: str | None = None) -> str:
    """The generated markdown: a heading, the steps in order and the diagram, per profile and family."""
    parts = [BEGIN, ""]
    for p, fam, policy in _machines(profile, family):
        parts.append(f"## {p.name}: {fam.value}")
        parts.append("")
        parts.append(f"Steps, in order: {', '.join(s.name for s in policy.steps)}.")
        parts.append("")
        parts.append("```mermaid")
        parts.append(mermaid(policy).rstrip("\n"))
        parts.append("```")
        parts.append("")
    parts.append(END)
    return "\n".join(parts) + "\n"


def generated_part(text: str, path: str) -> tuple[int, int]:
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise InputError(f"{path} has no generated diagram part (the lines {BEGIN!r} ... {END!r})")
    return start, end + len(END) + 1


def _read(path: str) -> str:
    return read_text(path, "file")


def run(args) -> int:
    if args.list:
        for name in profiles.names():
            p = profiles.get(name)
            print(f"{name:<14} {', '.join(f.value for f in p.policies)}  ({p.about})")
        return EXIT_OK
    if args.profile and args.family and not (args.check or args.update):
        policy = profiles.get(args.profile).policy(QuantFamily(args.family))
        sys.stdout.write(mermaid(policy))
        return EXIT_OK
    current = document(args.profile, args.family)
    if args.check:
        text = _read(args.check)
        start, end = generated_part(text, args.check)
        embedded = text[start:end]
        if embedded.rstrip() == current.rstrip():
            print(f"{args.check}: the state diagrams match the machines")
            return EXIT_OK
        diff = difflib.unified_diff(embedded.rstrip().splitlines(), current.rstrip().splitlines(),
                                    fromfile=f"{args.check} (embedded)", tofile="moe-fsm diagram", lineterm="")
        print(f"{args.check}: the state diagrams differ from the machines; run moe-fsm diagram --update {args.check}")
        print("\n".join(diff))
        return EXIT_DIFFERS
    if args.update:
        text = _read(args.update)
        start, end = generated_part(text, args.update)
        new = text[:start] + current + text[end:]
        if new != text:
            write_atomic(Path(args.update), new)
            print(f"{args.update}: state diagrams updated")
        else:
            print(f"{args.update}: already up to date")
        return EXIT_OK
    sys.stdout.write(current)
    return EXIT_OK
