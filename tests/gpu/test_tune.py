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

from moe_fsm.kernels.triton_moe.tuning import LayerShape, try_candidate, tune_and_write  # noqa: E402

from .moe_gpu_cases import Shape, float_weights, hidden_states, reference, rel_err, routing  # noqa: E402


def refuse_pointer_loads(candidate) -> None:
    """A screening trial that fails every pointer-load candidate (as a tile that does not build would), and runs
    the real trial on the others (top-level: the child process imports it by name)."""
    if not candidate[2].hopper:
        raise RuntimeError("refused by the test")
    try_candidate(candidate)


def test_tune_writes_a_table_the_runtime_picks_up(tmp_path, monkeypatch):
    monkeypatch.setenv(cfg.CONFIG_DIR_ENV, str(tmp_path))
    cfg.clear_caches()
    e, n, k, top_k = 16, 256, 512, 2
    assert cli(["tune", "--experts", str(e), "--intermediate", str(n), "--hidden", str(k), "--top-k", str(top_k),
                "--tokens", "1", "64", "--workers", "4"]) == 0
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


def test_a_candidate_refused_in_its_child_process_is_never_timed_nor_written(tmp_path, capsys, monkeypatch):
    """Screening runs each candidate in a worker process first: the ones it refuses are reported and never reach
    the table, the passing ones are timed as before. (Two candidates of each kernel family per count keep it short.)"""
    from moe_fsm.kernels.triton_moe import tuning

    every = tuning.candidate_configs

    def a_few(shape, tokens, **kw):
        found = every(shape, tokens, **kw)
        return [c for c in found if not c.hopper][:2] + [c for c in found if c.hopper][:2]

    monkeypatch.setattr(tuning, "candidate_configs", a_few)
    shape = LayerShape(16, 256, 512, 4)
    report = tune_and_write([shape], [1, 512], workers=4, directory=tmp_path, trial=refuse_pointer_loads,
                            candidate_timeout_s=240)
    device = device_name(torch.device("cuda", torch.cuda.current_device()))
    entries = json.loads((tmp_path / cfg.config_file_name(device)).read_text())["configs"][cfg.shape_key(16, 256, 512, "bf16")]
    # at one token every candidate is a pointer-load one (thin row blocks): all refused, so no entry
    assert set(entries) == {"512"}
    assert MoEConfig.from_json(entries["512"]).hopper
    assert report.refused and all(not r.candidate[2].hopper and "refused by the test" in r.reason for r in report.refused)
    assert any(r.candidate[1] == 1 for r in report.refused)
    out = capsys.readouterr().out
    assert "screened in" in out and f"{len(report.refused)} refused" in out
    cfg.clear_caches()
