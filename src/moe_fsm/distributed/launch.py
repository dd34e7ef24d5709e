"""Re-run a command as N ranks under torch.distributed.run, and name per-rank files.

``moe-fsm run --nproc N ...`` calls :func:`launch` with the command line it
would have run itself (minus ``--nproc``); torch.distributed.run starts N copies
with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT/LOCAL_RANK set, and each copy calls
:func:`moe_fsm.distributed.init_from_env`. ``--standalone`` makes the launcher
pick a free local rendezvous port, so two launches on one machine do not collide.
The command reaches the ranks through a trampoline module (see
:mod:`moe_fsm.launch_trampoline`) because torchrun's own parser would
otherwise claim arguments such as ``--nproc``; the same module runs torchrun's
agent, so that no process of a launch outlives the launcher.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Mapping, Optional, Sequence

from moe_fsm.distributed.group import is_launched, resolve_timeout
from moe_fsm.errors import InputError
from moe_fsm.launch_trampoline import AGENT_FLAG, ARGV_ENV, LAUNCHER_PID_ENV

TRAMPOLINE = "moe_fsm.launch_trampoline"


def torchrun_command(nproc: int) -> list[str]:
    """The agent command line: torch.distributed.run starting ``nproc`` local ranks of the launch trampoline.

    The per-rank command itself travels in ``$MOE_FSM_LAUNCH_ARGV`` (see
    :mod:`moe_fsm.launch_trampoline`), out of reach of torchrun's option parser.
    """
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise InputError(f"nproc must be a positive integer, got {nproc!r}")
    return [
        sys.executable,
        "-m",
        TRAMPOLINE,
        AGENT_FLAG,
        "--standalone",
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(nproc),
        "--max-restarts",
        "0",
        "-m",
        TRAMPOLINE,
    ]


def launch_env(argv: Sequence[str], env: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """This environment, plus ``env``, plus the per-rank command for the trampoline.

    ``argv`` is the per-rank command: a first element ending in ``.py`` runs as a
    script with this interpreter; anything else (``moe-fsm``, ``python -m ...``, a
    path to an executable) runs verbatim.
    """
    argv = [str(a) for a in argv]
    if not argv:
        raise InputError("launch needs the per-rank command to run (argv is empty)")
    full = dict(os.environ)
    if env:
        full.update(env)
    full[ARGV_ENV] = json.dumps(argv)
    full[LAUNCHER_PID_ENV] = str(os.getpid())
    return full


def launch(
    nproc: int,
    argv: Sequence[str],
    *,
    env: Optional[Mapping[str, str]] = None,
    timeout_s: Optional[float] = None,
) -> int:
    """Run ``argv`` as ``nproc`` ranks on this machine and return the launch's exit status.

    The ranks inherit this environment (plus ``env``), so $MOE_FSM_DIST_BACKEND
    and $MOE_FSM_DIST_TIMEOUT reach them. The agent runs in its own session, so
    the launcher stops it (and it its ranks) itself: past ``timeout_s`` (124, as
    coreutils' ``timeout`` returns), on Ctrl-C (KeyboardInterrupt propagates) and
    on SIGTERM or SIGHUP (128 + the signal's number). A failed rank stops the
    others and its status is returned. Refused inside a launched rank: a rank
    that launched again would start N*N processes.
    """
    if is_launched():
        raise InputError(
            "launch() was called inside a rank that torch.distributed.run already started "
            f"(RANK={os.environ.get('RANK')}); run the per-rank command directly instead"
        )
    if timeout_s is not None:
        timeout_s = resolve_timeout(timeout_s)  # the bounds of a process group's timeout hold for a launch's too
    proc = subprocess.Popen(torchrun_command(nproc), env=launch_env(argv, env), start_new_session=True)
    try:
        with _stop_signals_raise():
            return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _stop(proc)
        return TIMEOUT_STATUS
    except _StopSignal as stop:
        _stop(proc)
        return 128 + stop.signum
    except BaseException:
        _stop(proc)
        raise


TIMEOUT_STATUS = 124
_STOP_GRACE_S = 8.0
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class _StopSignal(BaseException):
    """SIGTERM or SIGHUP reached the launcher while it waited for the agent."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextmanager
def _stop_signals_raise() -> Iterator[None]:
    """Turn SIGTERM/SIGHUP into :class:`_StopSignal` while waiting (their default would orphan the agent)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise _StopSignal(signum)

    previous = {sig: signal.signal(sig, handler) for sig in _STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the launcher's process group (torch.distributed.run forwards it to the ranks), then SIGKILL."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=_STOP_GRACE_S)
            return
        except subprocess.TimeoutExpired:
            continue


def rank_trace_path(path: str | os.PathLike[str], rank: int) -> Path:
    """``traces/run.json`` -> ``traces/run.rank1.json``: one trace file per rank, rank in the name."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise InputError(f"rank must be a non-negative integer, got {rank!r}")
    p = Path(path)
    if p.suffix:
        return p.with_name(f"{p.stem}.rank{rank}{p.suffix}")
    return p.with_name(f"{p.name}.rank{rank}")
