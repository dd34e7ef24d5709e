"""The sglang-0.5.23 profile: each stage of SGLang 0.5.23's MoE runner resolution, on CPU.

Every expectation names the SGLang 0.5.23 source it comes from (srt/arg_groups/ for the server-argument
pipeline, srt/layers/quantization/*'s create_moe_runner for the per-layer choice); tools/sglang_parity.py runs
SGLang's own code against the whole profile.
"""

from __future__ import annotations

import pytest

from moe_fsm import MoELayer, ParallelConfig, QuantScheme, preset, replay, select
from moe_fsm.errors import BackendUnsupportedError, EnvVarError, NoBackendError, SelectionError
from moe_fsm.inputs.model_facts import ModelFacts
from moe_fsm.inputs.platform import Library, with_libraries
from moe_fsm.trace import schema
from moe_fsm.trace.document import canonical

POLICY = "sglang-0.5.23"
GPT_OSS = ModelFacts(architecture="GptOssForCausalLM")
QWEN3 = ModelFacts(architecture="Qwen3MoeForCausalLM")


def decide(layer=None, parallel=None, platform="sm90", env=None, backend="auto"):
    facts = preset(platform) if isinstance(platform, str) else platform
    decision = select(layer or MoELayer(), parallel, backend=backend, env=env or {}, platform=facts, policy=POLICY)
    schema.validate(decision.trace)
    return decision


def refusal(**kwargs) -> SelectionError:
    with pytest.raises(SelectionError) as caught:
        decide(**kwargs)
    schema.validate(caught.value.trace)
    return caught.value


def resolved(decision) -> dict:
    return decision.outcome["resolved"]


def fired(trace, step) -> list[str]:
    return [e["rule"] for e in trace["events"] if e["event"] == "rule" and e["step"] == step and e["fired"]]


# -- the explicit runner (argparse, srt/arg_groups/choices.py) ------------------------------------------------------

def test_an_explicit_runner_goes_through_the_pipeline_and_the_method_builds_it():
    decision = decide(MoELayer(quant=QuantScheme.fp8()), backend="deep_gemm")
    assert (decision.backend, decision.kernel) == ("DEEP_GEMM", "DeepGemmRunnerCore")
    assert "explicit_runner" in decision.trace["path"] and decision.outcome["via"] == "create_moe_runner"
    assert resolved(decision)["runner_kind"] == "MoeRunner"


def test_a_runner_sglang_does_not_offer_is_argparse_s_invalid_choice():
    err = refusal(backend="flashinfer_b12x")
    assert isinstance(err, BackendUnsupportedError)
    assert "argument --moe-runner-backend: invalid choice: 'flashinfer_b12x'" in err.message


def test_lora_runners_are_refused_as_not_modelled_by_name():
    err = refusal(backend="lora_triton")
    assert "does not model --moe-runner-backend lora_triton" in err.message


def test_the_megamoe_runner_is_an_alias_of_the_megamoe_all_to_all():
    """mega_moe_hook.handle_moe_runner_backend_alias: runner auto, a2a megamoe; ModelOpt NVFP4 then runs MegaMoE."""
    decision = decide(MoELayer(quant=QuantScheme.nvfp4()), parallel=ParallelConfig(tp_size=4), platform="sm100",
                      backend="megamoe")
    assert resolved(decision)["moe_a2a_backend"] == "megamoe" and resolved(decision)["ep_size"] == 4
    assert resolved(decision)["layer_runner"] == "flashinfer_trtllm"  # what get_moe_runner_backend reports
    assert decision.backend == "MEGAMOE"  # what runs: the block calls DeepGEMM's MegaMoE


# -- env overrides (srt/environ.py, get_bool_env_var) ----------------------------------------------------------------

def test_sglang_use_aiter_puts_bf16_layers_on_the_aiter_runner_when_the_ck_kernels_take_them():
    """unquant.py: _use_aiter and (auto or aiter) and supports_aiter(), when 128-aligned."""
    assert decide(platform="rocm-mi300").backend == "TRITON"
    assert decide(platform="rocm-mi300", env={"SGLANG_USE_AITER": "1"}).backend == "AITER"
    unaligned = MoELayer(intermediate_size=320)
    assert decide(unaligned, platform="rocm-mi300", env={"SGLANG_USE_AITER": "true"}).backend == "TRITON"
    err = refusal(layer=unaligned, platform="rocm-mi300", env={"SGLANG_USE_AITER": "1"}, backend="aiter")
    assert "moe_runner_backend=aiter is not supported" in err.message
    assert decide(platform="sm90", env={"SGLANG_USE_AITER": "1"}).backend == "TRITON"  # CUDA: _is_hip is False


def test_deepgemm_jit_switch_decides_fp8_under_deepep():
    """fp8.py is_deepgemm_moe_runner_backend_enabled: auto + DeepEP-style all-to-all + ENABLE_JIT_DEEPGEMM."""
    layer, deepep = MoELayer(quant=QuantScheme.fp8()), ParallelConfig(tp_size=8, a2a_backend="deepep")
    assert decide(layer, deepep).backend == "DEEP_GEMM"
    assert decide(layer, deepep, env={"SGLANG_ENABLE_JIT_DEEPGEMM": "0"}).backend == "TRITON"
    assert decide(layer, deepep, platform="sm90-bare").backend == "TRITON"  # deep_gemm not importable
    assert decide(layer).backend == "TRITON"  # no all-to-all


def test_a_value_the_two_sglang_readers_disagree_on_is_refused_by_name():
    """SGLANG_USE_AITER=yes: EnvBool reads on, get_bool_env_var reads off."""
    with pytest.raises(EnvVarError, match="SGLANG_USE_AITER"):
        decide(platform="rocm-mi300", env={"SGLANG_USE_AITER": "yes"})


def test_sglang_force_fp8_marlin_is_not_an_moe_switch():
    """0.5.23 reads SGLANG_FORCE_FP8_MARLIN in the dense FP8 linear methods only: --env refuses it here."""
    from moe_fsm import profiles

    assert "SGLANG_FORCE_FP8_MARLIN" not in profiles.get(POLICY).env


# -- model overrides (srt/arg_groups/model_overrides/*.py) ----------------------------------------------------------

def test_gpt_oss_on_hopper_picks_triton_kernel_when_importable():
    """gpt_oss.py: ep_size 1, is_triton_kernels_available(), no --quantization -> triton_kernel."""
    layer = MoELayer(quant=QuantScheme.mxfp4(), activation="swigluoai", model=GPT_OSS)
    with_tk = with_libraries(preset("sm90"), {Library.TRITON_KERNELS})
    decision = decide(layer, platform=with_tk)
    assert decision.backend == "TRITON_KERNELS" and "model_override" in decision.trace["path"]
    assert decide(layer).backend == "TRITON"  # triton_kernels not importable: auto, then Mxfp4MoEMethod's triton
    assert decide(layer, ParallelConfig(tp_size=2, ep_size=2), platform=with_tk).backend == "TRITON"
    err = refusal(layer=layer, parallel=ParallelConfig(tp_size=2, ep_size=2), platform=with_tk, backend="triton_kernel")
    assert err.message == "Triton kernel MoE is only supported when ep_size == 1"


def test_gpt_oss_on_blackwell_with_an_mxfp4_checkpoint_picks_flashinfer_mxfp4():
    layer = MoELayer(quant=QuantScheme.mxfp4(), activation="swigluoai", model=GPT_OSS)
    assert decide(layer, platform="sm100").backend == "FLASHINFER_MXFP4"
    assert decide(layer, platform="sm120").backend == "FLASHINFER_MXFP4"


def test_qwen3_on_sm100_picks_flashinfer_trtllm_without_an_all_to_all_only():
    """qwen3_moe.py: SM100, quantization None/fp8/modelopt_fp4, a2a none, auto."""
    layer = MoELayer(model=QWEN3)
    assert decide(layer, platform="sm100").backend == "FLASHINFER_TRTLLM"
    assert decide(layer, platform="sm90").backend == "TRITON"
    deepep = ParallelConfig(tp_size=4, a2a_backend="deepep")
    assert decide(layer, deepep, platform="sm100").backend == "TRITON"
    fp8 = decide(MoELayer(quant=QuantScheme.fp8(), model=QWEN3), platform="sm100")
    assert resolved(fp8)["quantization"] == "fp8" and fp8.backend == "FLASHINFER_TRTLLM"


def test_an_architecture_whose_override_is_not_modelled_is_refused_by_name():
    err = refusal(layer=MoELayer(model=ModelFacts(architecture="NemotronHForCausalLM")))
    assert "does not model the model override" in err.message


def test_an_architecture_without_an_override_skips_the_stage():
    decision = decide(MoELayer(model=ModelFacts(architecture="MixtralForCausalLM")), platform="sm100")
    assert "model_override" not in decision.trace["path"] and decision.backend == "TRITON"


# -- quantization constraints (overrides._moe_runner_backend_quant_constraints) --------------------------------------

def test_modelopt_fp4_on_sm120_resolves_auto_to_flashinfer_cutlass():
    layer = MoELayer(quant=QuantScheme.nvfp4(), model=ModelFacts(quantization="modelopt_fp4"))
    decision = decide(layer, platform="sm120")
    assert decision.backend == "FLASHINFER_CUTLASS" and fired(decision.trace, "quant_constraint")
    assert decide(MoELayer(quant=QuantScheme.nvfp4()), platform="sm120").backend == "FLASHINFER_TRTLLM"  # no flag


def test_mxfp8_overrides_a_runner_it_does_not_take_with_its_default():
    layer = MoELayer(quant=QuantScheme.mxfp8(), model=ModelFacts(quantization="mxfp8"))
    assert decide(layer, platform="sm100").backend == "FLASHINFER_TRTLLM"
    overridden = decide(layer, platform="sm100", backend="triton")
    assert overridden.backend == "FLASHINFER_TRTLLM"
    assert resolved(overridden)["moe_runner_backend"] == "flashinfer_trtllm"
    assert decide(layer, platform="sm100", backend="deep_gemm").backend == "DEEP_GEMM"


def test_nvfp4_online_is_refused_off_sm100():
    err = refusal(layer=MoELayer(quant=QuantScheme.nvfp4(), model=ModelFacts(quantization="nvfp4_online")))
    assert err.message.startswith("--quantization nvfp4_online is supported only on NVIDIA Blackwell")


def test_flashinfer_cutlass_refuses_a_quantization_it_does_not_take():
    """moe_hook.handle_moe_kernel_config's assert."""
    err = refusal(layer=MoELayer(quant=QuantScheme.fp8(), model=ModelFacts(quantization="fp8")),
                  backend="flashinfer_cutlass")
    assert "FlashInfer Cutlass MOE supports only" in err.message


# -- all-to-all constraints (moe_hook.handle_a2a_moe, overrides._a2a_ep_size) ---------------------------------------

def test_deepep_v2_forces_deep_gemm_and_ep_size_tp_size():
    layer = MoELayer(model=ModelFacts(architecture="DeepseekV3ForCausalLM"))
    decision = decide(layer, ParallelConfig(tp_size=8, a2a_backend="deepep_v2"))
    assert decision.backend == "DEEP_GEMM" and resolved(decision)["ep_size"] == 8
    err = refusal(layer=layer, parallel=ParallelConfig(tp_size=8, a2a_backend="deepep_v2"), backend="triton")
    assert "DeepEP v2 MoE currently supports only --moe-runner-backend deep_gemm" in err.message
    err = refusal(layer=MoELayer(), parallel=ParallelConfig(tp_size=8, a2a_backend="deepep_v2"))
    assert "DeepEP v2 MoE is not validated" in err.message


def test_pplx_forces_deep_gemm_low_latency_and_needs_attention_dp():
    decision = decide(MoELayer(quant=QuantScheme.fp8()), ParallelConfig(tp_size=4, dp_size=4, a2a_backend="pplx"))
    assert decision.backend == "DEEP_GEMM"
    assert (resolved(decision)["deepep_mode"], resolved(decision)["ep_size"]) == ("low_latency", 4)
    err = refusal(parallel=ParallelConfig(tp_size=4, a2a_backend="pplx"))
    assert "requires attention DP with at least 2 groups" in err.message
    err = refusal(parallel=ParallelConfig(tp_size=4, dp_size=4, a2a_backend="pplx", deepep_mode="normal"))
    assert "only supports low-latency mode" in err.message


def test_a_fused_only_runner_needs_a_fused_function_for_the_all_to_all():
    """MoeRunner: Marlin has no runner core and no fused function under DeepEP."""
    err = refusal(layer=MoELayer(quant=QuantScheme.nvfp4()), parallel=ParallelConfig(tp_size=4, a2a_backend="deepep"))
    assert isinstance(err, NoBackendError)
    assert err.message == "Runner backend marlin requires a fused func for a2a backend deepep, but none is registered."


# -- the per-quantization automatic choice (create_moe_runner) ------------------------------------------------------

@pytest.mark.parametrize("layer, platform, backend", [
    (MoELayer(), "sm90", "TRITON"),                                          # unquant.py: otherwise TRITON
    (MoELayer(quant=QuantScheme.fp8()), "sm100", "TRITON"),                   # fp8.py: no DeepEP-style all-to-all
    (MoELayer(quant=QuantScheme.nvfp4()), "sm80", "MARLIN"),                  # modelopt_quant.py: SM80-9x -> marlin
    (MoELayer(quant=QuantScheme.nvfp4()), "sm100", "FLASHINFER_TRTLLM"),      # else flashinfer_trtllm
    (MoELayer(quant=QuantScheme.mxfp4()), "sm90", "TRITON"),                  # mxfp4.py: auto -> triton
    (MoELayer(quant=QuantScheme.int_wna16(checkpoint="compressed-tensors")), "sm90", "MARLIN"),
    (MoELayer(quant=QuantScheme.int_wna16(checkpoint="compressed-tensors")), "sm100", "TRITON"),
    (MoELayer(quant=QuantScheme.int_wna16(checkpoint="compressed-tensors", zero_point=True)), "sm100", "MARLIN"),
    (MoELayer(quant=QuantScheme.int_wna16(checkpoint="gptq")), "sm90", "MARLIN"),   # gptq_marlin
    (MoELayer(quant=QuantScheme.int_wna16(checkpoint="moe_wna16")), "sm90", "TRITON"),
])
def test_auto_per_quantization(layer, platform, backend):
    assert decide(layer, platform=platform).backend == backend


def test_w4afp8_calls_its_cutlass_kernel_and_reports_no_runner():
    decision = decide(MoELayer(quant=QuantScheme.w4a8()), backend="triton")
    assert decision.backend == "CUTLASS_W4A8" and resolved(decision)["layer_runner"] is None


def test_fp8_runs_its_experts_on_triton_under_a_runner_pinned_for_nvfp4():
    """fp8.py: flashinfer_cutlass and flashinfer_cutedsl have no FP8 MoE path."""
    decision = decide(MoELayer(quant=QuantScheme.fp8()), platform="sm120", backend="flashinfer_cutlass")
    assert decision.backend == "TRITON" and resolved(decision)["moe_runner_backend"] == "flashinfer_cutlass"


def test_compressed_tensors_fp8_builds_no_runner_for_deep_gemm():
    layer = MoELayer(quant=QuantScheme.fp8(), model=ModelFacts(quant_method="compressed-tensors"))
    err = refusal(layer=layer, backend="deep_gemm")
    assert "builds no MoE runner for --moe-runner-backend deep_gemm" in err.message


def test_gptq_marlin_asserts_the_runner_is_auto():
    err = refusal(layer=MoELayer(quant=QuantScheme.int_wna16(checkpoint="gptq")), backend="triton")
    assert "asserts --moe-runner-backend auto" in err.message


def test_hpc_ops_needs_fp8_layers():
    err = refusal(layer=MoELayer(), backend="hpc_ops")
    assert "hpc_ops only supports Fp8MoEMethod" in err.message


def test_a_method_the_profile_does_not_model_is_refused_by_name():
    err = refusal(layer=MoELayer(quant=QuantScheme.fp8(), model=ModelFacts(quant_method="w8a8_fp8")))
    assert "quantization method 'w8a8_fp8' are not modelled" in err.message


# -- speculative draft layers (overrides._speculative_moe_runner_default) -------------------------------------------

def test_a_draft_layer_under_deepep_v2_is_refused():
    layer = MoELayer(model=ModelFacts(architecture="DeepseekV3ForCausalLM", draft=True))
    err = refusal(layer=layer, parallel=ParallelConfig(tp_size=8, a2a_backend="deepep_v2"))
    assert "not validated as a speculative draft backend" in err.message


def test_a_draft_layer_inherits_the_target_runner():
    layer = MoELayer(model=ModelFacts(architecture="Qwen3MoeForCausalLM", draft=True))
    decision = decide(layer, platform="sm100")
    assert "speculative_default" in decision.trace["path"] and decision.backend == "FLASHINFER_TRTLLM"


# -- the inputs are recorded and replay ---------------------------------------------------------------------------

def test_the_new_inputs_are_recorded_and_replay():
    layer = MoELayer(quant=QuantScheme.fp8(), model=ModelFacts(architecture="DeepseekV3ForCausalLM", draft=False))
    decision = decide(layer, ParallelConfig(tp_size=8, a2a_backend="deepep", deepep_mode="low_latency"))
    inputs = decision.trace["inputs"]
    assert inputs["layer"]["model"]["architecture"] == "DeepseekV3ForCausalLM"
    assert (inputs["parallel"]["a2a_backend"], inputs["parallel"]["deepep_mode"]) == ("deepep", "low_latency")
    assert replay(decision.trace) == canonical(decision.trace)


def test_vllm_traces_do_not_record_the_engine_inputs():
    decision = select(MoELayer(), env={}, platform=preset("sm90"), policy="vllm-0.33")
    assert "model" not in decision.trace["inputs"]["layer"]
    assert "a2a_backend" not in decision.trace["inputs"]["parallel"]
    assert "resolved" not in decision.outcome


# -- what the parity run against SGLang's own code found (tools/sglang_parity.py) -----------------------------------

def test_nvfp4_off_blackwell_takes_only_the_marlin_fallback():
    """ModelOptNvFp4FusedMoEMethod.__init__: off Blackwell, auto on SM80-9x or an explicit marlin."""
    layer = MoELayer(quant=QuantScheme.nvfp4())
    assert decide(layer, platform="sm90", backend="marlin").backend == "MARLIN"
    for platform, backend in (("sm90", "triton"), ("rocm-mi300", "auto"), ("cpu", "auto")):
        err = refusal(layer=layer, platform=platform, backend=backend)
        assert err.message.startswith("Current platform does not support NVFP4 quantization"), (platform, backend)


def test_fp8_cutlass_asserts_block_weights_and_its_gpus():
    """Fp8MoEMethod.__init__: cutlass_fp8_supported(), block quantization, SM90/SM100/SM120."""
    assert decide(MoELayer(quant=QuantScheme.fp8("block")), backend="cutlass").backend == "CUTLASS"
    assert "requires block quantization" in refusal(layer=MoELayer(quant=QuantScheme.fp8("channel")),
                                                    backend="cutlass").message
    assert "CUDA 12.0+ with SM90" in refusal(layer=MoELayer(quant=QuantScheme.fp8("block")), platform="sm80",
                                            backend="cutlass").message


def test_moe_runner_refuses_intel_xpu_and_takes_hpc_ops_on_a_gfx9_gpu():
    """runner.py: intel_xpu has no runner core; hpc_ops checks torch's capability major, which is 9 on gfx9 too."""
    err = refusal(layer=MoELayer(quant=QuantScheme.nvfp4()), platform="sm100", backend="intel_xpu")
    assert isinstance(err, NoBackendError) and "Unsupported runner backend" in err.message
    assert decide(MoELayer(quant=QuantScheme.fp8()), platform="rocm-mi355", backend="hpc_ops").backend == "HPC_OPS"


def test_megamoe_needs_a_hopper_or_blackwell_gpu_or_rocm():
    """mega_moe_hook.check_mega_moe_compat."""
    err = refusal(layer=MoELayer(quant=QuantScheme.nvfp4()), parallel=ParallelConfig(tp_size=4), platform="sm120",
                  backend="megamoe")
    assert err.message.startswith("--moe-a2a-backend megamoe needs a CUDA SM90 GPU")


def test_block_fp8_with_sglang_int4_weight_on_rocm_is_sglang_s_crash():
    err = refusal(layer=MoELayer(quant=QuantScheme.fp8("block")), platform="rocm-mi300",
                  env={"SGLANG_INT4_WEIGHT": "1"})
    assert "UnboundLocalError" in err.message


def test_the_layer_is_paired_as_one_rank_and_built_only_for_one():
    """SGLang's dispatcher is SGLang's: moe-fsm runs the layer as one rank."""
    one = decide(MoELayer())
    assert one.trace["build"]["prepare_finalize_buildable"]
    many = decide(MoELayer(), ParallelConfig(tp_size=4, a2a_backend="deepep"))
    assert many.prepare_finalize.name == "LocalPrepareFinalize"
    assert "deepep dispatcher over tp_size=4, ep_size=4" in many.prepare_finalize.reason
    assert not many.trace["build"]["prepare_finalize_buildable"]
