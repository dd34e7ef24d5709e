"""``moe-fsm run --nproc 2 --device cuda --max-tokens-per-rank N``: each expert-parallel layer sends fixed blocks, so
every rank captures it in a CUDA graph at the same point and replays it in step; the replayed output checks out
against float64, and the table and the manifest say the layers ran as graphs (what an engine replaying its layers
gets, not the host-bound eager call).

Needs two CUDA devices (NCCL, one GPU per rank) and Triton (the decided experts on a GPU are TritonExperts, which
read nothing on the host); skipped elsewhere. On the CPU the same run stays eager (``tests/engine/test_run_cli.py``).
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from moe_fsm.cli.main import main

pytestmark = [  # the distributed suite's (bench/gpu.sh distributed), as test_graph_capture.py: not the one-GPU suite's
    pytest.mark.distributed,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="an NCCL run of two ranks needs 2 CUDA devices"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="the experts that capture are Triton kernels"),
]


def test_run_replays_fixed_block_ep_layers_from_cuda_graphs(tmp_path, capfd) -> None:
    code = main(["run", "--nproc", "2", "--device", "cuda", "--layers", "2", "--tokens", "8", "--max-tokens-per-rank",
                 "16", "--repeats", "2", "--trace-dir", str(tmp_path)])
    out = capfd.readouterr().out
    assert code == 0, out
    assert "2/2 layers within tolerance" in out, out
    manifest = json.loads((tmp_path / "run.manifest").read_text())
    assert [layer["call"] for layer in manifest["layers"]] == ["cuda_graph", "cuda_graph"], manifest["layers"]
    stage_rows = out.split("stage times per layer", 1)[1].splitlines()[2:4]
    assert [row.split()[-1] for row in stage_rows] == ["cuda_graph", "cuda_graph"], stage_rows
