"""The main job: load a model preset, run every MoE layer, check it against float64.

Weights are random from a seed (no downloads) and quantized the way the
checkpoint would ship them; each layer's output is compared with the float64
reference computed on the weights the kernel actually holds (dequantized), so
the relative error measures the kernel, not the quantization of the weights.
Layers are chained (x <- rmsnorm(x + moe(x))) like a model's residual stream.

What makes the default run take seconds, not minutes, on a CPU: layers of one
configuration (same MoELayer) share one draw of weights (drawing and
quantizing DeepSeek-V3's 256 experts takes seconds per layer), and the float64
reference checks a sample of each layer's rows (every row with
``check_rows=None``, the CLI's ``--full-check``). A layer's time is the median
of ``repeats`` calls, after one warm-up call the first time a kernel meets a
shape. Non-finite outputs are counted and fail the layer where the reference
row is finite (a NaN token must not poison the rest of the batch).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

import torch

from moe_fsm.backends.build_plan import SUBSTITUTE
from moe_fsm.engine.engine import Engine, LoadedLayer, route
from moe_fsm.engine.presets import ModelPreset
from moe_fsm.errors import InputError
from moe_fsm.experts.torch_experts import torch_dtype
from moe_fsm.inputs.env import EnvSnapshot
from moe_fsm.inputs.parallel import ParallelConfig
from moe_fsm.inputs.platform import PlatformFacts
from moe_fsm.inputs.quant import QuantFamily
from moe_fsm.inputs.request import BackendRequest
from moe_fsm.trace.manifest import layer_number
from moe_fsm.kernels.reference import moe_reference
from moe_fsm.modular.interfaces import ExpertScales
from moe_fsm.plan.decider import DEFAULT_TRACE_DIR
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
# A quantized layer computed with 16-bit activations (weight-only schemes, and the layers a weight-only kernel such as
# vLLM's Marlin runs): only the dequantized weights' products and the compute dtype's rounding remain.
WEIGHT_ONLY_TOLERANCE = 2e-2


def tolerance(layer) -> float:
    """The relative error a correct kernel computing ``layer`` (as built: ``ModularKernel.layer``) stays under."""
    if layer.family is not QuantFamily.UNQUANTIZED and layer.quant.activation is None:
        return min(WEIGHT_ONLY_TOLERANCE, TOLERANCE[(layer.family, layer.dtype)])
    return TOLERANCE[(layer.family, layer.dtype)]


DEFAULT_CHECK_ROWS = 16
DEFAULT_REPEATS = 3


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
    checked_rows: int = 0
    nonfinite_rows: int = 0  # output rows with a NaN/Inf where the reference row is finite
    call: str = "eager"  # how the timed and checked calls ran: "eager", or "cuda_graph" (replays of one capture)

    @property
    def ok(self) -> bool:
        return self.rel_error <= self.tolerance and self.nonfinite_rows == 0


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


class WeightBank:
    """One draw of weights per layer configuration: layers with equal MoELayer share it."""

    def __init__(self, generator: torch.Generator, device: torch.device) -> None:
        self.generator = generator
        self.device = device
        self._drawn: dict = {}

    def __call__(self, layer, sample: torch.Tensor) -> LayerWeights:
        if layer not in self._drawn:
            self._drawn[layer] = make_weights(layer, self.generator, self.device, sample)
        return self._drawn[layer]

    @property
    def draws(self) -> int:
        return len(self._drawn)


def rms_norm(x: torch.Tensor) -> torch.Tensor:
    xf = x.to(torch.float32)
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


@dataclass(frozen=True)
class RunOptions:
    """How thoroughly each layer is checked and timed (see the module docstring)."""

    check_rows: Optional[int] = DEFAULT_CHECK_ROWS  # None: every row
    repeats: int = DEFAULT_REPEATS

    def __post_init__(self) -> None:
        if self.check_rows is not None and (isinstance(self.check_rows, bool) or not isinstance(self.check_rows, int) or self.check_rows < 1):
            raise InputError(f"check_rows must be a positive integer or None (every row), got {self.check_rows!r}")
        if isinstance(self.repeats, bool) or not isinstance(self.repeats, int) or not 1 <= self.repeats <= 1000:
            raise InputError(f"repeats must be an integer from 1 to 1000, got {self.repeats!r}")


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
    options: RunOptions = RunOptions(),
    progress=None,
    policy: Optional[str] = None,
    strict_build: bool = False,
    speed_table=None,
) -> tuple[Engine, list[LayerResult]]:
    """Load (decide + build) and run ``num_layers`` layers of ``model``; one row per layer.

    A decided kernel moe-fsm cannot load here runs as its stand-in (``backends.stand_ins``), named in the
    row's kernel column and the trace's build section; ``strict_build`` refuses stand-ins and substitutes instead.
    ``speed_table``: a measured table or its path, for a profile that orders by one (None: this device's, if any).
    """
    specs = list(model.layers[: num_layers or len(model.layers)])
    engine = Engine(
        specs, parallel=parallel, request=request, env=env if env is not None else EnvSnapshot.from_process(),
        platform=platform, trace_dir=trace_dir, policy=policy if policy is not None else model.policy,
        strict_build=strict_build, device=torch.device(device).type, speed_table=speed_table,
    )
    loaded = engine.load()
    dev = torch.device(device)
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, specs[0].layer.hidden_size, generator=generator)
    bank = WeightBank(generator, dev)
    timer = KernelTimer(options.repeats)
    results = []
    for index, layer_state in enumerate(loaded):
        layer = layer_state.spec.layer
        x = hidden.to(torch_dtype(layer.dtype)).to(dev)
        weights = bank(layer, x)
        topk_weights, topk_ids = route(x, weights.router, layer.top_k)
        out, result = run_layer(index, layer_state, x, weights, topk_weights, topk_ids, options=options, timer=timer)
        results.append(result)
        hidden = rms_norm(x + out).to(torch.float32).cpu()
        if progress is not None:
            progress(index + 1, len(loaded), layer_state.spec.name, result)
    return engine, results


def run_layer(index: int, layer_state: LoadedLayer, x, weights: LayerWeights, topk_weights, topk_ids, *,
              shard: Optional[tuple] = None, expert_map=None, options: RunOptions = RunOptions(),
              timer: Optional["KernelTimer"] = None, capture=None) -> tuple[torch.Tensor, "LayerResult"]:
    """Run one layer's kernel on ``x`` and check it against the float64 reference.

    ``shard`` is this rank's (w1, w2, scales) when experts are spread over ranks;
    the reference always uses every expert, since the layer's output must not
    depend on where its experts live. ``capture`` as for :class:`KernelTimer`: the timed and checked calls are
    then replays of a CUDA graph (the row's ``call`` says which ran).
    """
    layer = layer_state.spec.layer
    w1, w2, scales = shard if shard is not None else (weights.w1, weights.w2, weights.scales)
    kernel = layer_state.kernel
    call = lambda: kernel(x, w1, w2, topk_weights, topk_ids, scales=scales, expert_map=expert_map)
    timer = timer or KernelTimer(options.repeats)
    out, elapsed = timer(call, key=(id(kernel), tuple(x.shape[1:]), x.dtype), on_cuda=x.is_cuda, capture=capture)
    rows = check_rows(x.shape[0], options.check_rows, seed=index)
    ref = moe_reference(
        x.cpu()[rows], weights.w1_ref, weights.w2_ref, topk_weights.cpu()[rows], topk_ids.cpu()[rows],
        activation=layer.activation.value, swiglu_limit=layer.swiglu_limit,
        apply_router_weight_on_input=layer.router_weight_on_input,
        w1_bias=None if weights.scales.w1_bias is None else weights.scales.w1_bias.cpu(),
        w2_bias=None if weights.scales.w2_bias is None else weights.scales.w2_bias.cpu(),
    )
    err, nonfinite = compare(out.cpu()[rows], ref)
    return out, _row(index, layer_state, elapsed, err, checked_rows=len(rows), nonfinite_rows=nonfinite,
                     call="cuda_graph" if timer.replayed else "eager")


def check_rows(total: int, sample: Optional[int], *, seed: int) -> torch.Tensor:
    """The rows the reference checks: all of them, or ``sample`` of them drawn from ``seed`` (sorted)."""
    if sample is None or sample >= total:
        return torch.arange(total)
    picked = torch.randperm(total, generator=torch.Generator().manual_seed(seed))[:sample]
    return picked.sort().values


def compare(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, int]:
    """(relative error over the rows whose reference is finite, rows non-finite in ``out`` but not in ``ref``)."""
    if not ref.numel():
        return 0.0, 0
    ref_ok = torch.isfinite(ref).all(dim=-1)
    out = out.double()
    bad = int((ref_ok & ~torch.isfinite(out).all(dim=-1)).sum())
    good = ref_ok & torch.isfinite(out).all(dim=-1)
    if not bool(good.any()):
        return 0.0, bad
    diff = torch.linalg.norm(out[good] - ref[good])
    return float(diff / torch.linalg.norm(ref[good]).clamp_min(1e-30)), bad


class KernelTimer:
    """Median of ``repeats`` calls; one warm-up call the first time a kernel meets a shape.

    The key leaves the token count out, so ranks holding different numbers of
    tokens still make the same number of calls (each call may be a collective).

    The first timed call's output is the one checked and passed on: every call
    computes the same thing, and the first is what a model would have used.

    ``capture`` (a GPU run, where every rank replays in step): after the warm-up, ``capture(call)`` returns a
    replay of ``call`` captured in a CUDA graph (or None where it could not capture it); the timed calls are then
    replays, whose output is the graph's, the same tensor each time (identical calls on identical inputs).
    ``replayed`` says whether the last layer's timed calls were replays.
    """

    def __init__(self, repeats: int = DEFAULT_REPEATS) -> None:
        self.repeats = repeats
        self._warm: set = set()
        self.replayed = False

    def __call__(self, call, *, key, on_cuda: bool, capture=None):
        if key not in self._warm:
            call()  # first-call allocations, lazy initialization, kernel compilation
            self._warm.add(key)
        replay = capture(call) if capture is not None else None
        self.replayed = replay is not None
        call = replay or call
        times, out = [], None
        for _ in range(self.repeats):
            if on_cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            result = call()
            if on_cuda:
                torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e3)
            out = result if out is None else out
        return out, statistics.median(times)


def kernel_text(decision, stand_in) -> str:
    """The table's kernel column: what ran, and the decided kernel beside it wherever moe-fsm built something else
    (a profile's substitute, or a stand-in), so the table never passes a stand-in off as the decision."""
    if stand_in is not None:
        return stand_in.describe(decision.kernel or decision.backend)
    if decision.plan.how == SUBSTITUTE:
        decided = f"{decision.kernel} decided" if decision.kernel else "left to the platform"
        return f"{decided}; runs as {decision.runner} (substitute)"
    return decision.runner or "-"


def _row(index: int, layer_state: LoadedLayer, elapsed_ms: float, err: float, *, checked_rows: int,
         nonfinite_rows: int, call: str = "eager") -> LayerResult:
    decision, layer = layer_state.decision, layer_state.spec.layer
    return LayerResult(
        index=layer_number(layer_state.spec.name, index),  # the decoder layer, as the trace file and plan number it
        name=layer_state.spec.name,
        family=layer.family.value,
        backend=decision.backend,
        kernel=kernel_text(decision, layer_state.stand_in),
        prepare_finalize=decision.prepare_finalize.name,
        time_ms=elapsed_ms,
        rel_error=err,
        tolerance=tolerance(getattr(layer_state.kernel, "layer", layer)),
        cached=layer_state.cached,
        checked_rows=checked_rows,
        nonfinite_rows=nonfinite_rows,
        call=call,
    )
