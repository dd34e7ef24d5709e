"""Build a trimmed copy of FlashInfer's SM90 CUTLASS fused-MoE module, or pack FlashInfer for a machine without network.

The build itself lives in ``moe_fsm.experts.flashinfer_build`` (``moe-fsm flashinfer build`` is the
same command); this script adds what only a developer needs: ``--dry-run`` (the object list),
``--pack-runtime`` (FlashInfer's Python plus the sources and headers the trimmed build reads,
the headers taken from the compiler's dependency files) and ``--cuda-extra`` (headers and
libraries a CUDA toolkit lacks).

    python tools/build_flashinfer_sm90.py --dtypes bf16,fp8,fp8_block          # into the user cache
    python tools/build_flashinfer_sm90.py --dry-run                             # list the objects
    python tools/build_flashinfer_sm90.py --pack-runtime fi.tar.xz              # nvcc -M here
    python tools/build_flashinfer_sm90.py --pack-runtime fi.tar.xz --header-list headers.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from moe_fsm.experts import flashinfer_build as fb  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None,
                        help="where the module, its manifest and ninja's log go (default: the user cache "
                             "moe_fsm.experts.flashinfer_prebuilt reads)")
    parser.add_argument("--dtypes", default=",".join(fb.DEFAULT_DTYPES), help=f"comma list of {sorted(fb.DTYPE_SETS)}")
    parser.add_argument("--jobs", type=int, default=None, help="ninja -j (default: free memory / 5 GB, at most the cores)")
    parser.add_argument("--workspace", type=Path, default=None,
                        help="FlashInfer workspace (generated sources, objects); default: a temp dir")
    parser.add_argument("--time-limit", type=float, default=None, help="stop ninja after this many seconds")
    parser.add_argument("--no-smoke", action="store_true", help="install without the smoke call (no GPU here)")
    parser.add_argument("--cuda-extra", type=Path, action="append", default=[],
                        help="a directory with include/ and lib/ to add, for a CUDA toolkit without cuBLAS headers, "
                             "libnvrtc or the libcuda stub (for example the nvidia/cu13 folder of NVIDIA's pip wheels)")
    parser.add_argument("--dry-run", action="store_true", help="print the object list and exit")
    parser.add_argument("--pack-runtime", type=Path, metavar="ARCHIVE.tar.xz",
                        help="instead of building, archive FlashInfer's Python plus the sources and headers the "
                             "trimmed build of --dtypes reads")
    parser.add_argument("--header-list", type=Path, default=None,
                        help="with --pack-runtime: a JSON list of the headers (a build manifest's headers_read) "
                             "instead of an nvcc -M pass here")
    args = parser.parse_args(argv)
    try:
        dtype_sets = fb.parse_dtype_sets(args.dtypes)
    except ValueError as err:
        parser.error(str(err))

    if args.pack_runtime:
        header_list = args.header_list
        if header_list is not None and header_list.suffix == ".json" and "headers_read" in header_list.read_text()[:200000]:
            manifest = json.loads(header_list.read_text())
            if isinstance(manifest, dict):
                header_list = Path(tempfile.mkdtemp()) / "headers.json"
                header_list.write_text(json.dumps(manifest["headers_read"]))
        fb.pack_runtime(args.pack_runtime, header_list, dtype_sets, jobs=os.cpu_count() or 1)
        return 0
    if args.dry_run:
        os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", fb.ARCH)
        os.environ["FLASHINFER_WORKSPACE_BASE"] = str(args.workspace or tempfile.mkdtemp(prefix="moe-fsm-fi-"))
        full, spec = fb.trimmed_spec(dtype_sets, args.cuda_extra)
        print(f"{len(spec.sources)} of {len(full.sources)} objects kept for {dtype_sets}; "
              f"flags {[f for f in spec.extra_cuda_cflags if f.startswith('-DENABLE')]}")
        for source in spec.sources:
            print(f"  {source.name}")
        return 0
    try:
        fb.build(dtype_sets, out=args.out, jobs=args.jobs, workspace=args.workspace, cuda_extra=args.cuda_extra,
                 time_limit=args.time_limit, smoke=not args.no_smoke)
    except fb.BuildError as err:
        print(f"build failed: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
