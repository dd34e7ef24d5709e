"""The gpt-oss (MXFP4) and GPTQ-INT4 Qwen3-MoE presets run on CPU through the torch experts.

Until the vllm-0.33 profile has their families' policies, the kernels are built
here directly (LocalPrepareFinalize + TorchExperts, what a CPU decision builds)
and each layer is checked against float64 with run's own tolerance table.
"""

from __future__ import annotations

import json

import pytest
import torch

from moe_fsm.engine.engine import route
from moe_fsm.engine.presets import PRESETS
from moe_fsm.engine.run import TOLERANCE, make_weights, rms_norm
from moe_fsm.experts.torch_experts import TorchExperts, torch_dtype
from moe_fsm.inputs.quant import QuantFamily
from moe_fsm.kernels.reference import moe_reference
from moe_fsm.modular.kernel import ModularKernel
from moe_fsm.prepare_finalize.local import LocalPrepareFinalize


def _run_layers(name: str, layers: int, tokens: int = 16) -> list[float]:
    model = PRESETS[name]
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, model.layers[0].layer.hidden_size, generator=gen)
    errors = []
    for spec in model.layers[:layers]:
        layer = spec.layer
        kernel = ModularKernel(LocalPrepareFinalize(), TorchExperts(layer), layer)
        x = hidden.to(torch_dtype(layer.dtype))
        weights = make_weights(layer, gen, torch.device("cpu"), x)
        g, ids = route(x, weights.router, layer.top_k)
        out = kernel(x, weights.w1, weights.w2, g, ids, scales=weights.scales)
        ref = moe_reference(x, weights.w1_ref, weights.w2_ref, g, ids, activation=layer.activation.value,
                            swiglu_limit=layer.swiglu_limit, w1_bias=weights.scales.w1_bias, w2_bias=weights.scales.w2_bias)
        errors.append(float((out.double() - ref).norm() / ref.norm()))
        assert errors[-1] <= TOLERANCE[(layer.family, layer.dtype)], (spec.name, errors[-1])
        hidden = rms_norm(x + out).to(torch.float32)
    return errors


def test_gpt_oss_preset_is_mxfp4_with_biases_and_the_clamp():
    layer = PRESETS["gpt-oss-20b"].layers[0].layer
    assert (layer.family, layer.bias, layer.activation.value, layer.swiglu_limit) == (QuantFamily.MXFP4, True, "swigluoai", 7.0)
    assert layer.hidden_size * PRESETS["gpt-oss-20b"].shrink == 2880 and len(PRESETS["gpt-oss-20b"].layers) == 24
    assert len(_run_layers("gpt-oss-20b", 2)) == 2


def test_gptq_int4_preset_runs_its_layers():
    model = PRESETS["qwen3-30b-a3b-gptq-int4"]
    layer = model.layers[0].layer
    assert (layer.family, layer.quant.weight_bits, layer.quant.checkpoint) == (QuantFamily.INT_WNA16, 4, "gptq")
    assert (layer.hidden_size * model.shrink, layer.intermediate_size * model.shrink) == (2048, 768)
    assert len(_run_layers("qwen3-30b-a3b-gptq-int4", 2)) == 2


@pytest.mark.parametrize("platform", ["cpu-x86-amx", "cpu-x86", "cpu-arm"])
@pytest.mark.parametrize("name", ["gpt-oss-20b", "qwen3-30b-a3b-gptq-int4"])
def test_run_cli_decides_the_presets_under_vllm_0_33(name, platform, as_platform, tmp_path, capsys):
    """vLLM 0.33's CPU kernels for MXFP4 and INT4 weight-only need x86 with AMX tiles; elsewhere no backend
    applies (its emulation needs amd-quark), and run says so with the trace written: the outcome is the
    platform's, never the host CPU's."""
    from moe_fsm.cli.main import main

    as_platform(platform)
    code = main(["run", "--preset", name, "--layers", "1", "--tokens", "8", "--policy", "vllm-0.33",
                 "--trace-dir", str(tmp_path)])
    out, err = capsys.readouterr()
    trace = json.loads((tmp_path / "layer000-model.layers.0.mlp.experts.json").read_text())
    assert trace["inputs"]["platform"]["probe_override"] == platform
    if platform == "cpu-x86-amx":
        assert code == 0, out + err
        assert "1/1 layers within tolerance" in out
        assert trace["outcome"]["backend"] == "CPU"
    else:
        assert code == 3, out + err
        assert trace["outcome"]["status"] == "failed"
        if platform == "cpu-x86":
            assert "which has no AMX tiles" in err


def test_run_cli_without_their_policy_says_which_profile_has_one(tmp_path, capsys):
    from moe_fsm.cli.main import main

    code = main(["run", "--preset", "gpt-oss-20b", "--layers", "1", "--tokens", "8", "--policy", "seeds",
                 "--trace-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code != 0
    assert "no selection policy for family mxfp4 in profile seeds" in err and "vllm-0.33 (--policy" in err
