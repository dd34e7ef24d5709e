"""The eager ``max_tokens_per_rank`` all-to-all call replayed from graphs its P/F captured (``dispatch_graphs.py``).

On the CPU: when the plain path runs instead (the switches), what a graph is captured for (the keys: not the
token count), the padding of the static inputs, and the rule that keeps a replay from overwriting tokens a caller
still holds. Over NCCL (one CUDA device for world 1, two and four where there are): ``dispatch_graphs_worker.py`` runs
the plain and the replayed call on the same inputs and compares them bit for bit (see its docstring).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
import weakref
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dist_harness import HERE, run_ranks  # noqa: E402

from moe_fsm.distributed import ExpertPlacement  # noqa: E402
from moe_fsm.modular.interfaces import ActivationFormat, WeightAndReduce  # noqa: E402
from moe_fsm.prepare_finalize import dispatch_graphs  # noqa: E402
from moe_fsm.prepare_finalize.all2all import AllToAllPrepareFinalize  # noqa: E402
from moe_fsm.prepare_finalize.dispatch_graphs import (  # noqa: E402
    DispatchGraphs,
    _Lane,
    _StaticInputs,
    finalize_key,
    prepare_key,
)

CUDA = torch.device("cuda", 0)  # a device object only: nothing is allocated on it here


@pytest.fixture
def all_on(monkeypatch):
    """Every switch at the value that lets a call replay, on a machine without CUDA or Triton."""
    monkeypatch.setattr(dispatch_graphs, "HAS_TRITON", True)
    monkeypatch.setattr(dispatch_graphs, "interpreter_enabled", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.delenv(dispatch_graphs.ENV, raising=False)
    return monkeypatch


def test_replay_applies_on_cuda_with_compiled_kernels(all_on) -> None:
    assert DispatchGraphs.applies(CUDA)


def test_the_cpu_runs_the_plain_call(all_on) -> None:
    assert not DispatchGraphs.applies(torch.device("cpu"))


@pytest.mark.parametrize("value", ["0", "false", "off", "no", " OFF "])
def test_the_env_switch_turns_replay_off(all_on, value: str) -> None:
    all_on.setenv(dispatch_graphs.ENV, value)
    assert not DispatchGraphs.applies(CUDA)
    all_on.setenv(dispatch_graphs.ENV, "1")
    assert DispatchGraphs.applies(CUDA)


def test_a_caller_capturing_gets_the_plain_call(all_on) -> None:
    # its own graph takes the launches: a replay inside a capture would capture a graph launch
    all_on.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert not DispatchGraphs.applies(CUDA)


def test_the_interpreter_and_no_triton_get_the_plain_call(all_on) -> None:
    all_on.setattr(dispatch_graphs, "interpreter_enabled", lambda: True)
    assert not DispatchGraphs.applies(CUDA)
    all_on.setattr(dispatch_graphs, "interpreter_enabled", lambda: False)
    all_on.setattr(dispatch_graphs, "HAS_TRITON", False)
    assert not DispatchGraphs.applies(CUDA)


def _call(tokens: int, hidden: int = 64, top_k: int = 4, dtype=torch.bfloat16, ids_dtype=torch.int32):
    return (torch.zeros(tokens, hidden, dtype=dtype), torch.zeros(tokens, top_k, dtype=torch.float32),
            torch.zeros(tokens, top_k, dtype=ids_dtype))


def test_the_prepare_key_leaves_out_the_token_count() -> None:
    lane = (0, 1, 2)
    assert prepare_key(lane, *_call(48), False, None) == prepare_key(lane, *_call(3), False, None)
    assert prepare_key(lane, *_call(0), False, "group") == prepare_key(lane, *_call(48), False, "group")


def test_the_prepare_key_holds_what_changes_the_launches() -> None:
    lane = (0, 1, 2)
    base = prepare_key(lane, *_call(8), False, None)
    others = [
        prepare_key((0, 7, 2), *_call(8), False, None),  # another stream
        prepare_key(lane, *_call(8, hidden=128), False, None),
        prepare_key(lane, *_call(8, top_k=8), False, None),
        prepare_key(lane, *_call(8, dtype=torch.float16), False, None),
        prepare_key(lane, *_call(8, ids_dtype=torch.int64), False, None),
        prepare_key(lane, *_call(8), True, None),  # router weights applied on the input
        prepare_key(lane, *_call(8), False, "group"),  # FP8 per 1x128 group
        prepare_key(lane, *_call(8), False, "token"),
    ]
    assert len({base, *others}) == len(others) + 1


def test_the_finalize_key_leaves_out_the_output_rows() -> None:
    expert_output = torch.zeros(96, 64, dtype=torch.bfloat16)
    key = finalize_key(expert_output, torch.zeros(40, 64, dtype=torch.bfloat16), WeightAndReduce.EXPERTS, False)
    assert key == finalize_key(expert_output, torch.zeros(3, 64, dtype=torch.bfloat16), WeightAndReduce.EXPERTS, False)
    assert key != finalize_key(expert_output, torch.zeros(3, 64, dtype=torch.float32), WeightAndReduce.EXPERTS, False)
    assert key != finalize_key(torch.zeros(96, 4, 64, dtype=torch.bfloat16), torch.zeros(3, 64, dtype=torch.bfloat16),
                               WeightAndReduce.CONTIGUOUS, False)


def test_static_inputs_pad_with_ids_that_route_nowhere() -> None:
    capacity = 6
    static = _StaticInputs(torch.zeros(capacity, 2), torch.zeros(capacity, 3), torch.full((capacity, 3), -1))
    gen = torch.Generator().manual_seed(0)
    for tokens in (6, 2, 4, 0, 5, 1, 6):  # shrinking and growing
        hidden, weights = torch.randn(tokens, 2, generator=gen), torch.rand(tokens, 3, generator=gen)
        ids = torch.randint(0, 16, (tokens, 3), generator=gen)
        assert static.copy_in(hidden, weights, ids) == tokens
        assert torch.equal(static.hidden[:tokens], hidden) and torch.equal(static.topk_weights[:tokens], weights)
        assert torch.equal(static.topk_ids[:tokens], ids)
        assert bool((static.topk_ids[tokens:] == -1).all()), f"{tokens} tokens: padding ids {static.topk_ids[tokens:]}"


def test_a_lane_knows_when_handed_out_tokens_are_held() -> None:
    lane = _Lane(torch.device("cpu"), pool=None, stream=None)
    graph_output = torch.zeros(8, 4)
    ids = torch.zeros(8, 2, dtype=torch.int32)
    held_by_graph = _prepared(graph_output[:, :2], ids)  # the graph's own prepared tokens, kept with it
    lane.last = (held_by_graph, dispatch_graphs._use_counts(held_by_graph))
    assert not lane.outstanding()
    handed = _prepared(held_by_graph.hidden.detach(), held_by_graph.topk_ids.detach())
    assert lane.outstanding()
    kept_view = handed.topk_ids[1:]  # a view made from a handed-out tensor counts too
    del handed
    assert lane.outstanding()
    del kept_view
    assert not lane.outstanding()


def test_a_lane_keeps_the_last_tokens_alive_after_their_graph_is_dropped() -> None:
    # The use counts are read at the storages' addresses: a P/F dropped with its graphs must not leave the lane
    # reading freed storages (on the GPU that gave one rank "held" and the others not, and the ranks then called
    # different collectives), and memory a caller's alias still uses must stay allocated.
    lane = _Lane(torch.device("cpu"), pool=None, stream=None)
    held_by_graph = _prepared(torch.zeros(8, 4)[:, :2], torch.zeros(8, 2, dtype=torch.int32))
    lane.last = (held_by_graph, dispatch_graphs._use_counts(held_by_graph))
    alive = weakref.ref(held_by_graph.topk_ids)
    del held_by_graph  # the P/F and its graphs are gone
    assert alive() is not None
    assert not lane.outstanding()
    alias = lane.last[0].topk_ids.detach()
    assert lane.outstanding()
    del alias
    assert not lane.outstanding()


def _prepared(hidden: torch.Tensor, ids: torch.Tensor):
    from moe_fsm.modular.interfaces import PreparedTokens

    return PreparedTokens(hidden=hidden, scale=None, topk_ids=ids, topk_weights=hidden[:, :1])


def test_only_the_standard_fixed_block_call_has_graphs() -> None:
    placement = ExpertPlacement(8, 1, 0)
    assert AllToAllPrepareFinalize(placement, max_tokens_per_rank=16)._graphs is not None
    assert AllToAllPrepareFinalize(placement)._graphs is None  # variable counts: the splits are read on the host
    batched = AllToAllPrepareFinalize(placement, activation_format=ActivationFormat.BATCHED, max_tokens_per_rank=16)
    assert batched._graphs is None  # its local packing reads a count on the host


class _ReplayedByRunning:
    """A stand-in for a captured graph on the CPU: a replay runs the captured body again and writes its results
    into the tensors the capture returned, as a real replay rewrites the graph's own outputs in place."""

    replays = 0

    def __init__(self, body, result) -> None:
        self.body, self.result = body, result

    def replay(self) -> None:
        type(self).replays += 1
        _copy_into(self.result, self.body())

    def reset(self) -> None:  # release_graphs frees every P/F's graphs, these included
        self.body = self.result = None


def _copy_into(held, fresh) -> None:
    if isinstance(held, torch.Tensor):
        held.copy_(fresh)
    elif dataclasses.is_dataclass(held):
        for f in dataclasses.fields(held):
            _copy_into(getattr(held, f.name), getattr(fresh, f.name))


@pytest.fixture
def stand_in_graphs(monkeypatch, world_of_one):
    """The graph path on the CPU: the interpreter's kernels, one gloo rank, graphs replayed by running their body
    (the capture itself, the pool and the streams are CUDA's and are left out)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv(dispatch_graphs.ENV, raising=False)
    monkeypatch.setattr(DispatchGraphs, "applies", staticmethod(lambda device: dispatch_graphs.enabled_by_env()))
    lane = _Lane(torch.device("cpu"), pool=None, stream=None)
    monkeypatch.setattr(dispatch_graphs, "_lane", lambda device: (0, 0, 0))
    monkeypatch.setattr(dispatch_graphs, "_lane_state", lambda key: lane)
    monkeypatch.setattr(dispatch_graphs.dist, "get_backend", lambda group=None: "nccl")

    def capture(pf, lane, body, what):
        body()  # the warm-up, as the real capture runs it
        result = body()
        return _ReplayedByRunning(body, result), result

    monkeypatch.setattr(dispatch_graphs, "_capture", capture)
    _ReplayedByRunning.replays = 0
    return monkeypatch


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="the padded calls run the Triton kernels (interpreter)")
@pytest.mark.parametrize("quant", ["none", "group"])
def test_padded_calls_equal_the_plain_calls_bit_for_bit(stand_in_graphs, quant: str) -> None:
    """Calls of fewer tokens than the capacity, padded with ids -1, give the plain call's bytes (a shrink, a growth,
    no tokens); the plain path runs with the switch off, the padded one through the stand-in replays."""
    from moe_fsm.modular.interfaces import DynamicFP8RowQuantizer

    num_experts, hidden_size, top_k, capacity = 8, 256, 2, 12
    placement = ExpertPlacement(num_experts, 1, 0)
    expert_map = placement.expert_map(torch.device("cpu"))
    pf = AllToAllPrepareFinalize(placement, max_tokens_per_rank=capacity)
    quantize = None if quant == "none" else DynamicFP8RowQuantizer("group", lambda x: pytest.fail("fused: not called"))
    gen = torch.Generator().manual_seed(3)
    replays_before = 0
    for tokens in (capacity, 5, 9, 0, capacity):
        hidden = torch.randn(tokens, hidden_size, generator=gen).to(torch.bfloat16)
        ids = torch.randperm(num_experts, generator=gen)[:top_k].repeat(tokens, 1).to(torch.int32)
        ids[: tokens // 2, 0] = -1  # skipped slots too
        weights = torch.rand(tokens, top_k, generator=gen)
        runs = []
        for switch in ("0", "1"):
            stand_in_graphs.setenv(dispatch_graphs.ENV, switch)
            prepared = pf.prepare(hidden, weights, ids, num_experts=num_experts, expert_map=expert_map,
                                  apply_router_weight_on_input=False, quantize=quantize)
            fields = [None if t is None else t.clone() for t in
                      (prepared.hidden, prepared.scale, prepared.topk_ids, prepared.topk_weights)]
            expert_output = torch.randn(prepared.hidden.shape[0], hidden_size, generator=torch.Generator().manual_seed(tokens))
            output = torch.full_like(hidden, float("nan"))
            pf.finalize(output, expert_output.to(torch.bfloat16), prepared, topk_weights=prepared.topk_weights,
                        topk_ids=prepared.topk_ids, apply_router_weight_on_input=False, reduce=WeightAndReduce.EXPERTS)
            runs.append((fields, output, type(prepared.state).__name__))
            del prepared
        (plain, plain_out, plain_state), (padded, padded_out, padded_state) = runs
        assert (plain_state, padded_state) == ("DispatchState", "ReplayedDispatch")
        for a, b in zip(plain, padded):
            assert (a is None) == (b is None)
            if a is not None:
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"{tokens} tokens"
        assert torch.equal(plain_out.view(torch.uint8), padded_out.view(torch.uint8)), f"{tokens} tokens"
        assert _ReplayedByRunning.replays == replays_before + 2  # one prepare graph, one finalize graph
        replays_before = _ReplayedByRunning.replays


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="the padded calls run the Triton kernels (interpreter)")
def test_held_tokens_make_the_next_prepare_plain(stand_in_graphs) -> None:
    num_experts, hidden_size, top_k, capacity = 8, 256, 2, 6
    placement = ExpertPlacement(num_experts, 1, 0)
    expert_map = placement.expert_map(torch.device("cpu"))
    pf = AllToAllPrepareFinalize(placement, max_tokens_per_rank=capacity)
    hidden = torch.randn(capacity, hidden_size).to(torch.bfloat16)
    ids = torch.arange(top_k, dtype=torch.int32).repeat(capacity, 1)
    weights = torch.rand(capacity, top_k)

    def prepare(x):
        return pf.prepare(x, weights, ids, num_experts=num_experts, expert_map=expert_map,
                          apply_router_weight_on_input=False, quantize=None)

    first = prepare(hidden)
    kept = first.hidden.clone()
    second = prepare(hidden * 2)
    assert type(first.state).__name__ == "ReplayedDispatch" and type(second.state).__name__ == "DispatchState"
    assert torch.equal(first.hidden, kept)  # not overwritten by the second call
    rows = first.hidden  # a tensor kept alone still holds the graph's tokens
    del first, second
    assert type(prepare(hidden).state).__name__ == "DispatchState"
    del rows
    assert type(prepare(hidden).state).__name__ == "ReplayedDispatch"


class _ResetRecorder:
    """A captured graph's stand-in that records whether it was freed."""

    def __init__(self) -> None:
        self.freed = False

    def reset(self) -> None:
        self.freed = True


def test_released_graphs_are_freed_and_later_calls_run_plainly(all_on) -> None:
    graphs = DispatchGraphs(4)
    prepare_graph, combine_graph = _ResetRecorder(), _ResetRecorder()
    captured = dispatch_graphs._Captured(lane=None, graph=prepare_graph, inputs=None, prepared=None, expert_map=None,
                                         finalize={("combine",): (combine_graph, None, None), ("failed",): None})
    graphs._captured = {("prepare",): captured, ("eager",): None}
    dispatch_graphs.release_graphs()
    assert prepare_graph.freed and combine_graph.freed
    assert graphs._captured == {("prepare",): None, ("eager",): None}
    assert captured.finalize == {("combine",): None, ("failed",): None}
    # a later prepare takes the plain call before it looks at anything else (no P/F needed to learn that)
    assert graphs.prepare(None, torch.zeros(2, 8), torch.zeros(2, 1), torch.zeros(2, 1, dtype=torch.int32),
                          expert_map=None, apply_router_weight_on_input=False, quantize=None) is None


def test_destroying_the_group_releases_the_graphs_first(monkeypatch) -> None:
    """NCCL destroys a communicator only once no CUDA graph holds one of its collectives: moe_fsm's destroy() frees
    the P/Fs' graphs before it destroys the process group."""
    from moe_fsm.distributed import group

    order = []
    monkeypatch.setattr(group.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(group.dist, "destroy_process_group", lambda: order.append("destroy_process_group"))
    monkeypatch.setattr(group, "_BEFORE_DESTROY", [lambda: order.append("released")])
    group.before_destroy(dispatch_graphs.release_graphs)
    group.before_destroy(dispatch_graphs.release_graphs)  # registered once however often asked
    monkeypatch.setattr(dispatch_graphs, "release_graphs", lambda: pytest.fail("the registered function is called"))
    graphs = DispatchGraphs(4)
    graphs._captured = {("prepare",): dispatch_graphs._Captured(None, _ResetRecorder(), None, None, None)}
    group.destroy()
    assert order == ["released", "destroy_process_group"] and graphs._released
    assert len(group._BEFORE_DESTROY) == 2


@pytest.mark.gpu
@pytest.mark.distributed
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="the wire kernels are Triton kernels")
@pytest.mark.parametrize("world", [1, 2, 4])
def test_replayed_calls_equal_the_plain_calls_over_nccl(tmp_path: Path, world: int) -> None:
    if torch.cuda.device_count() < world:
        pytest.skip(f"NCCL needs one GPU per rank: world {world} > {torch.cuda.device_count()} CUDA devices")
    files = run_ranks(world, tmp_path, worker=HERE / "dispatch_graphs_worker.py", backend="nccl", group_timeout_s=120,
                      deadline_s=240)
    results = [r for f in files for r in f["results"]]
    errors = [r["error"] for r in results if "error" in r]
    assert not errors, errors[0]
    calls = [r for r in results if "prepared_equal" in r]
    assert len(calls) == world * 2 * 6  # ranks x payloads x token counts
    for r in calls:
        assert r["prepared_equal"] and r["output_equal"], r
        assert r["output_finite"] and r["ref_err"] <= r["ref_tol"], r
        assert r["plain_state"] == "DispatchState" and r["graph_state"] == "ReplayedDispatch", r
        plain, graph = r["plain_calls"], r["graph_calls"]
        assert plain["replay"] == 0 and plain["route"] == 1 and plain["all_to_all_equal"] == 2, r
        assert graph["replay"] == 2, r  # one graph for prepare, one for finalize
        if r["call"] > 0:  # the first call also warms up and captures both graphs through the plain steps
            assert all(graph[step] == 0 for step in ("route", "send_rows", "all_to_all_equal", "local_ids",
                                                     "combine_returned")), r
    held = [r for r in results if r["scenario"].endswith("-held")]
    assert len(held) == world * 2
    for r in held:
        assert r["first_state"] == "ReplayedDispatch" and r["second_state"] == "DispatchState", r
        assert r["held_unchanged"], r
