"""Process groups as torch.distributed.run sets them up: gloo on CPU, NCCL on CUDA.

Every per-rank program (``moe-fsm run --nproc N``, the multi-process tests, the
benchmark) starts with :func:`init_from_env` and ends with :func:`destroy`, so
the backend choice, the device of each rank and the timeouts live in one place.
The timeout given to the process group bounds both the rendezvous and every
collective: a rank that dies makes the others fail after ``timeout`` seconds
instead of hanging forever.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist

from moe_fsm.errors import BackendUnavailableError, EnvVarError, InputError

BACKEND_ENV = "MOE_FSM_DIST_BACKEND"
TIMEOUT_ENV = "MOE_FSM_DIST_TIMEOUT"
BACKENDS = ("gloo", "nccl")
DEFAULT_TIMEOUT_S = 300.0

# What torch.distributed.run exports to every rank; env:// rendezvous needs all four.
LAUNCH_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class DistContext:
    """Where this process stands: its rank, the world, its device and the backend.

    ``group`` is the process group the prepare/finalize objects communicate over;
    None means the default (world) group.
    """

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device
    group: Optional[dist.ProcessGroup] = None


def is_launched() -> bool:
    """True inside a process started by torch.distributed.run (or set up like one)."""
    return all(name in os.environ for name in LAUNCH_ENV)


def current_rank() -> Optional[int]:
    """This process's global rank from the launcher's environment; None outside a launch."""
    if "RANK" not in os.environ:
        return None
    return _env_int("RANK", minimum=0)


def resolve_backend(backend: Optional[str] = None) -> str:
    """Pick the backend: the argument, else $MOE_FSM_DIST_BACKEND, else nccl with CUDA, gloo without.

    NCCL is refused without CUDA devices because it cannot run on CPU tensors;
    gloo works everywhere (on CUDA machines too, through host copies).
    """
    if backend is None:
        raw = os.environ.get(BACKEND_ENV)
        if raw is not None and raw.strip():
            backend = raw.strip().lower()
            if backend not in BACKENDS:
                raise EnvVarError(BACKEND_ENV, raw, ", ".join(BACKENDS))
        else:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
    elif backend not in BACKENDS:
        raise InputError(f"distributed backend {backend!r} is not one of {list(BACKENDS)}")
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise BackendUnavailableError("backend nccl needs CUDA devices, and torch sees none; use gloo on CPU")
        if not dist.is_nccl_available():
            raise BackendUnavailableError("backend nccl: this torch build has no NCCL support; use gloo")
    elif not dist.is_gloo_available():
        raise BackendUnavailableError("backend gloo: this torch build has no gloo support")
    return backend


def device_for(backend: str, local_rank: int) -> torch.device:
    """NCCL ranks own one GPU each (cuda:LOCAL_RANK); gloo ranks compute on the CPU."""
    if backend == "nccl":
        count = torch.cuda.device_count()
        if local_rank >= count:
            raise InputError(
                f"LOCAL_RANK={local_rank} has no GPU of its own: this node has {count} CUDA device(s); "
                f"NCCL needs one GPU per rank, so run at most {count} processes per node"
            )
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


MAX_TIMEOUT_S = 7 * 24 * 3600.0  # a week: longer is a typo, and past ~1e9 s timedelta and the backends overflow
TIMEOUT_ACCEPTED = f"a positive finite number of seconds, at most {MAX_TIMEOUT_S:.0f} (7 days)"


def resolve_timeout(timeout_s: Optional[float] = None) -> float:
    """Seconds the process group waits for a rendezvous or a collective before failing (``TIMEOUT_ACCEPTED``)."""
    if timeout_s is None:
        raw = os.environ.get(TIMEOUT_ENV)
        if raw is None or not raw.strip():
            return DEFAULT_TIMEOUT_S
        try:
            seconds = float(raw)
        except ValueError:
            raise EnvVarError(TIMEOUT_ENV, raw, TIMEOUT_ACCEPTED) from None
        if not 0 < seconds <= MAX_TIMEOUT_S:  # also false for nan
            raise EnvVarError(TIMEOUT_ENV, raw, TIMEOUT_ACCEPTED)
        return seconds
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s <= MAX_TIMEOUT_S:
        raise InputError(f"timeout_s must be {TIMEOUT_ACCEPTED}, got {timeout_s!r}")
    return float(timeout_s)


def init_from_env(backend: Optional[str] = None, timeout_s: Optional[float] = None) -> DistContext:
    """Join the process group that torch.distributed.run describes in the environment.

    Reads RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (and LOCAL_RANK, default 0),
    selects the device (cuda:LOCAL_RANK for NCCL, set as the current device before
    the group exists so NCCL binds to it) and initializes the default group with
    ``timeout_s`` (argument, else $MOE_FSM_DIST_TIMEOUT, else 300 s). If this
    process already has a default group, it is reused as long as it agrees with
    the environment.
    """
    missing = [name for name in LAUNCH_ENV if name not in os.environ]
    if missing:
        raise InputError(
            f"not a launched rank: environment variable(s) {missing} are unset; start the program with "
            f"'moe-fsm run --nproc N ...' or 'python -m torch.distributed.run --nproc-per-node N ...'"
        )
    rank = _env_int("RANK", minimum=0)
    world_size = _env_int("WORLD_SIZE", minimum=1)
    local_rank = _env_int("LOCAL_RANK", minimum=0) if "LOCAL_RANK" in os.environ else 0
    if rank >= world_size:
        raise InputError(f"RANK={rank} must be below WORLD_SIZE={world_size}")
    if dist.is_initialized():
        existing = dist.get_backend()
        if dist.get_rank() != rank or dist.get_world_size() != world_size:
            raise InputError(
                f"a process group already exists as rank {dist.get_rank()} of {dist.get_world_size()}, "
                f"but the environment says rank {rank} of {world_size}"
            )
        return DistContext(rank, world_size, local_rank, existing, device_for(existing, local_rank))
    backend = resolve_backend(backend)
    device = device_for(backend, local_rank)
    _stacks_on_request()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend=backend,
        init_method="env://",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=resolve_timeout(timeout_s)),
    )
    return DistContext(rank, world_size, local_rank, backend, device)


STACKS_DIR_ENV = "MOE_FSM_STACKS_DIR"
_stacks_file = None  # the open file faulthandler writes this rank's stacks into (it must outlive the registration)


def _stacks_on_request() -> None:
    """SIGUSR1 makes this rank print every thread's Python stack (and go on).

    A supervisor that finds a rank hung (``bench/gpu.sh step``) asks it where it
    waits before ending it. The stacks go to ``$MOE_FSM_STACKS_DIR/rank<RANK>-pid<pid>.txt``
    where the supervisor names that folder (a rank started by a test or ``moe-fsm run``
    often writes its stderr into a pipe that a killed parent never prints), else to
    stderr. Left alone where the program handles SIGUSR1 itself.
    """
    global _stacks_file
    usr1 = getattr(signal, "SIGUSR1", None)  # POSIX only
    if usr1 is None or threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(usr1) != signal.SIG_DFL:
        return
    folder = os.environ.get(STACKS_DIR_ENV)
    if folder and _stacks_file is None:
        name = f"rank{os.environ.get('RANK', '')}-pid{os.getpid()}.txt"
        try:
            _stacks_file = open(os.path.join(folder, name), "w", encoding="utf-8")  # noqa: SIM115 - held for the process
        except OSError:  # a folder that is gone or not writable: the stacks go to stderr, the rank runs on
            _stacks_file = None
    if _stacks_file is not None:
        faulthandler.register(usr1, file=_stacks_file, all_threads=True)
    else:
        faulthandler.register(usr1, all_threads=True)


_BEFORE_DESTROY: list[Callable[[], None]] = []


def before_destroy(release: Callable[[], None]) -> None:
    """Have :func:`destroy` call ``release`` before it destroys the process group (once, however often registered).

    Why: NCCL destroys a communicator only after every CUDA graph that captured one of its collectives is gone, so
    a graph still alive at ``destroy_process_group`` blocks it forever (a rank that printed its whole report and
    never exited, ``run --nproc 2`` on 2 x H200). Graphs whose owners outlive the group register their release here.
    """
    if release not in _BEFORE_DESTROY:
        _BEFORE_DESTROY.append(release)


def destroy() -> None:
    """Tear down the default process group if this process has one (safe to call twice), after releasing what
    :func:`before_destroy` registered."""
    if dist.is_available() and dist.is_initialized():
        for release in list(_BEFORE_DESTROY):
            release()
        dist.destroy_process_group()


@contextmanager
def distributed(backend: Optional[str] = None, timeout_s: Optional[float] = None) -> Iterator[DistContext]:
    """``with distributed() as ctx:``: init from the environment, always destroy on the way out."""
    ctx = init_from_env(backend, timeout_s)
    try:
        yield ctx
    finally:
        destroy()


def group_rank_and_size(group: Optional[dist.ProcessGroup]) -> tuple[int, int]:
    """This process's rank in ``group`` and the group's size (the default group for None)."""
    if not dist.is_initialized():
        raise InputError(
            "torch.distributed has no process group in this process; call moe_fsm.distributed.init_from_env() first"
        )
    return dist.get_rank(group), dist.get_world_size(group)


def _env_int(name: str, *, minimum: int) -> int:
    raw = os.environ[name]
    try:
        value = int(raw)
    except ValueError:
        raise EnvVarError(name, raw, f"an integer >= {minimum}") from None
    if value < minimum:
        raise EnvVarError(name, raw, f"an integer >= {minimum}")
    return value
