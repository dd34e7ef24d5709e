"""`moe-fsm select`: decide one layer's backend, print the path, write the trace."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from moe_fsm.cli import render
from moe_fsm.cli.inputs import add_input_arguments, inputs_from_args
from moe_fsm.cli.exit_codes import EXIT_NO_BACKEND
from moe_fsm.cli.text import printable
from moe_fsm.decision import decide
from moe_fsm.errors import SelectionError
from moe_fsm.trace import document as trace_doc

DEFAULT_TRACE_DIR = trace_doc.DEFAULT_TRACE_DIR


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "select",
        help="decide the experts backend of one MoE layer and write its decision trace",
        description="Run the selection state machine on one layer. Prints the states visited, each guard and "
                    "candidate verdict, and the outcome; writes the decision trace (JSON) for explain and replay. "
                    "Exit status: 0 on a decision (including FP8's fallback NONE), 2 on bad input, 3 on a selection "
                    "error (the trace is written all the same), 4 when the trace cannot be written.",
    )
    add_input_arguments(parser)
    out = parser.add_argument_group("output")
    out.add_argument("--trace-out", metavar="PATH",
                     help=f"where to write the trace (default {DEFAULT_TRACE_DIR}/decision-<family>.json, or "
                          "decision-<family>-2.json, ... where that exists: never over an earlier trace; "
                          "with --json, only when given)")
    out.add_argument("--json", action="store_true", help="print the trace JSON instead of the readable path")
    out.add_argument("--layer-name", metavar="NAME", help="a name for the layer, recorded in the trace")
    out.add_argument("--verbose", "-v", action="store_true", help="show every failing check of every kernel")
    parser.set_defaults(func=run)


def claim_free_name(directory: Path, stem: str) -> Path:
    """Create ``stem.json``, else ``stem-2.json``, ``stem-3.json``, ...: the first name not taken, as an empty file.

    The name is claimed by creating it (``O_EXCL``), not by looking first, so
    selects running at once each get their own file; the trace then replaces
    the empty one.
    """
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise trace_doc.write_error(directory / f"{stem}.json", err) from None
    n = 1
    while True:
        path = directory / (f"{stem}.json" if n == 1 else f"{stem}-{n}.json")
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666))
            return path
        except FileExistsError:
            n += 1
        except OSError as err:
            raise trace_doc.write_error(path, err) from None


def _release(claimed: Path) -> None:
    """Remove the empty file claim_free_name made, unless something has been written to it since."""
    try:
        if claimed.lstat().st_size == 0:
            claimed.unlink()
    except OSError:
        pass  # already gone, or the directory cannot be changed: an empty file is all that stays


def run(args) -> int:
    inputs = inputs_from_args(args)
    family = inputs.layer.family.value
    claimed: Path | None = None  # the empty file claim_free_name made, until the trace replaces it
    if args.trace_out:
        trace_path: Path | None = Path(args.trace_out)
    elif args.json:
        trace_path = None
    else:
        trace_path = claimed = claim_free_name(Path(DEFAULT_TRACE_DIR), f"decision-{family}")

    try:
        decision = decide(inputs, layer_name=args.layer_name, trace_path=trace_path)
    except SelectionError as err:
        document, written = err.trace, err.trace_path
        code = EXIT_NO_BACKEND
    except BaseException:  # no trace came (the write failed, Ctrl-C): the claimed name goes back
        if claimed is not None:
            _release(claimed)
        raise
    else:
        document, written = decision.trace, (str(trace_path) if trace_path else None)
        code = 0

    if args.json:
        sys.stdout.write(trace_doc.dumps(document))
        if written:
            print(f"trace written to {written}", file=sys.stderr)
        return code

    out = [f"moe-fsm select: {family} layer", *render.inputs_lines(document), ""]
    out.append(f"path: {render.path_text(document)}")
    out.extend(render.event_lines(document, detail=args.verbose))
    out.append("")
    out.extend(render.outcome_lines(document))
    print(printable("\n".join(out)))
    if written:
        print(f"\ntrace written to {written}")
        print(f"  explain it: moe-fsm explain {written}")
        print(f"  replay it:  moe-fsm replay {written}")
    if code:
        print(f"moe-fsm select: error: {document['outcome']['error']['message']}", file=sys.stderr)
    return code
