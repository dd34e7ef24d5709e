"""`moe-fsm tune` on a weight-quantized preset, on the GPU: the table it writes is the one the runtime then serves,
and a tile refused in its child process never reaches it."""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
pytest.importorskip("triton")

from moe_fsm.backends.stand_ins import TRITON_WNA16  # noqa: E402
from moe_fsm.cli.main import main as cli  # noqa: E402
from moe_fsm.engine.presets import preset  # noqa: E402
from moe_fsm.kernels.reference import moe_reference  # noqa: E402
from moe_fsm.kernels.triton_moe._runtime import device_name  # noqa: E402
from moe_fsm.kernels.triton_moe.config import CONFIG_DIR_ENV  # noqa: E402
from moe_fsm.kernels.triton_wq import tuning  # noqa: E402
from moe_fsm.kernels.triton_wq.fused import WqConfig, get_wq_config  # noqa: E402
from moe_fsm.kernels.triton_wq.tables import table_file_name  # noqa: E402
from moe_fsm.quantize.weights import dequantize_weights  # noqa: E402

from .moe_gpu_cases import poison_allocator, rel_err  # noqa: E402

PRESET = "qwen3-30b-a3b-gptq-int4"  # E128, K256, N96, top-8, INT4 g32: vLLM decides Marlin, the Triton W4A16 stand-in runs


def refuse_split_k(candidate) -> None:
    """A screening trial that refuses every split-K tile (as one that does not build would) and runs the real trial
    on the others (top-level: the child process imports it by name)."""
    if max(candidate[2].splits("w1"), candidate[2].splits("w2")) > 1:
        raise RuntimeError("refused by the test")
    tuning.try_wq_candidate(candidate)


def a_few(every):
    """The default tile, then two one-pass and two split-K tiles per count (keeps the GPU suite's time)."""
    def few(*args, **kw):
        found = every(*args, **kw)
        one_pass = [c for c in found[1:] if c.splits("w1") == c.splits("w2") == 1]
        split = [c for c in found[1:] if max(c.splits("w1"), c.splits("w2")) > 1]
        return found[:1] + one_pass[:2] + split[:2]
    return few


def test_tune_on_a_preset_writes_a_table_the_runtime_picks_up(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(CONFIG_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(tuning, "candidate_wq_configs", a_few(tuning.candidate_wq_configs))
    assert cli(["tune", "--preset", PRESET, "--tokens", "1", "64", "--workers", "4"]) == 0
    out = capsys.readouterr().out
    assert "TritonWna16Experts" in out and "default tile" in out
    device = device_name(torch.device("cuda", torch.cuda.current_device()))
    layer = preset(PRESET).layers[0].layer
    shape = tuning.WqLayerShape(layer, TRITON_WNA16)
    entries = json.loads((tmp_path / table_file_name(device)).read_text())[shape.key()]
    assert set(entries) == {"1", "64"}
    e, n, k, top_k = layer.num_experts, layer.intermediate_size, layer.hidden_size, layer.top_k
    for tokens in (1, 64):
        served = get_wq_config(device, shape.quant, e, n, k, top_k, tokens)
        assert served == WqConfig.from_json(entries[str(tokens)])
        # the runtime's lookup (config=None) on fresh weights and inputs, against float64
        w1q, w2q, scales = tuning.quantized_weights(shape, e, seed=101 + tokens)
        gen = torch.Generator(device="cuda").manual_seed(tokens)
        x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        g, ids = torch.rand(tokens, e, device="cuda", generator=gen).topk(top_k, dim=1)
        g = g / g.sum(1, keepdim=True)
        poison_allocator()
        out = tuning.layer_fn(tuning.kernel_arguments(shape, w1q, w2q, scales), None)(x, g, ids.to(torch.int32))
        w1f, w2f = dequantize_weights(w1q, w2q, scales, layer.quant, torch.float64)
        assert rel_err(out, moe_reference(x, w1f, w2f, g, ids)) < 1e-2


def test_a_tile_refused_in_its_child_process_is_never_timed_nor_written(tmp_path, monkeypatch):
    monkeypatch.setattr(tuning, "candidate_wq_configs", a_few(tuning.candidate_wq_configs))
    shape = tuning.WqLayerShape(preset(PRESET).layers[0].layer, TRITON_WNA16)
    report = tuning.tune_and_write_wq([shape], [1], workers=4, directory=tmp_path, trial=refuse_split_k,
                                      candidate_timeout_s=240)
    device = device_name(torch.device("cuda", torch.cuda.current_device()))
    entries = json.loads((tmp_path / table_file_name(device)).read_text())[shape.key()]
    assert set(entries) == {"1"}
    written = WqConfig.from_json(entries["1"])
    assert written.splits("w1") == written.splits("w2") == 1
    assert report.refused and all("refused by the test" in r.reason for r in report.refused)
    assert all(max(r.candidate[2].splits("w1"), r.candidate[2].splits("w2")) > 1 for r in report.refused)
