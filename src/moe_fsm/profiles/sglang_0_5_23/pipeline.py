"""SGLang 0.5.23's server-argument pipeline for the MoE runner, as the stages every family's machine shares.

``srt/arg_groups/pipeline.py`` (``run_resolution_pipeline``) calls, in this order, the hooks that decide
``moe_runner_backend``: the runner alias (``mega_moe_hook.handle_moe_runner_backend_alias``), the
per-architecture model overrides (``model_hook.handle_model_specific_adjustments``: the
``arg_groups/model_overrides/*.py`` declarations, then the DeepSeek family's ``_deepseek_moe_quant_resolution``),
the quantization constraints and the runner/quantization asserts (``moe_hook.handle_moe_kernel_config``:
``overrides._moe_runner_backend_quant_constraints``), the all-to-all constraints (``moe_hook.handle_a2a_moe``:
``_a2a_ep_size`` and the per-backend rules), and the speculative default
(``overrides._speculative_moe_runner_default``, for the draft model's layers). Each hook is one stage here,
its ``if`` statements ``Rule`` objects in source order; ``docs/profiles.md`` maps them onto the machine.

What the inputs cannot say is assumed and named where it matters: CUDA is 12.8 or newer (SGLang's
``is_sm100`` needs it), the NVIDIA driver is older than 595 (GPT-OSS on Blackwell keeps ``triton_kernel``),
no waterfill, no DSA context parallelism, no FlashInfer A2A dispatch type, token budgets that fit, and
``--quantization`` names SGLang's method (``modelopt_fp4``, not ``modelopt``).
"""

from __future__ import annotations

from moe_fsm.backends.requirements import CudaCapability
from moe_fsm.errors import NoBackendError
from moe_fsm.inputs.platform import Vendor
from moe_fsm.fsm.runner_steps import (
    First, Resolved, Rule, ServerArgs, Stage, Value, is_, is_not, resolved_value,
)
from moe_fsm.inputs.quant import QuantFamily
from moe_fsm.profiles.sglang_0_5_23.facts import (
    AITER, DRAFT, GFX95, HIP, KIMI_INT4, LORA, NOT_AMX_CPU, NOT_CPU, SM100, SM110_OR_SM120, SM120, TRITON_KERNELS,
    architecture, env_on, model, negated, not_architecture_prefix,
)

# srt/arg_groups/choices.py
RUNNER_CHOICES = (
    "auto", "deep_gemm", "triton", "triton_kernel", "flashinfer_trtllm", "experimental_sgl_trtllm",
    "flashinfer_trtllm_routed", "flashinfer_cutlass", "flashinfer_mxfp4", "flashinfer_cutedsl", "flashinfer_megamoe",
    "cutlass", "aiter", "marlin", "humming", "experimental_sgl_marlin", "lora_cutedsl", "lora_triton", "lora_marlin",
    "hpc_ops", "megamoe", "intel_xpu",
)
MXFP8_RUNNER_CHOICES = ("cutlass", "deep_gemm", "flashinfer_megamoe", "flashinfer_trtllm", "flashinfer_trtllm_routed")
# Runners whose server validation needs flags moe-fsm does not model (LoRA's, the experimental runners' policies).
NOT_MODELLED_RUNNERS = ("lora_cutedsl", "lora_triton", "lora_marlin", "experimental_sgl_marlin",
                        "experimental_sgl_trtllm")
# overrides._A2A_EP_SPANNING_BACKENDS: all-to-all backends that set ep_size = tp_size.
EP_SPANNING = ("megamoe", "deepep", "deepep_v2", "mooncake", "nixl", "ascend_fuseep", "flashinfer",
               "flashinfer_megamoe", "mori", "pplx")
# configs/moe_model_registry._DEEPEP_V2_MODELS
DEEPEP_V2_MODELS = ("DeepseekV3ForCausalLM", "DeepseekV4ForCausalLM", "Qwen3MoeForCausalLM",
                    "Glm5NextForConditionalGeneration", "GlmMoeDsaForCausalLM", "MiMoV2ForCausalLM",
                    "MiMoV2FlashForCausalLM")
# moe_hook.validate_flashinfer_megamoe_model
MEGAMOE_MODELS = ("BeamForCausalLM", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM",
                  "DeepseekV4ForCausalLM", "Glm4MoeForCausalLM", "GlmMoeDsaForCausalLM", "NemotronHForCausalLM",
                  "NemotronHPuzzleForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM",
                  "KimiK3ForConditionalGeneration", "KimiK3LinearForCausalLM")

GPT_OSS = ("GptOssForCausalLM",)
QWEN3_FAMILY = ("Qwen3MoeForCausalLM", "Qwen3VLMoeForConditionalGeneration", "Qwen3NextForCausalLM",
                "Qwen3_5MoeForConditionalGeneration", "InternS2PreviewForConditionalGeneration",
                "Qwen3_5ForConditionalGeneration", "Qwen4ExpForConditionalGeneration")
GLM4_MOE = ("Glm4MoeForCausalLM",)
LLAMA4 = ("Llama4ForConditionalGeneration", "Llama4ForCausalLM")
# overrides._DEEPSEEK_FAMILY_ARCHS, less HYV4 (its MXFP8 DeepGEMM default is not modelled: below)
DEEPSEEK_FAMILY = ("DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM", "KimiK25ForConditionalGeneration",
                   "MistralLarge3ForCausalLM", "PixtralForConditionalGeneration", "GlmMoeDsaForCausalLM",
                   "Glm5NextForConditionalGeneration", "LongcatFlashForCausalLM", "LongcatFlashForCausalLMNextN",
                   "Dots3NoteForCausalLM")
# Architectures whose model override sets the MoE runner or all-to-all backend in ways this profile does not model
# (they read config fields or flags moe-fsm's inputs lack): refused by name rather than decided as if none applied.
NOT_MODELLED_ARCHS = (
    "MiniMaxM3SparseForCausalLM", "MiniMaxM3SparseForConditionalGeneration", "NemotronHForCausalLM",
    "NemotronHPuzzleForCausalLM", "NemotronH_Omni_Reasoning_V3", "Cohere2VisionForConditionalGeneration",
    "Cohere2MoeForCausalLM", "KimiK3ForConditionalGeneration", "MiniMaxM2ForCausalLM", "DeepseekV4ForCausalLM",
    "BailingMoeV3ForCausalLM", "BailingMoeV3VLForConditionalGeneration", "Gemma4ForConditionalGeneration",
    "Gemma4ForCausalLM", "Gemma4UnifiedForConditionalGeneration", "DiffusionGemmaForBlockDiffusion",
    "BeamForCausalLM", "InternS2MobiusForConditionalGeneration", "HYV4ForCausalLM", "HYV4ForCausalLMNextN",
)
OVERRIDE_ARCHS = GPT_OSS + QWEN3_FAMILY + GLM4_MOE + LLAMA4 + DEEPSEEK_FAMILY + NOT_MODELLED_ARCHS

RUNNER, A2A, QUANT = "moe_runner_backend", "moe_a2a_backend", "quantization"

# The quant_method a checkpoint of each scheme usually declares, when the caller names none.
DEFAULT_METHOD = {
    QuantFamily.UNQUANTIZED: None, QuantFamily.FP8: "fp8", QuantFamily.MXFP8: "mxfp8",
    QuantFamily.NVFP4: "modelopt_fp4", QuantFamily.MXFP4: "mxfp4", QuantFamily.W4A8: "w4afp8",
    QuantFamily.INT8: "w8a8_int8",
}


def checkpoint_method(run) -> str | None:
    """The quant_method the checkpoint declares: given, else the layer scheme's usual one."""
    facts = model(run.ctx)
    if facts.quant_method is not None:
        return facts.quant_method
    quant = run.ctx.layer.quant
    if quant.family is QuantFamily.INT_WNA16:
        return quant.checkpoint
    return DEFAULT_METHOD.get(quant.family)


def _quantization_flag(run) -> str | None:
    flag = model(run.ctx).quantization
    return None if flag == "unquant" else flag  # serving_hook: --quantization unquant is None, explicitly


SERVER_ARGS = ServerArgs("server_args", seed={
    RUNNER: Value("--moe-runner-backend", lambda run: run.request),
    A2A: Value("--moe-a2a-backend", lambda run: run.ctx.parallel.a2a_backend or "none"),
    QUANT: Value("--quantization", _quantization_flag),
    "quantization_explicitly_unset": Value("--quantization unquant",
                                           lambda run: model(run.ctx).quantization == "unquant"),
    "quant_method": Value("the checkpoint's quant_method", checkpoint_method),
    "tp_size": Value("--tp-size", lambda run: run.ctx.parallel.tp_size),
    "ep_size": Value("--ep-size", lambda run: run.ctx.parallel.ep_size),
    "attn_dp_size": Value("--attn-dp-size (moe-fsm's dp_size)", lambda run: run.ctx.parallel.dp_size),
    "deepep_mode": Value("--deepep-mode", lambda run: run.ctx.parallel.deepep_mode),
    "intermediate_size": Value("the layer's intermediate size", lambda run: run.ctx.layer.intermediate_size),
})

EXPLICIT_RUNNER = Stage("explicit_runner", when=(is_not(RUNNER, "auto"),), rules=(
    Rule("argparse: --moe-runner-backend takes one of MOE_RUNNER_BACKEND_CHOICES",
         when=(Resolved("moe_runner_backend is not a choice", (RUNNER,), lambda v: v not in RUNNER_CHOICES),),
         fail="argument --moe-runner-backend: invalid choice: {moe_runner_backend!r} (choose from "
              + ", ".join(RUNNER_CHOICES) + ")"),
    Rule("LoRA and experimental runners: their server validation needs flags moe-fsm does not model",
         when=(is_(RUNNER, *NOT_MODELLED_RUNNERS),),
         fail="moe-fsm's sglang-0.5.23 profile does not model --moe-runner-backend {moe_runner_backend} "
              "(SGLang validates it against LoRA and experimental-runner flags moe-fsm's inputs lack)"),
))

MEGA_MOE_GPUS = CudaCapability(families=(9, 10), also=(Vendor.ROCM,))
MEGA_MOE = Stage("mega_moe", when=(Resolved("moe_runner_backend or moe_a2a_backend is megamoe", (RUNNER, A2A),
                                            lambda runner, a2a: "megamoe" in (runner, a2a)),), rules=(
    # mega_moe_hook.handle_mega_moe
    Rule("handle_moe_runner_backend_alias: --moe-runner-backend megamoe is --moe-a2a-backend megamoe with the runner "
         "on auto", when=(is_(RUNNER, "megamoe"),), sets={RUNNER: "auto", A2A: "megamoe"}),
    Rule("check_mega_moe_compat: megamoe runs DeepGEMM on a CUDA SM90 or SM100-class GPU, or aiter on ROCm",
         when=(is_(A2A, "megamoe"), negated(MEGA_MOE_GPUS, "not a CUDA SM90 or SM100-class GPU, nor ROCm")),
         fail="--moe-a2a-backend megamoe needs a CUDA SM90 GPU (block-FP8 experts) or an SM100-class GPU (MXFP4 / "
              "NVFP4 experts); it runs DeepGEMM kernels over CUDA symmetric memory. On ROCm, set "
              "SGLANG_AMD_USE_FLYDSL_MEGA_MOE=1 to select aiter MegaMoEv2 instead."),
))

_AUTO = is_(RUNNER, "auto")
_UNSET_QUANT = (is_(QUANT, None), is_("quantization_explicitly_unset", False), is_not("quant_method", None))


IS_GPT_OSS = architecture(*GPT_OSS)
IS_QWEN3 = architecture(*QWEN3_FAMILY, text="in the Qwen3 MoE family")
IS_GLM4_MOE = architecture(*GLM4_MOE)
IS_LLAMA4 = architecture(*LLAMA4, text="Llama 4")
IS_DEEPSEEK = architecture(*DEEPSEEK_FAMILY, text="in the DeepSeek family")


def _quant_from_checkpoint(archs, where: str) -> Rule:
    return Rule(f"{where}: on SM100 an unset --quantization takes the checkpoint's quant_method",
                when=(archs, SM100, *_UNSET_QUANT), sets={QUANT: resolved_value("quant_method")})


MODEL_OVERRIDE = Stage("model_override", when=(architecture(*OVERRIDE_ARCHS, text="one with a MoE model override"),),
                       rules=(
    Rule("this architecture's model override is not modelled by moe-fsm",
         when=(architecture(*NOT_MODELLED_ARCHS, text="one whose override moe-fsm does not model"),),
         fail="moe-fsm's sglang-0.5.23 profile does not model the model override SGLang applies to this "
              "architecture (it sets the MoE runner from checkpoint fields or flags moe-fsm's inputs lack)"),
    # model_overrides/gpt_oss.py: one if/elif chain, only while the runner is auto
    First((
        Rule("gpt_oss: SM100 with an MXFP4 checkpoint -> flashinfer_mxfp4",
             when=(IS_GPT_OSS, _AUTO, SM100, is_("quant_method", "mxfp4")),
             sets={RUNNER: "flashinfer_mxfp4"}),
        Rule("gpt_oss: SM120 with an MXFP4 checkpoint -> flashinfer_mxfp4 (FlashInfer CUTLASS MXFP4)",
             when=(IS_GPT_OSS, _AUTO, SM120, is_("quant_method", "mxfp4")),
             sets={RUNNER: "flashinfer_mxfp4"}),
        Rule("gpt_oss: ROCm with SGLANG_USE_AITER and an MXFP4 checkpoint keeps auto (the aiter MXFP4 kernel)",
             when=(IS_GPT_OSS, _AUTO, AITER, is_("quant_method", "mxfp4")), sets={RUNNER: "auto"}),
        Rule("gpt_oss: ROCm with SGLANG_USE_AITER and a BF16 checkpoint -> triton",
             when=(IS_GPT_OSS, _AUTO, AITER), sets={RUNNER: "triton"}),
        Rule("gpt_oss: ep_size 1, triton_kernels importable, no --quantization, not an AMX CPU -> triton_kernel "
             "(an NVIDIA driver >= 595 on Blackwell would take triton: moe-fsm assumes an older driver)",
             when=(IS_GPT_OSS, _AUTO, is_("ep_size", 1), TRITON_KERNELS, is_(QUANT, None), NOT_AMX_CPU),
             sets={RUNNER: "triton_kernel"}),
    )),
    Rule("model_hook (GptOssForCausalLM): Triton kernel MoE is only supported when ep_size == 1",
         when=(IS_GPT_OSS, is_(RUNNER, "triton_kernel"), is_not("ep_size", 1)),
         fail="Triton kernel MoE is only supported when ep_size == 1"),
    # model_overrides/qwen3_moe.py (SM100 only; the W4A16-NVFP4 modelopt_mixed branch needs --quantization
    # modelopt_mixed, which this profile does not model)
    _quant_from_checkpoint(IS_QWEN3, "qwen3_moe"),
    Rule("qwen3_moe: SM100 with fp8 / modelopt_fp4 / modelopt_mixed / no quantization, no all-to-all, auto "
         "-> flashinfer_trtllm",
         when=(IS_QWEN3, SM100, is_(QUANT, "fp8", "modelopt_fp4", "modelopt_mixed", None),
               is_(A2A, "none"), _AUTO),
         sets={RUNNER: "flashinfer_trtllm"}),
    # model_overrides/glm4_moe.py
    _quant_from_checkpoint(IS_GLM4_MOE, "glm4_moe"),
    Rule("glm4_moe: SM100 with modelopt_fp4 or no quantization, no all-to-all, auto -> flashinfer_trtllm",
         when=(IS_GLM4_MOE, SM100, is_(QUANT, "modelopt_fp4", None), is_(A2A, "none"), _AUTO),
         sets={RUNNER: "flashinfer_trtllm"}),
    # model_overrides/llama4.py
    Rule("llama4: SM100 (not a CPU device), auto, --quantization fp8 or modelopt_fp8 -> flashinfer_trtllm",
         when=(IS_LLAMA4, NOT_CPU, SM100, _AUTO, is_(QUANT, "fp8", "modelopt_fp8")),
         sets={RUNNER: "flashinfer_trtllm"}),
    # overrides._deepseek_moe_quant_resolution (a DeepseekV3 checkpoint that declares no quant_method is FP8 only
    # when its safetensors hold FP8 expert weights: an unquantized layer's checkpoint holds none)
    _quant_from_checkpoint(IS_DEEPSEEK, "_deepseek_moe_quant_resolution"),
    First((
        Rule("_deepseek_moe_quant_resolution: SM100, no all-to-all, auto, not LongCat, with fp8 / modelopt_fp8 / "
             "modelopt_fp4 / modelopt_mixed / no quantization -> flashinfer_trtllm",
             when=(IS_DEEPSEEK, SM100, is_(A2A, "none"), _AUTO,
                   not_architecture_prefix("LongcatFlash"),
                   is_(QUANT, "fp8", "modelopt_fp8", "modelopt_fp4", "modelopt_mixed", None)),
             sets={RUNNER: "flashinfer_trtllm"}),
        Rule("_deepseek_moe_quant_resolution: the same for the Kimi K2 / K2.5 thinking INT4 recipe",
             when=(IS_DEEPSEEK, SM100, is_(A2A, "none"), _AUTO,
                   not_architecture_prefix("LongcatFlash"), KIMI_INT4),
             sets={RUNNER: "flashinfer_trtllm"}),
    )),
))

QUANT_CONSTRAINT = Stage("quant_constraint", when=(is_(QUANT, "nvfp4_online", "mxfp8", "modelopt_fp4"),), rules=(
    # overrides._moe_runner_backend_quant_constraints
    Rule("nvfp4_online is supported only on SM100/SM103",
         when=(is_(QUANT, "nvfp4_online"), negated(SM100, "not an SM100 GPU")),
         fail="--quantization nvfp4_online is supported only on NVIDIA Blackwell SM100/SM103 GPUs."),
    First((
        Rule("nvfp4_online, auto, flashinfer_megamoe all-to-all with CuteDSL NVFP4 W4A16 -> flashinfer_megamoe",
             when=(is_(QUANT, "nvfp4_online"), _AUTO, is_(A2A, "flashinfer_megamoe"),
                   env_on("SGLANG_FLASHINFER_CUTEDSL_NVFP4_W4A16")),
             sets={RUNNER: "flashinfer_megamoe"}),
        Rule("nvfp4_online, auto -> flashinfer_trtllm", when=(is_(QUANT, "nvfp4_online"), _AUTO),
             sets={RUNNER: "flashinfer_trtllm"}),
        Rule("nvfp4_online takes flashinfer_trtllm, flashinfer_trtllm_routed or flashinfer_cutedsl as they are",
             when=(is_(QUANT, "nvfp4_online"), is_(RUNNER, "flashinfer_trtllm", "flashinfer_trtllm_routed",
                                                   "flashinfer_cutedsl"))),
        Rule("nvfp4_online takes flashinfer_megamoe under the flashinfer_megamoe all-to-all with W4A16",
             when=(is_(QUANT, "nvfp4_online"), is_(RUNNER, "flashinfer_megamoe"), is_(A2A, "flashinfer_megamoe"),
                   env_on("SGLANG_FLASHINFER_CUTEDSL_NVFP4_W4A16"))),
        Rule("nvfp4_online refuses every other runner", when=(is_(QUANT, "nvfp4_online"),),
             fail="--quantization nvfp4_online supports only --moe-runner-backend flashinfer_trtllm or "
                  "flashinfer_trtllm_routed, or flashinfer_cutedsl; flashinfer_megamoe requires --moe-a2a-backend "
                  "flashinfer_megamoe and SGLANG_FLASHINFER_CUTEDSL_NVFP4_W4A16=1."),
    )),
    # mxfp8 (not on Ascend, which moe-fsm has no vendor for): auto takes the default, an unsupported runner is
    # overridden by it with a warning
    First((
        Rule("mxfp8, auto, flashinfer_megamoe all-to-all -> flashinfer_megamoe",
             when=(is_(QUANT, "mxfp8"), _AUTO, is_(A2A, "flashinfer_megamoe")), sets={RUNNER: "flashinfer_megamoe"}),
        Rule("mxfp8, auto, ROCm gfx95 -> triton", when=(is_(QUANT, "mxfp8"), _AUTO, GFX95), sets={RUNNER: "triton"}),
        Rule("mxfp8, auto -> flashinfer_trtllm", when=(is_(QUANT, "mxfp8"), _AUTO),
             sets={RUNNER: "flashinfer_trtllm"}),
        Rule("mxfp8 keeps a runner of MXFP8_MOE_RUNNER_BACKEND_CHOICES",
             when=(is_(QUANT, "mxfp8"), is_(RUNNER, *MXFP8_RUNNER_CHOICES))),
        Rule("mxfp8 keeps triton on ROCm", when=(is_(QUANT, "mxfp8"), is_(RUNNER, "triton"), HIP)),
        Rule("mxfp8 keeps aiter on ROCm gfx95 with SGLANG_USE_AITER",
             when=(is_(QUANT, "mxfp8"), is_(RUNNER, "aiter"), GFX95, env_on("SGLANG_USE_AITER"))),
        Rule("mxfp8 overrides another runner with its default: flashinfer_megamoe under that all-to-all",
             when=(is_(QUANT, "mxfp8"), is_(A2A, "flashinfer_megamoe")), sets={RUNNER: "flashinfer_megamoe"}),
        Rule("mxfp8 overrides another runner with its default: triton on ROCm gfx95",
             when=(is_(QUANT, "mxfp8"), GFX95), sets={RUNNER: "triton"}),
        Rule("mxfp8 overrides another runner with its default: flashinfer_trtllm",
             when=(is_(QUANT, "mxfp8"),), sets={RUNNER: "flashinfer_trtllm"}),
    )),
    Rule("modelopt_fp4, auto, SM110 or SM120 -> flashinfer_cutlass (trtllm-gen MoE kernels are SM100-only)",
         when=(is_(QUANT, "modelopt_fp4"), _AUTO, SM110_OR_SM120),
         sets={RUNNER: "flashinfer_cutlass"}),
))

CUTEDSL_PER_TOKEN = "flashinfer_cutedsl per-token NVFP4 activation requires moe_a2a_backend='none' or 'flashinfer'."
CHECKED_RUNNERS = ("flashinfer_cutlass", "flashinfer_cutedsl", "flashinfer_trtllm", "flashinfer_trtllm_routed",
                   "cutlass")
RUNNER_QUANT_CHECK = Stage("runner_quant_check", when=(is_(RUNNER, *CHECKED_RUNNERS),), rules=(
    # moe_hook.handle_moe_kernel_config's asserts
    Rule("flashinfer_cutlass supports modelopt_fp4, modelopt_fp8, modelopt_mixed or bfloat16",
         when=(is_(RUNNER, "flashinfer_cutlass"),
               is_not(QUANT, "modelopt_fp4", "modelopt_fp8", "modelopt_mixed", None)),
         fail="Invalid quantization '{quantization}'. FlashInfer Cutlass MOE supports only: 'modelopt_fp4', "
              "'modelopt_fp8', 'modelopt_mixed', or bfloat16 (None)."),
    Rule("flashinfer_cutlass needs ep_size 1 or tp_size",
         when=(is_(RUNNER, "flashinfer_cutlass"), Resolved("ep_size is neither 1 nor tp_size", ("ep_size", "tp_size"),
                                                           lambda ep, tp: ep not in (1, tp))),
         fail="The expert parallel size must be 1 or the same as the tensor parallel size"),
    Rule("flashinfer_cutedsl supports modelopt_fp4, modelopt_mixed or nvfp4_online",
         when=(is_(RUNNER, "flashinfer_cutedsl"), is_not(QUANT, "modelopt_fp4", "modelopt_mixed", "nvfp4_online")),
         fail="Invalid quantization '{quantization}'. FlashInfer CuteDSL MOE currently supports only: "
              "'modelopt_fp4', 'modelopt_mixed' (with NVFP4 MoE layers), 'nvfp4_online', or hybrid NVFP4 models."),
    Rule("flashinfer_cutedsl needs ep_size 1 or tp_size",
         when=(is_(RUNNER, "flashinfer_cutedsl"), Resolved("ep_size is neither 1 nor tp_size", ("ep_size", "tp_size"),
                                                           lambda ep, tp: ep not in (1, tp))),
         fail="The expert parallel size must be 1 or the same as the tensor parallel size"),
    Rule("flashinfer_cutedsl supports the none, deepep or flashinfer all-to-all",
         when=(is_(RUNNER, "flashinfer_cutedsl"), is_not(A2A, "none", "deepep", "flashinfer")),
         fail="flashinfer_cutedsl supports moe_a2a_backend='none', 'deepep', or 'flashinfer', got "
              "'{moe_a2a_backend}'."),
    Rule("flashinfer_cutedsl with nvfp4_online (per-token NVFP4 activation) needs no or the flashinfer all-to-all",
         when=(is_(RUNNER, "flashinfer_cutedsl"), is_(A2A, "deepep"), is_(QUANT, "nvfp4_online")),
         fail=CUTEDSL_PER_TOKEN),
    Rule("flashinfer_cutedsl with SGLANG_FLASHINFER_NVFP4_PER_TOKEN_ACTIVATION needs no or the flashinfer all-to-all",
         when=(is_(RUNNER, "flashinfer_cutedsl"), is_(A2A, "deepep"),
               env_on("SGLANG_FLASHINFER_NVFP4_PER_TOKEN_ACTIVATION")),
         fail=CUTEDSL_PER_TOKEN),
    Rule("flashinfer_trtllm supports modelopt_fp4, nvfp4_online, fp8, mxfp8, modelopt_fp8, modelopt_mixed, "
         "compressed-tensors or bfloat16",
         when=(is_(RUNNER, "flashinfer_trtllm"), is_not(QUANT, "modelopt_fp4", "nvfp4_online", "fp8", "mxfp8",
                                                        "modelopt_fp8", "modelopt_mixed", "compressed-tensors", None)),
         fail="Invalid quantization '{quantization}'. FlashInfer TRTLLM MOE supports only: 'modelopt_fp4', "
              "'nvfp4_online', 'fp8', 'modelopt_fp8', 'modelopt_mixed', 'compressed-tensors', or bfloat16 (None)."),
    Rule("flashinfer_trtllm_routed supports fp8, mxfp8, modelopt_fp4, modelopt_mixed, nvfp4_online, "
         "minimax_m3_nvfp4 or bfloat16",
         when=(is_(RUNNER, "flashinfer_trtllm_routed"), is_not(QUANT, "fp8", "mxfp8", "modelopt_fp4", "modelopt_mixed",
                                                               "nvfp4_online", "minimax_m3_nvfp4", None)),
         fail="Invalid quantization '{quantization}'. FlashInfer TRTLLM routed MOE supports only: 'fp8', 'mxfp8', "
              "'modelopt_fp4', 'modelopt_mixed', 'nvfp4_online', 'minimax_m3_nvfp4', or bfloat16 (None)."),
    Rule("FP8/MXFP8 cutlass MoE needs ep_size 1",
         when=(is_(RUNNER, "cutlass"), is_(QUANT, "fp8", "mxfp8"), is_not("ep_size", 1)),
         fail="FP8/MXFP8 Cutlass MoE is only supported with ep_size == 1"),
))

A2A_CONSTRAINT = Stage("a2a_constraint", when=(is_not(A2A, "none"),), rules=(
    # overrides._a2a_ep_size
    Rule("_a2a_ep_size: this all-to-all spans expert parallelism over the tensor-parallel group: ep_size = tp_size",
         when=(is_(A2A, *EP_SPANNING),), sets={"ep_size": resolved_value("tp_size")}),
    # moe_hook.handle_a2a_moe, backend by backend in its order
    Rule("flashinfer_megamoe is validated for some architectures only",
         when=(is_(A2A, "flashinfer_megamoe"),
               negated(architecture(*MEGAMOE_MODELS, text="validated for FlashInfer MegaMOE"))),
         fail="FlashInfer MegaMOE is not validated for this model architecture. Supported architectures: "
              + str(sorted(MEGAMOE_MODELS)) + "."),
    First((
        Rule("flashinfer_megamoe takes MXFP8 or ModelOpt NVFP4",
             when=(is_(A2A, "flashinfer_megamoe"), is_(QUANT, "mxfp8", "modelopt_fp4"))),
        Rule("flashinfer_megamoe takes nvfp4_online with CuteDSL NVFP4 W4A16",
             when=(is_(A2A, "flashinfer_megamoe"), is_(QUANT, "nvfp4_online"),
                   env_on("SGLANG_FLASHINFER_CUTEDSL_NVFP4_W4A16"))),
        Rule("flashinfer_megamoe refuses every other quantization", when=(is_(A2A, "flashinfer_megamoe"),),
             fail="FlashInfer MegaMOE currently supports only MXFP8, ModelOpt NVFP4, FP4-expert, hybrid NVFP4 MoE "
                  "checkpoints, or nvfp4_online with SGLANG_FLASHINFER_CUTEDSL_NVFP4_W4A16=1; got "
                  "quantization={quantization!r}. Standard FP8 MoE checkpoints are not supported."),
    )),
    Rule("flashinfer_megamoe needs --attn-dp-size equal to --tp-size",
         when=(is_(A2A, "flashinfer_megamoe"), Resolved("attn_dp_size != tp_size", ("attn_dp_size", "tp_size"),
                                                        lambda dp, tp: dp != tp)),
         fail="FlashInfer MegaMOE is only supported with --attn-dp-size equal to --tp-size"),
    Rule("flashinfer_megamoe resolves auto to flashinfer_megamoe", when=(is_(A2A, "flashinfer_megamoe"), _AUTO),
         sets={RUNNER: "flashinfer_megamoe"}),
    Rule("flashinfer_megamoe needs the flashinfer_megamoe runner",
         when=(is_(A2A, "flashinfer_megamoe"), is_not(RUNNER, "flashinfer_megamoe")),
         fail="FlashInfer MegaMOE a2a backend requires --moe-runner-backend flashinfer_megamoe"),
    Rule("flashinfer_megamoe needs an SM100-family GPU",
         when=(is_(A2A, "flashinfer_megamoe"), negated(SM100, "not an SM100 GPU")),
         fail="FlashInfer MegaMOE currently requires an SM100-family CUDA device for all supported quantization "
              "formats."),
    Rule("deepep with flashinfer_cutedsl: --deepep-mode auto becomes low_latency",
         when=(is_(A2A, "deepep"), is_(RUNNER, "flashinfer_cutedsl"), is_("deepep_mode", "auto")),
         sets={"deepep_mode": "low_latency"}),
    Rule("deepep with flashinfer_cutedsl has no normal-dispatch handler",
         when=(is_(A2A, "deepep"), is_(RUNNER, "flashinfer_cutedsl"), is_("deepep_mode", "normal")),
         fail="flashinfer_cutedsl FP4 MoE only supports DeepEP low_latency dispatch (masked layout). DeepEP normal "
              "(prefill) dispatch has no CuteDSL FP4 handler. Pass --deepep-mode low_latency or auto."),
    Rule("deepep_v2 is validated for registered architectures only",
         when=(is_(A2A, "deepep_v2"), negated(architecture(*DEEPEP_V2_MODELS, text="registered for DeepEP v2"))),
         fail="DeepEP v2 MoE is not validated for this architecture. The model package must register its "
              "architecture with register_deepep_v2_model, because its combine and post-expert reduction "
              "semantics must be validated first."),
    Rule("deepep_v2 resolves auto to deep_gemm", when=(is_(A2A, "deepep_v2"), _AUTO), sets={RUNNER: "deep_gemm"}),
    Rule("deepep_v2 supports only deep_gemm", when=(is_(A2A, "deepep_v2"), is_not(RUNNER, "deep_gemm")),
         fail="DeepEP v2 MoE currently supports only --moe-runner-backend deep_gemm. Got {moe_runner_backend!r}. "
              "Add a runner adapter before enabling DeepEP v2 with other MoE runners."),
    Rule("ascend_tp runs as no all-to-all", when=(is_(A2A, "ascend_tp"),), sets={A2A: "none"}),
    Rule("flashinfer all-to-all needs --attn-dp-size equal to --tp-size",
         when=(is_(A2A, "flashinfer"), Resolved("attention DP is off or attn_dp_size != tp_size",
                                                ("attn_dp_size", "tp_size"), lambda dp, tp: not (dp > 1 and dp == tp))),
         fail="Flashinfer MoE A2A requires --attn-dp-size equal to --tp-size, except for Muse Spark TP4/EP4 or "
              "TP8/EP8 prefill sequence parallelism."),
    Rule("flashinfer all-to-all supports flashinfer_cutlass, flashinfer_cutedsl, flashinfer_trtllm, "
         "flashinfer_trtllm_routed or deep_gemm",
         when=(is_(A2A, "flashinfer"), is_not(RUNNER, "flashinfer_cutlass", "flashinfer_cutedsl", "flashinfer_trtllm",
                                              "flashinfer_trtllm_routed", "deep_gemm")),
         fail="FlashInfer MoE A2A is supported with flashinfer_cutlass, flashinfer_cutedsl, flashinfer_trtllm, "
              "flashinfer_trtllm_routed, or deep_gemm."),
    Rule("mori: --deepep-mode auto becomes normal", when=(is_(A2A, "mori"), is_("deepep_mode", "auto")),
         sets={"deepep_mode": "normal"}),
    Rule("pplx only supports low-latency mode", when=(is_(A2A, "pplx"), is_("deepep_mode", "normal")),
         fail="moe_a2a_backend='pplx' only supports low-latency mode; set --deepep-mode to 'low_latency' or 'auto'."),
    Rule("pplx: --deepep-mode auto becomes low_latency", when=(is_(A2A, "pplx"), is_("deepep_mode", "auto")),
         sets={"deepep_mode": "low_latency"}),
    Rule("pplx needs attention DP with at least 2 groups",
         when=(is_(A2A, "pplx"), Resolved("attn_dp_size < 2", ("attn_dp_size",), lambda dp: dp < 2)),
         fail="moe_a2a_backend='pplx' requires attention DP with at least 2 groups (--attn-dp-size >= 2)."),
    Rule("pplx supports only deep_gemm (or auto)", when=(is_(A2A, "pplx"), is_not(RUNNER, "deep_gemm", "auto")),
         fail="moe_a2a_backend='pplx' is only supported with --moe-runner-backend deep_gemm (or auto)."),
    Rule("pplx resolves auto to deep_gemm", when=(is_(A2A, "pplx"), _AUTO), sets={RUNNER: "deep_gemm"}),
))

SPECULATIVE_DEFAULT = Stage("speculative_default", when=(DRAFT,), rules=(
    # overrides._speculative_moe_runner_default and layers/moe/utils._default_speculative_a2a_backend: a draft
    # layer runs with --speculative-moe-runner-backend / -a2a-backend, which default to the target's (moe-fsm
    # models the defaults only)
    Rule("the draft's runner defaults to the target's, except flashinfer_megamoe -> flashinfer_trtllm",
         when=(is_(RUNNER, "flashinfer_megamoe"),), sets={RUNNER: "flashinfer_trtllm"}),
    Rule("the draft's all-to-all defaults to the target's, except flashinfer_megamoe -> none",
         when=(is_(A2A, "flashinfer_megamoe"),), sets={A2A: "none"}),
    Rule("validate_deepep_v2_speculative_draft: DeepEP v2 is not validated as a draft backend",
         when=(is_(A2A, "deepep_v2"),),
         fail="DeepEP v2 MoE is not validated as a speculative draft backend. Select another "
              "--speculative-moe-a2a-backend."),
))

LORA_LAYER = Stage("lora_layer", when=(LORA,), rules=(
    Rule("LoRA MoE runs through SGLang's LoRA runners and server flags, which moe-fsm does not model",
         fail="moe-fsm's sglang-0.5.23 profile does not model LoRA MoE layers (SGLang serves them with its "
              "lora_* runners and --enable-lora flags)", error=NoBackendError),
))

STAGES = (SERVER_ARGS, LORA_LAYER, EXPLICIT_RUNNER, MEGA_MOE, MODEL_OVERRIDE, QUANT_CONSTRAINT, RUNNER_QUANT_CHECK,
          A2A_CONSTRAINT, SPECULATIVE_DEFAULT)
