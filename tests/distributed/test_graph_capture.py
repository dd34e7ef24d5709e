"""The all-to-all P/Fs that send fixed blocks captured in a CUDA graph with Triton experts, replayed with new routings:
the fixed-capacity one with the batched experts, the Standard-format one built with ``max_tokens_per_rank`` with
TritonExperts.

Needs at least two CUDA devices (NCCL, one GPU per rank) and Triton; skipped
elsewhere. The ranks run ``graph_worker.py``; see its docstring.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dist_harness import HERE, run_ranks  # noqa: E402

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="a CUDA-graph capture of NCCL all-to-all needs 2 CUDA devices"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="the batched experts are Triton kernels"),
]


def test_graph_replays_dispatch_experts_combine_with_new_routings(tmp_path: Path) -> None:
    # Generous limits: the first call JIT-compiles the Triton kernels on every rank.
    files = run_ranks(2, tmp_path, worker=HERE / "graph_worker.py", backend="nccl", group_timeout_s=300, deadline_s=540)
    results = [r for f in files for r in f["results"]]
    errors = [r["error"] for r in results if "error" in r]
    assert not errors, errors[0]
    assert len(results) == 2 * 2 * 2 * 3  # ranks x formats x quantizations x routings
    for r in results:
        assert r["ref_err"] <= r["tol"], r
        assert r["eager_err"] <= 1e-2, r  # the replay computes what the eager call computes (up to summation order)
