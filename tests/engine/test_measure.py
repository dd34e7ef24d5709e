"""moe-fsm measure's pieces that need no GPU: which candidates it times, the table it writes, the files it refuses."""

from __future__ import annotations

import json

import pytest

from moe_fsm.cli.main import main
from moe_fsm.engine.measure import Measured, candidates, existing_table, table_json, write_table
from moe_fsm.errors import InputError
from moe_fsm.inputs.env import EnvSnapshot
from moe_fsm.inputs.layer import MoELayer
from moe_fsm.inputs.platform import preset
from moe_fsm.inputs.spec import layer_from_spec
from moe_fsm.inputs.speed import read_speed_table

QWEN3 = MoELayer(num_experts=128, top_k=8, hidden_size=2048, intermediate_size=768)
NO_ENV = EnvSnapshot.from_mapping({})


def _names(layer, platform):
    return [c.backend for c in candidates(layer, preset(platform), NO_ENV, "fastest-vllm-0.33")[0]]


def test_candidates_are_what_the_profile_would_compare_here():
    # vLLM 0.33's scan order on Hopper (FlashInfer moved back), those that support the layer, then grouped_mm
    assert _names(QWEN3, "sm90") == ["TRITON", "FLASHINFER_CUTLASS", "TORCH_GROUPED_MM"]
    assert _names(QWEN3, "sm90-bare") == ["TRITON", "TORCH_GROUPED_MM"]  # no FlashInfer installed
    block = layer_from_spec({"num_experts": 128, "top_k": 8, "hidden_size": 2048, "intermediate_size": 768,
                             "quant": "fp8", "weight_scale": "block"})
    assert "TORCH_GROUPED_MM" not in _names(block, "sm90")  # block scales are not row-wise: not eligible


def test_candidates_need_a_profile_that_orders_by_speed_and_a_layer_it_scans():
    with pytest.raises(InputError, match="does not order by measured speed"):
        candidates(QWEN3, preset("sm90"), NO_ENV, "vllm-0.33")
    lora = MoELayer(num_experts=128, top_k=8, hidden_size=2048, intermediate_size=768, lora=True)
    found, why = candidates(lora, preset("sm90"), NO_ENV, "fastest-vllm-0.33")
    assert found == [] and "before the measured scan (TRITON via lora_shortcut)" in why


def test_the_table_reads_back_and_extends_only_this_device_s_table(tmp_path):
    key = "E=128,N=768,K=2048,topk=8,dtype=bfloat16,quant=unquantized"
    measured = {key: [Measured("TRITON", {1: 20.5, 64: 40.0}, "TritonExperts (native)"),
                      Measured("TORCH_GROUPED_MM", {1: 30.0}, "GroupedMMExperts (native)"),
                      Measured("FLASHINFER_CUTLASS", {}, "x", left_out="relative error 1e-1 exceeds 2e-2")]}
    path = tmp_path / "t.json"
    write_table(path, table_json("NVIDIA H100", measured, "moe-fsm measure --preset x", 20, None))
    table = read_speed_table(path)
    assert table.figures(key) == {1: {"TRITON": 20.5, "TORCH_GROUPED_MM": 30.0}, 64: {"TRITON": 40.0}}
    assert "FLASHINFER_CUTLASS" not in table.ran(key)  # a candidate that failed its check is not in the table
    other = "E=8,N=8,K=8,topk=1,dtype=bfloat16,quant=unquantized"
    extended = table_json("NVIDIA H100", {other: [Measured("TRITON", {1: 1.0}, "r")]}, "c", 20,
                          existing_table(path, "NVIDIA H100"))
    assert set(extended["shapes"]) == {key, other}
    with pytest.raises(InputError, match="holds figures of 'NVIDIA H100', not of this 'NVIDIA H200'"):
        existing_table(path, "NVIDIA H200")
    foreign = tmp_path / "notes.json"
    foreign.write_text(json.dumps({"mine": 1}))
    with pytest.raises(InputError, match="is not a speed table moe-fsm can extend"):
        existing_table(foreign, "NVIDIA H100")
    assert json.loads(foreign.read_text()) == {"mine": 1}


def test_measure_refuses_a_machine_without_cuda_and_a_half_given_shape(capsys, monkeypatch):
    monkeypatch.setenv("MOE_FSM_PLATFORM", "cpu")
    assert main(["measure", "--experts", "8", "--hidden", "64"]) != 0
    assert "missing --intermediate --top-k" in capsys.readouterr().err
    assert main(["measure", "--experts", "8", "--hidden", "64", "--intermediate", "32", "--top-k", "2"]) != 0
    assert "times kernels on a CUDA device" in capsys.readouterr().err


def test_an_extra_backend_without_its_entry_point_is_named(monkeypatch):
    from moe_fsm.backends import registry as registry_module
    from moe_fsm.engine.measure import unregistered_extras

    assert unregistered_extras(QWEN3, "fastest-vllm-0.33") == []  # installed: grouped_mm's entry point is there
    monkeypatch.setattr(registry_module.Registry, "load_entry_points", lambda self: [])
    monkeypatch.setattr(registry_module, "_DEFAULTS", {})  # registries made afresh, without moe-fsm's entry points
    assert unregistered_extras(QWEN3, "fastest-vllm-0.33") == ["TORCH_GROUPED_MM"]
    assert "TORCH_GROUPED_MM" not in _names(QWEN3, "sm90")


def test_the_base_profile_s_choice_is_always_among_the_measured_candidates():
    """The guarantee 'never slower than vLLM's choice at a measured point' needs vLLM's choice in the table: on every
    vllm-0.33 golden scenario decided by the auto scan on one CUDA GPU, measure times the backend it chose (and
    names it as the reference)."""
    from pathlib import Path

    from moe_fsm import golden
    from moe_fsm.decision import decide
    from moe_fsm.inputs.platform import Vendor

    checked = 0
    for scenario in golden.load_scenarios(Path(__file__).resolve().parents[2] / "traces", "vllm-0.33"):
        inputs = scenario.inputs()
        if inputs.platform.vendor is not Vendor.CUDA or inputs.parallel != type(inputs.parallel)() \
                or inputs.request.to_json() != "auto":
            continue
        try:
            decision = decide(inputs, registry=golden.registry("vllm-0.33"), trace=False)
        except Exception:
            continue
        if decision.via != "auto_scan":
            continue
        found = [c.backend for c in candidates(inputs.layer, inputs.platform, inputs.env, "fastest-vllm-0.33")[0]]
        assert decision.backend in found, (scenario.name, decision.backend, found)
        assert {c.base for c in candidates(inputs.layer, inputs.platform, inputs.env, "fastest-vllm-0.33")[0]} \
            == {decision.backend}
        checked += 1
    assert checked > 50
