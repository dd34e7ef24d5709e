"""`moe-fsm tune` on the GPU: the table it writes is the one the runtime then serves."""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
pytest.importorskip("triton")

from moe_fsm.cli.main import main as cli  # noqa: E402
from moe_fsm.kernels.triton_moe import MoEConfig, fused_experts, get_config  # noqa: E402
from moe_fsm.kernels.triton_moe import config as cfg  # noqa: E402
from moe_fsm.kernels.triton_moe._runtime import device_name  # noqa: E402

from .moe_gpu_cases import Shape, float_weights, hidden_states, reference, rel_err, routing  # noqa: E402


def test_tune_writes_a_table_the_runtime_picks_up(tmp_path, monkeypatch):
    monkeypatch.setenv(cfg.CONFIG_DIR_ENV, str(tmp_path))
    cfg.clear_caches()
    e, n, k, top_k = 16, 256, 512, 2
    assert cli(["tune", "--experts", str(e), "--intermediate", str(n), "--hidden", str(k), "--top-k", str(top_k),
                "--tokens", "1", "64", "--workers", "0"]) == 0
    device = device_name(torch.device("cuda", torch.cuda.current_device()))
    table = json.loads((tmp_path / cfg.config_file_name(device)).read_text())
    entries = table["configs"][cfg.shape_key(e, n, k, "bf16")]
    assert set(entries) == {"1", "64"}
    for tokens in (1, 64):
        assert get_config(device, e, n, k, top_k, tokens, "bfloat16", None) == MoEConfig.from_json(entries[str(tokens)])
    shape = Shape("tuned", e, k, n, top_k)
    w1, w2 = float_weights(shape)
    x = hidden_states(64, k, torch.bfloat16, seed=31)
    g, ids = routing(64, e, top_k, seed=31)
    assert rel_err(fused_experts(x, w1, w2, g, ids), reference(x, w1, w2, g, ids)) < 1e-2
    cfg.clear_caches()
