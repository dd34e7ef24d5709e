"""`moe-fsm tune`: tune the Triton MoE configs of layer shapes on this GPU into the user's config directory.

The shapes come from the flags (one shape, or named full-size layers), a preset (``--preset``: its layers at the
preset's reduced sizes, what ``moe-fsm run`` runs) or a model's ``config.json`` (``--config``: every distinct MoE
layer, read by the plan package's config reader, as one rank holds it under ``--tp``/``--ep``). 16-bit and FP8
w8a8 layers tune the Triton experts' configs (``kernels/triton_moe/tuning.py``). Every other layer is decided as the
runtime decides it (profile, env, this GPU or the sm90 preset without one) and built as the runtime builds it
(``runtime.build_experts``): where that runs moe-fsm's weight-quantized Triton kernels (MXFP4, NVFP4 weight-only,
INT4/INT8 WNA16; natively or as a stand-in), their tiles are tuned (``kernels/triton_wq/tuning.py``); the rest are
named with the kernel they run and left out. The runtime reads the user's directory before the tables shipped in
the package, so a shape tuned here is served from the new table from the next lookup on. Triton and the GPU are
touched only when timing starts.
"""

from __future__ import annotations

from pathlib import Path

from moe_fsm.cli.exit_codes import EXIT_OK
from moe_fsm.cli.inputs import POLICY_HELP, Once, add_kernel_shape_flags
from moe_fsm.errors import InputError


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "tune",
        help="tune the Triton MoE kernel configs of a layer shape on this GPU",
        description="Time candidate Triton MoE configs for one layer shape as whole-layer CUDA-graph replays "
        "at each token count and write the fastest into the user's config table, which the runtime reads "
        "before the shipped tables. Weight-quantized layers (--preset, --config) that run moe-fsm's "
        "weight-quantized Triton kernels get their tiles tuned into the weight-quantized table beside it.",
    )
    parser.add_argument("--shape", nargs="+", default=None, help="named full-size layers (see --list) instead of the four sizes")
    parser.add_argument("--preset", default=None, metavar="NAME", help="every distinct MoE layer of a built-in model preset")
    parser.add_argument("--config", type=Path, default=None, metavar="PATH",
                        help="every distinct MoE layer of a model's config.json (a file or its directory)")
    parser.add_argument("--tp", type=int, default=1, help="with --config/--preset: tensor-parallel ranks; without --ep "
                        "each rank holds N / tp of every expert (default 1)")
    parser.add_argument("--ep", type=int, default=1, help="with --config/--preset: expert-parallel ranks; each holds "
                        "E / ep whole experts (vLLM's --enable-expert-parallel: N is not split) (default 1)")
    parser.add_argument("--policy", metavar="PROFILE", action=Once,
                        help="with --config/--preset: the profile that decides the kernel of each layer that is "
                        "neither 16-bit nor FP8 w8a8 (default: the preset's profile, else 'default'): " + POLICY_HELP)
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
    if args.policy is not None and not {"--preset", "--config"} & set(sources):
        raise InputError("--policy decides the layers of --config or --preset; the sizes and --shape are 16-bit or FP8 "
                         "layers, tuned whatever the profile")
    for flag, value in (("--tp", args.tp), ("--ep", args.ep)):
        if value < 1:
            raise InputError(f"{flag} must be 1 or more; got {value}")
    if args.config is not None:
        return model_config_shapes(args.config, args.tp, args.ep, args.policy)
    if args.preset is not None:
        return preset_shapes(args.preset, args.tp, args.ep, args.policy)
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


def tuning_platform():
    """(platform, in words): the facts the weight-quantized layers are decided on. The tuner times on a CUDA GPU:
    this one when there is one (or ``MOE_FSM_PLATFORM`` names a CUDA preset), else the sm90 preset."""
    from moe_fsm.inputs.platform import PRESETS, Vendor, probed_platform

    probed = probed_platform()
    if probed.vendor is Vendor.CUDA:
        return probed, f"{probed.device_name} (sm{''.join(map(str, probed.capability))})"
    return PRESETS["sm90"], f"the sm90 preset ({PRESETS['sm90'].device_name}): no CUDA GPU here"


def _shard(layer, tp: int, ep: int, where: str):
    """One rank's copy of ``layer``: E / ep whole experts, or every expert's N / tp."""
    from dataclasses import replace

    e, n = layer.num_experts, layer.intermediate_size
    if ep > 1:
        if e % ep:
            raise InputError(f"{where}: {e} experts do not split over --ep {ep} ranks")
        return replace(layer, num_experts=e // ep)
    if tp > 1:
        if n % tp:
            raise InputError(f"{where}: intermediate size {n} does not split over --tp {tp} ranks")
        try:
            return replace(layer, intermediate_size=n // tp)
        except InputError as err:
            raise InputError(f"{where}: a --tp {tp} shard holds N={n // tp}, which its experts cannot take: {err}; "
                             "take another --tp or --ep") from None
    return layer


def layer_shape(layer, tp: int, ep: int, where: str, decider):
    """One rank's LayerShape (16-bit, FP8 w8a8) or WqLayerShape (a layer the runtime runs on moe-fsm's
    weight-quantized Triton kernels) of a MoELayer under tp/ep, or a string saying why moe-fsm tune leaves it out.
    ``decider`` (a LayerDecider) decides the layers of other families."""
    from moe_fsm.inputs.quant import FP8_WEIGHT_SCALES, QuantFamily
    from moe_fsm.kernels.triton_moe.tuning import LayerShape

    if layer.quant.family is QuantFamily.UNQUANTIZED:
        fp8 = None
    elif layer.quant.family is QuantFamily.FP8:
        fp8 = next(name for name, key in FP8_WEIGHT_SCALES.items() if key == layer.quant.weight)
    else:
        return weight_quantized_shape(layer, tp, ep, where, decider)
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


def weight_quantized_shape(layer, tp: int, ep: int, where: str, decider):
    """The WqLayerShape of a layer whose decided kernel runs, as the runtime builds it on CUDA, on moe-fsm's
    weight-quantized Triton kernels (natively or as a stand-in), or why it is left out, naming the kernel."""
    from dataclasses import replace

    from moe_fsm.backends.stand_ins import TRITON_MXFP4, TRITON_NVFP4, TRITON_WNA16
    from moe_fsm.decision import decide
    from moe_fsm.errors import BackendUnavailableError, KernelInputError, SelectionError
    from moe_fsm.kernels.triton_wq.tuning import WqLayerShape
    from moe_fsm.runtime import build_experts

    family = layer.quant.family.value
    try:
        decision = decide(decider.inputs_for(layer), registry=decider.registry, trace=False)
    except SelectionError as err:
        return f"{family} experts: {decider.profile.name} selects no kernel for them ({type(err).__name__}: {err.message})"
    decided = f"{decision.backend} ({decision.kernel or 'the platform path'})"
    try:
        experts, stand_in, computed = build_experts(decision, decider.registry, device="cuda")
    except (BackendUnavailableError, KernelInputError) as err:
        return f"{family} experts: {decided} decided, which moe-fsm cannot build ({err})"
    impl = f"{type(experts).__module__}:{type(experts).__name__}"
    runs = f"{stand_in.label} (stand-in)" if stand_in is not None else type(experts).__name__
    if impl not in (TRITON_MXFP4, TRITON_NVFP4, TRITON_WNA16):
        return (f"{family} experts: {decided} decided, runs as {runs}; moe-fsm tune tunes moe-fsm's Triton "
                "kernels only")
    return WqLayerShape(replace(_shard(computed, tp, ep, where), model=None), impl), f"{decided} decided, runs as {runs}"


def _distinct(layers: list, tp: int, ep: int, where: str, decider, decided_on: str) -> list:
    """[(index or name, MoELayer)] -> [(shape, "layers ...")], one per distinct shape; skipped ones printed.
    ``decider`` decides the layers that are neither 16-bit nor FP8 w8a8, on ``decided_on`` (the platform, in words)."""
    from moe_fsm.plan.plan import layer_ranges

    shapes: dict = {}
    skipped: dict = {}
    for label, layer in layers:
        shape = layer_shape(layer, tp, ep, where, decider)
        if isinstance(shape, str):
            skipped.setdefault(shape, []).append(label)
            continue
        shape, runs = shape if isinstance(shape, tuple) else (shape, None)
        shapes.setdefault(shape, (runs, []))[1].append(label)

    def named(labels: list) -> str:
        if all(isinstance(x, int) for x in labels):
            return f"layer{'s' if len(labels) > 1 else ''} {layer_ranges(labels)}"
        return f"{len(labels)} layer{'s' if len(labels) > 1 else ''}"

    for why, labels in skipped.items():
        print(f"{where}: {named(labels)} not tuned: {why}")
    if not shapes:
        raise InputError(f"{where}: no MoE layer moe-fsm tune can tune (16-bit or FP8 w8a8 experts, or experts that "
                         "run moe-fsm's weight-quantized Triton kernels)")
    if any(runs for runs, _ in shapes.values()):
        print(f"weight-quantized layers decided by profile {decider.profile.name} on {decided_on}")
    return [(shape, f"{where}, {named(labels)}" + (f"; {runs}" if runs else "")) for shape, (runs, labels) in shapes.items()]


def _decider(tp: int, ep: int, policy):
    """(the LayerDecider tune decides with: one rank of ``tp``/``ep``, the tuning platform, ``policy``; the
    platform in words)."""
    from moe_fsm.inputs.parallel import ParallelConfig
    from moe_fsm.plan.decider import LayerDecider

    platform, words = tuning_platform()
    return LayerDecider(parallel=ParallelConfig(tp_size=tp, ep_size=ep), platform=platform, policy=policy), words


def model_config_shapes(path: Path, tp: int, ep: int, policy=None) -> list:
    """Every distinct MoE layer of a config.json as one rank holds it, through the plan package's readers."""
    from moe_fsm.plan.plan import checkpoint_layers, layer_of, layer_ranges
    from moe_fsm.plan.quant_fields import Mapped

    decider, decided_on = _decider(tp, ep, policy)
    model, _, quants = checkpoint_layers(path, decider)
    layers, unmapped = [], {}
    for index, quant in zip(model.moe_layers, quants):
        if isinstance(quant, Mapped):
            layers.append((index, layer_of(model, quant)))
        else:
            unmapped.setdefault(quant.reason, []).append(index)
    for reason, indices in unmapped.items():
        print(f"{model.path}: layers {layer_ranges(indices)} not tuned: {reason}")
    return _distinct(layers, tp, ep, str(model.path), decider, decided_on)


def preset_shapes(name: str, tp: int, ep: int, policy=None) -> list:
    """Every distinct MoE layer of a built-in preset (at its reduced sizes) as one rank holds it."""
    from moe_fsm.engine.presets import preset

    chosen = preset(name)
    decider, decided_on = _decider(tp, ep, policy if policy is not None else chosen.policy)
    return _distinct([(spec.name, spec.layer) for spec in chosen.layers], tp, ep, f"preset {name}", decider, decided_on)


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
    from moe_fsm.kernels.triton_wq.tuning import WqLayerShape, wq_shape_label

    for shape, where in found:
        print(f"shape {wq_shape_label(shape) if isinstance(shape, WqLayerShape) else shape_label(shape)} ({where})")
    if args.dry_run:
        return EXIT_OK
    import time

    import torch

    if not torch.cuda.is_available():
        raise InputError("moe-fsm tune times kernels on a CUDA GPU and none is visible here")
    from moe_fsm.kernels.triton_moe.tuning import TOKENS, describe_candidate, tune_and_write
    from moe_fsm.kernels.triton_wq.tuning import describe_wq_candidate, tune_and_write_wq

    shapes = list(dict.fromkeys(s for s, _ in found))
    weight_quantized = [s for s in shapes if isinstance(s, WqLayerShape)]
    triton_moe = [s for s in shapes if not isinstance(s, WqLayerShape)]
    start = time.monotonic()
    reports = []
    for kind, tune, describe in ((triton_moe, tune_and_write, describe_candidate),
                                 (weight_quantized, tune_and_write_wq, describe_wq_candidate)):
        if not kind:
            continue
        budget = None
        if args.budget_s is not None:  # each kind's share by its shapes; the last takes what is left
            left = args.budget_s - (time.monotonic() - start)
            budget = max(1.0, left if kind is weight_quantized else args.budget_s * len(kind) / len(shapes))
        report = tune(kind, list(tokens or TOKENS), workers=args.workers, directory=args.config_dir, budget_s=budget,
                      candidate_timeout_s=args.candidate_timeout_s)
        reports.append(report)
        if report.refused:
            print(f"refused {len(report.refused)} candidate(s), never timed nor written:")
            for refusal in report.refused:
                print(f"  {describe(refusal.candidate)}: {refusal.reason}")
        if report.not_tried:
            print(f"{len(report.not_tried)} candidate(s) left untried or untimed by --budget-s")
    written = list(dict.fromkeys(r.path for r in reports if r.path))
    print("\n".join(f"wrote {path}" for path in written) if written
          else "wrote nothing: no shape had a candidate that passed")
    return EXIT_OK
