"""Tune the weight-quantized Triton MoE's tiles of one layer on this GPU (what ``moe-fsm tune`` runs for them).

A layer here is one rank's ``MoELayer`` as its experts compute it (a weight-only stand-in's takes 16-bit
activations) and the experts class the runtime builds for it (``TritonMxfp4Experts``, ``TritonNvfp4Experts``,
``TritonWna16Experts``), which says how the kernels read the weights (SPLIT nibbles, activation order,
``tl.dot_scaled``). The candidates (``candidate_wq_configs``) are ``WqConfig`` tiles: the tile an untuned shape gets
(``default_wq_config``) first, the tile the tables serve now, then row blocks, weight-row and reduction tiles, warps and
stages per token count, and at decode counts each thin tile in one pass and split along K (``split_k``/
``w2_split_k`` from ``decode_split_k`` for that tile, and twice that).

Each candidate first runs in a child process (``screen.screen_and_time``, ``try_wq_candidate``) on a two-expert copy
of the layer with a time limit, and must come within 2e-2 (relative) of float64 on the dequantized weights; the
rest are timed as the whole layer (alignment, both GEMMs with the dequantization, the split-K passes and the top-k
sum) in CUDA graphs replaying R routings, L2 flushed per replay, as the 16-bit tuner times its layers. The winner
per token count goes into the user's weight-quantized table (``tables.write_user_table``), which the runtime reads
over the shipped one. The kernels specialize on neither the expert count nor the batch size, so the child's
compilation is Triton's on-disk cache for the main process.
"""

from __future__ import annotations

import importlib
import json
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Optional

import torch

from moe_fsm.inputs.layer import MoELayer
from moe_fsm.kernels.triton_moe.screen import TuneReport, screen_and_time
from moe_fsm.kernels.triton_wq.fused import (
    FALLBACK_SM_COUNT, MAX_SPLIT_K, WeightQuant, WqConfig, decode_split_k, default_wq_config, fused_wq_experts,
    get_wq_config, relayout_nibbles, sort_act_order, table_key,
)

TOLERANCE = 2e-2  # relative Frobenius error against float64 a candidate may have (the kernels measure 2-4e-3)
REFERENCE_TOKENS = 16  # tokens of a trial checked against float64

# (block_n, block_k, num_warps, num_stages) of 16-row decode tiles: the default's, thinner and wider weight-row
# tiles, deeper and shallower pipelines, longer reduction steps (bench/bench_weight_quantized.py's decode grid)
DECODE_TILES = ((64, 128, 4, 4), (32, 128, 4, 4), (64, 256, 4, 3), (64, 64, 4, 6), (64, 128, 4, 6),
                (128, 128, 8, 4), (32, 256, 4, 4))
# (block_m, block_n, block_k, num_warps, num_stages) for 17-96 pairs per expert
MID_TILES = ((32, 64, 128, 4, 4), (64, 64, 128, 4, 3), (64, 128, 128, 8, 3), (32, 128, 128, 4, 3),
             (64, 64, 128, 4, 4), (64, 128, 64, 8, 4))
# prefill: more than 96 pairs per expert, grouped row blocks (group_m 8) for L2 reuse of the weight tiles
PREFILL_TILES = ((128, 128, 64, 8, 3), (128, 64, 128, 4, 3), (128, 128, 128, 8, 3), (64, 128, 128, 8, 3),
                 (128, 64, 128, 4, 4), (64, 64, 128, 4, 3), (128, 256, 64, 8, 3))


@dataclass(frozen=True)
class WqLayerShape:
    """One rank's weight-quantized layer as its experts compute it, and the experts class (``module:Class``)."""

    layer: MoELayer
    experts: str

    def build(self):
        """The experts object the runtime builds (no weights: it says how the kernels read them)."""
        module, _, name = self.experts.partition(":")
        return getattr(importlib.import_module(module), name)(self.layer)

    @property
    def quant(self) -> WeightQuant:
        return WeightQuant.for_scheme(self.layer.quant)

    def key(self) -> str:
        """The table key the runtime looks this layer up by."""
        layer = self.layer
        return table_key(self.quant, layer.num_experts, layer.intermediate_size, layer.hidden_size, layer.top_k,
                         self.build().use_scaled_dot)


def wq_shape_label(shape: WqLayerShape) -> str:
    layer, quant = shape.layer, shape.quant
    group = "channel" if quant.group == -1 else f"g{quant.group}"
    extras = [name for name, on in (("zero points", quant.zero_point), ("act-order", quant.act_order),
                                    ("biases", layer.bias)) if on]
    return (f"E={layer.num_experts} N={layer.intermediate_size} K={layer.hidden_size} top-{layer.top_k} "
            f"{quant.kind} {group}{''.join(', ' + e for e in extras)} {layer.dtype} "
            f"({shape.experts.rpartition(':')[2]})")


def _splits(tile: WqConfig, pairs: int, num_experts: int, n: int, k: int, sm_count: int) -> list[tuple[int, int]]:
    """(w1, w2) K slices offered for a decode tile: one pass, the rule's count for this tile, and twice that."""
    w1_n, w1_k = tile.gemm("w1")[:2]
    w2_n, w2_k = tile.gemm("w2")[:2]
    w1_tiles, w2_tiles = -(-k // w1_k), -(-n // w2_k)
    w1 = decode_split_k(pairs, num_experts, -(-n // w1_n), w1_tiles, sm_count)
    w2 = decode_split_k(pairs, num_experts, -(-k // w2_n), w2_tiles, sm_count)
    doubled = (min(2 * w1, MAX_SPLIT_K, max(1, w1_tiles // 2)), min(2 * w2, MAX_SPLIT_K, max(1, w2_tiles // 2)))
    return list(dict.fromkeys([(1, 1), (w1, w2), doubled]))


def candidate_wq_configs(num_tokens: int, top_k: int, num_experts: int, n: int, k: int, *,
                         sm_count: int = FALLBACK_SM_COUNT, served: Optional[WqConfig] = None,
                         kind: Optional[str] = None, quant: Optional[WeightQuant] = None) -> list[WqConfig]:
    """The tiles tried at one token count: the default first (the reference, what an untuned shape of format
    ``kind`` (stored as ``quant``) runs), the tile the tables serve now (``served``), then the grid of the count's
    row-block size (split along K at decode counts)."""
    default = default_wq_config(num_tokens, top_k, num_experts, n, k, sm_count, kind, quant=quant)
    found = [default] + ([served] if served is not None else [])
    per_expert = num_tokens * top_k / max(num_experts, 1)
    if per_expert <= 16:
        for block_n, block_k, warps, stages in DECODE_TILES:
            tile = WqConfig(16, block_n, block_k, warps, stages)
            for w1, w2 in _splits(tile, num_tokens * top_k, num_experts, n, k, sm_count):
                found.append(replace(tile, split_k=w1, w2_split_k=w2))
    else:
        tiles, group_m = (MID_TILES, 1) if per_expert <= 96 else (PREFILL_TILES, 8)
        found += [WqConfig(*tile, group_m=group_m) for tile in tiles]
        if per_expert > 96:
            # the bf16 Hopper path (hit experts dequantized into a scratch; its GEMM tiles are the bf16 experts'):
            # the default rule takes it from PREFILL_ROWS_PER_EXPERT pairs an expert, the tuner tries it below too
            found.append(WqConfig(*PREFILL_TILES[0], group_m=8, hopper_bf16=True))
    return list(dict.fromkeys(found))


def quantized_weights(shape: WqLayerShape, num_experts: int, seed: int):
    """(w1q, w2q, scales): random N(0, 1/K) / N(0, 1/N) experts quantized to the layer's scheme on the GPU, 16
    experts at a time, with biases where the layer has them."""
    from moe_fsm.modular.interfaces import ExpertScales
    from moe_fsm.quantize.weights import quantize_weights

    layer = shape.layer
    k, n = layer.hidden_size, layer.intermediate_size
    gen = torch.Generator(device="cuda").manual_seed(seed)
    parts = []
    for first in range(0, num_experts, 16):
        count = min(16, num_experts - first)
        w1 = torch.randn(count, 2 * n, k, device="cuda", generator=gen).mul_(k**-0.5)
        w2 = torch.randn(count, k, n, device="cuda", generator=gen).mul_(n**-0.5)
        parts.append(quantize_weights(w1, w2, layer.quant))
        del w1, w2
    fields = {f: (None if getattr(parts[0][2], f) is None else torch.cat([getattr(p[2], f) for p in parts]))
              for f in vars(parts[0][2])}
    if layer.bias:
        dtype = getattr(torch, layer.dtype)
        fields["w1_bias"] = torch.randn(num_experts, 2 * n, device="cuda", generator=gen).mul_(0.1).to(dtype)
        fields["w2_bias"] = torch.randn(num_experts, k, device="cuda", generator=gen).mul_(0.1).to(dtype)
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]), ExpertScales(**fields)


def kernel_arguments(shape: WqLayerShape, w1q, w2q, scales) -> dict:
    """fused_wq_experts' weight arguments as the experts class hands them: activation-ordered columns sorted by
    group, 4-bit codes in the SPLIT layout where it uses it (the build-time re-layout, made once here)."""
    experts = shape.build()
    quant = experts.quant

    def kernel_weight(w, g_idx):
        perm = None
        if quant.act_order:
            w, perm = sort_act_order(w, g_idx, quant)
        return (relayout_nibbles(w) if experts.split else w), perm

    w1, w1_perm = kernel_weight(w1q, scales.w1_g_idx)
    w2, w2_perm = kernel_weight(w2q, scales.w2_g_idx)
    nvfp4 = quant.kind == "nvfp4"
    layer = shape.layer
    return dict(
        w1=w1, w2=w2, quant=quant, w1_scale=scales.w1_scale, w2_scale=scales.w2_scale,
        w1_zero_point=scales.w1_zero_point, w2_zero_point=scales.w2_zero_point, w1_perm=w1_perm, w2_perm=w2_perm,
        w1_global_scale=scales.w1_global_scale if nvfp4 else None,
        w2_global_scale=scales.w2_global_scale if nvfp4 else None,
        w1_bias=scales.w1_bias, w2_bias=scales.w2_bias, activation=layer.activation.value,
        swiglu_limit=layer.swiglu_limit, split=experts.split, scaled_dot=experts.use_scaled_dot,
    )


def layer_fn(arguments: dict, config: Optional[WqConfig]) -> Callable:
    """fn(x, topk_weights, topk_ids) -> the layer's output with this tile (None: the runtime's table lookup)."""
    w1, w2 = arguments["w1"], arguments["w2"]
    rest = {name: value for name, value in arguments.items() if name not in ("w1", "w2")}
    return lambda x, g, ids: fused_wq_experts(x, w1, w2, g, ids, config=config, **rest)


def try_wq_candidate(candidate: tuple[WqLayerShape, int, WqConfig]) -> None:
    """A screening trial (run in a child process): the tile computes the layer on a two-expert copy at its token
    count, finite and within ``TOLERANCE`` of float64 on the dequantized weights for up to 16 tokens; raises
    otherwise."""
    from moe_fsm.kernels.reference import moe_reference
    from moe_fsm.quantize.weights import dequantize_weights

    shape, num_tokens, config = candidate
    layer = shape.layer
    w1q, w2q, scales = quantized_weights(shape, 2, seed=7)
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    x = torch.randn(num_tokens, layer.hidden_size, device="cuda", dtype=getattr(torch, layer.dtype), generator=gen)
    # top-k slots over two experts repeat them, as a larger layer's slots share none: the kernels take both
    ids = torch.randint(0, 2, (num_tokens, layer.top_k), device="cuda", dtype=torch.int32, generator=gen)
    g = torch.rand(num_tokens, layer.top_k, device="cuda", generator=gen)
    g = g / g.sum(1, keepdim=True)
    out = layer_fn(kernel_arguments(shape, w1q, w2q, scales), config)(x, g, ids)
    torch.cuda.synchronize()
    sample = torch.randperm(num_tokens, device="cuda", generator=gen)[:REFERENCE_TOKENS]
    w1f, w2f = dequantize_weights(w1q, w2q, scales, layer.quant, torch.float64)
    expected = moe_reference(x[sample], w1f, w2f, g[sample], ids[sample], activation=layer.activation.value,
                             swiglu_limit=layer.swiglu_limit, w1_bias=scales.w1_bias, w2_bias=scales.w2_bias)
    got = out[sample].double()
    diff = float((got - expected).norm() / expected.norm().clamp(min=1e-30))
    if not bool(torch.isfinite(out).all()) or not diff <= TOLERANCE:
        raise ValueError(f"wrong layer: {diff:.2e} relative difference from float64 on the dequantized weights")


def describe_wq_candidate(candidate: tuple[WqLayerShape, int, WqConfig]) -> str:
    shape, num_tokens, config = candidate
    return f"{wq_shape_label(shape)} T={num_tokens} {json.dumps(config.to_json(), sort_keys=True)}"


def tune_wq_shape(
    shape: WqLayerShape, plan: dict[int, list[WqConfig]], *, rep_ms: float = 30.0, deadline: Optional[float] = None,
    log: Callable[[str], None] = print,
) -> tuple[dict[int, WqConfig], dict[int, float], list[tuple[int, WqConfig]]]:
    """``triton_moe.tuning.time_plan`` on a weight-quantized layer of ``shape`` (random weights quantized on the
    GPU; the tables' entry as the runtime serves it now)."""
    from moe_fsm.kernels.triton_moe._runtime import device_name
    from moe_fsm.kernels.triton_moe.tuning import time_plan

    layer = shape.layer
    arguments = kernel_arguments(shape, *quantized_weights(shape, layer.num_experts, seed=0))
    device = device_name(torch.device("cuda", torch.cuda.current_device()))
    sm_count = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    timed = time_plan(plan, lambda config: layer_fn(arguments, config), num_experts=layer.num_experts,
                      top_k=layer.top_k, hidden=layer.hidden_size, dtype=layer.dtype,
                      served=lambda num_tokens: served_wq_config(shape, num_tokens, device, sm_count),
                      describe=lambda config: json.dumps(config.to_json(), sort_keys=True), rep_ms=rep_ms,
                      deadline=deadline, log=log)
    del arguments
    torch.cuda.empty_cache()
    return timed


def served_wq_config(shape: WqLayerShape, num_tokens: int, device: str, sm_count: int) -> WqConfig:
    """The tile the runtime serves this layer now: its tables' entry nearest in token count, else the default."""
    layer = shape.layer
    return get_wq_config(device, shape.quant, layer.num_experts, layer.intermediate_size, layer.hidden_size,
                         layer.top_k, num_tokens, shape.build().use_scaled_dot, sm_count)


def tune_and_write_wq(
    shapes: list[WqLayerShape], tokens: list[int], *, workers: int = 8, directory=None,
    log: Callable[[str], None] = print, budget_s: Optional[float] = None, candidate_timeout_s: float = 120.0,
    trial: Callable = try_wq_candidate, time_shape: Optional[Callable] = None, device: Optional[str] = None,
    sm_count: Optional[int] = None,
) -> TuneReport:
    """Tune each weight-quantized layer's tiles on the current device and merge the winners into the user's
    table (``tables.write_user_table``) as each layer ends. Screening, budget and timing as ``screen_and_time``
    runs them; ``trial``, ``time_shape`` (shape, plan, deadline), ``device`` and ``sm_count`` default to this
    GPU's (tests pass their own)."""
    from moe_fsm.kernels.triton_wq.tables import write_user_table

    start = time.monotonic()
    if device is None:
        from moe_fsm.kernels.triton_moe._runtime import device_name

        device = device_name(torch.device("cuda", torch.cuda.current_device()))
    if sm_count is None:
        sm_count = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    if time_shape is None:
        def time_shape(shape, plan, deadline):
            return tune_wq_shape(shape, plan, deadline=deadline, log=log)

    plans = {}
    for shape in shapes:
        layer = shape.layer
        plans[shape] = {t: candidate_wq_configs(t, layer.top_k, layer.num_experts, layer.intermediate_size,
                                                layer.hidden_size, sm_count=sm_count,
                                                served=served_wq_config(shape, t, device, sm_count),
                                                kind=shape.quant.kind, quant=shape.quant) for t in tokens}
    count = len({(s, t, c) for s, plan in plans.items() for t, cs in plan.items() for c in cs})
    log(f"tuning {len(shapes)} weight-quantized layer(s) x {len(tokens)} token count(s) on {device}: {count} tile "
        f"candidates (split-K at decode counts), screening in {workers} process(es)"
        + (f", budget {budget_s:.0f} s" if budget_s else ""))

    def write(shape: WqLayerShape, best: dict) -> Path:
        return write_user_table(device, shape.key(), {t: c.to_json() for t, c in best.items()}, directory)

    return screen_and_time(plans, trial, time_shape, write, workers=workers, candidate_timeout_s=candidate_timeout_s,
                           budget_s=budget_s, start=start, log=log, describe=describe_wq_candidate,
                           name=WqLayerShape.key)
