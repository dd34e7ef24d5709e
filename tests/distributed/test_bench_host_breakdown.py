"""``bench_distributed.py --host-breakdown`` on one gloo rank: each step timed, the P/F and modules left as they were.

The breakdown wraps functions where the all-to-all P/F looks them up (module globals, class methods, the P/F's own
prepare and finalize); a wrapper left behind would time, or break, every later call in the process.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from moe_fsm.distributed import ExpertPlacement
from moe_fsm.modular.interfaces import WeightAndReduce
from moe_fsm.prepare_finalize import all2all
from moe_fsm.prepare_finalize.all2all import AllToAllPrepareFinalize
from moe_fsm.prepare_finalize.local import LocalPrepareFinalize

BENCH = Path(__file__).resolve().parents[2] / "bench" / "bench_distributed.py"


@pytest.fixture
def bench(monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_distributed_under_test", BENCH)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("max_tokens_per_rank", [None, 16], ids=["variable", "max_tokens_per_rank"])
def test_each_step_is_timed_and_every_wrapper_removed(bench, world_of_one, max_tokens_per_rank) -> None:
    gen = torch.Generator().manual_seed(3)
    experts, hidden_size, tokens = 8, 64, 12
    placement = ExpertPlacement(experts, 1, 0)
    pf = AllToAllPrepareFinalize(placement, max_tokens_per_rank=max_tokens_per_rank)
    hidden = torch.randn(tokens, hidden_size, generator=gen)
    ids = torch.randint(0, experts, (tokens, 2), generator=gen)
    weights = torch.rand(tokens, 2, generator=gen)
    output = torch.full_like(hidden, float("nan"))
    expert_map = placement.expert_map(hidden.device)

    def call() -> None:
        prepared = pf.prepare(hidden, weights, ids, num_experts=experts, expert_map=expert_map,
                              apply_router_weight_on_input=False, quantize=None)
        pf.finalize(output, prepared.hidden, prepared, topk_weights=prepared.topk_weights, topk_ids=prepared.topk_ids,
                    apply_router_weight_on_input=False, reduce=WeightAndReduce.EXPERTS)

    originals = {name: getattr(all2all, name) for name in ("route", "send_rows", "all_to_all_v", "all_to_all_equal",
                                                            "exchange_counts", "unpack_row_bytes", "combine_returned")}
    breakdown = bench.host_breakdown(pf, call, hidden.device)

    assert set(breakdown) == {"prepare", "finalize"}
    collective = "all-to-all (equal)" if max_tokens_per_rank else "all-to-all (variable)"
    expected_prepare = {"check the call", "source rows, small fields packed", "send-row kernel", collective,
                        "received fields as views", "local prepare"}
    if max_tokens_per_rank is None:
        expected_prepare.add("counts all-to-all")
    assert expected_prepare <= set(breakdown["prepare"])
    assert {collective, "combine kernel"} <= set(breakdown["finalize"])
    for steps in breakdown.values():
        assert all(v >= 0 for k, v in steps.items() if k != "rest")
        assert steps["total"] > 0
        assert sum(v for k, v in steps.items() if k != "total") == pytest.approx(steps["total"])
    # nothing left wrapped: the module's names, the classes' methods (inherited ones not shadowed), the P/F's own
    assert {name: getattr(all2all, name) for name in originals} == originals
    assert "_check_call" not in vars(AllToAllPrepareFinalize) and "_source" not in vars(AllToAllPrepareFinalize)
    assert LocalPrepareFinalize.prepare.__qualname__ == "LocalPrepareFinalize.prepare"
    assert "prepare" not in vars(pf) and "finalize" not in vars(pf)
    call()  # and the P/F still computes: one rank, its own experts' (already reduced) rows come back as they were
    assert torch.equal(output, hidden)
