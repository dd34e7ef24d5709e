"""`moe-fsm measure`: time every candidate backend of a layer shape on this GPU into the speed table that
``--policy fastest-vllm-0.33`` orders by.

The shapes come from the flags (one layer) or a preset (``--preset``: its distinct layers at the preset's sizes,
what ``moe-fsm run`` runs). Each candidate is built as ``run`` builds it and checked once against float64 before it
is timed (``engine/measure.py``). The table goes to this device's file in the user's config directory (where
select, plan and run find it) unless ``--out`` names another; torch is imported only when measuring starts.
"""

from __future__ import annotations

import shlex
from dataclasses import replace
from pathlib import Path

from moe_fsm.cli.exit_codes import EXIT_OK
from moe_fsm.cli.inputs import add_kernel_shape_flags
from moe_fsm.errors import InputError

DEFAULT_TOKENS = (1, 8, 64, 512, 2048)


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "measure",
        help="time every candidate backend of a layer shape on this GPU into the fastest-* profiles' speed table",
        description="Build every backend the fastest-vllm-0.33 profile would compare for a layer (its base scan's "
        "candidates that support the layer here, and TORCH_GROUPED_MM) as `moe-fsm run` builds it, check it against "
        "float64, time it at each token count as CUDA-graph replays, and write the medians into the speed table.",
    )
    parser.add_argument("--preset", default=None, metavar="NAME", help="every distinct MoE layer of a built-in model preset")
    add_kernel_shape_flags(parser, dtype_help="activation dtype (default bfloat16)",
                           fp8_help="FP8 weights of this scale granularity, dynamic activations (default: unquantized)")
    parser.add_argument("--tokens", type=int, nargs="+", default=list(DEFAULT_TOKENS),
                        help=f"token counts to time (default {' '.join(map(str, DEFAULT_TOKENS))})")
    parser.add_argument("--replays", type=int, default=20, help="CUDA-graph replays per point; the median is kept (default 20)")
    parser.add_argument("--policy", default="fastest-vllm-0.33", metavar="PROFILE",
                        help="the measured-speed profile whose candidates are timed (default fastest-vllm-0.33)")
    parser.add_argument("--out", type=Path, default=None, metavar="PATH",
                        help="the table file (default: this device's file in $MOE_FSM_SPEED_TABLE_DIR or "
                             "~/.config/moe_fsm/speed); an existing table of this device is extended")
    parser.set_defaults(func=run)


def layers_of(args) -> list:
    """The distinct layers to measure, from --preset or the shape flags (InputError naming what is missing)."""
    from moe_fsm.inputs.spec import layer_from_spec

    shape = {"num_experts": args.experts, "intermediate_size": args.intermediate, "hidden_size": args.hidden,
             "top_k": args.top_k}
    given = {k: v for k, v in shape.items() if v is not None}
    if args.preset is not None:
        if given or args.fp8:
            raise InputError("give --preset or the shape flags (--experts --intermediate --hidden --top-k), not both")
        from moe_fsm.engine.presets import preset

        distinct = []
        for spec in preset(args.preset).layers:
            layer = replace(spec.layer, model=None)
            if layer not in distinct:
                distinct.append(layer)
        return distinct
    missing = [f"--{k.replace('num_', '').replace('_size', '').replace('_', '-')}" for k, v in shape.items() if v is None]
    if missing:
        raise InputError(f"measure needs a layer: --preset NAME, or all of --experts --intermediate --hidden --top-k "
                         f"(missing {' '.join(missing)})")
    spec = {**given, "dtype": args.dtype}
    if args.fp8:
        spec.update(quant="fp8", weight_scale=args.fp8)
    return [layer_from_spec(spec)]


def command_text(args) -> str:
    """The command that measured the table, as the table records it (the output path left out)."""
    if args.preset is not None:
        words = ["--preset", args.preset]
    else:
        words = ["--experts", args.experts, "--intermediate", args.intermediate, "--hidden", args.hidden,
                 "--top-k", args.top_k, "--dtype", args.dtype] + (["--fp8", args.fp8] if args.fp8 else [])
    words += ["--tokens", *sorted(set(args.tokens)), "--replays", args.replays, "--policy", args.policy]
    return "moe-fsm measure " + shlex.join(str(w) for w in words)


def run(args) -> int:
    layers = layers_of(args)
    if any(t < 1 for t in args.tokens):
        raise InputError(f"--tokens must be positive token counts, got {args.tokens}")
    if not 1 <= args.replays <= 1000:
        raise InputError(f"--replays must be from 1 to 1000, got {args.replays}")
    from moe_fsm import profiles

    profiles.get(args.policy)
    from moe_fsm.inputs.platform import Vendor, probe

    platform = probe()
    if platform.vendor is not Vendor.CUDA:
        raise InputError(f"moe-fsm measure times kernels on a CUDA device; this machine is {platform.describe()}")
    from moe_fsm.engine.measure import existing_table, measure_layer, table_json, write_table
    from moe_fsm.inputs.env import EnvSnapshot
    from moe_fsm.inputs.speed import table_dir, table_file_name

    out = args.out or table_dir() / table_file_name(platform.device_name)
    existing = existing_table(out, platform.device_name)  # refused before anything is measured
    env = EnvSnapshot.from_process()
    measured = {}
    for layer in layers:
        key, results = measure_layer(layer, tokens=tuple(sorted(set(args.tokens))), platform=platform, env=env,
                                     profile=args.policy, replays=args.replays,
                                     progress=lambda text: print(text, flush=True))
        measured[key] = results
        # written after every shape, so an interrupted run keeps what it measured
        path = write_table(out, table_json(platform.device_name, measured, command_text(args), args.replays, existing))
        print(f"measure: {key} written to {path}", flush=True)
    print(f"speed table {out}: {len(measured)} shape(s) measured on {platform.device_name}")
    return EXIT_OK
