"""The two processes between :func:`moe_fsm.distributed.launch` and the ranks' own program.

``python -m moe_fsm.launch_trampoline --agent TORCHRUN_ARGS...`` is the agent:
it runs torch.distributed.run's main in this process and turns its endings into
an exit status and one line (a failed rank, a stop signal) instead of torchrun's
traceback. ``python -m moe_fsm.launch_trampoline`` (no arguments) is what the
agent starts as each rank: it replaces itself with the per-rank command.

The per-rank command travels in ``$MOE_FSM_LAUNCH_ARGV`` (a JSON list) because
torch.distributed.run parses every argument on its command line, including the
ones meant for the per-rank program, and rejects those that look like an
abbreviation of its own options (``--nproc`` is "ambiguous").

Neither process may outlive its parent: the launcher runs the agent in its own
session (so a stop reaches it and its ranks together), which also takes it out
of reach of the signals a terminal or ``timeout`` sends to the launcher's group.
On Linux each of them asks the kernel for SIGTERM when its parent dies
(``PR_SET_PDEATHSIG``), so even a SIGKILLed launcher leaves no orphan running.

It lives outside :mod:`moe_fsm.distributed` on purpose: running a module of that
package would import the package, and torch with it, in every rank just to
exec a program that imports torch again.
"""

from __future__ import annotations

import json
import os
import signal
import sys

ARGV_ENV = "MOE_FSM_LAUNCH_ARGV"
AGENT_FLAG = "--agent"
LAUNCHER_PID_ENV = "MOE_FSM_LAUNCHER_PID"
AGENT_PID_ENV = "MOE_FSM_AGENT_PID"
_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid_env: str) -> None:
    """SIGTERM this process when its parent exits (Linux); at once if the parent named in ``parent_pid_env`` is gone."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):
        return
    expected = os.environ.get(parent_pid_env, "")
    if expected.isdigit() and os.getppid() != int(expected):
        os.kill(os.getpid(), signal.SIGTERM)  # the parent died before prctl took effect


def agent(torchrun_args: list[str]) -> int:
    """Run torch.distributed.run; exit 128+N on signal N, a failed rank's status on failure, one line each."""
    die_with_parent(LAUNCHER_PID_ENV)
    os.environ[AGENT_PID_ENV] = str(os.getpid())
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    try:
        torchrun_main(torchrun_args)
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        code = failure.exitcode
        how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
        print(f"moe-fsm launch: rank {rank} {how}; the other ranks were stopped", file=sys.stderr)
        return 128 - code if code < 0 else (code if 0 < code < 256 else 1)
    except SignalException as err:
        print(f"moe-fsm launch: stopped by signal {err.sigval.name}; the ranks were stopped with it", file=sys.stderr)
        return 128 + int(err.sigval)
    return 0


def rank() -> None:
    """Replace this process with the per-rank command (same pid, same RANK/WORLD_SIZE/... environment)."""
    raw = os.environ.get(ARGV_ENV)
    if not raw:
        sys.exit(f"{__name__}: ${ARGV_ENV} is unset; this module is started by moe_fsm.distributed.launch()")
    argv = json.loads(raw)
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        sys.exit(f"{__name__}: ${ARGV_ENV} must be a non-empty JSON list of strings, got {raw!r}")
    die_with_parent(AGENT_PID_ENV)
    if argv[0].endswith(".py"):
        argv = [sys.executable, *argv]
    env = dict(os.environ)
    del env[ARGV_ENV]
    os.execvpe(argv[0], argv, env)


def main() -> None:
    if sys.argv[1:2] == [AGENT_FLAG]:
        sys.exit(agent(sys.argv[2:]))
    rank()


if __name__ == "__main__":
    main()
