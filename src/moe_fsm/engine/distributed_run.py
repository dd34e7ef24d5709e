"""``moe-fsm run --nproc N``: the main job across N processes.

The parent re-runs the same command under torch.distributed.run; each rank
joins the process group (gloo on CPU, NCCL on GPUs), runs the model with data
and expert parallelism (dp = ep = N: each rank holds its own tokens and
1/N of the experts), and writes its traces with its rank in the file name.
Every rank draws the same weights from the seed, keeps its experts, and
checks its tokens' outputs against the float64 reference over all experts;
rank 0 gathers the rows and prints the table, then each layer's dispatch,
experts and combine times (:class:`moe_fsm.modular.kernel.StageClock`).

On GPUs, a layer whose prepare/finalize sends fixed blocks (``--max-tokens-per-rank``: no host read after the
first call, collectives of fixed sizes) and whose experts read nothing on the host is captured in a CUDA graph by
every rank at the same point and replayed in step, so its time and checked output are the replay's, what an
engine replaying its layers gets (the eager call of the same layer is host-bound: ``docs/perf/distributed.md``).
The table's ``call`` column and the manifest's ``call`` say which ran.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

import moe_fsm
from moe_fsm.distributed.expert_map import ExpertPlacement
from moe_fsm.distributed.group import distributed, resolve_timeout
from moe_fsm.distributed.launch import launch
from moe_fsm.distributed.sharding import shard_experts
from moe_fsm.engine.engine import Engine, route
from moe_fsm.engine.manifest import write_manifest
from moe_fsm.engine.report import make_progress, render_check_mode, render_header, render_results
from moe_fsm.engine.run import KernelTimer, RunOptions, WeightBank, rms_norm, run_layer
from moe_fsm.experts.torch_experts import torch_dtype
from moe_fsm.inputs.parallel import ParallelConfig
from moe_fsm.modular.kernel import ModularKernel, StageClock
from moe_fsm.trace.document import remove_stale_temp_files

LAUNCH_COMMAND_VAR = "MOE_FSM_RUN_COMMAND"  # the user's `run --nproc` command, as the launcher hands it to the ranks


def launch_run(args, rank_flags: list[str]) -> int:
    """Start ``args.nproc`` ranks running ``run`` with ``rank_flags`` (every flag but the launcher's, checked here first).

    The ranks run the package's __main__.py: a rank knows it is one from the launcher's environment, and
    must not launch again. The process group's timeout is read here first, so a bad one stops the launch
    with one line instead of failing in every rank.
    """
    resolve_timeout()
    script = str(Path(moe_fsm.__file__).parent / "__main__.py")
    remove_stale_temp_files(args.trace_dir)
    command = getattr(args, "command_line", sys.argv)
    return launch(args.nproc, [script, "run", *rank_flags], env={LAUNCH_COMMAND_VAR: json.dumps(list(command))})


def launched_command(args) -> list[str]:
    """The command the user ran (handed to the ranks by the launcher), for rank 0's manifest; a rank's own argv is
    the launcher's per-rank command, not the user's."""
    try:
        command = json.loads(os.environ.get(LAUNCH_COMMAND_VAR, ""))
    except ValueError:
        command = None
    if isinstance(command, list) and all(isinstance(word, str) for word in command):
        return command
    return list(getattr(args, "command_line", sys.argv))


def run_rank(args, model, request, env, options: RunOptions, platform) -> int:
    """One rank's share of the run: ``platform`` is what the layers are decided for (``--platform``, or the probe)."""
    # A rank has no terminal: Ctrl-C reaches it only as a request to stop, and a rank blocked in a
    # collective would never see Python's KeyboardInterrupt. Dying at once lets the agent stop the rest.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    started_at = time.time()
    backend = "nccl" if args.device.startswith("cuda") else "gloo"
    with distributed(backend) as ctx:
        parallel = ParallelConfig(dp_size=ctx.world_size, ep_size=ctx.world_size, all2all=args.all2all)
        device = ctx.device
        specs = list(model.layers[: args.layers or len(model.layers)])
        if ctx.rank == 0:
            parallel_line = (f"  parallel: dp={parallel.dp_size} ep={parallel.ep_size} all2all={parallel.all2all.value}; "
                             f"rank r holds {args.tokens} + r tokens"
                             + (f"; all-to-all in fixed blocks of {args.max_tokens_per_rank} rows a rank"
                                if args.max_tokens_per_rank is not None else ""))
            print(render_header(model, args.tokens, args.layers, f"{device} x {ctx.world_size} ranks ({backend})",
                                platform, request, env, (parallel_line, render_check_mode(options))), flush=True)
        engine = Engine(specs, parallel=parallel, request=request, env=env, platform=platform,
                        trace_dir=args.trace_dir, rank=ctx.rank,
                        policy=args.policy if args.policy is not None else model.policy,
                        strict_build=args.strict_build, device=device.type, speed_table=args.speed_table,
                        max_tokens_per_rank=args.max_tokens_per_rank)
        loaded = engine.load()
        generator = torch.Generator().manual_seed(args.seed)
        counts = [args.tokens + r for r in range(ctx.world_size)]
        hidden_all = torch.randn(sum(counts), specs[0].layer.hidden_size, generator=generator)
        start = sum(counts[: ctx.rank])
        hidden = hidden_all[start : start + counts[ctx.rank]]
        bank = WeightBank(generator, device)
        timer = KernelTimer(options.repeats)
        progress = make_progress() if ctx.rank == 0 else None
        results, stage_times = [], []
        for index, layer_state in enumerate(loaded):
            layer = layer_state.spec.layer
            # Calibrate static scales on every rank's first-layer tokens, so all ranks agree on them.
            weights = bank(layer, hidden_all.to(torch_dtype(layer.dtype)))
            x = hidden.to(torch_dtype(layer.dtype)).to(device)
            topk_weights, topk_ids = route(x, weights.router, layer.top_k)
            placement = ExpertPlacement(layer.num_experts, ctx.world_size, ctx.rank)
            shard = shard_experts(weights.w1, weights.w2, weights.scales, placement)
            clock = _attach_clock(layer_state.kernel)
            capture = (lambda call, kernel=layer_state.kernel: capture_in_step(call, kernel, device, options.repeats)
                       ) if device.type == "cuda" and captures_in_step(layer_state.kernel) else None
            out, result = run_layer(index, layer_state, x, weights, topk_weights, topk_ids,
                                    shard=shard, expert_map=placement.expert_map(device), options=options, timer=timer,
                                    capture=capture)
            results.append(result)
            stage_times.append(_stage_medians(layer_state.kernel, clock, options.repeats))
            hidden = rms_norm(x + out).to(torch.float32).cpu()
            if progress is not None:
                progress(index + 1, len(loaded), layer_state.spec.name, result)
        if progress is not None:
            progress.done()
        # Rank 0 reports each layer's worst rank: figures travel as one tensor (gather_object
        # would need numpy, which torch does not install).
        mine = torch.tensor([[r.rel_error, r.time_ms, r.nonfinite_rows, r.checked_rows] for r in results],
                            dtype=torch.float64, device=device)
        everyone = [torch.empty_like(mine) for _ in range(ctx.world_size)]
        dist.all_gather(everyone, mine)
        stacked = torch.stack(everyone).cpu()
        worst, total = stacked.amax(dim=0), stacked.sum(dim=0)
        rows = [replace(r, rel_error=float(worst[i, 0]), time_ms=float(worst[i, 1]), nonfinite_rows=int(total[i, 2]),
                        checked_rows=int(total[i, 3])) for i, r in enumerate(results)]  # call: every rank's, agreed at capture
        stages = torch.tensor(stage_times, dtype=torch.float64, device=device).reshape(len(results), len(StageClock.STAGES))
        everyone = [torch.empty_like(stages) for _ in range(ctx.world_size)]
        dist.all_gather(everyone, stages)
        slowest_stages = torch.stack(everyone).cpu().amax(dim=0)
        if ctx.rank == 0:
            write_manifest(
                args.trace_dir, argv=launched_command(args), preset=model.name, tokens=args.tokens, seed=args.seed,
                check_rows=options.check_rows, repeats=options.repeats, world_size=ctx.world_size,
                started_at=started_at, results=rows,
                trace_files=[[_rank_file(layer.trace_path, ctx.rank, r) for r in range(ctx.world_size)] for layer in loaded],
            )
            print(render_results(rows, engine, args.trace_dir))
            print("(rel err and time: the worst rank per layer; checked and non-finite rows: all ranks; "
                  "traces carry .rank<r> in their names)")
            print(render_stage_times([r.name for r in rows], slowest_stages.tolist(), options.repeats,
                                     [r.call for r in rows]))
        return 0 if all(r.ok for r in rows) else 1


def captures_in_step(kernel) -> bool:
    """Whether every rank can capture a call of ``kernel`` in a CUDA graph at the same point and replay it in step:
    its prepare/finalize says so (fixed blocks) and its experts read nothing on the host."""
    return (isinstance(kernel, ModularKernel) and getattr(kernel.prepare_finalize, "captures_in_step", False)
            and kernel.experts.host_sync_free)


def capture_in_step(call, kernel, device: torch.device, warmups: int):
    """``call`` captured in a CUDA graph on this rank, at the same point as on every other rank; its replay (which
    returns the graph's output), or None on every rank when any rank's capture failed (those layers run eagerly).

    Before the capture, ``warmups`` eager calls on the capture's side stream, timed by the kernel's stage clock
    where one is attached (the stage times of a replayed layer come from them: a replay has no marks between its
    stages); the clock is detached while capturing, since its events cannot be recorded into a graph.
    """
    clock = getattr(kernel, "stage_clock", None)
    graph, output, failure = None, None, ""
    try:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(warmups):
                call()
        torch.cuda.current_stream(device).wait_stream(side)
        kernel.stage_clock = None
        graph = torch.cuda.CUDAGraph()
        # thread_local: the process group's watchdog thread queries its work events meanwhile, which must not
        # invalidate the capture (as eager_graphs captures)
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            output = call()
    except Exception as err:  # noqa: BLE001 - whatever stops one rank's capture, every rank must learn it below
        failure = str(err).splitlines()[0] if str(err) else type(err).__name__
    finally:
        kernel.stage_clock = clock
    failed = torch.tensor([1.0 if failure else 0.0], device=device)
    dist.all_reduce(failed)
    if failed.item():
        print(f"rank {dist.get_rank()}: {kernel.name} runs eagerly: "
              + (f"its CUDA-graph capture failed here: {failure}" if failure else "another rank's capture failed"),
              file=sys.stderr, flush=True)
        return None

    def replay() -> torch.Tensor:
        graph.replay()
        return output

    return replay


def _attach_clock(kernel) -> Optional[StageClock]:
    """A fresh stage clock on a modular kernel (None for anything else, whose stages are not visible)."""
    if not isinstance(kernel, ModularKernel):
        return None
    kernel.stage_clock = StageClock()
    return kernel.stage_clock


def _stage_medians(kernel, clock: Optional[StageClock], repeats: int) -> list[float]:
    """The layer's dispatch / experts / combine medians over its timed calls (NaN where not measured)."""
    if clock is None:
        return [float("nan")] * len(StageClock.STAGES)
    kernel.stage_clock = None
    medians = clock.medians(skip=max(clock.calls - repeats, 0))  # the warm-up call is not one of the timed ones
    return [medians[stage] for stage in StageClock.STAGES]


def render_stage_times(names: list[str], times: list[list[float]], repeats: int, calls: list[str]) -> str:
    """Per layer: dispatch (prepare), experts, combine (finalize) in ms, each the slowest rank's median, and how the
    layer's timed calls ran (``calls``: "eager" or "cuda_graph")."""
    lines = [f"stage times per layer (ms; median of {repeats} eager calls, slowest rank per stage; dispatch and combine "
             "include waiting for the other ranks; a layer whose call is cuda_graph was timed and checked above as "
             "replays of a CUDA graph, which has no marks between its stages):",
             f"  {'layer':<32} {'dispatch':>10} {'experts':>10} {'combine':>10}  call"]
    for name, (dispatch, experts, combine), call in zip(names, times, calls):
        cells = " ".join("         -" if t != t else f"{t:10.3f}" for t in (dispatch, experts, combine))  # NaN: not a modular kernel
        lines.append(f"  {name[:32]:<32} {cells}  {call}")
    return "\n".join(lines)


def _rank_file(path: Path, rank: int, other: int) -> Path:
    """Rank ``other``'s copy of a trace this rank wrote: every rank decides its layers alike, and names its files
    ``layerNNN-<module>.rank<r>.json`` after the first layer of each decision."""
    suffix = f".rank{rank}.json"
    return path.with_name(path.name[: -len(suffix)] + f".rank{other}.json") if path.name.endswith(suffix) else path
