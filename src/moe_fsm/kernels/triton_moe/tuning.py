"""Tune the Triton fused-MoE configs of one layer shape on this GPU (what ``moe-fsm tune`` runs).

Each candidate config is timed as the whole layer (alignment, both GEMMs, the
activation quantization and the top-k sum) captured in a CUDA graph that replays
the layer on R different routings, L2 flushed before each replay: decode buckets
are then ranked as they run in a serving engine, launch gaps included, which
timing each GEMM alone does not do. The winner per token count goes into the
user's config directory (``config.write_user_table``), which the runtime reads
before the shipped tables.

Every candidate first runs in a worker process (``screen.screen_and_time``, ``try_candidate``) on a
copy of the shape with two experts, with a time limit: a tile that does not build, computes
a wrong layer, crashes or hangs is refused there and never timed or written. That also
compiles the kernels in parallel: they specialize on strides, dtypes and the config, never
on the expert count, so Triton's on-disk cache then serves the main process. (``precompile``
does the compiling alone, for the benchmarks.)

``moe-fsm tune`` takes the shapes from its flags, a preset or a model's ``config.json``
(``cli/tune_cmd.py``); ``budget_s`` bounds a run.
"""

from __future__ import annotations

import itertools
import json
import math
import multiprocessing as mp
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import torch

from moe_fsm.kernels.triton_moe.config import (
    FP8_GROUP, GemmConfig, MoEConfig, default_config, gluon_pair_config, validate_config, vllm_tile_config,
)
from moe_fsm.kernels.triton_moe.fused import Fp8Spec, fused_experts
from moe_fsm.kernels.triton_moe.screen import TuneReport, screen_and_time

FP8_ACTIVATION = {"tensor": "tensor", "channel": "token", "block": "group"}


@dataclass(frozen=True)
class LayerShape:
    """What a table entry is keyed by, plus top-k (which sets rows per expert)."""

    num_experts: int
    intermediate: int  # N
    hidden: int  # K
    top_k: int
    dtype: str = "bfloat16"
    fp8: Optional[str] = None  # None, "tensor", "channel" or "block"

    @property
    def spec(self) -> Optional[Fp8Spec]:
        return Fp8Spec(self.fp8, FP8_ACTIVATION[self.fp8]) if self.fp8 else None

    @property
    def expert_bytes(self) -> int:
        """One expert's gated w1 [2N, K] and w2 [K, N] as stored: one byte a weight in FP8, else two."""
        return 3 * self.intermediate * self.hidden * (1 if self.fp8 else 2)

    def with_experts(self, num_experts: int) -> "LayerShape":
        return LayerShape(num_experts, self.intermediate, self.hidden, self.top_k, self.dtype, self.fp8)


# the full-size layers the tables ship for (and the vLLM side-by-side benchmark's grid)
NAMED_SHAPES: dict[str, LayerShape] = {
    "qwen3-30b-a3b": LayerShape(128, 768, 2048, 8),
    "qwen3-30b-a3b-tp2": LayerShape(128, 384, 2048, 8),
    "qwen3-30b-a3b-tp4": LayerShape(128, 192, 2048, 8),
    "mixtral-8x7b": LayerShape(8, 14336, 4096, 2),
    "mixtral-8x7b-fp8-tensor": LayerShape(8, 14336, 4096, 2, fp8="tensor"),
    "qwen3-30b-a3b-fp8-channel": LayerShape(128, 768, 2048, 8, fp8="channel"),
    "deepseek-v3-fp8-block": LayerShape(256, 2048, 7168, 8, fp8="block"),
}
TOKENS = (1, 8, 32, 128, 512, 2048, 8192)


# Hopper (TMA) variants offered at row blocks of 64 and up: (w1 block_n, w2 block_n, warps, stages) tiles, each
# under (persistent, gather_input, paired, flatten) choices; the tiles and flags the 8192-token measurements of
# docs/perf/hopper.md found fastest on one shape or another
HOPPER_TILES = ((128, 256, 8, 4), (128, 256, 8, 3), (128, 128, 8, 3), (64, 128, 4, 4))
HOPPER_FLAGS = ((False, False, False, False), (True, False, True, False), (False, True, True, False),
                (True, True, True, False), (True, False, True, True))


# Gluon block-FP8 variants (MoEConfig.gluon) offered at row blocks of 64 and up: (block_m, warps, stages,
# group_m, warp-specialized, persistent), all w1 64 / w2 128 wide; the fastest of the 8192-token measurements
# of docs/perf/hopper.md ("The Gluon block-FP8 kernel"); 64-row blocks also in two warpgroups side by side
# (config.gluon_pair_config)
GLUON_TILES = ((128, 8, 4, 8, True, True), (128, 8, 4, 16, True, True), (128, 8, 5, 8, True, True),
               (128, 8, 5, 8, True, False), (64, 4, 4, 8, True, True))


def candidate_configs(shape: LayerShape, num_tokens: int, *, hopper: bool = False, gluon: bool = False,
                      device: str = "") -> list[MoEConfig]:
    """The default config first (``device``'s, as the runtime would run it untuned), then row blocks around the
    mean rows per expert times a few tiles each; with ``hopper`` (the device runs the TMA kernels) also TMA variants
    of the row blocks of 64 rows and more, and with ``gluon`` (it runs the Gluon kernel too) for block FP8 the Gluon
    variants there."""
    block_fp8 = shape.fp8 == "block"
    default = default_config(
        shape.num_experts, shape.intermediate, shape.hidden, shape.top_k, num_tokens, block_fp8=block_fp8,
        fp8=shape.fp8 is not None, device=device,
    )
    rows = num_tokens * shape.top_k / shape.num_experts
    if num_tokens == 1 or rows < 4:
        block_ms = [16]
    elif rows < 24:
        block_ms = [16, 32]
    elif rows < 96:
        block_ms = [32, 64]
    else:
        block_ms = [64, 128]
    fold = [False, True] if num_tokens * shape.top_k >= 4096 else [False]
    bk = 128 if shape.fp8 else 64
    out = [default]
    shipped = shipped_config(shape, num_tokens)
    if shipped is not None:
        out.append(shipped)
    for block_m in block_ms:
        thin = block_m <= 32
        if thin:
            tiles = [(32, 64, 128, 4, 4), (64, 64, 128, 4, 3), (32, 128, 128, 4, 3), (64, 128, 256 if not shape.fp8 else 128, 4, 3)]
            tiles += _decode_tiles(shape)
        else:
            tiles = [(64, 128, bk, 4, 3), (64, 128, bk, 8, 3), (64, 128, 128, 8, 4), (128, 128, bk, 8, 3), (64, 256, bk, 8, 3), (128, 256, bk, 8, 4)]
            if shape.fp8 in ("tensor", "channel") and block_m == 64:
                # between decode and prefill a layer still streams its weights: 256-wide FP8 K steps move what a
                # 128-wide bf16 step moves (vLLM's H100 table takes them for Mixtral FP8 at 128 tokens)
                tiles += [(64, 128, 256, 4, 2), (64, 128, 256, 4, 3), (128, 128, 256, 8, 2)]
        group_m = 1 if thin else (16 if block_m >= 128 else 8)
        swaps = [True, False] if thin else [False]
        for (n1, n2, k_step, warps, stages), f, swap in itertools.product(tiles, fold, swaps):
            if block_fp8:
                k_step = min(k_step, FP8_GROUP)
            out.append(
                MoEConfig(
                    block_m,
                    GemmConfig(n1, k_step, group_m, warps, stages, swap),
                    GemmConfig(n2, k_step, group_m, warps, stages, swap),
                    f,
                )
            )
    if hopper:
        out += _hopper_candidates(block_ms, bk)
    if gluon and block_fp8:
        out += [
            MoEConfig(block_m, GemmConfig(64, FP8_GROUP, group_m, warps, stages, persistent=pers, warp_specialize=ws),
                      GemmConfig(128, FP8_GROUP, group_m, warps, stages, persistent=pers, warp_specialize=ws),
                      False, True, True, True)
            for block_m, warps, stages, group_m, ws, pers in GLUON_TILES if block_m in block_ms
        ] + ([gluon_pair_config()] if 64 in block_ms else [])
    valid = []
    for c in dict.fromkeys(out):
        try:
            validate_config(c, block_fp8=block_fp8)
        except Exception:
            continue
        valid.append(c)
    return valid


def _hopper_candidates(block_ms: list[int], block_k: int) -> list[MoEConfig]:
    """TMA variants (``MoEConfig.hopper``) of the prefill row blocks; the TMA kernels need block_m >= 64."""
    out = []
    for block_m in (m for m in block_ms if m >= 64):
        group_m = 16 if block_m >= 128 else 8
        for (n1, n2, warps, stages), (persistent, gather, paired, flatten) in itertools.product(HOPPER_TILES, HOPPER_FLAGS):
            out.append(
                MoEConfig(
                    block_m,
                    GemmConfig(n1, block_k, group_m, warps, stages, persistent=persistent, paired=paired, flatten=flatten),
                    GemmConfig(n2, block_k, group_m, warps, stages, persistent=persistent, flatten=flatten),
                    False,
                    True,
                    gather,
                )
            )
    return out


def _decode_tiles(shape: LayerShape) -> list[tuple[int, int, int, int, int]]:
    """Thin-row-block tiles (w1 block_n, w2 block_n, block_k, warps, stages) for weight-streaming decode calls.

    A decode call is a stream of weights: what counts is enough programs for every SM (w1 columns 16 wide
    give a narrow layer, such as a TP4 shard's 192 columns, twice the programs of 32) and enough bytes in
    flight per program (deeper pipelines; for 1-byte FP8 weights, 256-wide K steps move what a 128-wide bf16
    step moves). Block-FP8 K steps stay at one 128-wide scale block (``validate_config``).
    """
    tiles = [(16, 64, 128, 4, 4), (16, 128, 128, 4, 4), (32, 64, 128, 4, 6)]
    if shape.fp8 in ("tensor", "channel"):
        tiles += [(16, 64, 256, 4, 4), (32, 64, 256, 4, 4), (32, 128, 256, 4, 4), (64, 64, 256, 4, 3)]
    return tiles


def shipped_config(shape: LayerShape, num_tokens: int) -> Optional[MoEConfig]:
    """The entry the package's table holds for this shape (on this GPU) nearest in token count, if any."""
    if not torch.cuda.is_available():
        return None
    from moe_fsm.kernels.triton_moe._runtime import device_name
    from moe_fsm.kernels.triton_moe.config import dtype_key, load_shipped_table, shape_key

    table = load_shipped_table(device_name(torch.device("cuda", torch.cuda.current_device())))
    entries = table.get(shape_key(shape.num_experts, shape.intermediate, shape.hidden, dtype_key(shape.dtype, shape.fp8)))
    if not entries:
        return None
    target = math.log2(max(num_tokens, 1))
    return MoEConfig.from_json(entries[min(entries, key=lambda m: (abs(math.log2(int(m)) - target), int(m)))])


def _tma_kernels_here() -> bool:
    from moe_fsm.kernels.triton_moe.hopper import tma_kernels_available

    return tma_kernels_available(torch.cuda.current_device())


def _gluon_kernels_here() -> bool:
    from moe_fsm.kernels.triton_moe.hopper import gluon_kernels_available

    return gluon_kernels_available(torch.cuda.current_device())


def make_weights(shape: LayerShape, device: str = "cuda", seed: int = 0, init: bool = True):
    """(w1, w2, w1_scale, w2_scale): random bf16/fp16 weights, or random FP8 values with random scales."""
    e, n, k = shape.num_experts, shape.intermediate, shape.hidden
    dtype = getattr(torch, shape.dtype)
    gen = torch.Generator(device=device).manual_seed(seed)

    def draw(*size, scale):
        t = torch.empty(*size, device=device, dtype=dtype)
        return t.normal_(0, scale, generator=gen) if init else t.zero_()

    if shape.fp8 is None:
        return draw(e, 2 * n, k, scale=k**-0.5), draw(e, k, n, scale=n**-0.5), None, None
    w1 = draw(e, 2 * n, k, scale=100.0).clamp_(-448, 448).to(torch.float8_e4m3fn)
    w2 = draw(e, k, n, scale=100.0).clamp_(-448, 448).to(torch.float8_e4m3fn)

    def scales(rows, cols, fan_in):
        size = {"tensor": (e,), "channel": (e, rows), "block": (e, -(-rows // FP8_GROUP), -(-cols // FP8_GROUP))}[shape.fp8]
        return (0.5 + torch.rand(size, device=device, generator=gen)) * (fan_in**-0.5 / 100)

    return w1, w2, scales(2 * n, k, k), scales(k, n, n)


def routings(num_tokens: int, num_experts: int, top_k: int, count: int, seed: int, device: str = "cuda"):
    """``count`` random top-k routings: distinct experts per token, normalized fp32 weights, int32 ids."""
    gen = torch.Generator(device=device).manual_seed(seed)
    out = []
    for _ in range(count):
        scores = torch.rand(num_tokens, num_experts, device=device, generator=gen)
        w, ids = scores.topk(top_k, dim=1)
        out.append(((w / w.sum(1, keepdim=True)).float(), ids.to(torch.int32)))
    return out


def layer_fn(shape: LayerShape, weights, config: Optional[MoEConfig], unsorted: Optional[bool] = None,
             sum_in_w2: Optional[bool] = None) -> Callable:
    """fn(x, topk_weights, topk_ids) -> the layer's output, with this config (None: the runtime's lookup), row
    layout (``fused_experts``'s ``unsorted``; None: its rule) and top-k sum (``sum_in_w2``; None: its rule)."""
    w1, w2, s1, s2 = weights
    spec = shape.spec
    kw = {} if spec is None else {"fp8": spec, "w1_scale": s1, "w2_scale": s2}
    return lambda x, g, ids: fused_experts(x, w1, w2, g, ids, config=config, unsorted=unsorted, sum_in_w2=sum_in_w2,
                                           **kw)


def replays_per_graph(num_tokens: int) -> int:
    """Routings per captured graph: enough that no call finds the previous call's experts in L2."""
    return 8 if num_tokens <= 32 else (4 if num_tokens <= 512 else 2)


def time_graph(fn: Callable, inputs: list, rep_ms: float = 50.0) -> float:
    """Median µs per call of a CUDA graph replaying fn on each input set once, L2 flushed per replay."""
    import triton.testing

    for args in inputs:
        fn(*args)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for args in inputs:
            fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for args in inputs:
            fn(*args)
    ms = triton.testing.do_bench(graph.replay, warmup=max(5.0, rep_ms / 4), rep=rep_ms, return_mode="median")
    del graph
    return float(ms) * 1e3 / len(inputs)


def _compile_jobs(jobs: list[tuple]) -> list[str]:
    """Worker: run each (shape, tokens, config JSON) once on a two-expert copy, so the kernels compile."""
    failures = []
    for shape_tuple, num_tokens, config_json in jobs:
        shape = LayerShape(*shape_tuple).with_experts(2)
        config = MoEConfig.from_json(config_json)
        try:
            weights = make_weights(shape, init=False)
            x = torch.zeros(num_tokens, shape.hidden, device="cuda", dtype=getattr(torch, shape.dtype))
            ids = torch.randint(0, 2, (num_tokens, shape.top_k), device="cuda", dtype=torch.int32)
            g = torch.full(ids.shape, 1.0 / shape.top_k, device="cuda")
            layer_fn(shape, weights, config)(x, g, ids)
            torch.cuda.synchronize()
        except Exception as exc:  # a config that cannot build is just not a candidate
            failures.append(f"{shape_tuple} T={num_tokens} {config_json}: {type(exc).__name__}: {str(exc)[:160]}")
    return failures


def precompile(
    jobs: list[tuple[LayerShape, int, MoEConfig]], workers: int, timeout_s: Optional[float] = None
) -> list[str]:
    """Compile every (shape, tokens, config) in ``workers`` processes; returns the failures.

    With ``timeout_s`` the workers are stopped after that long and the unfinished part is reported as one
    failure line (what they did compile stays in Triton's cache; the rest compiles on first use).
    """
    from dataclasses import astuple

    unique = dict.fromkeys((astuple(s), t, json.dumps(c.to_json(), sort_keys=True)) for s, t, c in jobs)
    payload = [(s, t, json.loads(c)) for s, t, c in unique]
    if not payload:
        return []
    chunks = [c for c in (payload[i::workers] for i in range(workers)) if c]
    with mp.get_context("spawn").Pool(len(chunks)) as pool:
        pending = pool.map_async(_compile_jobs, chunks)
        try:
            return list(itertools.chain.from_iterable(pending.get(timeout_s)))
        except mp.TimeoutError:
            pool.terminate()
            return [f"precompile stopped after {timeout_s:.0f} s ({len(payload)} jobs in {len(chunks)} workers)"]


def try_candidate(candidate: tuple[LayerShape, int, MoEConfig]) -> None:
    """A screening trial (``screen.screen`` runs it in a child process): the candidate computes the layer on a
    two-expert copy of the shape at its token count, finite and within 2e-2 (relative) of vLLM's tiles on the
    pointer-load kernels (``vllm_tile_config``, the plainest path); raises otherwise. The kernels specialize on
    strides, dtypes and the config, never on the expert count, so this also compiles them for the main process."""
    shape, num_tokens, config = candidate
    small = shape.with_experts(2)
    weights = make_weights(small, seed=7)
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    x = torch.randn(num_tokens, shape.hidden, device="cuda", dtype=getattr(torch, shape.dtype), generator=gen)
    # top-k slots over two experts repeat them, as a larger layer's slots share none: the kernels take both
    ids = torch.randint(0, 2, (num_tokens, shape.top_k), device="cuda", dtype=torch.int32, generator=gen)
    g = torch.rand(num_tokens, shape.top_k, device="cuda", generator=gen)
    g = g / g.sum(1, keepdim=True)
    reference = vllm_tile_config(2, num_tokens, block_fp8=shape.fp8 == "block", fp8=shape.fp8 is not None)
    expected = layer_fn(small, weights, reference)(x, g, ids).float()
    out = layer_fn(small, weights, config)(x, g, ids).float()
    torch.cuda.synchronize()
    diff = float((out - expected).norm() / expected.norm().clamp(min=1e-30))
    if not bool(torch.isfinite(out).all()) or not diff <= 2e-2:
        raise ValueError(f"wrong layer: {diff:.2e} relative difference from vLLM's tiles on the pointer-load kernels")


def describe_candidate(candidate: tuple[LayerShape, int, MoEConfig]) -> str:
    shape, num_tokens, config = candidate
    return f"{shape_label(shape)} T={num_tokens} {json.dumps(config.to_json(), sort_keys=True)}"


def shape_label(shape: LayerShape) -> str:
    quant = f"fp8 {shape.fp8}" if shape.fp8 else shape.dtype
    return f"E={shape.num_experts} N={shape.intermediate} K={shape.hidden} top-{shape.top_k} {quant}"


def time_plan(
    plan: Mapping[int, list], fn_for: Callable[[Any], Callable], *, num_experts: int, top_k: int, hidden: int,
    dtype: str, served: Callable[[int], Any], describe: Callable[[Any], str] = str, rep_ms: float = 30.0,
    deadline: Optional[float] = None, log: Callable[[str], None] = print, device: str = "cuda",
    timer: Callable[[Callable, list, float], float] = time_graph,
) -> tuple[dict[int, Any], dict[int, float], list[tuple[int, Any]]]:
    """The fastest of ``plan``'s screened candidates per token count, its time (µs per layer call), and the
    (tokens, candidate) the deadline left untimed: the timing half of every kernel family's tuner.

    ``fn_for(candidate)`` is the layer call fn(x, topk_weights, topk_ids) with that candidate. A count's first
    candidate (the default tile) is the reference a candidate's full-size output must match (relative 2e-2, finite)
    before its time counts; one that raises is skipped with its error. ``served(num_tokens)`` is the tile the
    runtime serves now, logged beside the best when it is not the default. ``device`` and ``timer`` are the GPU's
    (tests pass the CPU and their own timer)."""
    best: dict[int, Any] = {}
    best_us: dict[int, float] = {}
    untimed: list[tuple[int, Any]] = []
    for num_tokens, candidates in plan.items():
        routes = routings(num_tokens, num_experts, top_k, replays_per_graph(num_tokens), seed=num_tokens, device=device)
        gen = torch.Generator(device=device).manual_seed(num_tokens + 1)
        inputs = [(torch.randn(num_tokens, hidden, device=device, dtype=getattr(torch, dtype), generator=gen), g, ids)
                  for g, ids in routes]
        results = []
        expected = None
        for index, candidate in enumerate(candidates):
            if deadline is not None and time.monotonic() >= deadline and results:
                untimed += [(num_tokens, c) for c in candidates[index:]]
                break
            fn = fn_for(candidate)
            try:
                out = fn(*inputs[0]).float()
                if expected is None:
                    expected = out
                elif not bool(torch.isfinite(out).all()) or float((out - expected).norm() / expected.norm()) > 2e-2:
                    log(f"  T={num_tokens} wrong result at full size, dropped: {describe(candidate)}")
                    continue
                us = timer(fn, inputs, rep_ms)
            except Exception as exc:
                if device != "cpu":
                    torch.cuda.synchronize()
                log(f"  T={num_tokens} skip {describe(candidate)}: {type(exc).__name__}: {str(exc)[:120]}")
                continue
            results.append((us, candidate))
        if not results:
            continue
        results.sort(key=lambda r: r[0])
        best_us[num_tokens], best[num_tokens] = results[0]
        default_us = next((u for u, c in results if c == candidates[0]), float("nan"))
        now = served(num_tokens)
        served_us = next((u for u, c in results if c == now and c != candidates[0]), None)
        log(f"  T={num_tokens:5d}: best {results[0][0]:9.1f} us (default tile {default_us:9.1f} us"
            + (f", the tables' entry now {served_us:9.1f} us" if served_us is not None else "")
            + f", {len(results)} timed) {describe(results[0][1])}")
        del inputs, routes
    return best, best_us, untimed


def tune_shape(
    shape: LayerShape, plan: dict[int, list[MoEConfig]], *, rep_ms: float = 30.0, deadline: Optional[float] = None,
    log: Callable[[str], None] = print,
) -> tuple[dict[int, MoEConfig], dict[int, float], list[tuple[int, MoEConfig]]]:
    """``time_plan`` on a 16-bit or FP8 layer of ``shape`` (random weights; the shipped table's entry as served)."""
    weights = make_weights(shape)
    timed = time_plan(plan, lambda config: layer_fn(shape, weights, config), num_experts=shape.num_experts,
                      top_k=shape.top_k, hidden=shape.hidden, dtype=shape.dtype,
                      served=lambda num_tokens: shipped_config(shape, num_tokens), rep_ms=rep_ms, deadline=deadline,
                      log=log)
    del weights
    torch.cuda.empty_cache()
    return timed


def tune_and_write(
    shapes: list[LayerShape], tokens: list[int], *, workers: int = 8, directory=None, log: Callable[[str], None] = print,
    budget_s: Optional[float] = None, candidate_timeout_s: float = 120.0, trial: Callable = try_candidate,
) -> TuneReport:
    """Tune each shape on the current device, merging each result into the user's table as it comes.

    Every candidate of every shape first runs in a child process (``screen.screen_and_time``: ``workers``
    processes, at most ``candidate_timeout_s`` each): what fails, computes a wrong layer, crashes or hangs is
    refused and never timed. The rest are timed here. ``budget_s`` bounds the whole: screening stops starting
    trials at 60% of it (the default and shipped tiles of every count first), timing stops after it with the
    fastest so far.
    """
    import triton

    from moe_fsm.kernels.triton_moe._runtime import device_name
    from moe_fsm.kernels.triton_moe.config import dtype_key, shape_key, write_user_table

    start = time.monotonic()
    device = device_name(torch.device("cuda", torch.cuda.current_device()))
    hopper, gluon = _tma_kernels_here(), _gluon_kernels_here()
    plans = {s: {t: candidate_configs(s, t, hopper=hopper, gluon=gluon, device=device) for t in tokens} for s in shapes}
    count = len({(s, t, c) for s, plan in plans.items() for t, cs in plan.items() for c in cs})
    log(f"tuning {len(shapes)} shape(s) x {len(tokens)} token count(s) on {device}: {count} candidates "
        f"(pointer-load{', TMA' if hopper else ''}{', Gluon' if gluon else ''}), screening in {workers} process(es)"
        + (f", budget {budget_s:.0f} s" if budget_s else ""))

    def key(shape: LayerShape) -> str:
        return shape_key(shape.num_experts, shape.intermediate, shape.hidden, dtype_key(shape.dtype, shape.fp8))

    def write(shape: LayerShape, best: dict) -> Path:
        meta = {"torch": torch.__version__, "triton": triton.__version__, "generated_by": "moe-fsm tune"}
        return write_user_table(device, key(shape), best, meta, directory)

    return screen_and_time(
        plans, trial, lambda shape, plan, deadline: tune_shape(shape, plan, deadline=deadline, log=log), write,
        workers=workers, candidate_timeout_s=candidate_timeout_s, budget_s=budget_s, start=start, log=log,
        describe=describe_candidate, name=lambda shape: f"{key(shape)} top_k={shape.top_k}",
    )
