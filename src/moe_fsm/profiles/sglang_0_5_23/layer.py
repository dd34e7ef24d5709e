"""SGLang 0.5.23's per-layer runner choice: what ``FusedMoE.__init__`` checks, then ``create_moe_runner``.

A layer's quantization method is made (``quant_config.get_quant_method``; its constructor may refuse the
platform), ``_validate_hpc_ops_quant_method`` and ``_validate_deepep_v2_quant_method`` check it
(``layers/moe/fused_moe_triton/layer.py``), then ``create_moe_runner`` turns the resolved runner (``auto``
above all) into the runner it builds, and ``MoeRunner.__init__`` (``layers/moe/moe_runner/runner.py``) checks
that runner against the server's choices and the registered fused functions. ``layer_runner`` is the
method's ``get_moe_runner_backend(layer)``; ``runner_kind`` says whether it builds a ``MoeRunner`` (whose
constructor checks apply) or calls a kernel itself; ``direct_kernel`` names that kernel where it is not the
reported runner (W4AFP8's CUTLASS kernel reports none; under the megamoe all-to-all DeepGEMM's MegaMoE runs).

The family modules give each method's rules (``METHOD_RULES`` there); the checks every layer meets are here.
"""

from __future__ import annotations

from moe_fsm.errors import NoBackendError
from moe_fsm.fsm.runner_steps import (
    DIRECT_KERNEL, LAYER_METHOD, LAYER_RUNNER, Resolved, Rule, Value, is_, is_not, resolved_value,
)
from moe_fsm.inputs.quant import QuantFamily
from moe_fsm.profiles.sglang_0_5_23.facts import FP8_BLOCK_128, FP8_DYNAMIC_ACT, TORCH_CAPABILITY_9, negated

RUNNER, A2A = "moe_runner_backend", "moe_a2a_backend"
KIND, METHOD = "runner_kind", LAYER_METHOD
DIRECT, MOE_RUNNER = "direct kernel", "MoeRunner"

# MoeA2ABackend.supports_aiter
AITER_A2A = ("none", "deepep", "mooncake", "nixl", "mori")
# runner.py: backends whose runner core is None (a fused function must be registered for the all-to-all)
FUSED_ONLY = ("marlin", "flashinfer_trtllm", "flashinfer_trtllm_routed", "flashinfer_cutedsl", "flashinfer_cutlass",
              "flashinfer_mxfp4", "flashinfer_megamoe", "cutlass", "hpc_ops")
# @register_fused_func(a2a, runner) in layers/moe/: the pairs a fused-only runner can run under
FUSED = {("deepep", "flashinfer_cutedsl"), ("flashinfer", "flashinfer_cutedsl"), ("flashinfer", "flashinfer_cutlass"),
         ("flashinfer", "flashinfer_trtllm"), ("flashinfer", "flashinfer_trtllm_routed"),
         ("flashinfer_megamoe", "flashinfer_megamoe"), ("none", "flashinfer_cutedsl"), ("none", "flashinfer_cutlass"),
         ("none", "flashinfer_mxfp4"), ("none", "flashinfer_trtllm"), ("none", "flashinfer_trtllm_routed"),
         ("none", "hpc_ops"), ("none", "humming"), ("none", "marlin"), ("none", "triton")}
FP8_METHODS = ("fp8", "mxfp8")  # the methods that make an Fp8MoEMethod


def layer_is(*runners: str):
    return is_(LAYER_RUNNER, *runners)


def runner_at(value) -> dict:
    """Settings that give the layer ``value`` (a runner name, or a ``Value``) built as a ``MoeRunner``."""
    return {LAYER_RUNNER: value, KIND: MOE_RUNNER}


def direct(value) -> dict:
    """The layer reports ``value`` as its runner but builds no ``MoeRunner``: the method calls that kernel itself."""
    return {LAYER_RUNNER: value, KIND: DIRECT}


def no_runner(kernel: str) -> dict:
    """The method reports no runner (None) and calls ``kernel`` itself."""
    return {LAYER_RUNNER: None, KIND: DIRECT, DIRECT_KERNEL: kernel}


# Under the megamoe all-to-all the model block calls DeepGEMM's MegaMoE; the method's runner is never reached.
MEGAMOE_RUNS = {KIND: DIRECT, DIRECT_KERNEL: "megamoe"}


AS_RESOLVED = resolved_value(RUNNER)  # the method takes the server's runner as it is

BEFORE = (
    Rule("_validate_hpc_ops_quant_method: --moe-runner-backend hpc_ops needs Fp8MoEMethod",
         when=(is_(RUNNER, "hpc_ops"), is_not(METHOD, *FP8_METHODS)),
         fail="--moe-runner-backend hpc_ops only supports Fp8MoEMethod (FP8 blockwise or per-tensor MoE), but this "
              "layer selected the {layer_method} method. Remove --moe-runner-backend hpc_ops for this model."),
    Rule("_validate_deepep_v2_quant_method: DeepEP v2 feeds BF16 or Fp8MoEMethod experts only",
         when=(is_(A2A, "deepep_v2"), is_not(METHOD, "unquantized", *FP8_METHODS)),
         fail=("--moe-a2a-backend deepep_v2 requires 128x128 blockwise FP8 or 1x32 MXFP8 experts with dynamic "
               "activation scaling or unquantized BF16 experts, but this layer selected the {layer_method} method. "
               "Use a compatible checkpoint or --moe-a2a-backend deepep.")),
    Rule("_validate_deepep_v2_quant_method: FP8 experts must be 128x128 blocks with dynamic activation scales",
         when=(is_(A2A, "deepep_v2"), is_(METHOD, "fp8"),
               negated(FP8_BLOCK_128, "not 128x128 block FP8 weights with dynamic activation scales")),
         fail=("--moe-a2a-backend deepep_v2 requires 128x128 blockwise FP8 or 1x32 MXFP8 experts with dynamic "
               "activation scaling or unquantized BF16 experts, but this layer has another weight_block_size. "
               "Use a compatible checkpoint or --moe-a2a-backend deepep.")),
    Rule("_validate_deepep_v2_quant_method: FP8 experts need dynamic activation scales",
         when=(is_(A2A, "deepep_v2"), is_(METHOD, "fp8"), negated(FP8_DYNAMIC_ACT)),
         fail=("--moe-a2a-backend deepep_v2 requires 128x128 blockwise FP8 or 1x32 MXFP8 experts with dynamic "
               "activation scaling or unquantized BF16 experts, but this layer has activation_scheme='static'. "
               "Use a compatible checkpoint or --moe-a2a-backend deepep.")),
)

AFTER = (
    # MoeRunner.__init__, for the layers that build one
    Rule("MoeRunner: with --moe-runner-backend hpc_ops every layer must build the hpc_ops runner",
         when=(is_(KIND, MOE_RUNNER), is_(RUNNER, "hpc_ops"), is_not(LAYER_RUNNER, "hpc_ops")),
         fail="--moe-runner-backend hpc_ops was requested, but this MoE layer's quantization method selected the "
              "'{layer_runner}' runner (hpc_ops only supports FP8 blockwise / per-tensor quantized MoE). Remove "
              "--moe-runner-backend hpc_ops for this model."),
    Rule("MoeRunner: --moe-a2a-backend deepep_v2 needs the deep_gemm runner",
         when=(is_(KIND, MOE_RUNNER), is_(A2A, "deepep_v2"), is_not(LAYER_RUNNER, "deep_gemm")),
         fail="--moe-a2a-backend deepep_v2 requires the deep_gemm MoE runner, but this MoE layer's quantization "
              "method selected the '{layer_runner}' runner."),
    Rule("MoeRunner: the hpc_ops runner needs torch's device capability major 9 (the kernels ship sm90a only)",
         when=(is_(KIND, MOE_RUNNER), is_(LAYER_RUNNER, "hpc_ops"), negated(TORCH_CAPABILITY_9)),
         fail="--moe-runner-backend hpc_ops requires an SM90 (Hopper) GPU (the HPC-Ops kernels ship sm90a only)."),
    Rule("MoeRunner: intel_xpu has no runner core", when=(is_(KIND, MOE_RUNNER), is_(LAYER_RUNNER, "intel_xpu")),
         fail="Unsupported runner backend: MoeRunnerBackend.INTEL_XPU", error=NoBackendError),
    Rule("MoeRunner: a runner with only a fused path needs a fused function registered for the all-to-all",
         when=(is_(KIND, MOE_RUNNER), Resolved(
             "the runner has only a fused path and no fused function is registered for (all-to-all, runner)",
             (A2A, LAYER_RUNNER), lambda a2a, runner: runner in FUSED_ONLY and (a2a, runner) not in FUSED)),
         fail="Runner backend {layer_runner} requires a fused func for a2a backend {moe_a2a_backend}, but none is "
              "registered.", error=NoBackendError),
)


# ModelConfig._verify_quantization's overrides: the method SGLang serves a declared quant_method with.
SERVED_AS = {"gptq": "gptq_marlin", "awq": "awq_marlin"}
# ModelOpt checkpoints (modelopt, and the mixed and per-format names) give each layer its format's method.
MODELOPT = ("modelopt", "modelopt_mixed", "modelopt_fp4", "modelopt_fp8")
MODELOPT_METHOD = {QuantFamily.NVFP4: "modelopt_fp4", QuantFamily.FP8: "modelopt_fp8"}


def method_name(run) -> str:
    """The layer's method: ``unquantized`` for BF16 experts; else, with no --quantization flag, the method ``plan``
    read from the checkpoint by SGLang's rules (``ModelFacts.layer_method``) where it did; else the server's
    --quantization (resolved) or the checkpoint's quant_method, as SGLang serves it."""
    if run.ctx.layer.quant.weight is None:
        return "unquantized"
    facts = run.ctx.layer.model
    if facts is not None and facts.layer_method is not None and facts.quantization is None:
        return facts.layer_method
    name = run.resolved.get("quantization") or run.resolved.get("quant_method")
    if name in MODELOPT:
        return MODELOPT_METHOD.get(run.ctx.layer.family, name)
    return SERVED_AS.get(name, name)


METHOD_OF = Value("the layer's quantization method", method_name)
