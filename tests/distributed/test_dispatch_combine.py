"""The all-to-all P/Fs over gloo at worlds 2 and 4: exact results against float64, and their launches pinned.

``dispatch_worker.py`` (see its docstring) runs on every rank. With
``TRITON_INTERPRET=1`` the Triton kernels run on the CPU tensors, so the counted
calls are the ones a CUDA rank makes: each launch there costs ~30-35 µs of host time
on an H200 host (docs/perf/distributed.md), so a change that adds launches to a
dispatch or a combine fails here, with the operations listed.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dist_harness import HERE, dist_backend, run_ranks  # noqa: E402

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(dist_backend() != "gloo", reason="counts CPU ranks; the NCCL suite runs test_multiprocess"),
]

TOLERANCE = 1e-2  # relative to max |expected|: bf16 partial sums and output

# The most launches (torch operations that compute, collectives, Triton kernels) one call of each case may make
# on the kernel path, for prepare and for finalize, as counted now. Variable prepare: the route, the small fields
# packed by one concatenation, the counts all-to-all (the records sent and received in one buffer, which the host reads at once: no
# cat), the send rows (one kernel: payload, FP8 quantized in the same pass, and small fields), the rows'
# all-to-all, the local ids. Variable finalize: the local
# top-k reduce of the CONTIGUOUS experts output used here (zeros, one addcmul per slot, a copy: none when the
# experts reduce), the all-to-all back, the combine. Capped (the variable P/F with max_tokens_per_rank: fixed blocks,
# no host read) prepare: the route, the concatenation, the send rows (one kernel, the empty rows past each rank's count
# included), the all-to-all, the local ids; its finalize as the variable one's, the all-to-all with equal splits.
# Fixed prepare: the route, the concatenation, the send rows, the all-to-all, one slab-layout kernel, the slab scatter of
# the rows (and of the FP8 scales). Fixed finalize: the slab reduce, the all-to-all, the combine.
PINNED = {
    ("variable", "none"): (6, 8),
    ("variable", "token"): (6, 8),
    ("variable", "group"): (6, 8),
    ("capped", "none"): (5, 8),
    ("capped", "token"): (5, 8),
    ("capped", "group"): (5, 8),
    ("fixed", "none"): (6, 3),
    ("fixed", "token"): (7, 3),
    ("fixed", "group"): (7, 3),
}

PATHS = ["torch"] + (["interpreter"] if importlib.util.find_spec("triton") is not None else [])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cache: dict = {}

    def get(world: int, path: str) -> list[dict]:
        if (world, path) not in cache:
            saved = os.environ.get("TRITON_INTERPRET")
            if path == "interpreter":
                os.environ["TRITON_INTERPRET"] = "1"
            else:
                os.environ.pop("TRITON_INTERPRET", None)
            try:
                files = run_ranks(world, tmp_path_factory.mktemp(f"dispatch_w{world}_{path}"),
                                  worker=HERE / "dispatch_worker.py", deadline_s=300)
            finally:
                if saved is None:
                    os.environ.pop("TRITON_INTERPRET", None)
                else:
                    os.environ["TRITON_INTERPRET"] = saved
            cache[(world, path)] = [r for f in files for r in f["results"]]
        return cache[(world, path)]

    return get


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("world", [2, 4])
def test_dispatch_combine_matches_float64(runs, world: int, path: str) -> None:
    results = runs(world, path)
    errors = [r["error"] for r in results if "error" in r]
    assert not errors, errors[0]
    assert len(results) == world * len(PINNED)
    for r in results:
        assert r["err"] <= TOLERANCE, r


@pytest.mark.skipif("interpreter" not in PATHS, reason="the kernel path's launches are counted under Triton's interpreter")
@pytest.mark.parametrize("world", [2, 4])
def test_launches_per_dispatch_and_combine_are_pinned(runs, world: int) -> None:
    results = runs(world, "interpreter")
    errors = [r["error"] for r in results if "error" in r]
    assert not errors, errors[0]
    for r in results:
        mode, kind = r["scenario"].split("-")
        for stage, limit in zip(("prepare", "finalize"), PINNED[(mode, kind)]):
            ops, triton, total = r["counts"][stage]
            assert total <= limit, f"{r['scenario']} {stage} on rank {r['rank']}: {total} launches > {limit}: {ops} {triton}"
