"""The multi-process scenarios: what each rank runs and checks, shared by the tests and the rank worker.

Every rank builds the same global batch and weights from a seed, takes its own
tokens (or, for EP without DP, all of them) and its own part of the weights,
runs the layer through the prepare/finalize that ``choose_prepare_finalize``
picks and ``build_prepare_finalize`` builds, and compares its rows with

* the float64 reference over the whole batch (``moe_reference`` on the
  dequantized weights), and
* where the quantization is row-wise (so splitting the batch cannot change it),
  the single-process modular kernel on the whole batch with the same experts.

Shapes are tiny so that both world sizes run every scenario in seconds on two cores.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Optional

import torch

from moe_fsm.distributed import ExpertPlacement, all_gather_v, all_to_all_v, exchange_sizes, reduce_scatter_v
from moe_fsm.distributed import shard_experts, shard_intermediate
from moe_fsm.experts.torch_experts import TorchBatchedExperts, TorchExperts
from moe_fsm.inputs.layer import MoELayer
from moe_fsm.inputs.parallel import ParallelConfig
from moe_fsm.inputs.quant import QuantScheme
from moe_fsm.kernels.reference import moe_reference
from moe_fsm.modular.interfaces import ActivationFormat, ExpertScales
from moe_fsm.modular.kernel import ModularKernel
from moe_fsm.prepare_finalize.all2all import AllToAllPrepareFinalize
from moe_fsm.prepare_finalize.choice import build_prepare_finalize, choose_prepare_finalize
from moe_fsm.prepare_finalize.local import LocalBatchedPrepareFinalize, LocalPrepareFinalize
from moe_fsm.prepare_finalize.transport import quantize_before_communication
from moe_fsm.quantize.weights import dequantize_weights, quantize_experts

NUM_EXPERTS = 10  # 5+5 on two ranks, 3+3+2+2 on four: the uneven split is exercised
HIDDEN = 64
INTERMEDIATE = 32

QUANT = {
    "none": QuantScheme.unquantized,
    "fp8_block_group": lambda: QuantScheme.fp8("block", "group"),
    "fp8_channel_token": lambda: QuantScheme.fp8("channel", "token"),
    "fp8_tensor_static": lambda: QuantScheme.fp8("tensor", "tensor", static_activation=True),
    "fp8_tensor_dynamic": lambda: QuantScheme.fp8("tensor", "tensor"),
    "nvfp4": QuantScheme.nvfp4,
}

# Relative error (max |out - expected| / max |expected|) allowed against the float64
# reference: float32 math, bf16 storage, or activation quantization (the reference
# sees unquantized activations; e4m3 keeps 3 mantissa bits, e2m1 one). The strict
# check for quantized runs is the one-process comparison below.
REF_TOL = {"float32": 2e-5, "bfloat16": 2e-2}
REF_TOL_QUANT = {"fp8": 0.1, "nvfp4": 0.3}
# Against the single-process kernel with identical quantization: only the order of
# float32 sums and (bf16) the rounding of per-rank partial sums differ. On CUDA the
# GEMMs of different batch sizes may round differently, which can move a re-quantized
# intermediate by one fp8/fp4 step, so quantized runs there get a looser bound.
LOCAL_TOL = {"float32": 2e-6, "bfloat16": 1.6e-2}
LOCAL_TOL_CUDA = {"float32": 1e-5, "bfloat16": 1.6e-2}
LOCAL_TOL_CUDA_QUANT = 3e-2

_A2A = {"standard": "AllToAllPrepareFinalize", "batched": "FixedCapacityAllToAllPrepareFinalize"}
MODES = {
    # mode: (parallel config for a world of W, the P/F class the choice must name for each format)
    "agrs": (lambda w: ParallelConfig(dp_size=w), dict.fromkeys(_A2A, "AllGatherReduceScatterPrepareFinalize")),
    "agrs_ep": (lambda w: ParallelConfig(dp_size=w, ep_size=w), dict.fromkeys(_A2A, "AllGatherReduceScatterPrepareFinalize")),
    "a2a": (lambda w: ParallelConfig(dp_size=w, ep_size=w, all2all="torch_all2all"), _A2A),
    # the variable-size all-to-all in the batched format, which the choice does not pick: built directly
    "a2a_var": (lambda w: ParallelConfig(dp_size=w, ep_size=w, all2all="torch_all2all"), _A2A),
    "ep_reduce": (lambda w: ParallelConfig(ep_size=w), dict.fromkeys(_A2A, "ExpertParallelReducePrepareFinalize")),
}


@dataclass(frozen=True)
class Scenario:
    """One distributed run. ``tokens[r]``: rank r's token count (EP-reduce: every rank holds ``tokens[0]``)."""

    name: str
    mode: str
    fmt: str
    quant: str
    tokens: tuple[int, ...]
    routing: str = "random"  # random | one_rank (every token to the last rank's experts) | skewed | hot
    dtype: str = "float32"
    top_k: int = 2
    on_input: bool = False
    seed: int = 0
    capacity: Optional[int] = None  # max_num_tokens given to build_prepare_finalize

    def layer(self) -> MoELayer:
        return MoELayer(
            quant=QUANT[self.quant](),
            num_experts=NUM_EXPERTS,
            top_k=self.top_k,
            hidden_size=HIDDEN,
            intermediate_size=INTERMEDIATE,
            router_weight_on_input=self.on_input,
            dtype=self.dtype,
        )

    @property
    def row_wise_quant(self) -> bool:
        """True when splitting the batch over ranks cannot change any quantized value.

        Dynamic per-tensor scales depend on the whole batch; and without EP each
        rank holds a slice of N, so per-token/per-group re-quantization of the
        intermediate sees a different row.
        """
        if self.quant == "fp8_tensor_dynamic":
            return False
        return self.mode != "agrs" or self.quant in ("none", "fp8_tensor_static")


def scenarios(world: int) -> list[Scenario]:
    uneven = (0, 7) if world == 2 else (6, 0, 3, 9)
    even = (4,) * world
    out: list[Scenario] = []

    def add(mode: str, fmt: str, quant: str, tokens: tuple[int, ...], **kw) -> None:
        tag = "-".join([mode, fmt, quant] + [f"{k}={v}" for k, v in sorted(kw.items())])
        out.append(Scenario(tag, mode, fmt, quant, tokens, **kw))

    for mode in MODES:
        for fmt in ("standard", "batched"):
            if mode != "a2a_var" or fmt == "batched":
                add(mode, fmt, "none", uneven)
    for mode, fmt in (("a2a", "standard"), ("a2a", "batched"), ("agrs_ep", "standard"), ("ep_reduce", "batched")):
        add(mode, fmt, "none", uneven, routing="one_rank")
    add("a2a", "standard", "none", even, routing="skewed")
    add("agrs", "batched", "none", even, routing="skewed")
    add("a2a", "standard", "none", (0,) * world, routing="random", seed=1)
    add("a2a", "batched", "none", uneven, dtype="bfloat16")
    add("agrs", "standard", "none", uneven, dtype="bfloat16")
    for mode, fmt in (("a2a", "standard"), ("a2a", "batched"), ("agrs_ep", "standard"), ("agrs_ep", "batched"), ("ep_reduce", "standard")):
        add(mode, fmt, "fp8_block_group", uneven)
    add("a2a", "standard", "fp8_block_group", uneven, dtype="bfloat16")
    add("agrs", "standard", "fp8_channel_token", uneven)
    add("agrs", "batched", "fp8_channel_token", even)
    add("a2a", "standard", "fp8_tensor_static", uneven)
    add("a2a", "batched", "fp8_tensor_dynamic", uneven)
    add("agrs_ep", "standard", "fp8_tensor_dynamic", uneven)
    add("a2a", "standard", "nvfp4", uneven)
    add("agrs_ep", "batched", "nvfp4", uneven)
    add("a2a", "standard", "none", uneven, top_k=1, on_input=True)
    add("agrs", "standard", "fp8_channel_token", uneven, top_k=1, on_input=True)
    add("a2a", "batched", "fp8_block_group", uneven, routing="one_rank")
    # Hot experts (every token picks expert 0, most pick expert 1 too: rank 0 computes nearly every pair),
    # zero-token ranks, and the fixed-capacity dispatch filled to its capacity.
    for fmt in ("standard", "batched"):
        add("a2a", fmt, "none", uneven, routing="hot")
        add("a2a", fmt, "fp8_block_group", uneven, routing="hot", dtype="bfloat16")
    add("a2a", "batched", "none", (0,) * world, seed=1)
    add("a2a", "batched", "none", uneven, routing="hot", capacity=max(uneven))
    add("a2a", "batched", "nvfp4", uneven)
    add("a2a", "batched", "none", uneven, top_k=1, on_input=True)
    add("a2a_var", "batched", "fp8_block_group", uneven, routing="hot")
    return out


def scenario_by_name(world: int) -> dict[str, Scenario]:
    return {s.name: s for s in scenarios(world)}


def _routing(s: Scenario, total: int, gen: torch.Generator, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct top-k experts per token, and positive weights."""
    if s.routing == "one_rank":
        last = ExpertPlacement(NUM_EXPERTS, world, world - 1)
        allowed = torch.arange(last.local_start, last.local_end)
    else:
        allowed = torch.arange(NUM_EXPERTS)
    scores = torch.rand(total, allowed.numel(), generator=gen)
    if s.routing == "skewed":
        scores[:, 0] += 0.9  # most tokens pick expert 0
    elif s.routing == "hot":
        scores[:, 0] += 2.0  # every token picks expert 0
        scores[:, 1] += 0.8  # and most pick expert 1
    ids = allowed[scores.argsort(dim=1, descending=True)[:, : s.top_k]].to(torch.int32)
    weights = torch.rand(total, s.top_k, generator=gen) + 0.1
    weights = (weights / weights.sum(dim=1, keepdim=True)).to(torch.float32)
    return ids, weights


def run_scenario(s: Scenario, rank: int, world: int, device: torch.device) -> dict:
    """Run ``s`` on this rank and return the errors it measured (relative to max |expected|)."""
    layer = s.layer()
    dtype = getattr(torch, s.dtype)
    gen = torch.Generator().manual_seed(1234 + s.seed)
    ep_reduce = s.mode == "ep_reduce"
    total = s.tokens[0] if ep_reduce else sum(s.tokens)
    x_all = torch.randn(total, HIDDEN, generator=gen).to(dtype)
    ids_all, w_all = _routing(s, total, gen, world)
    w1 = torch.randn(NUM_EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=gen) * 0.2
    w2 = torch.randn(NUM_EXPERTS, HIDDEN, INTERMEDIATE, generator=gen) * 0.2
    calib = torch.randn(32, HIDDEN, generator=gen)
    w1q, w2q, scales = quantize_experts(w1.to(dtype) if layer.quant.weight is None else w1, w2.to(dtype) if layer.quant.weight is None else w2, layer, sample=calib)

    # Expected: float64 reference on the weights as stored, and the one-process kernel.
    w1d, w2d = dequantize_weights(w1q, w2q, scales, layer.quant, torch.float64)
    ref_all = moe_reference(x_all, w1d, w2d, w_all, ids_all, activation=layer.activation.value,
                            apply_router_weight_on_input=layer.router_weight_on_input)
    fmt = ActivationFormat(s.fmt)
    experts_cls = TorchExperts if fmt is ActivationFormat.STANDARD else TorchBatchedExperts
    local_pf = LocalPrepareFinalize() if fmt is ActivationFormat.STANDARD else LocalBatchedPrepareFinalize()
    one_process = ModularKernel(local_pf, experts_cls(layer), layer)(
        x_all.to(device), w1q.to(device), w2q.to(device), w_all.to(device), ids_all.to(device), scales=_to(scales, device)
    ).cpu()

    # This rank's tokens and weights.
    if ep_reduce:
        rows = slice(0, total)
    else:
        start = sum(s.tokens[:rank])
        rows = slice(start, start + s.tokens[rank])
    parallel_for, expected_names = MODES[s.mode]
    expected_name = expected_names[s.fmt]
    parallel = parallel_for(world)
    rank_layer = layer
    expert_map: Optional[torch.Tensor] = None
    if s.mode == "agrs":
        w1r, w2r, scales_r = shard_intermediate(w1q, w2q, scales, intermediate_size=INTERMEDIATE, rank=rank, world_size=world)
        rank_layer = replace(layer, intermediate_size=INTERMEDIATE // world)
    else:
        placement = ExpertPlacement(NUM_EXPERTS, world, rank)
        w1r, w2r, scales_r = shard_experts(w1q, w2q, scales, placement)
        expert_map = placement.expert_map(device)

    choice = choose_prepare_finalize(parallel, fmt)
    if choice.name != expected_name:
        raise AssertionError(f"choice named {choice.name}, expected {expected_name}: {choice.reason}")
    if s.mode == "a2a_var":
        pf = AllToAllPrepareFinalize(
            ExpertPlacement(NUM_EXPERTS, world, rank), activation_format=fmt, quantize_first=quantize_before_communication(layer.quant)
        )
    else:
        pf = build_prepare_finalize(choice, parallel, NUM_EXPERTS, quant=layer.quant, max_num_tokens=s.capacity)
        if pf.name != choice.name:
            raise AssertionError(f"the choice names {choice.name} but build_prepare_finalize built {pf.name}")
    kernel = ModularKernel(pf, experts_cls(rank_layer), rank_layer)

    out = kernel(
        x_all[rows].to(device),
        w1r.to(device),
        w2r.to(device),
        w_all[rows].to(device),
        ids_all[rows].to(device),
        scales=_to(scales_r, device),
        expert_map=expert_map,
    ).cpu()

    ref, local = ref_all[rows], one_process[rows]
    denom = max(float(ref_all.abs().max()) if ref_all.numel() else 0.0, 1e-12)
    family = layer.quant.family.value
    ref_tol = REF_TOL_QUANT[family] if family in REF_TOL_QUANT else REF_TOL[s.dtype]
    result = {
        "scenario": s.name,
        "rank": rank,
        "rows": out.shape[0],
        "dtype_ok": out.dtype == dtype and tuple(out.shape) == (rows.stop - rows.start, HIDDEN),
        "ref_err": float((out.double() - ref).abs().max()) / denom if out.numel() else 0.0,
        "ref_tol": ref_tol,
        "local_err": None,
        "local_tol": None,
        "pf": pf.name,
        "reason": choice.reason,
    }
    if s.row_wise_quant:
        result["local_err"] = float((out.double() - local.double()).abs().max()) / denom if out.numel() else 0.0
        if device.type != "cuda":
            result["local_tol"] = LOCAL_TOL[s.dtype]
        else:
            result["local_tol"] = LOCAL_TOL_CUDA_QUANT if family in REF_TOL_QUANT else LOCAL_TOL_CUDA[s.dtype]
    return result


def _to(scales: ExpertScales, device: torch.device) -> ExpertScales:
    return ExpertScales(**{k: None if v is None else v.to(device) for k, v in vars(scales).items()})


def run_collectives(rank: int, world: int, device: torch.device) -> dict:
    """all-gather-v / reduce-scatter-v / all-to-all-v on uneven sizes with a zero, fp8 payload included."""
    sizes_all = [(r * 3) % 5 for r in range(world)]  # 0, 3, 1, 4: rank 0 holds nothing
    mine = sizes_all[rank]
    sizes = exchange_sizes(mine, device=device)
    ok = sizes == sizes_all
    base = sum(sizes_all[:rank])
    rows = (torch.arange(base, base + mine, dtype=torch.float32, device=device)[:, None] * torch.ones(1, 3, device=device))
    gathered = all_gather_v(rows.to(torch.float8_e4m3fn), sizes)
    expect = torch.arange(sum(sizes_all), dtype=torch.float32, device=device)[:, None] * torch.ones(1, 3, device=device)
    ok &= torch.equal(gathered.to(torch.float32), expect.to(torch.float8_e4m3fn).to(torch.float32))
    # every rank contributes (rank + 1) * expect; the sum over ranks is W(W+1)/2 * expect
    reduced = reduce_scatter_v(expect * (rank + 1), sizes)
    ok &= torch.allclose(reduced, expect[base : base + mine] * (world * (world + 1) / 2))
    # all-to-all-v: rank r sends (r + d) rows of value 100r + d to rank d
    send = [rank + d for d in range(world)]
    recv = [s + rank for s in range(world)]
    payload = torch.cat([torch.full((n, 2), 100.0 * rank + d, device=device) for d, n in enumerate(send)])
    got = all_to_all_v(payload, send, recv)
    want = torch.cat([torch.full((n, 2), 100.0 * s + rank, device=device) for s, n in enumerate(recv)])
    ok &= torch.equal(got, want)
    return {"scenario": "collectives", "rank": rank, "ok": bool(ok)}


def result_ok(result: dict) -> tuple[bool, str]:
    """Whether one rank's result passes, and a line saying why not."""
    if "error" in result:
        return False, result["error"]
    if result["scenario"] == "collectives":
        return result["ok"], "collectives mismatch"
    problems = []
    if not result["dtype_ok"]:
        problems.append("wrong output dtype or shape")
    if result["ref_err"] > result["ref_tol"]:
        problems.append(f"reference error {result['ref_err']:.3g} > {result['ref_tol']:.3g}")
    if result["local_err"] is not None and result["local_err"] > result["local_tol"]:
        problems.append(f"one-process kernel error {result['local_err']:.3g} > {result['local_tol']:.3g}")
    return not problems, "; ".join(problems)


def scenario_json(s: Scenario) -> dict:
    return asdict(s)
