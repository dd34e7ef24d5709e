"""moe-fsm measure on a CUDA device: a small shape's candidates are built, checked and timed into a table that the
fastest-vllm-0.33 profile then orders by."""

from __future__ import annotations

import pytest
import torch

from moe_fsm.cli.main import main
from moe_fsm.decision import select
from moe_fsm.inputs.layer import MoELayer
from moe_fsm.inputs.platform import probed_platform
from moe_fsm.inputs.speed import read_speed_table

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_measure_writes_a_table_the_fastest_profile_reads(tmp_path, capsys):
    out = tmp_path / "table.json"
    assert main(["measure", "--experts", "16", "--hidden", "256", "--intermediate", "128", "--top-k", "2",
                 "--tokens", "1", "64", "--replays", "5", "--out", str(out)]) == 0
    table = read_speed_table(out)
    key = "E=16,N=128,K=256,topk=2,dtype=bfloat16,quant=unquantized"
    figures = table.figures(key)
    assert set(figures) == {1, 64} and "TRITON" in figures[1] and table.device == torch.cuda.get_device_name(0)
    assert all(us > 0 for row in figures.values() for us in row.values())
    layer = MoELayer(num_experts=16, top_k=2, hidden_size=256, intermediate_size=128)
    decision = select(layer, platform=probed_platform(), env={}, policy="fastest-vllm-0.33", speed_table=out)
    assert decision.via == "measured_scan"
    base = select(layer, platform=probed_platform(), env={}, policy="vllm-0.33").backend
    for row in figures.values():
        if base in row:
            assert row[decision.backend] <= row[base]
