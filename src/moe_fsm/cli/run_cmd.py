"""`moe-fsm run`: the main job. Select, run and check every MoE layer of a model preset."""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

from moe_fsm.cli.exit_codes import EXIT_DIFFERS, EXIT_OK
from moe_fsm import profiles
from moe_fsm.cli.inputs import POLICY_HELP, SPEED_TABLE_HELP, Once
from moe_fsm.engine.presets import DEFAULT_PRESET, PRESETS, preset
from moe_fsm.errors import InputError, SelectionError
from moe_fsm.trace.document import DEFAULT_TRACE_DIR

DEFAULT_REPEATS = 3  # engine.run.DEFAULT_REPEATS; the flag's default without importing torch
MAX_TOKENS = 1 << 17
MAX_SEED = (1 << 63) - 1
# How ranks of `run --nproc` move tokens: the prepare/finalize kinds moe-fsm builds on torch.distributed.
RUNNABLE_ALL2ALL = ("torch_all2all", "allgather_reducescatter")


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "run",
        help="select, run and check every MoE layer of a model preset (the main job)",
        description="Load a model preset with random weights, let the state machine choose each layer's "
        "kernel, run every layer on a batch of tokens and check it against the float64 reference.",
    )
    add_arguments(parser)
    parser.set_defaults(func=main)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `run`; :func:`rank_argv` hands every one of them to the ranks of a launch."""
    parser.add_argument("--preset", default=DEFAULT_PRESET, choices=sorted(PRESETS), help=f"model preset (default {DEFAULT_PRESET})")
    parser.add_argument("--tokens", type=int, default=64, help=f"tokens per batch, 1 to {MAX_TOKENS} (default 64)")
    parser.add_argument("--layers", type=int, default=None, help="run only the first N MoE layers (default: all)")
    parser.add_argument("--device", default="cpu", help="torch device to run on: cpu or cuda (default cpu)")
    parser.add_argument("--backend", default="auto", help="auto, a backend name, or a per-family mapping like nvfp4=flashinfer_b12x,fp8=triton")
    parser.add_argument("--env", action="append", default=None, metavar="K=V",
                        help="a VLLM_* variable for the decision (repeatable; default: the process environment)")
    parser.add_argument("--policy", default=None, metavar="PROFILE", action=Once,
                        help=POLICY_HELP + "; the MX and integer presets need vllm-0.33 (their default)")
    parser.add_argument("--speed-table", metavar="PATH", action=Once,
                        help=SPEED_TABLE_HELP)
    parser.add_argument("--trace-dir", type=Path, default=DEFAULT_TRACE_DIR, help=f"where per-layer traces go (default {DEFAULT_TRACE_DIR}/)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights and tokens")
    parser.add_argument("--platform", default="probe", metavar="NAME",
                        help="decide for this platform preset (what-if: sm90, sm100, cpu-x86, ...) and run the numerics "
                             "here, with stand-ins where needed (default: probe this machine)")
    parser.add_argument("--strict-build", action="store_true",
                        help="run the decided kernel itself or nothing: exit 3 where a stand-in or a substitute would run it")
    parser.add_argument("--nproc", type=int, default=1, help="run across N processes (gloo on CPU, NCCL on GPUs)")
    parser.add_argument("--all2all", default="torch_all2all",
                        help=f"with --nproc > 1: how tokens travel ({' or '.join(RUNNABLE_ALL2ALL)})")
    parser.add_argument("--max-tokens-per-rank", type=int, default=None, metavar="N",
                        help="with --nproc > 1 and --all2all torch_all2all: the all-to-all sends fixed blocks of N "
                             "rows per rank, with no host read (CUDA-graph capturable); N >= the most tokens a rank "
                             "holds (--tokens + nproc - 1)")
    parser.add_argument("--full-check", action="store_true",
                        help="check every row of every layer against float64 (default: a sample of rows per layer)")
    parser.add_argument("--repeats", type=int, default=DEFAULT_REPEATS,
                        help=f"timed calls per layer; the table shows their median (default {DEFAULT_REPEATS})")


# The launcher's own flags: a rank runs the rest of the command, and must not launch again.
LAUNCHER_FLAGS = ("nproc",)


def rank_argv(args: argparse.Namespace) -> list[str]:
    """The command line every rank of ``run --nproc N`` parses back into ``args`` (less the launcher's flags).

    Built from the parser's own actions, so no flag can be left behind (a rank that lost --platform or
    --strict-build decided or built something else than asked); each value travels as ``--flag=value``,
    so a value starting with '-' (``--trace-dir=-x``) stays a value.
    """
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    argv = []
    for action in parser._actions:
        if action.dest in LAUNCHER_FLAGS:
            continue
        flag, value = max(action.option_strings, key=len), getattr(args, action.dest)
        if action.nargs == 0:  # a switch: given when it was given
            if value != action.default:
                argv.append(flag)
        elif isinstance(action, argparse._AppendAction):
            argv += [f"{flag}={item}" for item in value or ()]
        elif value is not None:
            argv.append(f"{flag}={value}")
    return argv


def check_args(args, model) -> None:
    """Every flag the ranks would otherwise trip over, checked before anything is loaded or launched."""
    if not 1 <= args.tokens <= MAX_TOKENS:  # no token, no row checked: "within tolerance" would mean nothing
        raise InputError(f"--tokens must be from 1 to {MAX_TOKENS}, got {args.tokens}")
    if args.layers is not None and not 1 <= args.layers <= len(model.layers):
        raise InputError(f"--layers must be from 1 to {len(model.layers)} (the MoE layers of {model.name}), got {args.layers}")
    if not 0 <= args.seed <= MAX_SEED:
        raise InputError(f"--seed must be from 0 to 2**63-1, got {args.seed}")
    if not 1 <= args.repeats <= 1000:
        raise InputError(f"--repeats must be from 1 to 1000, got {args.repeats}")
    if args.nproc < 1:
        raise InputError(f"--nproc must be 1 or more, got {args.nproc}")
    if args.platform != "probe":
        _platform(args.platform)
    if args.policy is not None:
        profiles.choose(args.policy)
    if args.speed_table is not None:
        from moe_fsm.inputs.speed import read_speed_table

        read_speed_table(args.speed_table)  # a bad table is refused before any rank starts
    if args.max_tokens_per_rank is not None:
        from moe_fsm.distributed.group import is_launched

        ranks = int(os.environ["WORLD_SIZE"]) if is_launched() else args.nproc  # a rank's own --nproc is 1
        most = args.tokens + ranks - 1  # rank r holds --tokens + r tokens
        if ranks == 1 or args.all2all != "torch_all2all":
            raise InputError("--max-tokens-per-rank sizes the all-to-all's blocks: it needs --nproc 2 or more and "
                             f"--all2all torch_all2all, got --nproc {ranks} --all2all {args.all2all}")
        if not most <= args.max_tokens_per_rank <= MAX_TOKENS:
            raise InputError(f"--max-tokens-per-rank must be from {most} (the most tokens a rank holds: --tokens "
                             f"{args.tokens} + {ranks - 1}) to {MAX_TOKENS}, got {args.max_tokens_per_rank}")
    if args.nproc > 1:
        if args.all2all not in RUNNABLE_ALL2ALL:
            raise InputError(f"--all2all {args.all2all!r} is not one of {list(RUNNABLE_ALL2ALL)} (what --nproc runs)")
        layers = model.layers[: args.layers or len(model.layers)]
        fewest = min(spec.layer.num_experts for spec in layers)
        if args.nproc > fewest:
            raise InputError(
                f"--nproc {args.nproc} spreads the experts over {args.nproc} ranks, but {model.name} has layers of "
                f"{fewest} experts: use --nproc {fewest} or fewer"
            )


def main(args) -> int:
    from moe_fsm.inputs.env import EnvSnapshot
    from moe_fsm.inputs.request import BackendRequest

    model = preset(args.preset)
    check_args(args, model)
    request = BackendRequest.parse(args.backend)
    env = EnvSnapshot.from_process() if args.env is None else EnvSnapshot.from_mapping(_pairs(args.env), strict_names=True)
    from moe_fsm.distributed.group import is_launched

    if is_launched():
        from moe_fsm.engine.distributed_run import run_rank

        return run_rank(args, model, request, env, run_options(args), _platform(args.platform))
    device = _device(args.device, args.nproc)
    from moe_fsm.trace.dir_lock import trace_dir_lock

    with trace_dir_lock(args.trace_dir):  # one run at a time owns the directory's traces (ranks: under the launcher's)
        if args.nproc > 1:
            from moe_fsm.engine.distributed_run import launch_run

            return launch_run(args, rank_argv(args))
        return _run_here(args, model, request, env, device)


def _run_here(args, model, request, env, device) -> int:
    from moe_fsm.engine.manifest import write_manifest
    from moe_fsm.engine.report import make_progress, render_check_mode, render_header, render_results
    from moe_fsm.engine.run import run_model
    from moe_fsm.trace.document import remove_stale_temp_files

    started_at = time.time()
    options = run_options(args)
    platform = _platform(args.platform)
    print(render_header(model, args.tokens, args.layers, device, platform, request, env, (render_check_mode(options),)),
          flush=True)
    remove_stale_temp_files(args.trace_dir)
    progress = make_progress()
    try:
        engine, results = run_model(
            model, tokens=args.tokens, num_layers=args.layers, device=device, request=request, env=env,
            platform=platform, trace_dir=args.trace_dir, seed=args.seed, options=options, progress=progress,
            policy=args.policy, strict_build=args.strict_build, speed_table=args.speed_table,
        )
    except SelectionError as err:
        hint = _platform_hint(model, args, request, env)
        if not hint:
            raise
        named = type(err)(f"{err.message}; {hint}", trace=err.trace)
        named.trace_path = err.trace_path
        raise named from err
    progress.done()
    write_manifest(
        args.trace_dir, argv=getattr(args, "command_line", sys.argv), preset=model.name, tokens=args.tokens, seed=args.seed,
        check_rows=options.check_rows, repeats=options.repeats, world_size=1, started_at=started_at,
        results=results, trace_files=[[layer.trace_path] for layer in engine.loaded],
    )
    print(render_results(results, engine, args.trace_dir))
    return EXIT_OK if all(r.ok for r in results) else EXIT_DIFFERS


WHAT_IF_PLATFORMS = ("sm90", "sm100", "sm80", "sm120", "cpu-x86-amx", "cpu-arm", "rocm-mi300")


def _platform_hint(model, args, request, env) -> str:
    """For the first layer that fails to decide here: the platform presets that would decide it (run --platform)."""
    from moe_fsm.decision import decide, make_inputs

    specs = model.layers[: args.layers or len(model.layers)]
    policy = args.policy if args.policy is not None else model.policy
    here = _platform(args.platform)
    for spec in specs:
        try:
            decide(make_inputs(spec.layer, None, request, env, here, policy), trace=False)
            continue
        except SelectionError:
            pass
        good = []
        for name in WHAT_IF_PLATFORMS:
            try:
                decide(make_inputs(spec.layer, None, request, env, _platform(name), policy), trace=False)
                good.append(name)
            except SelectionError:
                continue
        if good:
            return (f"{spec.name} would be decided with --platform {good[0]}" +
                    (f" (or {', '.join(good[1:])})" if len(good) > 1 else "") +
                    "; moe-fsm then runs its numerics here with stand-ins")
        return ""
    return ""


def _platform(name: str):
    from moe_fsm.decision import probed_platform
    from moe_fsm.inputs import platform as platforms

    if name in (None, "probe"):
        return probed_platform()
    return platforms.preset(name)


def run_options(args):
    from moe_fsm.engine.run import DEFAULT_CHECK_ROWS, RunOptions

    return RunOptions(check_rows=None if args.full_check else DEFAULT_CHECK_ROWS, repeats=args.repeats)


def _pairs(items: list[str]) -> dict[str, str]:
    pairs = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise InputError(f"--env takes KEY=VALUE, got {item!r}")
        pairs[key] = value
    return pairs


def _device(name: str, nproc: int = 1) -> str:
    """The device after checking it exists here (for --nproc N: cpu, or cuda with N GPUs)."""
    if name == "cpu":
        return name
    if not re.fullmatch(r"cuda(:\d+)?", name):
        raise InputError(f"--device {name!r} is not one of: cpu, cuda, cuda:N")
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise InputError(f"--device {name} was asked for, but torch sees no CUDA device here; use --device cpu")
    if nproc > 1:
        if name != "cuda":
            raise InputError(f"--nproc {nproc} gives each rank its own GPU: use --device cuda, not {name}")
        if nproc > count:
            raise InputError(f"--nproc {nproc} on --device cuda needs {nproc} GPUs; torch sees {count}")
    elif name != "cuda" and int(name.split(":")[1]) >= count:
        raise InputError(f"--device {name}: torch sees {count} CUDA device(s) (cuda:0 to cuda:{count - 1})")
    return name
