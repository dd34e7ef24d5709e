"""Cost of one backend decision, and of deciding a 61-layer model.

Not a test: run it and read the table.

    python bench/bench_decision_cost.py            # the table, then each target of issue 8 met or not
    python bench/bench_decision_cost.py --corpus   # plus the first decision of every golden scenario (both profiles)
    python bench/bench_decision_cost.py --profile  # plus a cProfile of the worst case (FP8 on a CPU, warm, traced)

Per decision (median of many, in microseconds), with tracing on and off:
  warm   the same inputs again: the registry's verdict memo already holds every verdict;
  cold   a new registry, so every verdict is computed (the measure issue 8's figures and targets use);
  first  the first decision of a new layer in the process: a new registry, new input objects equal to
         the case's (built from its JSON, so nothing is hashed or derived yet), and moe-fsm's per-input
         caches emptied (``forget_input_caches``: inputs JSON, env readers, prepare/finalize choices).
The state machine itself is built once per process in every case (as in an engine), and a collection
runs before each measurement, so the garbage collector's timing does not land on one side.

Cases run under both policy profiles (``seeds``, the default without vLLM; ``vllm-0.33``); the
"worst" cases are FP8 on a CPU platform, where every FP8 backend is scanned before NONE.

The model rows decide a DeepSeek-V3-like model (61 MoE layers of one FP8 128x128-block
scheme on an H100 preset), and a mixed NVFP4+FP8 variant (the PR #43334 checkpoint shape:
40 NVFP4 and 21 per-tensor FP8 layers on GB10 with --backend nvfp4=flashinfer_b12x), either
with one decision per layer (the first one cold) or with an engine-style cache keyed by
DecisionInputs (one decision per distinct input, then dictionary hits). "cached lookup" is one
such hit: an engine's dictionary lookup with a freshly built, equal DecisionInputs.

Targets (issue 8, on the 2-core CPU machine): traced warm decision <= 40 us median for the typical
cases, <= 80 us for the worst case, cold <= 150 us, cached lookup <= 2 us, 61-layer model <= 1 ms cached.
The machine is shared: run it when it is quiet and read medians.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import statistics
import sys
import time
from dataclasses import replace

from moe_fsm import golden, profiles
from moe_fsm.backends.registry import Registry, default_registry
from moe_fsm.decision import DecisionInputs, decide, forget_input_caches, make_inputs
from moe_fsm.errors import SelectionError
from moe_fsm.fsm.machine import machine_for
from moe_fsm.inputs.layer import MoELayer
from moe_fsm.inputs.parallel import ParallelConfig
from moe_fsm.inputs.platform import preset
from moe_fsm.inputs.quant import QuantScheme

TARGETS_US = {"typical traced warm": 40.0, "worst traced warm": 80.0, "cold traced": 150.0, "cached lookup": 2.0,
              "61-layer model, cached": 1000.0}


def fresh_registry(profile: str) -> Registry:
    """A registry like the default one (built-ins + installed plugins) with an empty verdict memo."""
    registry = Registry.builtin_only(profile)
    registry.load_entry_points()
    return registry


def _decide(inputs: DecisionInputs, **kwargs):
    try:
        return decide(inputs, **kwargs)
    except SelectionError as err:
        return err


DEEPSEEK_FP8 = MoELayer(quant=QuantScheme.fp8("block", "group"), num_experts=256, top_k=8, hidden_size=7168,
                        intermediate_size=2048)

TYPICAL = {
    "fp8 block, sm90, auto": make_inputs(DEEPSEEK_FP8, None, "auto", {}, preset("sm90")),
    "unquantized, sm90, auto": make_inputs(MoELayer(), None, "auto", {}, preset("sm90")),
    "nvfp4, sm100, auto": make_inputs(MoELayer(quant=QuantScheme.nvfp4()), None, "auto", {}, preset("sm100")),
    "fp8 block, sm90, explicit triton": make_inputs(DEEPSEEK_FP8, None, "triton", {}, preset("sm90")),
    "fp8 on sm121, backend flashinfer_b12x (error)": make_inputs(
        MoELayer(quant=QuantScheme.fp8("tensor", "tensor", True)), None, "flashinfer_b12x", {}, preset("sm121")),
}
WORST = "fp8 block, cpu: every backend scanned, NONE (worst)"
CASES = {
    f"{profile:<9} {name}": replace(inputs, profile=profiles.choose(profile))
    for profile in (profiles.SEEDS, "vllm-0.33")
    for name, inputs in {**TYPICAL, WORST: make_inputs(DEEPSEEK_FP8, None, "auto", {}, preset("cpu"))}.items()
}


def median_us(samples_ns: list[int]) -> float:
    return statistics.median(samples_ns) / 1000.0


def time_warm(inputs: DecisionInputs, trace: bool, n: int) -> float:
    registry = default_registry(inputs.profile.name)
    _decide(inputs, registry=registry, trace=trace)  # fill the memo
    gc.collect()
    samples = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        _decide(inputs, registry=registry, trace=trace)
        samples.append(time.perf_counter_ns() - t0)
    return median_us(samples)


def time_cold(inputs: DecisionInputs, trace: bool, n: int, first: bool = False) -> float:
    """Each sample with a new registry; ``first``: also new equal inputs and per-input caches emptied."""
    registries = [fresh_registry(inputs.profile.name) for _ in range(n)]
    samples_inputs = [DecisionInputs.from_json(inputs.to_json()) if first else inputs for _ in range(n)]
    _decide(inputs, trace=trace)  # the per-input caches hold this input (emptied again below when ``first``)
    gc.collect()
    samples = []
    for registry, sample in zip(registries, samples_inputs):
        if first:
            forget_input_caches()
        t0 = time.perf_counter_ns()
        _decide(sample, registry=registry, trace=trace)
        samples.append(time.perf_counter_ns() - t0)
    return median_us(samples)


def time_corpus(n: int) -> list[tuple[float, str]]:
    """The traced first-decision median of every golden scenario, slowest last."""
    results = []
    for scenario in golden.load_scenarios():
        results.append((time_cold(scenario.inputs(), True, n, first=True), scenario.key))
    return sorted(results)


def time_lookup(inputs: DecisionInputs, n: int) -> float:
    """One cached lookup: a dict hit with a freshly built DecisionInputs equal to the cached one."""
    cache = {inputs: _decide(inputs)}
    samples = []
    for _ in range(n):
        fresh = replace(inputs)
        t0 = time.perf_counter_ns()
        cache.get(fresh)
        samples.append(time.perf_counter_ns() - t0)
    return median_us(samples)


def model_layers(mixed: bool) -> list[DecisionInputs]:
    if not mixed:
        inputs = make_inputs(DEEPSEEK_FP8, ParallelConfig(), "auto", {}, preset("sm90"))
        return [inputs] * 61
    request = {"nvfp4": "flashinfer_b12x"}
    nvfp4 = make_inputs(MoELayer(quant=QuantScheme.nvfp4(), num_experts=256, top_k=8, hidden_size=2048,
                                 intermediate_size=512), None, request, {}, preset("sm121"))
    fp8 = make_inputs(MoELayer(quant=QuantScheme.fp8("tensor", "tensor", True), num_experts=256, top_k=8,
                               hidden_size=2048, intermediate_size=512), None, request, {}, preset("sm121"))
    return [fp8 if i % 3 == 2 else nvfp4 for i in range(61)]


def time_model(layers: list[DecisionInputs], cached: bool, trace: bool, repeats: int) -> float:
    """Milliseconds to decide every layer, each repetition starting from an empty memo (and cache)."""
    samples = []
    for _ in range(repeats):
        registry = fresh_registry(layers[0].profile.name)
        t0 = time.perf_counter_ns()
        if cached:
            cache: dict[DecisionInputs, object] = {}
            for inputs in layers:
                decision = cache.get(inputs)
                if decision is None:
                    decision = cache[inputs] = _decide(inputs, registry=registry, trace=trace)
        else:
            for index, inputs in enumerate(layers):
                _decide(inputs, registry=registry, trace=trace, layer_name=f"model.layers.{index}.mlp.experts")
        samples.append(time.perf_counter_ns() - t0)
    return statistics.median(samples) / 1e6


def profile_worst(n: int = 3000, top: int = 18) -> str:
    inputs = CASES[f"{profiles.SEEDS:<9} {WORST}"]
    registry = default_registry(inputs.profile.name)
    _decide(inputs, registry=registry)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(n):
        _decide(inputs, registry=registry)
    profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out).strip_dirs().sort_stats("tottime")
    stats.print_stats(top)
    out.write("\n--- by cumulative time ---\n")
    stats.sort_stats("cumulative").print_stats(top)
    return out.getvalue()


def positive(text: str) -> int:
    """argparse type: a count of decisions, which a median needs at least one of."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 1, got {text!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=positive, default=2000, help="decisions per warm measurement (default 2000)")
    parser.add_argument("--cold-n", type=positive, default=400, help="decisions per cold measurement (default 400)")
    parser.add_argument("--repeats", type=positive, default=30, help="repetitions of each 61-layer model (default 30)")
    parser.add_argument("--corpus", action="store_true", help="also time the first decision of every golden scenario")
    parser.add_argument("--corpus-n", type=positive, default=15, help="first decisions timed per golden scenario (default 15)")
    parser.add_argument("--profile", action="store_true", help="also profile the worst case")
    args = parser.parse_args(argv)

    for profile in (profiles.SEEDS, "vllm-0.33"):
        for policy in default_registry(profile).profile.policies.values():
            machine_for(policy)  # built once per process, as in an engine
    import os
    import platform

    print(f"moe-fsm decision benchmark  (python {platform.python_version()}, {os.cpu_count()} CPUs, "
          f"median of {args.n} warm / {args.cold_n} cold decisions)\n")
    header = (f"{'one decision, traced / untraced (us)':<62} {'warm':>13} {'cold':>13} {'first':>13}")
    print(header)
    print("-" * len(header))
    typical_warm, worst_warm, cold, first = 0.0, 0.0, 0.0, 0.0
    for name, inputs in CASES.items():
        warm_t, warm_u = time_warm(inputs, True, args.n), time_warm(inputs, False, args.n)
        cold_t, cold_u = time_cold(inputs, True, args.cold_n), time_cold(inputs, False, args.cold_n)
        first_t, first_u = (time_cold(inputs, True, args.cold_n, first=True),
                            time_cold(inputs, False, args.cold_n, first=True))
        if name.endswith(WORST):
            worst_warm = max(worst_warm, warm_t)
        else:
            typical_warm = max(typical_warm, warm_t)
        cold, first = max(cold, cold_t), max(first, first_t)
        print(f"{name:<62} {warm_t:>6.1f} /{warm_u:>5.1f} {cold_t:>6.1f} /{cold_u:>5.1f} {first_t:>6.1f} /{first_u:>5.1f}")

    lookup = time_lookup(CASES[f"{profiles.SEEDS:<9} {WORST}"], args.n)
    print(f"\ncached lookup (an engine's dict hit with a fresh, equal DecisionInputs): {lookup:.2f} us")

    print()
    header = f"{'61-layer model (ms, whole model)':<62} {'traced':>11} {'untraced':>11}"
    print(header)
    print("-" * len(header))
    model_cached = 0.0
    for mixed in (False, True):
        layers = model_layers(mixed)
        label = "mixed NVFP4+FP8, sm121" if mixed else "DeepSeek-V3-like FP8 block, sm90"
        for cached in (False, True):
            how = "cache by DecisionInputs" if cached else "decide every layer"
            t = time_model(layers, cached, True, args.repeats)
            u = time_model(layers, cached, False, args.repeats)
            if cached:
                model_cached = max(model_cached, t)
            print(f"{label + ', ' + how:<62} {t:>11.3f} {u:>11.3f}")

    print("\ntargets (issue 8):")
    measured = {"typical traced warm": typical_warm, "worst traced warm": worst_warm, "cold traced": cold,
                "cached lookup": lookup, "61-layer model, cached": model_cached * 1000}
    for what, limit in TARGETS_US.items():
        got = measured[what]
        print(f"  {what:<24} {got:>9.1f} us  (target <= {limit:g} us: {'met' if got <= limit else 'NOT met'})")
    print(f"  (first decision, stricter than the cold target's measure: slowest case {first:.1f} us)")
    if args.corpus:
        corpus = time_corpus(args.corpus_n)
        values = [us for us, _ in corpus]
        over = sum(us > TARGETS_US["cold traced"] for us in values)
        print(f"\nfirst traced decision of each of the {len(corpus)} golden scenarios (median of {args.corpus_n} each): "
              f"median {statistics.median(values):.1f} us, 90th percentile {values[int(0.9 * len(values))]:.1f} us, "
              f"slowest {values[-1]:.1f} us; {over} over {TARGETS_US['cold traced']:g} us. Slowest five:")
        for us, key in corpus[-5:]:
            print(f"  {us:>7.1f} us  {key}")
    if args.profile:
        print("\nprofile of the worst case (warm, traced):\n")
        print(profile_worst())
    return 0


if __name__ == "__main__":
    sys.exit(main())
