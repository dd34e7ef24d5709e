"""One rank of the dispatch/combine test: each all-to-all P/F's launches counted, and its result against float64.

    python tests/distributed/dispatch_worker.py OUT_DIR

``test_dispatch_combine.py`` starts it on 2 and 4 ranks over gloo, with
``TRITON_INTERPRET=1`` (the Triton kernels run on the CPU tensors, as on CUDA) or
without (the torch operations that stand in for them off CUDA). For each case
(variable all-to-all, the same P/F with fixed blocks of ``max_tokens_per_rank``
rows ("capped": no host read), and the fixed-capacity batched all-to-all; bf16
rows, and FP8 per-token and 1x128 group rows quantized while packing) the rank calls prepare and finalize three
times with fresh tokens and routings; the last call is counted: every torch
operation that computes (views and allocations are not launches), every
collective, and every Triton launch, for prepare and for finalize apart. The
"experts" are exact: each slot of local expert e returns (global id of e + 1)
times its dequantized row, so the combined output must be, per token,
sum_j w_j * (e_j + 1) * x_j dequantized, which is checked in float64 with the
output poisoned (NaN) first and the unused slab rows of the fixed path poisoned
too. Results go to ``OUT_DIR/results.rank{r}.json``.
"""

from __future__ import annotations

import contextlib
import json
import sys
import traceback
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))

from moe_fsm.distributed import ExpertPlacement, destroy, init_from_env, rank_trace_path  # noqa: E402
from moe_fsm.kernels import fp8  # noqa: E402
from moe_fsm.modular.interfaces import DynamicFP8RowQuantizer, WeightAndReduce  # noqa: E402
from moe_fsm.prepare_finalize import wire_kernels  # noqa: E402
from moe_fsm.prepare_finalize.all2all import AllToAllPrepareFinalize  # noqa: E402
from moe_fsm.prepare_finalize.fixed_all2all import FixedCapacityAllToAllPrepareFinalize  # noqa: E402

NUM_EXPERTS, HIDDEN, TOP_K, CAPACITY = 16, 192, 4, 12  # 192 columns: the last 1x128 group is short
CASES = [("variable", "none"), ("variable", "token"), ("variable", "group"),
         ("capped", "none"), ("capped", "token"), ("capped", "group"),
         ("fixed", "none"), ("fixed", "token"), ("fixed", "group")]
CALLS = 3

# Operations that launch nothing on a GPU: views, shape changes, allocations, reads of metadata.
NOT_LAUNCHES = {
    "view", "_unsafe_view", "reshape", "slice", "select", "as_strided", "t", "transpose", "unsqueeze", "squeeze",
    "expand", "alias", "detach", "empty", "empty_strided", "empty_like", "new_empty", "lift_fresh", "split",
    "split_with_sizes", "unbind", "chunk", "narrow", "view_as", "_reshape_alias", "sym_size", "sym_stride",
    "sym_numel", "sym_storage_offset", "is_same_size", "_has_compatible_shallow_copy_type", "resize_",
}


class LaunchCounter(TorchDispatchMode):
    """Counts the torch operations that compute (by name) while active, except inside a counted Triton launch."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()
        self.triton: Counter = Counter()
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.paused and name not in NOT_LAUNCHES:
            self.ops[f"{func.namespace}.{name}"] += 1
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def pause(self):
        self.paused, was = True, self.paused
        try:
            yield
        finally:
            self.paused = was

    def total(self) -> int:
        return sum(self.ops.values()) + sum(self.triton.values())


class CountedKernel:
    """Stands in for one interpreted kernel: counts ``kernel[grid](...)`` and hides the interpreter's own torch work."""

    def __init__(self, kernel, name: str, counters: list) -> None:
        self.kernel, self.name, self.counters = kernel, name, counters

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            counter = self.counters[0]
            if counter is None:
                return launch(*args, **kwargs)
            counter.triton[f"triton.{self.name}"] += 1
            with counter.pause():
                return launch(*args, **kwargs)

        return run


def count_triton_launches(counters: list) -> None:
    if not wire_kernels.kernels_apply(torch.zeros(1)):
        return
    module = wire_kernels._kernel_module(True)
    for name in dir(module):
        if name.endswith("_kernel"):
            setattr(module, name, CountedKernel(getattr(module, name), name, counters))


def quantizer(kind: str):
    if kind == "token":
        return DynamicFP8RowQuantizer("token", fp8.quantize_per_token)
    if kind == "group":
        return DynamicFP8RowQuantizer("group", fp8.quantize_per_group)
    return None


def dequantized(x: torch.Tensor, kind: str) -> torch.Tensor:
    """float64 rows as the experts see them: x itself, or x quantized by the torch quantizer and dequantized."""
    if kind == "none":
        return x.double()
    q, scale = quantizer(kind)(x)
    return fp8.dequantize_activation(q, scale, torch.float64)


def fake_experts(prepared, placement: ExpertPlacement, kind: str, fixed: bool, out_dtype: torch.dtype) -> torch.Tensor:
    """Each slot of local expert e: (global id + 1) x its dequantized row; unused slab rows NaN."""
    if prepared.hidden.dtype == torch.float8_e4m3fn:
        rows = fp8.dequantize_activation(prepared.hidden, prepared.scale, torch.float32)
    else:
        rows = prepared.hidden.to(torch.float32)
    if fixed:
        factor = torch.arange(placement.local_start, placement.local_end, dtype=torch.float32) + 1
        out = rows * factor.view(-1, 1, 1)
        used = torch.arange(out.shape[1]).view(1, -1) < prepared.expert_num_tokens.view(-1, 1).long()
        return out.masked_fill(~used.unsqueeze(-1), float("nan")).to(out_dtype)
    ids = prepared.topk_ids.long()  # local ids, -1: another rank computes the slot
    factor = torch.where(ids >= 0, ids + placement.local_start + 1, torch.zeros_like(ids)).to(torch.float32)
    return (rows.unsqueeze(1) * factor.unsqueeze(-1)).to(out_dtype)  # [R, top_k, K], unweighted


def run_case(mode: str, kind: str, rank: int, world: int, counters: list) -> dict:
    placement = ExpertPlacement(NUM_EXPERTS, world, rank)
    expert_map = placement.expert_map(torch.device("cpu"))
    fixed = mode == "fixed"
    if fixed:
        pf = FixedCapacityAllToAllPrepareFinalize(placement, max_tokens_per_rank=CAPACITY)
        reduce = WeightAndReduce.BATCHED
    else:
        pf = AllToAllPrepareFinalize(placement, max_tokens_per_rank=CAPACITY if mode == "capped" else None)
        reduce = WeightAndReduce.CONTIGUOUS
    gen = torch.Generator().manual_seed(1000 * world + 10 * rank + CASES.index((mode, kind)))
    worst, counts = 0.0, None
    for call in range(CALLS):
        tokens = CAPACITY - 4 * ((rank + call) % 3)  # ranks and calls differ in size
        x = (torch.randn(tokens, HIDDEN, generator=gen) * 3).to(torch.bfloat16)
        hot = call == 1  # every token picks expert 0 (distinct ids per token, as routers give)
        ids = torch.stack([torch.cat([torch.zeros(1, dtype=torch.long), torch.randperm(NUM_EXPERTS - 1, generator=gen)[: TOP_K - 1] + 1])
                           if hot else torch.randperm(NUM_EXPERTS, generator=gen)[:TOP_K] for _ in range(tokens)]).to(torch.int32)
        weights = torch.rand(tokens, TOP_K, generator=gen) + 0.1
        output = torch.full((tokens, HIDDEN), float("nan"), dtype=torch.bfloat16)
        counter = LaunchCounter() if call == CALLS - 1 else None
        counters[0] = counter
        with counter if counter is not None else contextlib.nullcontext():
            prepared = pf.prepare(x, weights, ids, num_experts=NUM_EXPERTS, expert_map=expert_map,
                                  apply_router_weight_on_input=False, quantize=quantizer(kind))
        counters[0] = None
        prepare_counts = counter and (dict(counter.ops), dict(counter.triton), counter.total())
        expert_output = fake_experts(prepared, placement, kind, fixed, torch.bfloat16)
        counter = LaunchCounter() if call == CALLS - 1 else None
        counters[0] = counter
        with counter if counter is not None else contextlib.nullcontext():
            pf.finalize(output, expert_output, prepared, topk_weights=prepared.topk_weights,
                        topk_ids=prepared.topk_ids, apply_router_weight_on_input=False, reduce=reduce)
        counters[0] = None
        if counter is not None:
            counts = {"prepare": prepare_counts, "finalize": (dict(counter.ops), dict(counter.triton), counter.total())}
        expect = (dequantized(x, kind).unsqueeze(1) * (weights.double() * (ids.double() + 1)).unsqueeze(-1)).sum(1)
        scale = max(float(expect.abs().max()), 1e-12)
        worst = max(worst, float((output.double() - expect).abs().max()) / scale)
    return {"scenario": f"{mode}-{kind}", "rank": rank, "err": worst, "counts": counts}


def main(argv: list[str]) -> int:
    out_dir = Path(argv[0])
    ctx = init_from_env()
    counters: list = [None]
    count_triton_launches(counters)
    results, status = [], 0
    try:
        for mode, kind in CASES:
            try:
                results.append(run_case(mode, kind, ctx.rank, ctx.world_size, counters))
            except Exception:
                results.append({"scenario": f"{mode}-{kind}", "rank": ctx.rank, "error": traceback.format_exc(limit=8)})
                status = 1
                break
    finally:
        path = rank_trace_path(out_dir / "results.json", ctx.rank)
        path.write_text(json.dumps({"rank": ctx.rank, "world": ctx.world_size, "results": results}, indent=1))
        destroy()
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
