"""`moe-fsm tune`: tune the Triton MoE configs of a layer shape on this GPU into the user's config directory.

The runtime reads that directory before the tables shipped in the package, so a
shape tuned here is served from the new table from the next lookup on. torch
and Triton are imported only when the command runs.
"""

from __future__ import annotations

from pathlib import Path

from moe_fsm.cli.exit_codes import EXIT_OK
from moe_fsm.errors import InputError

FP8_CHOICES = ("tensor", "channel", "block")


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "tune",
        help="tune the Triton MoE kernel configs of a layer shape on this GPU",
        description="Time candidate Triton MoE configs for one layer shape as whole-layer CUDA-graph replays "
        "at each token count and write the fastest into the user's config table, which the runtime reads "
        "before the shipped tables.",
    )
    parser.add_argument("--shape", nargs="+", default=None, help="named full-size layers (see --list) instead of the four sizes")
    parser.add_argument("--list", action="store_true", help="list the named layer shapes and exit")
    parser.add_argument("--experts", type=int, help="number of experts E")
    parser.add_argument("--intermediate", type=int, help="intermediate size N (w1 is [E, 2N, K])")
    parser.add_argument("--hidden", type=int, help="hidden size K")
    parser.add_argument("--top-k", type=int, help="experts per token")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"), help="compute dtype (default bfloat16)")
    parser.add_argument("--fp8", default=None, choices=FP8_CHOICES, help="FP8 w8a8 weight scale granularity (default: unquantized)")
    parser.add_argument("--tokens", type=int, nargs="+", default=None, help="token counts to tune (default 1 8 32 128 512 2048 8192)")
    parser.add_argument("--workers", type=int, default=8, help="processes that compile the candidates first (0: compile while timing)")
    parser.add_argument("--config-dir", type=Path, default=None, help="where the table goes (default: the user's config directory)")
    parser.set_defaults(func=main)


def _shapes(args):
    from moe_fsm.kernels.triton_moe.tuning import NAMED_SHAPES, LayerShape

    if args.shape is not None:
        unknown = [name for name in args.shape if name not in NAMED_SHAPES]
        if unknown:
            raise InputError(f"--shape {', '.join(unknown)}: not one of {sorted(NAMED_SHAPES)}")
        return [NAMED_SHAPES[name] for name in args.shape]
    sizes = {"--experts": args.experts, "--intermediate": args.intermediate, "--hidden": args.hidden, "--top-k": args.top_k}
    missing = [name for name, value in sizes.items() if value is None]
    if missing:
        raise InputError(f"give --shape NAME or all of --experts, --intermediate, --hidden, --top-k (missing {', '.join(missing)})")
    bad = [f"{name}={value}" for name, value in sizes.items() if value < 1]
    if bad or args.top_k > args.experts:
        raise InputError(f"sizes must be positive with --top-k <= --experts; got {', '.join(bad) or f'--top-k={args.top_k}'}")
    return [LayerShape(args.experts, args.intermediate, args.hidden, args.top_k, args.dtype, args.fp8)]


def main(args) -> int:
    if args.list:
        from moe_fsm.kernels.triton_moe.tuning import NAMED_SHAPES

        for name, shape in NAMED_SHAPES.items():
            print(f"{name:28s} E={shape.num_experts} N={shape.intermediate} K={shape.hidden} top_k={shape.top_k} "
                  f"{shape.dtype}{' fp8 ' + shape.fp8 if shape.fp8 else ''}")
        return EXIT_OK
    shapes = _shapes(args)
    tokens = args.tokens or None
    if tokens is not None and any(t < 1 for t in tokens):
        raise InputError(f"--tokens must all be 1 or more; got {tokens}")
    import torch

    if not torch.cuda.is_available():
        raise InputError("moe-fsm tune times kernels on a CUDA GPU and none is visible here")
    from moe_fsm.kernels.triton_moe.tuning import TOKENS, tune_and_write

    path = tune_and_write(shapes, list(tokens or TOKENS), workers=args.workers, directory=args.config_dir)
    print(f"wrote {path}")
    return EXIT_OK
