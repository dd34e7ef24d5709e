"""Measure the speed table a ``fastest-*`` profile orders by: each candidate of a layer, built as ``run`` builds it.

For one layer shape, the candidates are the ones the profile's measured scan compares (its base scan's candidates
that pass their support checks here, plus its extras such as TORCH_GROUPED_MM), found by running the machine on a
probe table; each is then decided through the same machine with a probe table that makes it the fastest, and built
through the engine (``Engine`` -> ``runtime.build``: the decided kernel, or its stand-in, exactly what ``moe-fsm
run`` would build for that decision), checked once against the float64 reference on fresh random weights (a
candidate that computes the wrong layer is left out of the table, with the reason), then timed at each token count
as CUDA-graph replays of R calls on R different inputs and routings (so no call finds the previous one's weights
in L2), median of the replays divided by R. What ran under each name goes in the table's ``ran``.

The table (``inputs/speed.py``) is written atomically; an existing file is extended (the shapes measured now
replace theirs) only when it is a speed table of this device, and is never replaced otherwise.
"""

from __future__ import annotations

import datetime
import statistics
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Callable, Optional

import torch

from moe_fsm import profiles
from moe_fsm.decision import decide, make_inputs
from moe_fsm.engine.engine import Engine, route
from moe_fsm.engine.run import RunOptions, WeightBank, run_layer
from moe_fsm.errors import InputError, SelectionError
from moe_fsm.experts.torch_experts import torch_dtype
from moe_fsm.inputs.env import EnvSnapshot
from moe_fsm.inputs.layer import MoELayer
from moe_fsm.inputs.parallel import ParallelConfig
from moe_fsm.inputs.platform import PlatformFacts
from moe_fsm.inputs.speed import FORMAT, SpeedTable, read_speed_table, shape_key
from moe_fsm.plan.decider import LayerSpec
from moe_fsm.trace import document as trace_doc

METHOD = ("moe-fsm measure: each candidate built as `moe-fsm run` builds it and checked against float64 once; "
          "CUDA-graph replays of R calls on R different inputs and routings (R = 8 up to 32 tokens, 4 up to 512, "
          "else 2), median of {replays} replays / R")


@dataclass(frozen=True)
class Candidate:
    """A backend the measured scan compares, and the base profile's choice it is compared with."""

    backend: str
    base: str


@dataclass
class Measured:
    """One candidate of one shape: µs per token count, what ran, or why it is not in the table."""

    backend: str
    us: dict[int, float]
    ran: str
    left_out: Optional[str] = None


def unregistered_extras(layer: MoELayer, profile: str) -> list[str]:
    """The profile's extra backends this process does not know: moe-fsm's own extension backends come through its
    entry points, which exist only where moe-fsm is installed (``pip install -e .``), not when run from a source
    tree on PYTHONPATH."""
    from moe_fsm.backends.registry import default_registry
    from moe_fsm.profiles.fastest_vllm_0_33 import MEASURED_EXTRAS

    known = set(default_registry(profile).extension_names[layer.family].values())
    return [b for b in MEASURED_EXTRAS if b not in known and b not in profiles.get(profile).policy(layer.family).backends]


def probe_table(device_name: str, key: str, figures: dict[str, float]) -> SpeedTable:
    """A one-point table for ``key`` with ``figures``: the measured scan run on it names every candidate (a probe
    figure for no candidate), or selects the one made fastest, through the same machine that will read the real
    table. Never written anywhere; the traces of these decisions stay in a temporary directory."""
    return SpeedTable.from_json({
        "format": FORMAT, "device": device_name,
        "measured": {"date": datetime.date.today().isoformat(), "moe_fsm_version": "probe",
                     "command": "moe-fsm measure (probe)", "method": "no measurement: a probe of the measured scan"},
        "shapes": {key: {"tokens": {"1": figures}}},
    }, source="(moe-fsm measure probe)")


def candidates(layer: MoELayer, platform: PlatformFacts, env: EnvSnapshot, profile: str) -> tuple[list[Candidate], str]:
    """The backends the measured scan of ``profile`` compares for ``layer`` here (its base scan's candidates that
    support the layer, and the extras), and why when there are none: the machine is run on a probe table, so the
    list is the scan's own, after every earlier step's pruning and the support checks."""
    chosen = profiles.get(profile)
    if not chosen.reads_speed_table:
        raise InputError(f"profile {profile!r} does not order by measured speed; measure for one that does "
                         f"({', '.join(n for n, p in profiles.profiles().items() if p.reads_speed_table)})")
    key = shape_key(layer, ParallelConfig())
    inputs = make_inputs(layer, None, "auto", env, platform, profile, probe_table(platform.device_name, key, {"PROBE": 1.0}))
    try:
        decision = decide(inputs)
    except SelectionError as err:
        return [], f"{profile} selects nothing for it: {err.message}"
    measured = next((e for e in decision.trace["events"] if e["event"] == "measured"), None)
    if measured is None:
        return [], f"{profile} decides it before the measured scan ({decision.backend} via {decision.via}): nothing to order"
    supported = [row["backend"] for row in measured["figures"] if row["supported"]]
    return [Candidate(backend, measured["base"]) for backend in supported], ""


def _calls_per_graph(tokens: int) -> int:
    return 8 if tokens <= 32 else (4 if tokens <= 512 else 2)


def time_graph(calls: list[Callable[[], object]], replays: int) -> float:
    """Median µs per call of a CUDA graph that makes every call of ``calls`` once, over ``replays`` replays."""
    for call in calls:
        call()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up on a side stream, as capture requires
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    del graph
    return statistics.median(times) / len(calls)


@dataclass
class Workload:
    """One layer's weights and, per token count, the R input sets every candidate is timed on (the same for all)."""

    weights: object  # engine.run.LayerWeights
    sample: torch.Tensor  # the rows the float64 check runs on
    inputs: dict[int, list[tuple]]  # token count -> [(x, topk_weights, topk_ids)] * R


def workload(layer: MoELayer, tokens: tuple[int, ...], seed: int = 0) -> Workload:
    device, dtype = torch.device("cuda"), torch_dtype(layer.dtype)
    generator = torch.Generator().manual_seed(seed)
    sample = torch.randn(256, layer.hidden_size, generator=generator).to(dtype).to(device)
    weights = WeightBank(generator, device)(layer, sample)
    inputs = {}
    for count in tokens:
        sets = []
        for _ in range(_calls_per_graph(count)):
            x = torch.randn(count, layer.hidden_size, generator=generator).to(dtype).to(device)
            sets.append((x, *route(x, weights.router, layer.top_k)))
        inputs[count] = sets
    return Workload(weights, sample, inputs)


def measure_candidate(layer: MoELayer, candidate: Candidate, work: Workload, *, platform: PlatformFacts,
                      env: EnvSnapshot, profile: str, replays: int) -> Measured:
    """Build ``candidate`` for ``layer`` through the engine, check it once, time it at each token count."""
    key = shape_key(layer, ParallelConfig())
    fastest = {candidate.backend: 1.0, **({candidate.base: 2.0} if candidate.base != candidate.backend else {})}
    with tempfile.TemporaryDirectory(prefix="moe-fsm-measure-") as traces:
        engine = Engine([LayerSpec("measured", layer)], env=env, platform=platform, policy=profile, trace_dir=traces,
                        device="cuda", speed_table=probe_table(platform.device_name, key, fastest))
        loaded = engine.load()[0]
    decision = loaded.decision
    if decision.backend != candidate.backend:  # the machine must select it when it is the fastest
        raise AssertionError(f"the measured scan chose {decision.backend} where {candidate.backend} was fastest")
    ran = loaded.stand_in.label if loaded.stand_in is not None else f"{decision.runner} ({decision.plan.how})"
    weights = work.weights
    _, check = run_layer(0, loaded, work.sample, weights, *route(work.sample, weights.router, layer.top_k),
                         options=RunOptions(check_rows=None))
    if not check.ok:
        return Measured(candidate.backend, {}, ran, f"relative error {check.rel_error:.2e} exceeds {check.tolerance:.0e} "
                                                    "against the float64 reference: not measured")
    kernel, w1, w2, scales = loaded.kernel, weights.w1, weights.w2, weights.scales
    us = {}
    for count, sets in work.inputs.items():
        calls = [lambda x=x, g=g, ids=ids: kernel(x, w1, w2, g, ids, scales=scales) for x, g, ids in sets]
        try:
            us[count] = round(time_graph(calls, replays), 2)
        except RuntimeError as err:  # a kernel that cannot be captured is left out, not timed some other way
            torch.cuda.synchronize()
            return Measured(candidate.backend, us, ran, f"CUDA-graph capture failed at {count} tokens: {err}")
    return Measured(candidate.backend, us, ran)


def measure_layer(layer: MoELayer, *, tokens: tuple[int, ...], platform: PlatformFacts, env: EnvSnapshot,
                  profile: str, replays: int, progress=print) -> tuple[str, list[Measured]]:
    """Every candidate of ``layer``, on the same weights and inputs: its shape key and the measurements."""
    key = shape_key(layer, ParallelConfig())
    found, why = candidates(layer, platform, env, profile)
    if not found:
        raise InputError(f"{key} on {platform.describe()}: nothing to measure: {why}")
    for backend in unregistered_extras(layer, profile):
        progress(f"measure: {key}: {backend} is not registered in this process (moe-fsm's entry points are not "
                 "installed: pip install -e .); not measured")
    work = workload(layer, tokens)
    results = []
    for candidate in found:
        progress(f"measure: {key}: {candidate.backend} ...")
        result = measure_candidate(layer, candidate, work, platform=platform, env=env, profile=profile,
                                   replays=replays)
        progress(f"measure: {key}: {candidate.backend}: " + (result.left_out or ", ".join(
            f"{t} tok {us:.1f} us" for t, us in result.us.items())) + f" [{result.ran}]")
        results.append(result)
    return key, results


def table_json(device_name: str, measured: dict[str, list[Measured]], command: str, replays: int,
               existing: Optional[SpeedTable]) -> dict:
    """The table file's content: the shapes measured now, and an existing table's other shapes."""
    shapes = {}
    if existing is not None:
        shapes = {k: v for k, v in existing.to_json()["shapes"].items() if k not in measured}
    for key, results in measured.items():
        kept = [r for r in results if r.left_out is None and r.us]
        if not kept:
            continue
        counts = sorted({t for r in kept for t in r.us})
        shapes[key] = {"tokens": {str(t): {r.backend: r.us[t] for r in kept if t in r.us} for t in counts},
                       "ran": {r.backend: r.ran for r in kept}}
    try:
        version = metadata.version("moe-fsm")
    except metadata.PackageNotFoundError:
        version = "source tree"
    return {
        "format": FORMAT,
        "device": device_name,
        "measured": {"date": datetime.date.today().isoformat(), "moe_fsm_version": version, "command": command,
                     "method": METHOD.format(replays=replays)},
        "shapes": dict(sorted(shapes.items())),
    }


def existing_table(path: Path, device_name: str) -> Optional[SpeedTable]:
    """The table already at ``path`` to extend, None when there is none; InputError when the file is not a speed
    table of this device (moe-fsm never replaces a file it did not make, nor another device's figures)."""
    if not path.exists():
        return None
    try:
        table = read_speed_table(path)
    except InputError as err:
        raise InputError(f"{path} exists and is not a speed table moe-fsm can extend ({err}); "
                         "give another --out") from None
    if table.device != device_name:
        raise InputError(f"{path} holds figures of {table.device!r}, not of this {device_name!r}; give another --out")
    return table


def write_table(path: Path, data: dict) -> Path:
    SpeedTable.from_json(data, source=str(path))  # what is written reads back
    path.parent.mkdir(parents=True, exist_ok=True)
    return trace_doc.write_atomic(path, trace_doc.dumps(data))
