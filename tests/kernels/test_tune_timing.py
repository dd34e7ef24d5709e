"""The tuner's timing half (``triton_moe.tuning.time_plan``), shared by the 16-bit/FP8 and weight-quantized tuners:
run on the CPU with stand-in layer calls and a stand-in timer, so what it keeps, drops and logs is checked without a
GPU."""

from __future__ import annotations

import time

from moe_fsm.kernels.triton_moe.tuning import time_plan

HIDDEN = 32


def layer_call(candidate: str):
    """fn(x, topk_weights, topk_ids) for a named stand-in candidate: right, slightly off, wrong, NaN or raising."""
    scale = {"wrong": 1.5, "slightly-off": 1.001}.get(candidate.split(":")[0], 1.0)

    def fn(x, g, ids):
        if candidate.startswith("raise"):
            raise RuntimeError("out of resources: shared memory")
        out = x.float() * scale * g.sum(1, keepdim=True)
        return out * float("nan") if candidate.startswith("nan") else out

    return fn


def fake_timer(times: dict):
    """A timer returning each candidate's made-up µs (looked up by the call fn), recording what it timed."""
    timed = []

    def timer(fn, inputs, rep_ms):
        assert inputs and all(x.shape == (inputs[0][0].shape[0], HIDDEN) for x, _, _ in inputs)
        timed.append(fn.candidate)
        return times[fn.candidate]

    return timer, timed


def named(candidate: str):
    fn = layer_call(candidate)
    fn.candidate = candidate
    return fn


def run(plan, times, *, served=lambda t: None, deadline=None):
    timer, timed = fake_timer(times)
    lines: list[str] = []
    result = time_plan(plan, named, num_experts=8, top_k=2, hidden=HIDDEN, dtype="float32", served=served,
                       deadline=deadline, log=lines.append, device="cpu", timer=timer)
    return result, timed, lines


def test_the_fastest_right_candidate_wins_and_wrong_ones_are_dropped_not_timed():
    plan = {1: ["default", "wrong:a", "fast", "nan:b", "raise:c", "slightly-off:d"], 64: ["default", "slow"]}
    times = {"default": 10.0, "fast": 4.0, "slightly-off:d": 3.0, "slow": 20.0}
    (best, best_us, untimed), timed, lines = run(plan, times)
    assert best == {1: "slightly-off:d", 64: "default"} and best_us == {1: 3.0, 64: 10.0} and untimed == []
    assert timed == ["default", "fast", "slightly-off:d", "default", "slow"]
    text = "\n".join(lines)
    assert "T=1 wrong result at full size, dropped: wrong:a" in text
    assert "T=1 wrong result at full size, dropped: nan:b" in text
    assert "T=1 skip raise:c: RuntimeError: out of resources" in text
    assert "default tile      10.0 us" in text


def test_the_served_tile_is_logged_beside_the_best_unless_it_is_the_default():
    plan = {8: ["default", "served", "fast"], 16: ["default", "fast"]}
    (best, _, _), _, lines = run(plan, {"default": 9.0, "served": 7.0, "fast": 5.0},
                                 served=lambda t: "served" if t == 8 else "default")
    assert best == {8: "fast", 16: "fast"}
    assert "the tables' entry now       7.0 us" in lines[0]
    assert "tables' entry" not in lines[1]


def test_a_passed_deadline_leaves_the_rest_untimed_once_one_candidate_has_a_time():
    plan = {1: ["default", "a", "b"], 2: ["default", "a"]}
    (best, _, untimed), timed, _ = run(plan, {"default": 9.0, "a": 1.0, "b": 1.0}, deadline=time.monotonic() - 1)
    assert best == {1: "default", 2: "default"}  # the reference of each count is still timed
    assert untimed == [(1, "a"), (1, "b"), (2, "a")]
    assert timed == ["default", "default"]


def test_a_count_where_every_candidate_fails_has_no_entry():
    (best, best_us, _), _, lines = run({4: ["raise:x", "raise:y"]}, {})
    assert best == {} and best_us == {}
    assert sum("skip raise" in line for line in lines) == 2
