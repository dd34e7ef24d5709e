"""The tuner's screening (``triton_moe/screen.py``): every candidate runs first in a child process with a time
limit, so one that raises, kills its process or never finishes is refused and the rest still pass."""

from __future__ import annotations

import os
import time

import pytest

from moe_fsm.kernels.triton_moe.screen import screen

SLOW_START_VAR = "MOE_FSM_TEST_SLOW_SCREEN_START"
if os.environ.get(SLOW_START_VAR):  # a child importing this module to run fake_trial starts slowly, as on a loaded machine
    time.sleep(float(os.environ[SLOW_START_VAR]))


def fake_trial(candidate: tuple[str, int]) -> None:
    """What a candidate does in its child: passes, raises, hangs or kills its process (top-level: spawn pickles it
    by name)."""
    what, _ = candidate
    if what == "raise":
        raise ValueError("CompilationError: out of shared memory")
    if what == "hang":
        time.sleep(3600)
    if what == "die":
        os._exit(3)


def test_a_failing_a_dying_and_a_hanging_candidate_are_refused_and_the_others_pass():
    candidates = [("ok", 0), ("raise", 1), ("ok", 2), ("hang", 3), ("ok", 4), ("die", 5), ("ok", 6)]
    lines: list[str] = []
    start = time.monotonic()
    passed, refused, not_tried = screen(candidates, fake_trial, workers=2, timeout_s=4.0, log=lines.append)
    assert time.monotonic() - start < 60
    assert passed == [("ok", 0), ("ok", 2), ("ok", 4), ("ok", 6)]
    reasons = {r.candidate: r.reason for r in refused}
    assert set(reasons) == {("raise", 1), ("hang", 3), ("die", 5)}
    assert "ValueError: CompilationError: out of shared memory" in reasons[("raise", 1)]
    assert "did not finish in 4 s" in reasons[("hang", 3)]
    assert "child process died (exit code 3)" in reasons[("die", 5)]
    assert not_tried == []
    assert sum(line.startswith("  refused: ") for line in lines) == 3


def test_no_trial_starts_after_the_deadline():
    candidates = [("ok", i) for i in range(4)]
    passed, refused, not_tried = screen(candidates, fake_trial, workers=2, timeout_s=5.0, deadline=time.monotonic() - 1)
    assert (passed, refused, not_tried) == ([], [], candidates)


def test_a_timeout_must_be_positive():
    with pytest.raises(ValueError, match="timeout_s must be positive"):
        screen([("ok", 0)], fake_trial, workers=1, timeout_s=0)


def test_a_slow_worker_start_is_not_counted_against_the_candidate(monkeypatch):
    """The time limit starts when the worker is ready: a 3 s start with a 1.5 s limit refuses nothing."""
    monkeypatch.setenv(SLOW_START_VAR, "3")
    passed, refused, not_tried = screen([("ok", 0), ("ok", 1)], fake_trial, workers=2, timeout_s=1.5, log=lambda line: None)
    assert passed == [("ok", 0), ("ok", 1)] and refused == [] and not_tried == []
