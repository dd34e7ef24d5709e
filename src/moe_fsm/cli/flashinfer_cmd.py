"""`moe-fsm flashinfer build`: build FlashInfer's SM90 CUTLASS MoE module, trimmed, into the user cache.

The module lands where ``moe_fsm.experts.flashinfer_prebuilt`` looks for it, so the next
``moe_fsm.runtime.build(decision)`` of a FLASHINFER_CUTLASS layer on an H100 runs FlashInfer's kernel. The
build refuses to install a module with an undefined symbol of a kept dtype pair, and ends with
a smoke call in a child process (``moe_fsm.experts.flashinfer_build``). flashinfer-python,
tvm-ffi and nvcc are needed only when the command runs.
"""

from __future__ import annotations

import sys
from pathlib import Path

from moe_fsm.cli.exit_codes import EXIT_OK
from moe_fsm.errors import BackendUnavailableError, InputError


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "flashinfer",
        help="build FlashInfer's SM90 CUTLASS fused-MoE module (trimmed) for moe-fsm's adapter",
        description="FlashInfer's CUTLASS fused MoE on Hopper: build the trimmed module moe-fsm loads.",
    )
    actions = parser.add_subparsers(dest="flashinfer_command", metavar="ACTION")
    build = actions.add_parser(
        "build",
        help="build the trimmed SM90 module into the user cache (about 10 minutes on 16 cores)",
        description="Build FlashInfer's SM90 CUTLASS fused-MoE module with only the dtype sets asked for, check its "
        "undefined symbols, smoke-test it in a child process, and install it where moe-fsm loads it from. "
        "About 8-10 minutes on 16 cores and about 5 GB of memory a compile.",
    )
    from moe_fsm.experts.flashinfer_build import DEFAULT_DTYPES, DTYPE_SETS

    build.add_argument("--dtypes", default=",".join(DEFAULT_DTYPES),
                       help=f"comma list of {', '.join(sorted(DTYPE_SETS))} (default {','.join(DEFAULT_DTYPES)})")
    build.add_argument("--jobs", "-j", type=int, default=None,
                       help="parallel compiles (default: free memory / 5 GB, at most one per core)")
    build.add_argument("--out", type=Path, default=None,
                       help="where the module goes (default: the user cache, "
                            "$XDG_CACHE_HOME/moe-fsm/flashinfer/<version>/sm90)")
    build.add_argument("--workspace", type=Path, default=None, help="FlashInfer's workspace (default: a temp dir)")
    build.add_argument("--no-smoke", action="store_true",
                       help="install without the smoke call (for a machine without a GPU; the manifest says so)")
    build.set_defaults(func=main)
    parser.set_defaults(func=lambda args: (parser.print_help(sys.stderr), 2)[1])


def main(args) -> int:
    from moe_fsm.experts import flashinfer_build as fb

    try:
        dtype_sets = fb.parse_dtype_sets(args.dtypes)
    except ValueError as err:
        raise InputError(str(err)) from None
    if args.jobs is not None and args.jobs < 1:
        raise InputError(f"--jobs must be 1 or more; got {args.jobs}")
    try:
        import flashinfer  # noqa: F401
        import tvm_ffi  # noqa: F401
    except ImportError as err:
        raise BackendUnavailableError(f"building needs flashinfer-python and apache-tvm-ffi "
                                      f"(pip install 'moe-fsm[flashinfer]'): {err}") from None
    try:
        fb.build(dtype_sets, out=args.out, jobs=args.jobs, workspace=args.workspace, smoke=not args.no_smoke,
                 log=lambda line: print(line, flush=True))
    except fb.BuildError as err:
        raise BackendUnavailableError(f"the FlashInfer module was not installed: {err}") from None
    return EXIT_OK
