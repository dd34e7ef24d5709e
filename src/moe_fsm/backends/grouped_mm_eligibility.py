"""When torch's grouped GEMMs can run a layer: the TORCH_GROUPED_MM backend's eligibility rule.

A pure rule on the layer, a compute capability and a torch version string, so
the decision core can judge it from recorded platform facts (no torch import)
and the runtime can ask it of the live device (``kernels/grouped_mm.py``,
``experts/grouped_mm_experts.py``, ``bench/bench_experts_roofline.py``).
"""

from __future__ import annotations

from typing import Optional

from moe_fsm.errors import KernelInputError
from moe_fsm.inputs.layer import MoELayer
from moe_fsm.inputs.quant import Granularity, QuantFamily

MIN_CAPABILITY = (9, 0)
MIN_TORCH = (2, 8)
_ROWWISE_WEIGHTS = (Granularity.TENSOR, Granularity.CHANNEL)
_ROWWISE_ACTIVATIONS = (Granularity.TENSOR, Granularity.TOKEN)


def _version_tuple(version: str) -> tuple[int, int]:
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)
    except (IndexError, ValueError):
        raise KernelInputError(f"torch version {version!r} is not of the form MAJOR.MINOR[.PATCH]") from None


def grouped_mm_eligibility(
    layer: MoELayer, capability: Optional[tuple[int, int]], torch_version: str
) -> tuple[bool, str]:
    """Whether the grouped-GEMM experts can run ``layer`` on a CUDA device of ``capability`` with this torch.

    The reason names the first requirement that fails, or what will run.
    """
    if capability is None:
        return False, "torch._grouped_mm needs a CUDA device; no compute capability was given"
    if tuple(capability) < MIN_CAPABILITY:
        return False, (
            f"torch._grouped_mm's CUTLASS kernels need compute capability >= "
            f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}; the device has {capability[0]}.{capability[1]}"
        )
    if _version_tuple(torch_version) < MIN_TORCH:
        return False, f"torch._grouped_mm arrived in torch {MIN_TORCH[0]}.{MIN_TORCH[1]}; this is torch {torch_version}"
    if layer.lora:
        return False, "LoRA adapters hook into the Triton experts; the grouped-GEMM experts have no LoRA path"
    family = layer.quant.family
    if family is QuantFamily.NVFP4:
        return False, "NVFP4 is not a torch grouped-GEMM dtype; use an NVFP4 backend"
    if family is QuantFamily.UNQUANTIZED:
        if layer.dtype != "bfloat16":
            return False, f"torch._grouped_mm runs bfloat16 operands; the layer is {layer.dtype}"
        if layer.hidden_size % 8 or layer.intermediate_size % 8:
            return False, (
                "torch._grouped_mm needs 16-byte aligned rows (hidden and intermediate sizes divisible by 8 "
                f"in bf16); got K={layer.hidden_size}, N={layer.intermediate_size}"
            )
        return True, "bf16 through torch._grouped_mm (two grouped GEMMs, activation and top-k sum in torch)"
    weight, activation = layer.quant.weight, layer.quant.activation
    if weight.granularity not in _ROWWISE_WEIGHTS or activation.granularity not in _ROWWISE_ACTIVATIONS:
        return False, (
            f"torch._scaled_grouped_mm takes row-wise FP8 scales (per-tensor or per-channel weights, per-tensor or "
            f"per-token activations); the layer has {weight.granularity.value} weights with "
            f"{activation.granularity.value} activations"
        )
    if capability[0] != 9 and not (capability[0] == 10 and _version_tuple(torch_version) >= (2, 9)):
        return False, (
            "torch._scaled_grouped_mm has FP8 kernels for compute capability 9.x (and 10.x from torch 2.9); "
            f"the device has {capability[0]}.{capability[1]} with torch {torch_version}"
        )
    if layer.dtype != "bfloat16":
        return False, f"torch._scaled_grouped_mm writes bfloat16 output; the layer is {layer.dtype}"
    if layer.hidden_size % 16 or layer.intermediate_size % 16:
        return False, (
            "torch._scaled_grouped_mm needs 16-byte aligned FP8 rows (hidden and intermediate sizes divisible by 16); "
            f"got K={layer.hidden_size}, N={layer.intermediate_size}"
        )
    return True, "FP8 row-wise through torch._scaled_grouped_mm (per-tensor scales broadcast to rows)"
