"""Policy profiles: chosen by the installed vLLM or explicitly, recorded in the trace, and only data."""

from __future__ import annotations

import dataclasses
from types import MappingProxyType

import pytest

from moe_fsm import profiles
from moe_fsm.decision import DecisionInputs, decide, make_inputs, replay, select
from moe_fsm.errors import InputError, NoPolicyError
from moe_fsm.fsm.policy import Reorder
from moe_fsm.fsm.steps import AutoScan
from moe_fsm.backends.requirements import CudaCapability
from moe_fsm.inputs.env import EnvRegistry
from moe_fsm.inputs.layer import MoELayer
from moe_fsm.inputs.platform import preset
from moe_fsm.inputs.quant import QuantFamily, QuantScheme
from moe_fsm.runtime import build
from moe_fsm.trace.document import canonical

SEEDS = profiles.get("seeds")


def test_shipped_profiles_are_found_by_name():
    assert "seeds" in profiles.names()
    assert SEEDS.vllm_version is None
    assert set(SEEDS.policies) == {QuantFamily.UNQUANTIZED, QuantFamily.FP8, QuantFamily.NVFP4}
    with pytest.raises(InputError, match=r"unknown policy profile 'vllm-9.9'; known: \["):
        profiles.get("vllm-9.9")


@pytest.fixture
def release_profiles():
    """Two release profiles built from the seeds' data (a profile is data), registered for the test."""
    made = []
    for name, version in (("test-0.40", (0, 40)), ("test-0.50", (0, 50))):
        made.append(profiles.register(dataclasses.replace(SEEDS, name=name, vllm_version=version)))
    yield made
    for profile in made:
        profiles.unregister(profile.name)


def test_default_follows_the_installed_vllm(release_profiles):
    none = profiles.choose_for_vllm(None)
    assert none.name == "seeds" and "no vLLM distribution is installed" in none.reason
    exact = profiles.choose_for_vllm("0.50.2")
    assert exact.name == "test-0.50" and exact.reason == "vLLM 0.50.2 is installed beside moe-fsm"
    newer = profiles.choose_for_vllm("0.55.0rc1")
    assert newer.name == "test-0.50" and "nearest older profile" in newer.reason
    between = profiles.choose_for_vllm("0.45.1")
    assert between.name == "test-0.40" and "note:" in between.reason
    older = profiles.choose_for_vllm("0.20.0")
    assert older.name == "seeds" and "older than every release profile" in older.reason


def test_version_parsing():
    assert profiles.version_tuple("0.33.0") == (0, 33, 0)
    assert profiles.version_tuple("0.33.0rc1") == (0, 33, 0)
    assert profiles.version_tuple("0.34.0.dev12+g1234") == (0, 34, 0)


def test_the_trace_records_the_profile_and_why_and_replay_uses_it(release_profiles):
    layer = MoELayer(quant=QuantScheme.fp8())
    decision = select(layer, env={}, platform=preset("sm90"), policy="test-0.40")
    assert decision.trace["inputs"]["profile"] == {"name": "test-0.40", "reason": "asked for explicitly (policy=)"}
    assert decision.inputs.profile.name == "test-0.40"
    assert replay(decision.trace) == canonical(decision.trace)
    assert DecisionInputs.from_json(decision.trace["inputs"]).profile.name == "test-0.40"


def test_traces_without_a_profile_replay_under_seeds():
    decision = select(MoELayer(), env={}, platform=preset("sm90"), policy="seeds")
    old = {**decision.trace, "inputs": {k: v for k, v in decision.trace["inputs"].items() if k != "profile"}}
    assert DecisionInputs.from_json(old["inputs"]).profile.name == "seeds"


def test_a_profile_built_from_data_changes_the_decision_without_new_code():
    """A test-only profile: FP8 without the LoRA shortcut and with FlashInfer moved to the back on SM90."""
    fp8 = SEEDS.policy(QuantFamily.FP8)
    steps = tuple(s for s in fp8.steps if s.name != "lora_shortcut")
    reorder = Reorder(when=(CudaCapability(exact=((9, 0),)),), backends=("FLASHINFER_TRTLLM", "FLASHINFER_CUTLASS"),
                      to="back", because="FlashInfer is slower than Triton on SM90 (test profile)")
    changed = dataclasses.replace(fp8, steps=steps, reorders=(reorder,))
    profile = profiles.register(dataclasses.replace(
        SEEDS, name="test-data-only", vllm_version=None,
        policies=MappingProxyType({**SEEDS.policies, QuantFamily.FP8: changed}),
    ))
    try:
        layer = MoELayer(quant=QuantScheme.fp8(), lora=True)
        seeds = select(layer, env={}, platform=preset("sm90"), policy="seeds")
        other = select(layer, env={}, platform=preset("sm90"), policy=profile.name)
        assert (seeds.backend, seeds.via) == ("TRITON", "lora_shortcut")
        assert other.via == "auto_scan" and "lora_shortcut" not in other.trace["path"]
        reordered = [e for e in other.trace["events"] if e["event"] == "reordered"]
        assert reordered and reordered[0]["to"] == "back"
        plain = select(MoELayer(quant=QuantScheme.fp8()), env={}, platform=preset("sm90"), policy=profile.name)
        assert plain.backend == "DEEPGEMM"  # FLASHINFER_CUTLASS under seeds: it moved behind DeepGEMM
    finally:
        profiles.unregister(profile.name)


def test_a_profile_reads_only_its_own_env_registry():
    only_deep_gemm = EnvRegistry.of(SEEDS.env["VLLM_USE_DEEP_GEMM"], SEEDS.env["VLLM_MOE_USE_DEEP_GEMM"],
                                    SEEDS.env["VLLM_ROCM_USE_AITER"], SEEDS.env["VLLM_ROCM_USE_AITER_MOE"])
    fp8 = SEEDS.policy(QuantFamily.FP8)
    steps = tuple(s for s in fp8.steps if s.name not in ("flashinfer_preference", "forced_marlin"))
    profile = profiles.register(dataclasses.replace(
        SEEDS, name="test-fewer-env", vllm_version=None, env=only_deep_gemm,
        policies=MappingProxyType({QuantFamily.FP8: dataclasses.replace(fp8, steps=steps)}),
    ))
    try:
        env = {"VLLM_USE_FLASHINFER_MOE_FP8": "maybe", "VLLM_TEST_FORCE_FP8_MARLIN": "1"}
        decision = select(MoELayer(quant=QuantScheme.fp8()), env=env, platform=preset("sm90"), policy=profile.name)
        assert decision.backend == "FLASHINFER_CUTLASS"  # neither variable is read by this profile
        with pytest.raises(NoPolicyError, match="no selection policy for family unquantized in profile test-fewer-env"):
            select(MoELayer(), env={}, platform=preset("sm90"), policy=profile.name)
    finally:
        profiles.unregister(profile.name)


def test_a_registry_of_another_profile_is_refused():
    from moe_fsm.backends.registry import Registry

    inputs = make_inputs(MoELayer(), env={}, platform=preset("sm90"), policy="seeds")
    other = profiles.register(dataclasses.replace(SEEDS, name="test-other", vllm_version=None))
    try:
        with pytest.raises(InputError, match="the registry serves profile 'test-other'"):
            decide(inputs, registry=Registry.builtin_only("test-other"))
    finally:
        profiles.unregister(other.name)


def test_every_policy_ends_with_a_step_whose_guard_always_holds():
    """An oracle's auto scan, or an engine's per-layer runner choice: the machine always has a way on."""
    from moe_fsm.fsm.runner_steps import LayerRunner

    for name in profiles.names():
        for policy in profiles.get(name).policies.values():
            assert isinstance(policy.steps[-1], (AutoScan, LayerRunner)), (name, policy.family)


def test_build_is_judged_apart_from_the_decision():
    """DP2xTP2 decides as vLLM does; build says moe-fsm cannot run that prepare/finalize here."""
    from moe_fsm.errors import BackendUnavailableError
    from moe_fsm.inputs.parallel import ParallelConfig

    for parallel in (ParallelConfig(tp_size=2, dp_size=2), ParallelConfig(tp_size=2, dp_size=2, ep_size=4)):
        decision = select(MoELayer(), parallel, env={}, platform=preset("sm90"), policy="seeds")
        assert decision.backend == "TRITON"
        assert decision.trace["build"]["experts"] == "TritonExperts"
        assert not decision.trace["build"]["prepare_finalize_buildable"]
        with pytest.raises(BackendUnavailableError, match="tp_size=1"):
            build(decision)


def test_a_kernel_moe_fsm_lacks_runs_as_its_named_substitute():
    """vLLM 0.33's NVFP4 emulation experts decide (with their own support conditions); moe-fsm builds its torch emulation."""
    decision = select(MoELayer(quant=QuantScheme.nvfp4()), backend="emulation", env={}, platform=preset("sm90-bare"),
                      policy="vllm-0.33")
    assert (decision.backend, decision.kernel) == ("EMULATION", "Nvfp4QuantizationEmulationTritonExperts")
    assert decision.trace["build"]["how"] == "substitute" and decision.runner == "TorchExperts"
    assert type(build(decision).experts).__name__ == "TorchExperts"
    with pytest.raises(Exception, match="LoRA"):
        select(MoELayer(quant=QuantScheme.nvfp4(), lora=True), backend="emulation", env={}, platform=preset("sm90-bare"),
               policy="vllm-0.33")
