"""The machine itself, the trace contract, the inputs' validation and the public registry."""

import json

import pytest

from moe_fsm import profiles
from moe_fsm.backends.registry import Registry, default_registry
from moe_fsm.backends.requirements import OnVendor
from moe_fsm.backends.specs import BackendSpec, KernelSpec
from moe_fsm.backends.verdict import SupportContext
from moe_fsm.decision import DecisionInputs, decide, make_inputs, replay, select
from moe_fsm.errors import EnvVarError, InputError, NoBackendError, SelectionError
from moe_fsm.fsm.machine import machine_for, mermaid
from moe_fsm.fsm.policy import TERMINAL_STATES
from moe_fsm.inputs.env import ENV_VARS, EnvSnapshot
from moe_fsm.inputs.layer import MoELayer
from moe_fsm.inputs.parallel import ParallelConfig
from moe_fsm.inputs.platform import Vendor, preset
from moe_fsm.inputs.quant import QuantFamily, QuantScheme
from moe_fsm.inputs.request import BackendRequest
from moe_fsm.inputs.formats import ActivationFormat
from moe_fsm.trace.document import canonical, dumps


SEEDS = profiles.get("seeds")
SEEDS_ENV = SEEDS.env


def test_each_policy_machine_is_built_once():
    for policy in SEEDS.policies.values():
        assert machine_for(policy) is machine_for(policy)


def test_every_state_is_in_the_diagram():
    for policy in SEEDS.policies.values():
        diagram = mermaid(policy)
        for state in (*(s.name for s in policy.steps), *TERMINAL_STATES):
            assert state in diagram


def test_every_policy_ends_with_auto_scan_and_names_existing_backends():
    registry = default_registry("seeds")
    for family, policy in SEEDS.policies.items():
        assert policy.steps[-1].name == "auto_scan"
        named = set(policy.user_names.values()) | set(policy.batched_variants.values())
        for backends in policy.priority.values():
            named |= set(backends)
        assert named <= set(registry.backends[family]), family


def test_deciding_twice_gives_byte_identical_canonical_traces():
    inputs = make_inputs(MoELayer(quant=QuantScheme.fp8()), env={}, platform=preset("sm90"))
    first, second = decide(inputs).trace, decide(inputs).trace
    assert dumps(first, include_volatile=False) == dumps(second, include_volatile=False)
    assert first["volatile"]["started_at"] <= second["volatile"]["started_at"]


def test_a_failed_selection_writes_its_trace_before_raising(tmp_path):
    path = tmp_path / "nested" / "trace.json"
    with pytest.raises(NoBackendError) as info:
        select(MoELayer(quant=QuantScheme.nvfp4(), swiglu_limit=7.0), env={}, platform=preset("sm90"), trace_path=path)
    written = json.loads(path.read_text())
    assert written == info.value.trace
    assert written["outcome"]["status"] == "failed"
    assert written["outcome"]["error"]["builtin"] == "NotImplementedError"
    assert info.value.trace_path == str(path)


def test_the_trace_alone_replays_the_decision():
    decision = select(MoELayer(quant=QuantScheme.nvfp4()), backend={"nvfp4": "flashinfer_b12x"}, env={}, platform=preset("sm121"))
    document = json.loads(json.dumps(decision.trace))
    assert replay(document) == canonical(decision.trace)
    assert DecisionInputs.from_json(document["inputs"]) == decision.inputs


def test_untraced_decisions_reach_the_same_outcome():
    inputs = make_inputs(MoELayer(quant=QuantScheme.fp8()), env={}, platform=preset("cpu"))
    traced, untraced = decide(inputs), decide(inputs, trace=False)
    assert (traced.backend, traced.kernel) == (untraced.backend, untraced.kernel)
    assert untraced.trace["events"] == []


def test_env_registry_rejects_bad_values_naming_variable_and_accepted_values():
    with pytest.raises(EnvVarError, match=r"VLLM_USE_FLASHINFER_MOE_FP8='maybe' is not valid; accepted values: 0 or 1"):
        SEEDS_ENV.reader(EnvSnapshot.from_mapping({"VLLM_USE_FLASHINFER_MOE_FP8": "maybe"}))
    with pytest.raises(EnvVarError, match=r"VLLM_FLASHINFER_MOE_BACKEND='fast' is not valid; accepted values: throughput, latency, masked_gemm"):
        select(MoELayer(), env={"VLLM_FLASHINFER_MOE_BACKEND": "fast"}, platform=preset("sm90"), policy="seeds")
    with pytest.raises(InputError, match="unknown environment variable"):
        EnvSnapshot.from_mapping({"VLLM_USE_FLASHINFER_MOE_FP9": "1"}, strict_names=True)


def test_env_snapshot_tells_unset_from_default():
    env = SEEDS_ENV.reader(EnvSnapshot.from_mapping({"VLLM_USE_DEEP_GEMM": "1", "PATH": "/bin"}))
    assert env.is_set("VLLM_USE_DEEP_GEMM") and env.value("VLLM_USE_DEEP_GEMM") is True
    assert not env.is_set("VLLM_MOE_USE_DEEP_GEMM") and env.value("VLLM_MOE_USE_DEEP_GEMM") is True
    assert set(ENV_VARS) >= {"VLLM_USE_FLASHINFER_MOE_FP16", "VLLM_ROCM_USE_AITER_MOE", "VLLM_TEST_FORCE_FP8_MARLIN"}


def test_inputs_reject_bad_values_with_what_is_accepted():
    with pytest.raises(InputError, match="top_k=9 exceeds num_experts=8"):
        MoELayer(top_k=9)
    with pytest.raises(InputError, match=r"activation 'relu' is not one of \['silu', 'swigluoai', 'gelu'\]"):
        MoELayer(activation="relu")
    with pytest.raises(InputError, match="FP8 weight_scale 'row' is not one of"):
        QuantScheme.fp8("row")
    with pytest.raises(InputError, match="platform preset 'sm99' is not one of"):
        preset("sm99")
    with pytest.raises(InputError, match="backend mapping key 'int4' is not a quantization family"):
        BackendRequest.parse({"int4": "marlin"})
    with pytest.raises(InputError, match="all2all 'nccl' is not one of"):
        ParallelConfig(all2all="nccl")


def test_request_parsing():
    request = BackendRequest.parse("NVFP4=FlashInfer-B12X, fp8=triton")
    assert request.for_family(QuantFamily.NVFP4) == "flashinfer_b12x"
    assert request.for_family(QuantFamily.FP8) == "triton"
    assert request.for_family(QuantFamily.UNQUANTIZED) == "auto"
    assert BackendRequest.parse(request.to_json()) == request


def test_inputs_round_trip_through_json():
    inputs = make_inputs(
        MoELayer(quant=QuantScheme.fp8("channel", "token"), swiglu_limit=7, lora=True),
        ParallelConfig(dp_size=2, ep_size=2, all2all="torch_all2all"),
        {"fp8": "triton"}, {"VLLM_USE_DEEP_GEMM": "0"}, preset("rocm-mi355"),
    )
    assert DecisionInputs.from_json(json.loads(json.dumps(inputs.to_json()))) == inputs
    assert hash(inputs) == hash(DecisionInputs.from_json(inputs.to_json()))


def test_registry_answers_any_backend_directly():
    registry = default_registry("seeds")
    ctx = SupportContext(MoELayer(quant=QuantScheme.nvfp4()), ParallelConfig(), preset("sm90"), SEEDS_ENV.reader(EnvSnapshot()), ActivationFormat.STANDARD)
    verdict = registry.verdict(QuantFamily.NVFP4, "FLASHINFER_TRTLLM", ctx)
    assert not verdict.supported
    assert verdict.reason == "needs compute capability 10.x, this is 9.0"
    assert registry.verdict(QuantFamily.NVFP4, "MARLIN", ctx).kernel == "MarlinExperts"
    assert "flashinfer.cutlass_fused_moe is not installed" in registry.verdict(
        QuantFamily.FP8, "FLASHINFER_CUTLASS",
        SupportContext(MoELayer(quant=QuantScheme.fp8()), ParallelConfig(), preset("sm90-bare"), SEEDS_ENV.reader(EnvSnapshot()), ActivationFormat.STANDARD),
    ).reason


def test_plugins_register_backends_tried_after_the_builtins():
    registry = Registry.builtin_only()
    registry.register_kernel(KernelSpec("TpuPluginExperts", ActivationFormat.STANDARD, (OnVendor((Vendor.TPU,)),)))
    registry.register_backend(BackendSpec("TPU_PLUGIN", QuantFamily.FP8, ("TpuPluginExperts",)), "tpu_plugin")
    layer = MoELayer(quant=QuantScheme.fp8())
    decision = decide(make_inputs(layer, env={}, platform=preset("tpu"), policy="seeds"), registry=registry)
    assert (decision.backend, decision.kernel) == ("TPU_PLUGIN", "TpuPluginExperts")
    explicit = decide(make_inputs(layer, backend="tpu_plugin", env={}, platform=preset("tpu"), policy="seeds"), registry=registry)
    assert explicit.via == "explicit_user_choice"
    with pytest.raises(InputError, match="reserved by a built-in backend"):
        registry.register_backend(BackendSpec("TRITON", QuantFamily.FP8, ("TpuPluginExperts",)), "triton2")
    with pytest.raises(InputError, match="unregistered kernel"):
        registry.register_backend(BackendSpec("OTHER", QuantFamily.FP8, ("NoSuchExperts",)), "other")


def test_selection_errors_subclass_the_builtin_types_vllm_raises():
    with pytest.raises(SelectionError):
        select(MoELayer(quant=QuantScheme.fp8()), backend="emulation", env={}, platform=preset("sm90"))
