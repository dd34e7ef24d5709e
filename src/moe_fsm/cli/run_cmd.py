"""`moe-fsm run`: the main job. Select, run and check every MoE layer of a model preset."""

from __future__ import annotations

import sys
from pathlib import Path

from moe_fsm.engine.presets import DEFAULT_PRESET, PRESETS, preset
from moe_fsm.errors import InputError
from moe_fsm.trace.document import DEFAULT_TRACE_DIR


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "run",
        help="select, run and check every MoE layer of a model preset (the main job)",
        description="Load a model preset with random weights, let the state machine choose each layer's "
        "kernel, run every layer on a batch of tokens and check it against the float64 reference.",
    )
    parser.add_argument("--preset", default=DEFAULT_PRESET, choices=sorted(PRESETS), help=f"model preset (default {DEFAULT_PRESET})")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per batch (default 64)")
    parser.add_argument("--layers", type=int, default=None, help="run only the first N MoE layers (default: all)")
    parser.add_argument("--device", default="cpu", help="torch device to run on: cpu or cuda (default cpu)")
    parser.add_argument("--backend", default="auto", help="auto, a backend name, or a per-family mapping like nvfp4=flashinfer_b12x,fp8=triton")
    parser.add_argument("--env", action="append", default=None, metavar="K=V",
                        help="a VLLM_* variable for the decision (repeatable; default: the process environment)")
    parser.add_argument("--trace-dir", type=Path, default=DEFAULT_TRACE_DIR, help=f"where per-layer traces go (default {DEFAULT_TRACE_DIR}/)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights and tokens")
    parser.add_argument("--nproc", type=int, default=1, help="run across N processes (gloo on CPU, NCCL on GPUs)")
    parser.add_argument("--all2all", default="torch_all2all", help="with --nproc > 1: how tokens travel (torch_all2all or allgather_reducescatter)")
    parser.set_defaults(func=main)


def main(args) -> int:
    from moe_fsm.engine.report import render_results, render_header
    from moe_fsm.engine.run import run_model
    from moe_fsm.inputs.env import EnvSnapshot
    from moe_fsm.inputs.request import BackendRequest

    if args.tokens < 0:
        raise InputError(f"--tokens must be 0 or more, got {args.tokens}")
    if args.layers is not None and args.layers < 1:
        raise InputError(f"--layers must be 1 or more, got {args.layers}")
    if args.nproc < 1:
        raise InputError(f"--nproc must be 1 or more, got {args.nproc}")
    model = preset(args.preset)
    request = BackendRequest.parse(args.backend)
    env = EnvSnapshot.from_process() if args.env is None else EnvSnapshot.from_mapping(_pairs(args.env), strict_names=True)
    from moe_fsm.distributed.group import is_launched

    if args.nproc > 1 or is_launched():
        from moe_fsm.engine.distributed_run import launch_run

        return launch_run(args, model, request, env)
    device = _device(args.device)
    from moe_fsm.decision import probed_platform

    platform = probed_platform()
    print(render_header(model, args.tokens, args.layers, device, platform, request, env))
    progress = _Progress() if sys.stderr.isatty() else None
    engine, results = run_model(
        model, tokens=args.tokens, num_layers=args.layers, device=device, request=request, env=env,
        platform=platform, trace_dir=args.trace_dir, seed=args.seed, progress=progress,
    )
    if progress:
        progress.done()
    print(render_results(results, engine, args.trace_dir))
    return 0 if all(r.ok for r in results) else 1


def _pairs(items: list[str]) -> dict[str, str]:
    pairs = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise InputError(f"--env takes KEY=VALUE, got {item!r}")
        pairs[key] = value
    return pairs


def _device(name: str) -> str:
    import torch

    if name == "cpu":
        return name
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise InputError("--device cuda was asked for, but torch sees no CUDA device here; use --device cpu")
        return name
    raise InputError(f"--device {name!r} is not one of: cpu, cuda, cuda:N")


class _Progress:
    """A one-line progress bar on stderr, for terminals only."""

    def __init__(self, width: int = 30) -> None:
        self.width = width

    def __call__(self, done: int, total: int, label: str) -> None:
        filled = self.width * done // max(total, 1)
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (self.width - filled)}] {done}/{total} {label[:48]:<48}")
        sys.stderr.flush()

    def done(self) -> None:
        sys.stderr.write("\r" + " " * (self.width + 60) + "\r")
        sys.stderr.flush()
