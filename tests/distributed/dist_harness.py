"""Start N ranks of ``rank_worker.py`` the way torchrun would, with hard time limits.

Each rank is a subprocess with RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT
set (a free port on 127.0.0.1), so the worker's ``init_from_env`` is the real
code path. The process group gets a 30 s timeout (a rank that dies fails the
others' collectives instead of hanging them), and the whole run a deadline
after which every rank is killed. One suite per world size runs all scenarios
in a single set of processes, because starting Python with torch costs far
more on two cores than the scenarios themselves.

MOE_FSM_DIST_BACKEND=nccl runs the same suite over NCCL with one GPU per rank
(world sizes above the GPU count are skipped).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

import torch

from moe_fsm.distributed import BACKEND_ENV, TIMEOUT_ENV, DistContext, destroy, init_from_env, rank_trace_path

HERE = Path(__file__).resolve().parent
WORKER = HERE / "rank_worker.py"
GROUP_TIMEOUT_S = 30
SUITE_DEADLINE_S = 180
PORT_RETRIES = 2


def dist_backend() -> str:
    return os.environ.get(BACKEND_ENV, "gloo").strip().lower() or "gloo"


class SuiteError(RuntimeError):
    """The ranks did not finish, or did not report: the message carries the log tail."""


def skip_unless_world_fits(world: int) -> None:
    import pytest

    if dist_backend() == "nccl" and torch.cuda.device_count() < world:
        pytest.skip(f"NCCL needs one GPU per rank: world {world} > {torch.cuda.device_count()} GPUs")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world: int, port: int, backend: str | None = None, group_timeout_s: int = GROUP_TIMEOUT_S) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    env[BACKEND_ENV] = backend or dist_backend()
    env[TIMEOUT_ENV] = str(capped_group_timeout(group_timeout_s))
    return env


def capped_group_timeout(seconds: int) -> int:
    """``seconds``, or less where this process's own $MOE_FSM_DIST_TIMEOUT is lower.

    A supervisor (``bench/gpu.sh distributed``) sets it below its step's limit, so that
    a rank stuck in a collective fails, and says where, before the step is ended.
    """
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    try:
        cap = int(float(raw)) if raw else seconds
    except ValueError:
        cap = seconds
    return max(1, min(seconds, cap))


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait()


def _tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else "(no log)"


def run_ranks(
    world: int,
    out_dir: Path,
    names: tuple[str, ...] = (),
    *,
    worker: Path = WORKER,
    backend: str | None = None,
    group_timeout_s: int = GROUP_TIMEOUT_S,
    deadline_s: int = SUITE_DEADLINE_S,
) -> list[dict]:
    """Run ``worker`` on ``world`` ranks; return each rank's result file; SuiteError with the logs on any problem."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for attempt in range(PORT_RETRIES + 1):
        port = free_port()
        logs = [out_dir / f"rank{r}.log" for r in range(world)]
        procs = []
        for r in range(world):
            with open(logs[r], "w") as log:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, str(worker), str(out_dir), *names],
                        env=rank_env(r, world, port, backend, group_timeout_s),
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                )
        deadline = time.monotonic() + deadline_s
        try:
            for p in procs:
                p.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            _kill(procs)
            raise SuiteError(f"world {world}: ranks still running after {deadline_s} s; rank 0 log:\n{_tail(logs[0])}")
        finally:
            _kill(procs)
        if any("address already in use" in _tail(log, 20000).lower() for log in logs) and attempt < PORT_RETRIES:
            continue  # another process took the port between free_port() and the rendezvous
        break
    results = []
    for r in range(world):
        path = rank_trace_path(out_dir / "results.json", r)
        if not path.exists():
            raise SuiteError(f"world {world}: rank {r} wrote no results (exit {procs[r].returncode}); log:\n{_tail(logs[r])}")
        results.append(json.loads(path.read_text()))
    return results


def worker_main(out_dir: Path, scenario: str, run: Callable[[DistContext, list[dict]], None]) -> int:
    """A worker rank's whole life: init the group from the launcher's environment, ``run(ctx, results)`` appending
    this rank's results, write them where ``run_ranks`` reads them (those made so far and one naming the scenario
    with the traceback where ``run`` raised: exit 1) and destroy the group whatever happened."""
    ctx = init_from_env()
    results: list[dict] = []
    status = 0
    try:
        run(ctx, results)
    except Exception:
        results.append({"scenario": scenario, "rank": ctx.rank, "error": traceback.format_exc(limit=8)})
        status = 1
    finally:
        rank_trace_path(out_dir / "results.json", ctx.rank).write_text(json.dumps({"rank": ctx.rank, "results": results}, indent=1))
        destroy()
    return status


def main(argv: list[str]) -> int:
    """``python tests/distributed/dist_harness.py OUT_DIR [WORLD ...]``: the suite without pytest; exit 1 on any failure."""
    sys.path.insert(0, str(HERE))
    import dist_scenarios

    out_dir = Path(argv[0])
    worlds = [int(w) for w in argv[1:]] or [2, 4]
    failed = 0
    for world in worlds:
        if dist_backend() == "nccl" and torch.cuda.device_count() < world:
            print(f"world {world}: skipped (NCCL needs one GPU per rank, {torch.cuda.device_count()} GPUs)")
            continue
        files = run_ranks(world, out_dir / f"world{world}")
        for f in files:
            for res in f["results"]:
                ok, why = dist_scenarios.result_ok(res)
                failed += not ok
                print(f"world {world} rank {f['rank']} {res['scenario']}: {'ok' if ok else 'FAILED ' + why}")
    print(f"{failed} failure(s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
