"""The main job: load a model preset, run every MoE layer, check it against float64.

Weights are random from a seed (no downloads) and quantized the way the
checkpoint would ship them; each layer's output is compared with the float64
reference computed on the weights the kernel actually holds (dequantized), so
the relative error measures the kernel, not the quantization of the weights.
Layers are chained (x <- rmsnorm(x + moe(x))) like a model's residual stream.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

import torch

from moe_fsm.engine.engine import DEFAULT_TRACE_DIR, Engine, LoadedLayer, route
from moe_fsm.engine.presets import ModelPreset
from moe_fsm.experts.torch_experts import torch_dtype
from moe_fsm.inputs.env import EnvSnapshot
from moe_fsm.inputs.parallel import ParallelConfig
from moe_fsm.inputs.platform import PlatformFacts
from moe_fsm.inputs.quant import QuantFamily
from moe_fsm.inputs.request import BackendRequest
from moe_fsm.kernels.reference import moe_reference
from moe_fsm.modular.interfaces import ExpertScales
from moe_fsm.quantize.weights import dequantize_weights, quantize_experts

# Relative error (||out - ref|| / ||ref||) a correct kernel stays under, per family and dtype.
# Quantized families also quantize activations (FP8 e4m3: ~3 significant bits after
# rounding; NVFP4 e2m1: ~1), which the reference does not; the bounds say so.
TOLERANCE = {
    (QuantFamily.UNQUANTIZED, "float32"): 1e-4,
    (QuantFamily.UNQUANTIZED, "float16"): 5e-3,
    (QuantFamily.UNQUANTIZED, "bfloat16"): 2e-2,
    (QuantFamily.FP8, "float32"): 8e-2,
    (QuantFamily.FP8, "float16"): 8e-2,
    (QuantFamily.FP8, "bfloat16"): 8e-2,
    (QuantFamily.NVFP4, "float32"): 2.5e-1,
    (QuantFamily.NVFP4, "float16"): 2.5e-1,
    (QuantFamily.NVFP4, "bfloat16"): 2.5e-1,
    # Weight-only formats (MXFP4 with 16-bit activations, WNA16) are judged on their dequantized weights,
    # so only the compute dtype's rounding remains; formats with quantized activations add theirs
    # (INT8: 7 bits; FP8/MXFP8: 3 mantissa bits; e2m1 activations: 1).
    **{(family, dtype): tol for family, tol in (
        (QuantFamily.INT_WNA16, 2e-2), (QuantFamily.MXFP8, 8e-2), (QuantFamily.INT8, 6e-2),
        (QuantFamily.W4A8, 8e-2), (QuantFamily.W4A8_INT8, 4e-2),
    ) for dtype in ("float32", "float16", "bfloat16")},
    # MXFP4 layers may quantize activations to e2m1 (w4a4): the NVFP4 bound.
    **{(QuantFamily.MXFP4, dtype): 2.5e-1 for dtype in ("float32", "float16", "bfloat16")},
}


@dataclass(frozen=True)
class LayerResult:
    index: int
    name: str
    family: str
    backend: str
    kernel: str
    prepare_finalize: str
    time_ms: float
    rel_error: float
    tolerance: float
    cached: bool

    @property
    def ok(self) -> bool:
        return self.rel_error <= self.tolerance


@dataclass
class LayerWeights:
    w1: torch.Tensor
    w2: torch.Tensor
    scales: ExpertScales
    w1_ref: torch.Tensor
    w2_ref: torch.Tensor
    router: torch.Tensor


def make_weights(layer, generator: torch.Generator, device: torch.device, sample: torch.Tensor) -> LayerWeights:
    """Random float experts, quantized to the layer's scheme, plus their dequantized float view."""
    e, n, k = layer.num_experts, layer.intermediate_size, layer.hidden_size
    w1 = torch.randn(e, 2 * n, k, generator=generator) / k**0.5
    w2 = torch.randn(e, k, n, generator=generator) / n**0.5
    router = torch.randn(e, k, generator=generator) / k**0.5
    dtype = torch_dtype(layer.dtype)
    if layer.family is QuantFamily.UNQUANTIZED:
        w1, w2 = w1.to(dtype), w2.to(dtype)
    w1q, w2q, scales = quantize_experts(w1, w2, layer, sample=sample.to(torch.float32).cpu())
    w1_ref, w2_ref = dequantize_weights(w1q, w2q, scales, layer.quant)
    if layer.bias:
        scales = replace(scales, w1_bias=(torch.randn(e, 2 * n, generator=generator) * 0.1).to(dtype),
                         w2_bias=(torch.randn(e, k, generator=generator) * 0.1).to(dtype))
    scales = ExpertScales(**{f: (v.to(device) if v is not None else None) for f, v in vars(scales).items()})
    return LayerWeights(w1q.to(device), w2q.to(device), scales, w1_ref, w2_ref, router.to(device))


def rms_norm(x: torch.Tensor) -> torch.Tensor:
    xf = x.to(torch.float32)
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


def run_model(
    model: ModelPreset,
    *,
    tokens: int = 64,
    num_layers: Optional[int] = None,
    device: str = "cpu",
    request: BackendRequest = BackendRequest(),
    env: Optional[EnvSnapshot] = None,
    platform: PlatformFacts,
    parallel: ParallelConfig = ParallelConfig(),
    trace_dir: Path = DEFAULT_TRACE_DIR,
    seed: int = 0,
    progress=None,
) -> tuple[Engine, list[LayerResult]]:
    """Load (decide + build) and run ``num_layers`` layers of ``model``; one row per layer."""
    specs = list(model.layers[: num_layers or len(model.layers)])
    engine = Engine(
        specs, parallel=parallel, request=request, env=env if env is not None else EnvSnapshot.from_process(),
        platform=platform, trace_dir=trace_dir,
    )
    loaded = engine.load()
    dev = torch.device(device)
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, specs[0].layer.hidden_size, generator=generator)
    results = []
    for index, layer_state in enumerate(loaded):
        layer = layer_state.spec.layer
        x = hidden.to(torch_dtype(layer.dtype)).to(dev)
        weights = make_weights(layer, generator, dev, x)
        topk_weights, topk_ids = route(x, weights.router, layer.top_k)
        out, result = run_layer(index, layer_state, x, weights, topk_weights, topk_ids)
        results.append(result)
        hidden = rms_norm(x + out).to(torch.float32).cpu()
        if progress is not None:
            progress(index + 1, len(loaded), layer_state.spec.name)
    return engine, results


def run_layer(index: int, layer_state: LoadedLayer, x, weights: LayerWeights, topk_weights, topk_ids, *,
              shard: Optional[tuple] = None, expert_map=None) -> tuple[torch.Tensor, "LayerResult"]:
    """Run one layer's kernel on ``x`` and check it against the float64 reference.

    ``shard`` is this rank's (w1, w2, scales) when experts are spread over ranks;
    the reference always uses every expert, since the layer's output must not
    depend on where its experts live.
    """
    layer = layer_state.spec.layer
    w1, w2, scales = shard if shard is not None else (weights.w1, weights.w2, weights.scales)
    kernel = layer_state.kernel
    call = lambda: kernel(x, w1, w2, topk_weights, topk_ids, scales=scales, expert_map=expert_map)
    out, elapsed = _timed(call, x.is_cuda)
    ref = moe_reference(
        x.cpu(), weights.w1_ref, weights.w2_ref, topk_weights.cpu(), topk_ids.cpu(),
        activation=layer.activation.value, swiglu_limit=layer.swiglu_limit,
        apply_router_weight_on_input=layer.router_weight_on_input,
        w1_bias=None if weights.scales.w1_bias is None else weights.scales.w1_bias.cpu(),
        w2_bias=None if weights.scales.w2_bias is None else weights.scales.w2_bias.cpu(),
    )
    err = float(torch.linalg.norm(out.cpu().double() - ref) / torch.linalg.norm(ref).clamp_min(1e-30)) if ref.numel() else 0.0
    return out, _row(index, layer_state, elapsed, err)


def _timed(call, on_cuda: bool):
    """One warm-up call (first-call allocations, lazy initialization), then one timed call."""
    call()
    if on_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = call()
    if on_cuda:
        torch.cuda.synchronize()
    return out, (time.perf_counter() - start) * 1e3


def _row(index: int, layer_state: LoadedLayer, elapsed_ms: float, err: float) -> LayerResult:
    decision, layer = layer_state.decision, layer_state.spec.layer
    return LayerResult(
        index=index,
        name=layer_state.spec.name,
        family=layer.family.value,
        backend=decision.backend,
        kernel=decision.runner or "-",
        prepare_finalize=decision.prepare_finalize.name,
        time_ms=elapsed_ms,
        rel_error=err,
        tolerance=TOLERANCE[(layer.family, layer.dtype)],
        cached=layer_state.cached,
    )
