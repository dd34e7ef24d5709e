"""`moe-fsm tune`: tune the Triton MoE configs of layer shapes on this GPU into the user's config directory.

The shapes come from the flags (one shape, or named full-size layers), a preset (``--preset``: its layers at the
preset's reduced sizes, what ``moe-fsm run`` runs) or a model's ``config.json`` (``--config``: every distinct MoE
layer, read by the plan package's config reader, as one rank holds it under ``--tp``/``--ep``). The runtime reads
the user's directory before the tables shipped in the package, so a shape tuned here is served from the new table
from the next lookup on. torch and Triton are imported only when timing starts.
"""

from __future__ import annotations

from pathlib import Path

from moe_fsm.cli.exit_codes import EXIT_OK
from moe_fsm.cli.inputs import add_kernel_shape_flags
from moe_fsm.errors import InputError


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "tune",
        help="tune the Triton MoE kernel configs of a layer shape on this GPU",
        description="Time candidate Triton MoE configs for one layer shape as whole-layer CUDA-graph replays "
        "at each token count and write the fastest into the user's config table, which the runtime reads "
        "before the shipped tables.",
    )
    parser.add_argument("--shape", nargs="+", default=None, help="named full-size layers (see --list) instead of the four sizes")
    parser.add_argument("--preset", default=None, metavar="NAME", help="every distinct MoE layer of a built-in model preset")
    parser.add_argument("--config", type=Path, default=None, metavar="PATH",
                        help="every distinct MoE layer of a model's config.json (a file or its directory)")
    parser.add_argument("--tp", type=int, default=1, help="with --config/--preset: tensor-parallel ranks; without --ep "
                        "each rank holds N / tp of every expert (default 1)")
    parser.add_argument("--ep", type=int, default=1, help="with --config/--preset: expert-parallel ranks; each holds "
                        "E / ep whole experts (vLLM's --enable-expert-parallel: N is not split) (default 1)")
    parser.add_argument("--list", action="store_true", help="list the named layer shapes and exit")
    parser.add_argument("--dry-run", action="store_true", help="print the shapes that would be tuned and exit")
    add_kernel_shape_flags(parser, dtype_help="compute dtype (default bfloat16)",
                           fp8_help="FP8 w8a8 weight scale granularity (default: unquantized)")
    parser.add_argument("--tokens", type=int, nargs="+", default=None, help="token counts to tune (default 1 8 32 128 512 2048 8192)")
    parser.add_argument("--workers", type=int, default=8, help="processes that compile the candidates first (0: compile while timing)")
    parser.add_argument("--config-dir", type=Path, default=None, help="where the table goes (default: the user's config directory)")
    parser.add_argument("--budget-s", type=float, default=None, help="time budget of the whole run in seconds: screening "
                        "stops starting trials at 60%% of it, timing keeps the fastest so far when it is spent")
    parser.add_argument("--candidate-timeout-s", type=float, default=120.0,
                        help="a candidate whose trial run (in a child process) takes longer is refused (default 120)")
    parser.set_defaults(func=main)


def _shapes(args):
    """The layer shapes to tune, with a line for each saying where it came from."""
    from moe_fsm.kernels.triton_moe.tuning import NAMED_SHAPES, LayerShape

    sources = [name for name, given in (("--shape", args.shape is not None), ("--preset", args.preset is not None),
                                        ("--config", args.config is not None)) if given]
    if len(sources) > 1:
        raise InputError(f"give one of --shape, --preset, --config, or the sizes; got {', '.join(sources)}")
    if (args.tp, args.ep) != (1, 1) and not {"--preset", "--config"} & set(sources):
        raise InputError("--tp and --ep shard the layers of --config or --preset; give the shard's sizes directly otherwise")
    for flag, value in (("--tp", args.tp), ("--ep", args.ep)):
        if value < 1:
            raise InputError(f"{flag} must be 1 or more; got {value}")
    if args.config is not None:
        return model_config_shapes(args.config, args.tp, args.ep)
    if args.preset is not None:
        return preset_shapes(args.preset, args.tp, args.ep)
    if args.shape is not None:
        unknown = [name for name in args.shape if name not in NAMED_SHAPES]
        if unknown:
            raise InputError(f"--shape {', '.join(unknown)}: not one of {sorted(NAMED_SHAPES)}")
        return [(NAMED_SHAPES[name], name) for name in args.shape]
    sizes = {"--experts": args.experts, "--intermediate": args.intermediate, "--hidden": args.hidden, "--top-k": args.top_k}
    missing = [name for name, value in sizes.items() if value is None]
    if missing:
        raise InputError(f"give --shape NAME, --preset NAME, --config PATH or all of --experts, --intermediate, --hidden, "
                         f"--top-k (missing {', '.join(missing)})")
    bad = [f"{name}={value}" for name, value in sizes.items() if value < 1]
    if bad or args.top_k > args.experts:
        raise InputError(f"sizes must be positive with --top-k <= --experts; got {', '.join(bad) or f'--top-k={args.top_k}'}")
    return [(LayerShape(args.experts, args.intermediate, args.hidden, args.top_k, args.dtype, args.fp8), "given sizes")]


def layer_shape(layer, tp: int, ep: int, where: str):
    """One rank's LayerShape of a MoELayer under tp/ep, or a string saying why moe-fsm tune does not tune it."""
    from moe_fsm.inputs.quant import FP8_WEIGHT_SCALES, QuantFamily
    from moe_fsm.kernels.triton_moe.tuning import LayerShape

    if layer.quant.family is QuantFamily.UNQUANTIZED:
        fp8 = None
    elif layer.quant.family is QuantFamily.FP8:
        fp8 = next(name for name, key in FP8_WEIGHT_SCALES.items() if key == layer.quant.weight)
    else:
        return (f"{layer.quant.family.value} experts: moe-fsm tune times the Triton kernels of 16-bit and FP8 w8a8 "
                "layers; the weight-quantized kernels are not tuned here")
    if layer.dtype not in ("bfloat16", "float16"):
        return f"dtype {layer.dtype}: the Triton kernels compute in bfloat16 or float16"
    e, n = layer.num_experts, layer.intermediate_size
    if ep > 1:
        if e % ep:
            raise InputError(f"{where}: {e} experts do not split over --ep {ep} ranks")
        e //= ep
    elif tp > 1:
        if n % tp:
            raise InputError(f"{where}: intermediate size {n} does not split over --tp {tp} ranks")
        n //= tp
        if fp8 == "block" and n % 128:
            raise InputError(f"{where}: a --tp {tp} shard of block-FP8 experts holds N={n}, not a multiple of the "
                             "128-wide scale blocks (vLLM refuses it too); take another --tp or --ep")
    return LayerShape(e, n, layer.hidden_size, layer.top_k, layer.dtype, fp8)


def _distinct(layers: list, tp: int, ep: int, where: str) -> list:
    """[(index or name, MoELayer)] -> [(LayerShape, "layers ...")], one per distinct shape; skipped ones printed."""
    from moe_fsm.plan.plan import layer_ranges

    shapes: dict = {}
    skipped: dict = {}
    for label, layer in layers:
        shape = layer_shape(layer, tp, ep, where)
        (skipped if isinstance(shape, str) else shapes).setdefault(shape, []).append(label)

    def named(labels: list) -> str:
        if all(isinstance(x, int) for x in labels):
            return f"layer{'s' if len(labels) > 1 else ''} {layer_ranges(labels)}"
        return f"{len(labels)} layer{'s' if len(labels) > 1 else ''}"

    for why, labels in skipped.items():
        print(f"{where}: {named(labels)} not tuned: {why}")
    if not shapes:
        raise InputError(f"{where}: no MoE layer moe-fsm tune can tune (16-bit or FP8 w8a8 experts)")
    return [(shape, f"{where}, {named(labels)}") for shape, labels in shapes.items()]


def model_config_shapes(path: Path, tp: int, ep: int) -> list:
    """Every distinct MoE layer of a config.json as one rank holds it, through the plan package's readers."""
    from moe_fsm.inputs.parallel import ParallelConfig
    from moe_fsm.inputs.platform import PRESETS
    from moe_fsm.plan.decider import LayerDecider
    from moe_fsm.plan.plan import checkpoint_layers, layer_of, layer_ranges
    from moe_fsm.plan.quant_config import Mapped

    # the tuner runs on an NVIDIA GPU: its quantization rules are read for Hopper
    decider = LayerDecider(parallel=ParallelConfig(tp_size=tp, ep_size=ep), platform=PRESETS["sm90"])
    model, _, quants = checkpoint_layers(path, decider)
    layers, unmapped = [], {}
    for index, quant in zip(model.moe_layers, quants):
        if isinstance(quant, Mapped):
            layers.append((index, layer_of(model, quant)))
        else:
            unmapped.setdefault(quant.reason, []).append(index)
    for reason, indices in unmapped.items():
        print(f"{model.path}: layers {layer_ranges(indices)} not tuned: {reason}")
    return _distinct(layers, tp, ep, str(model.path))


def preset_shapes(name: str, tp: int, ep: int) -> list:
    """Every distinct MoE layer of a built-in preset (at its reduced sizes) as one rank holds it."""
    from moe_fsm.engine.presets import preset

    return _distinct([(spec.name, spec.layer) for spec in preset(name).layers], tp, ep, f"preset {name}")


def main(args) -> int:
    if args.list:
        from moe_fsm.kernels.triton_moe.tuning import NAMED_SHAPES

        for name, shape in NAMED_SHAPES.items():
            print(f"{name:28s} E={shape.num_experts} N={shape.intermediate} K={shape.hidden} top_k={shape.top_k} "
                  f"{shape.dtype}{' fp8 ' + shape.fp8 if shape.fp8 else ''}")
        return EXIT_OK
    tokens = args.tokens or None
    if tokens is not None and any(t < 1 for t in tokens):
        raise InputError(f"--tokens must all be 1 or more; got {tokens}")
    if args.budget_s is not None and not args.budget_s > 0:
        raise InputError(f"--budget-s must be a positive number of seconds; got {args.budget_s}")
    if not args.candidate_timeout_s > 0:
        raise InputError(f"--candidate-timeout-s must be a positive number of seconds; got {args.candidate_timeout_s}")
    if args.workers < 1:
        raise InputError(f"--workers must be 1 or more (every candidate runs first in a worker process); got {args.workers}")
    found = _shapes(args)
    from moe_fsm.kernels.triton_moe.tuning import shape_label

    for shape, where in found:
        print(f"shape {shape_label(shape)} ({where})")
    if args.dry_run:
        return EXIT_OK
    import torch

    if not torch.cuda.is_available():
        raise InputError("moe-fsm tune times kernels on a CUDA GPU and none is visible here")
    from moe_fsm.kernels.triton_moe.tuning import TOKENS, describe_candidate, tune_and_write

    report = tune_and_write(list(dict.fromkeys(s for s, _ in found)), list(tokens or TOKENS), workers=args.workers,
                            directory=args.config_dir, budget_s=args.budget_s,
                            candidate_timeout_s=args.candidate_timeout_s)
    if report.refused:
        print(f"refused {len(report.refused)} candidate(s), never timed nor written:")
        for refusal in report.refused:
            print(f"  {describe_candidate(refusal.candidate)}: {refusal.reason}")
    if report.not_tried:
        print(f"{len(report.not_tried)} candidate(s) left untried or untimed by --budget-s")
    print(f"wrote {report.path}" if report.path else "wrote nothing: no shape had a candidate that passed")
    return EXIT_OK
