"""``moe-fsm run --nproc``'s CUDA-graph path for fixed-block EP layers whose eager calls replay the P/F's own graphs.

``capture_in_step_worker.py`` runs two layers as ``engine.distributed_run`` does (an eager warm-up, eager warm-ups on
a side stream, the capture of the whole layer call, replays) with fewer tokens a rank than the capacity: the eager
calls replay the P/F's graphs, captured at the capacity's rows, and the run's capture then takes the plain call at the
rank's own token count. Each layer must replay from the run's graph and equal the float64 reference and the plain
eager call. World 1 needs one GPU (NCCL over one rank: the graphs, the pool and the streams are the same as at any
world); worlds 2 and 4 one GPU a rank (``test_run_cuda_graph.py`` runs the CLI itself at world 2).
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
    pytest.mark.gpu,
    pytest.mark.distributed,
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="the experts and the wire kernels are Triton kernels"),
]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_layers_replay_from_the_run_graph_after_the_pf_replayed_its_own(tmp_path: Path, world: int) -> None:
    if torch.cuda.device_count() < world:
        pytest.skip(f"NCCL needs one GPU per rank: world {world} > {torch.cuda.device_count()} CUDA devices")
    files = run_ranks(world, tmp_path, worker=HERE / "capture_in_step_worker.py", backend="nccl", group_timeout_s=120,
                      deadline_s=240)
    results = [r for f in files for r in f["results"]]
    errors = [r["error"] for r in results if "error" in r]
    assert not errors, errors[0]
    assert len(results) == world * 2  # ranks x layers
    for r in results:
        assert r["replayed"], r  # the run's capture worked on every rank
        assert r["finite"] and r["ref_err"] <= 2e-2, r
        assert r["plain_err"] <= 1e-2, r
