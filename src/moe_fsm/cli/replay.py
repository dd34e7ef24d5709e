"""`moe-fsm replay TRACE.json`: decide again from the recorded inputs and compare.

Exit 0 when the replayed decision takes the same path to the same outcome;
1 with a unified diff of the canonical JSON when it does not (``--strict``:
when any canonical byte differs, events and messages included); 2 when the
trace cannot be read.
"""

from __future__ import annotations

import difflib
import sys

from moe_fsm.cli.exit_codes import EXIT_DIFFERS, EXIT_OK
from moe_fsm.cli.explain import add_trace_arguments, shared_lines, trace_documents
from moe_fsm.decision import replay
from moe_fsm.trace import document as trace_doc


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "replay",
        help="decide again from a trace's recorded inputs; non-zero with a diff if the outcome changed",
        description="Re-run the decision recorded in a trace (on any machine: the trace holds the platform facts "
                    "and the env snapshot) and compare the canonical documents. Exit 0 when the path and the "
                    "outcome are the same, 1 with a unified diff when not, 2 when the trace is unreadable.",
    )
    add_trace_arguments(parser)
    parser.add_argument("--strict", action="store_true",
                        help="fail on any difference of the canonical trace (events and messages too), "
                             "not only of the path and outcome")
    parser.set_defaults(func=run)


def canonical_diff(old: dict, new: dict, old_name: str = "recorded", new_name: str = "replayed") -> str:
    a = trace_doc.dumps(trace_doc.canonical(old)).splitlines(keepends=True)
    b = trace_doc.dumps(trace_doc.canonical(new)).splitlines(keepends=True)
    return "".join(difflib.unified_diff(a, b, fromfile=old_name, tofile=new_name))


def run(args) -> int:
    """Replay a trace, or (a manifest) the trace of ``--layer`` or every distinct trace: the worst status wins."""
    results = trace_documents(args.trace, args.layer, args.rank)
    status = 0
    for source, document, layers in results:
        if layers is not None:
            print(shared_lines(source, layers)[0])
        status = max(status, replay_one(document, source, args.strict))
    return status


def replay_one(document: dict, source: str, strict: bool) -> int:
    recorded = trace_doc.canonical(document)
    replayed = replay(document)
    same_decision = recorded["path"] == replayed["path"] and recorded["outcome"] == replayed["outcome"]
    identical = trace_doc.dumps(recorded) == trace_doc.dumps(replayed)
    outcome = replayed["outcome"]
    result = outcome.get("backend") or f"{outcome['error']['type']}: {outcome['error']['message']}"
    if identical:
        print(f"replay: same decision, byte-identical canonical trace ({' -> '.join(replayed['path'])}; {result})")
        return EXIT_OK
    diff = canonical_diff(recorded, replayed, f"{source} (recorded)", "replayed")
    if same_decision and not strict:
        print(f"replay: same path and outcome ({' -> '.join(replayed['path'])}; {result}); "
              "the recorded events differ (a reason's wording?):")
        sys.stdout.write(diff)
        return EXIT_OK
    print("replay: the decision changed" if not same_decision else "replay: the canonical trace changed (--strict)")
    sys.stdout.write(diff)
    return EXIT_DIFFERS
