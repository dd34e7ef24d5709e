"""SGLang 0.5.23's MoE runners, as the profile's kernel catalog and each family's backends.

A runner is what ``MoeRunnerBackend`` names (``layers/moe/utils.py``): a runner core (Triton, DeepGEMM,
AITER, ...) or a fused function (``@register_fused_func``), or, for the methods that call their kernel
directly (W4AFP8's ``cutlass_w4a8_moe``), that kernel. SGLang checks no kernel's support when it picks a
runner: what refuses a layer is the resolution itself (``pipeline.py``, ``layer.py``), so the kernel specs
carry no requirements and the verdict of a decided runner is always yes. None of them is implemented in
moe-fsm: a run builds moe-fsm's stand-in of the same numerics (``backends/stand_ins.py``), named in the
trace's build.
"""

from __future__ import annotations

from moe_fsm.backends.pf_choice import PrepareFinalizeChoice, PrepareFinalizeKind
from moe_fsm.backends.specs import BackendSpec, KernelSpec
from moe_fsm.inputs.formats import ActivationFormat
from moe_fsm.inputs.quant import QuantFamily

# runner name (--moe-runner-backend / get_moe_runner_backend().value) -> (backend, kernel, where SGLang has it)
RUNNERS = {
    "triton": ("TRITON", "TritonRunnerCore", "layers/moe/moe_runner/triton.py"),
    "triton_kernel": ("TRITON_KERNELS", "TritonKernelsRunnerCore", "layers/moe/moe_runner/triton_kernels.py"),
    "deep_gemm": ("DEEP_GEMM", "DeepGemmRunnerCore", "layers/moe/moe_runner/deep_gemm.py"),
    "aiter": ("AITER", "AiterRunnerCore", "layers/moe/moe_runner/aiter.py"),
    "marlin": ("MARLIN", "MarlinFusedMoE", "layers/moe/moe_runner/marlin.py (fused_marlin_moe)"),
    "humming": ("HUMMING", "HummingRunnerCore", "layers/moe/moe_runner/humming.py"),
    "flashinfer_trtllm": ("FLASHINFER_TRTLLM", "FlashInferTrtllmFusedMoE",
                          "layers/moe/moe_runner/flashinfer_trtllm.py"),
    "flashinfer_trtllm_routed": ("FLASHINFER_TRTLLM_ROUTED", "FlashInferTrtllmRoutedFusedMoE",
                                 "layers/moe/moe_runner/flashinfer_trtllm.py"),
    "flashinfer_cutlass": ("FLASHINFER_CUTLASS", "FlashInferCutlassFusedMoE",
                           "layers/moe/moe_runner/flashinfer_cutlass.py"),
    "flashinfer_cutedsl": ("FLASHINFER_CUTEDSL", "FlashInferCuteDslFusedMoE",
                           "layers/moe/moe_runner/flashinfer_cutedsl.py"),
    "flashinfer_mxfp4": ("FLASHINFER_MXFP4", "FlashInferMxfp4FusedMoE", "layers/moe/moe_runner/flashinfer_cutlass.py"),
    "flashinfer_megamoe": ("FLASHINFER_MEGAMOE", "FlashInferMegaMoE", "layers/moe/flashinfer_megamoe.py"),
    "cutlass": ("CUTLASS", "CutlassMoE", "layers/moe/cutlass_moe.py"),
    "hpc_ops": ("HPC_OPS", "HpcOpsFusedMoE", "layers/moe/moe_runner/hpc_ops.py"),
    "intel_xpu": ("INTEL_XPU", "IntelXpuMoE", "the XPU quantization methods' own kernels"),
    "megamoe": ("MEGAMOE", "DeepGemmMegaMoE", "layers/moe/mega_moe.py (the megamoe all-to-all's experts)"),
    "cutlass_w4a8": ("CUTLASS_W4A8", "CutlassW4A8MoE", "layers/moe/cutlass_w4a8_moe.py (cutlass_w4a8_moe)"),
}

KERNELS: dict[str, KernelSpec] = {
    kernel: KernelSpec(kernel, ActivationFormat.STANDARD, (), library_note=f"SGLang's {where}")
    for _, kernel, where in RUNNERS.values()
}


def family_backends(family: QuantFamily, runners: tuple[str, ...]) -> tuple[dict[str, BackendSpec], dict[str, str]]:
    """A family's backends (one per runner its methods can build) and the runner names that map to them."""
    backends, names = {}, {}
    for runner in runners:
        backend, kernel, _ = RUNNERS[runner]
        backends[backend] = BackendSpec(backend, family, (kernel,))
        names[runner] = backend
    return backends, names


def one_rank_pairing(run) -> PrepareFinalizeChoice:
    """SGLang moves tokens with its own dispatcher (the resolved --moe-a2a-backend, over tp_size ranks with
    ep_size of them holding experts), which moe-fsm's runtime does not reproduce: the layer is paired as one rank,
    buildable only when the decision is for one."""
    r = run.resolved
    layout = (f"SGLang's {r.get('moe_a2a_backend')} dispatcher over tp_size={r.get('tp_size')}, "
              f"ep_size={r.get('ep_size')}, attn_dp_size={r.get('attn_dp_size')}")
    single = (r.get("tp_size"), r.get("ep_size"), r.get("attn_dp_size")) == (1, 1, 1)
    return PrepareFinalizeChoice(
        "LocalPrepareFinalize", PrepareFinalizeKind.LOCAL, ActivationFormat.STANDARD,
        f"{layout}; moe-fsm runs the layer as one rank", uses_expert_map=False, group_size=1,
        not_buildable_because=None if single else f"moe-fsm's runtime does not reproduce {layout}; decide it for "
                                                  "one rank (--tp 1) to run it here")


def sglang_policy(family: QuantFamily, label: str, methods: dict, runners: tuple[str, ...]):
    """A family's machine: the server-argument stages every family shares, then its methods' runner choice."""
    from moe_fsm.fsm.policy import FamilyPolicy, frozen
    from moe_fsm.fsm.runner_steps import LayerRunner
    from moe_fsm.profiles.sglang_0_5_23.layer import AFTER, BEFORE, METHOD_OF
    from moe_fsm.profiles.sglang_0_5_23.pipeline import STAGES

    backends, names = family_backends(family, runners)
    return FamilyPolicy(
        family=family,
        label=label,
        steps=(*STAGES, LayerRunner("create_moe_runner", method=METHOD_OF, before=BEFORE, methods=frozen(methods),
                                    after=AFTER)),
        backends=frozen(backends),
        user_names=frozen(names),
        batched_variants=frozen({}),
        priority=frozen({}),
        unsupported_message=f"SGLang's {{backend}} MoE runner cannot run this {label} layer: {{reason}}.",
        exhausted_message=f"SGLang builds no MoE runner for this {label} layer.",
        pairing=one_rank_pairing,
    )
