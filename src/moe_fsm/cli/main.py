"""The `moe-fsm` command: select, explain, replay, diff, diagram, golden, plan (and run, tune, measure).

Each subcommand module exposes ``register(subparsers)``, which adds its parser
and sets ``func`` to a handler returning the exit status. ``main`` never lets a
user error out as a traceback: each documented error prints one line naming
the problem and exits with its own status (``exit_codes.EXIT_STATUSES``).
"""

from __future__ import annotations

import argparse
import os
import sys

from moe_fsm import __version__
from moe_fsm.cli.exit_codes import (
    EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_NO_BACKEND, EXIT_OK, EXIT_STATUSES, EXIT_WRITE_FAILED,
)
from moe_fsm.errors import BackendUnavailableError, MoeFsmError, SelectionError, TraceWriteError


def build_parser() -> argparse.ArgumentParser:
    from moe_fsm.cli import (
        diagram,
        diff_cmd,
        explain,
        flashinfer_cmd,
        golden_cmd,
        measure_cmd,
        plan_cmd,
        replay,
        run_cmd,
        select_cmd,
        tune_cmd,
    )

    parser = argparse.ArgumentParser(
        prog="moe-fsm",
        description="Choose the experts kernel backend of MoE layers with an explicit state machine, and explain, "
                    "replay and check the decision traces it records.",
        epilog=EXIT_STATUSES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"moe-fsm {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in (select_cmd, explain, replay, diff_cmd, diagram, golden_cmd, plan_cmd, run_cmd, tune_cmd, measure_cmd,
                   flashinfer_cmd):
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
        return exit_.code if isinstance(exit_.code, int) else (EXIT_OK if exit_.code is None else EXIT_BAD_INPUT)
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return EXIT_BAD_INPUT
    # the command as the user gave it, for the manifests that record it (sys.argv is the host's when called in-process)
    args.command_line = ["moe-fsm", *(sys.argv[1:] if argv is None else argv)]
    stdout = sys.stdout
    sys.stdout = _CheckedStdout(stdout)
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # here, not at exit: output that cannot be written is this command's error
        return code
    except MoeFsmError as err:
        from moe_fsm.cli.text import printable

        print(printable(f"moe-fsm {args.command}: error: {err}"), file=sys.stderr)
        if isinstance(err, StdoutWriteError):
            _discard_output(stdout)
        return exit_status(err)
    except BrokenPipeError:  # `moe-fsm select --json | head`
        _discard_output(stdout)
        return EXIT_OK
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    finally:
        sys.stdout = stdout


class StdoutWriteError(TraceWriteError):
    """Standard output could not be written (a full disk: ``moe-fsm select > /dev/full``)."""


class _CheckedStdout:
    """sys.stdout, whose failed writes are a StdoutWriteError (exit 4, one line) instead of an OSError traceback.

    A closed pipe stays a BrokenPipeError: the reader has all it wanted (``| head``).
    """

    def __init__(self, stream) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            raise
        except OSError as err:
            raise StdoutWriteError(f"cannot write to standard output: {err.strerror or err}") from None

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            raise
        except OSError as err:
            raise StdoutWriteError(f"cannot write to standard output: {err.strerror or err}") from None

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def _discard_output(stdout) -> None:
    """Point stdout at /dev/null, so the interpreter's own flush at exit has nowhere to fail and prints no second
    traceback (what Python's documentation on SIGPIPE advises for a broken pipe)."""
    try:
        fileno = stdout.fileno()
    except (OSError, ValueError, AttributeError):  # not a real file (a test's capture): nothing is flushed at exit
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fileno)
    os.close(devnull)


def exit_status(err: MoeFsmError) -> int:
    if isinstance(err, TraceWriteError):
        return EXIT_WRITE_FAILED
    if isinstance(err, (SelectionError, BackendUnavailableError)):
        return EXIT_NO_BACKEND
    return EXIT_BAD_INPUT


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
