"""Run every tuning candidate once in a child process, with a time limit, before the tuner times it.

A tile the compiler cannot build, that computes a wrong layer, that crashes the CUDA context or that never
finishes must not reach the table the runtime serves, and must not stop the tuner. So each candidate first runs
in a worker process (``multiprocessing`` spawn: no CUDA state is inherited) through ``trial``; the parent waits
at most ``timeout_s`` for it. A candidate whose trial raised, whose worker died, or that ran past the limit is
refused with the reason; the worker is then replaced (a failed CUDA call can leave its context unusable), so the
next candidate starts clean. Workers are reused between passing candidates, so each imports torch and compiles
its kernels once. A candidate's time starts when its worker has said it is ready (its imports done): a worker
that starts slowly on a loaded machine does not make the candidate it is given look hung.

``screen_and_time`` is the tuner's whole run around it, for any kernel family: screen every candidate, time the
ones that passed, write each shape's winners, within one time budget (``triton_moe/tuning.py`` for the 16-bit and
FP8 kernels, ``triton_wq/tuning.py`` for the weight-quantized ones).

Torch-free: the trial, timing and writing functions are the caller's (``tuning.try_candidate`` on a GPU; tests pass
their own).
"""

from __future__ import annotations

import multiprocessing as mp
import time
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from pathlib import Path
from typing import Callable, Hashable, Mapping, Optional, Sequence

POLL_S = 0.5
STARTUP_S = 300.0  # a worker not ready by then (imports hung) is the machine's failure, not a candidate's


@dataclass(frozen=True)
class Refusal:
    """A candidate that did not pass its trial, and why."""

    candidate: Hashable
    reason: str


def _worker_loop(conn, trial: Callable) -> None:
    """Child: say ("ready", None), then run ``trial`` on each candidate received, answer ("ok", None) or
    ("error", why); stop on None."""
    conn.send(("ready", None))
    while True:
        try:
            candidate = conn.recv()
        except EOFError:
            return
        if candidate is None:
            return
        try:
            trial(candidate)
        except BaseException as exc:  # the child reports everything; the parent decides
            conn.send(("error", f"{type(exc).__name__}: {str(exc)[:300]}"))
        else:
            conn.send(("ok", None))


class _Worker:
    def __init__(self, ctx, trial: Callable) -> None:
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker_loop, args=(child, trial), daemon=True)
        self.process.start()
        child.close()
        self.spawned = time.monotonic()
        self.ready = False
        self.candidate: Optional[Hashable] = None
        self.started = 0.0

    def take_ready(self) -> None:
        """The child's first message, once it arrived; a child that died before it fails the screening."""
        try:
            self.conn.recv()
        except (EOFError, OSError):
            self.process.join(1)
            raise RuntimeError(f"a screening worker died before it was ready (exit code {self.process.exitcode}): "
                               "the trial function cannot be loaded in a child process") from None
        self.ready = True

    def give(self, candidate: Hashable) -> None:
        self.candidate, self.started = candidate, time.monotonic()
        self.conn.send(candidate)

    def stop(self, kill: bool = False) -> None:
        if kill:
            self.process.kill()
        else:
            try:
                self.conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        self.conn.close()


def screen(
    candidates: Sequence[Hashable],
    trial: Callable[[Hashable], None],
    *,
    workers: int,
    timeout_s: float,
    deadline: Optional[float] = None,
    log: Callable[[str], None] = print,
    describe: Callable[[Hashable], str] = str,
    progress_every_s: float = 10.0,
) -> tuple[list[Hashable], list[Refusal], list[Hashable]]:
    """(passed, refused, not tried): each candidate's trial in a child process, at most ``timeout_s`` each.

    ``deadline`` (``time.monotonic()``): no trial starts after it; the candidates left are returned as not tried.
    Passed candidates keep the input order. ``log`` gets a progress line every ``progress_every_s`` seconds and one
    line per refusal.
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    ctx = mp.get_context("spawn")
    pending = list(candidates)
    pending.reverse()  # pop() from the end takes them in order
    ok: set = set()
    refused: list[Refusal] = []
    pool = [_Worker(ctx, trial) for _ in range(max(1, min(workers, len(pending))))] if pending else []
    done = 0
    start = last_report = time.monotonic()

    def refuse(worker: _Worker, why: str) -> _Worker:
        refused.append(Refusal(worker.candidate, why))
        log(f"  refused: {describe(worker.candidate)}: {why}")
        worker.stop(kill=True)
        return _Worker(ctx, trial) if pending and not past_deadline() else None

    def past_deadline() -> bool:
        return deadline is not None and time.monotonic() >= deadline

    try:
        while True:
            for worker in pool:
                if worker is not None and worker.ready and worker.candidate is None and pending and not past_deadline():
                    worker.give(pending.pop())
            busy = [w for w in pool if w is not None and w.candidate is not None]
            starting = [w for w in pool if w is not None and not w.ready] if pending and not past_deadline() else []
            if not busy and not starting:
                break
            now = time.monotonic()
            wait_s = min([w.started + timeout_s - now for w in busy] + [w.spawned + STARTUP_S - now for w in starting])
            ready = wait([w.conn for w in busy + starting], timeout=min(wait_s, POLL_S) if wait_s > 0 else 0)
            for i, worker in enumerate(pool):
                if worker is None:
                    continue
                if not worker.ready:
                    if worker.conn in ready:
                        worker.take_ready()
                    elif time.monotonic() - worker.spawned > STARTUP_S:
                        raise RuntimeError(f"a screening worker was not ready after {STARTUP_S:.0f} s (its imports hung)")
                    continue
                if worker.candidate is None:
                    continue
                if worker.conn in ready:
                    try:
                        status, why = worker.conn.recv()
                    except (EOFError, OSError):
                        worker.process.join(1)
                        pool[i] = refuse(worker, f"the child process died (exit code {worker.process.exitcode})")
                        done += 1
                        continue
                    done += 1
                    if status == "ok":
                        ok.add(worker.candidate)
                        worker.candidate = None
                    else:
                        pool[i] = refuse(worker, why)
                elif time.monotonic() - worker.started > timeout_s:
                    done += 1
                    pool[i] = refuse(worker, f"did not finish in {timeout_s:.0f} s (hung or too slow); its process was killed")
            if time.monotonic() - last_report >= progress_every_s:
                last_report = time.monotonic()
                log(f"  screened {done}/{len(candidates)} candidates in {last_report - start:.0f} s, "
                    f"{len(refused)} refused")
    finally:
        for worker in pool:
            if worker is not None:
                worker.stop(kill=not worker.ready or worker.candidate is not None)
    passed = [c for c in candidates if c in ok]
    tried = ok | {r.candidate for r in refused}
    not_tried = [c for c in candidates if c not in tried]
    return passed, refused, not_tried


@dataclass
class TuneReport:
    """What a tuning run did: the table written, the winners' times, the candidates refused by their
    trial (never timed, never written) and those the budget left untried or untimed."""

    path: Optional[Path] = None
    best_us: dict = field(default_factory=dict)  # (shape, tokens) -> µs of the winner
    refused: list = field(default_factory=list)  # Refusal, candidate = (shape, tokens, config)
    not_tried: list = field(default_factory=list)  # candidates the budget left unscreened or untimed


def screen_and_time(
    plans: Mapping[Hashable, Mapping[int, list]],
    trial: Callable[[tuple], None],
    time_shape: Callable[[Hashable, dict, Optional[float]], tuple[dict, dict, list]],
    write: Callable[[Hashable, dict], Path],
    *,
    workers: int,
    candidate_timeout_s: float,
    budget_s: Optional[float] = None,
    start: Optional[float] = None,
    log: Callable[[str], None] = print,
    describe: Callable[[tuple], str] = str,
    name: Callable[[Hashable], str] = str,
) -> TuneReport:
    """Tune ``plans`` ({shape: {token count: [config, ...]}}) and write each shape's winners.

    Every (shape, tokens, config) first runs ``trial`` in a child process (``screen``: ``workers`` processes, at
    most ``candidate_timeout_s`` each); what fails, computes a wrong layer, crashes or hangs is refused and never
    timed. ``time_shape(shape, plan, deadline)`` times the rest of one shape -> (best config per count, its µs,
    the (tokens, config) the deadline left untimed); ``write(shape, best)`` merges the winners into a table and
    returns its path. ``budget_s`` (from ``start``, default now) bounds the whole: screening stops starting trials
    at 60% of it (the first candidate of every count before the others, so a cut keeps them), timing stops after
    it with the fastest so far.
    """
    start = time.monotonic() if start is None else start
    deadline = None if budget_s is None else start + budget_s
    ranked = sorted(((rank, s, t, c) for s, plan in plans.items() for t, cs in plan.items() for rank, c in enumerate(cs)),
                    key=lambda r: r[0])
    candidates = list(dict.fromkeys((s, t, c) for _, s, t, c in ranked))
    screen_deadline = None if budget_s is None else start + 0.6 * budget_s
    passed, refused, not_screened = screen(candidates, trial, workers=max(1, workers), timeout_s=candidate_timeout_s,
                                           deadline=screen_deadline, log=log, describe=describe)
    log(f"screened in {time.monotonic() - start:.0f} s: {len(passed)} passed, {len(refused)} refused, "
        f"{len(not_screened)} left untried by the budget")
    ok = set(passed)
    report = TuneReport(refused=refused, not_tried=list(not_screened))
    for shape, counts in plans.items():
        plan = {t: [c for c in cs if (shape, t, c) in ok] for t, cs in counts.items()}
        plan = {t: cs for t, cs in plan.items() if cs}
        if deadline is not None and time.monotonic() >= deadline:
            log(f"{name(shape)}: not timed, the budget of {budget_s:.0f} s is spent")
            report.not_tried += [(shape, t, c) for t, cs in plan.items() for c in cs]
            continue
        log(f"timing {name(shape)}: " + ", ".join(f"T={t} {len(cs)}" for t, cs in plan.items())
            + f" candidates ({time.monotonic() - start:.0f} s elapsed)")
        best, best_us, untimed = time_shape(shape, plan, deadline)
        report.not_tried += [(shape, t, c) for t, c in untimed]
        if not best:
            log(f"{name(shape)}: no candidate passed; nothing written")
            continue
        report.path = write(shape, best)
        report.best_us.update({(shape, t): us for t, us in best_us.items()})
        log(f"{name(shape)}: " + ", ".join(f"T={t} {us:.1f} us" for t, us in sorted(best_us.items()))
            + f" -> {report.path}")
    return report
