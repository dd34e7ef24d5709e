"""Stand-ins: moe-fsm's own implementation, with the same numerics, of a decided kernel it cannot load here.

A decision is vLLM's and never changes with what this machine can load. When the
runtime cannot build the decided experts kernel (vLLM's compiled Marlin, Humming,
CUTLASS, DeepGEMM, TRTLLM, its CPU kernels, a platform's own MoE path, ...), or the
kernel moe-fsm implements needs a device this run does not have (its Triton and
FlashInfer kernels off CUDA), the build maps it to the moe-fsm implementation that
computes the same function on the same weight format, scales and activation:

* MXFP4 weights, 16-bit activations: moe-fsm's Triton MXFP4 experts (CUDA);
* NVFP4 weights, 16-bit activations (Marlin's NVFP4 on Hopper): moe-fsm's Triton NVFP4
  experts (CUDA);
* INT4/INT8 weight-only (GPTQ/AWQ/compressed-tensors, activation order included): moe-fsm's
  Triton W4A16/W8A16 experts (CUDA);
* unquantized and FP8 layers: moe-fsm's Triton experts (CUDA);
* everything else, and every family off CUDA: moe-fsm's torch experts, which dequantize
  every scheme the families hold and emulate the activation quantization.

A weight-only kernel (vLLM's Marlin: NVFP4 on Hopper, FP8 before it, MXFP4 and INT4)
dequantizes the checkpoint's weights and runs 16-bit activations, whatever activation
quantization the checkpoint declares; its stand-in computes the same layer without the
activation quantization (``computed_layer``), and says so.

Pure data (no torch): ``choose`` answers from the layer, the decided activation format
and the run's device type. ``Decision.build`` follows it unless the build is strict.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from moe_fsm.errors import InputError
from moe_fsm.inputs.formats import ActivationFormat
from moe_fsm.inputs.quant import MX_FP4, QuantFamily

TORCH = "moe_fsm.experts.torch_experts:TorchExperts"
TORCH_BATCHED = "moe_fsm.experts.torch_experts:TorchBatchedExperts"
TRITON = "moe_fsm.experts.triton_experts:TritonExperts"
TRITON_BATCHED = "moe_fsm.experts.triton_experts:BatchedTritonExperts"
TRITON_MXFP4 = "moe_fsm.experts.triton_wq_experts:TritonMxfp4Experts"
TRITON_WNA16 = "moe_fsm.experts.triton_wq_experts:TritonWna16Experts"
TRITON_NVFP4 = "moe_fsm.experts.triton_wq_experts:TritonNvfp4Experts"
# moe-fsm implementations that run only on CUDA tensors
CUDA_ONLY = ("moe_fsm.experts.triton_", "moe_fsm.experts.flashinfer_", "moe_fsm.experts.grouped_mm_")


@dataclass(frozen=True)
class StandIn:
    """What runs in place of ``replaces``: ``impl`` (module:Class), ``label`` for people, ``because``."""

    replaces: str
    impl: str
    label: str
    because: str
    weight_only: bool = False  # the replaced kernel runs 16-bit activations: so does the stand-in

    def to_json(self) -> dict:
        return {"replaces": self.replaces, "impl": self.impl, "label": self.label, "because": self.because,
                "activations": ("16-bit, as the weight-only kernel it replaces computes" if self.weight_only
                                else "as the layer's scheme declares")}

    def describe(self, backend: str) -> str:
        return f"{backend} decided; runs as {self.label} (stand-in)"


def cuda_only(impl: Optional[str]) -> bool:
    return impl is not None and impl.startswith(CUDA_ONLY)


def computed_layer(layer, weight_only: bool):
    """``layer`` as a kernel computes it: a weight-only kernel takes the checkpoint's weights and 16-bit activations.

    Where the family has no weight-only scheme (moe-fsm's FP8 schemes all carry an activation key), the layer
    stays as declared: its stand-in then emulates the activation quantization Marlin skips, and says so (no
    ``weight_only`` on the StandIn)."""
    if not weight_only or layer.quant.activation is None:
        return layer
    try:
        return replace(layer, quant=replace(layer.quant, activation=None))
    except InputError:
        return layer


def choose(layer, activation_format: ActivationFormat, device_type: str, replaces: str, because: str,
           weight_only: bool = False) -> StandIn:
    """The stand-in for a layer whose decided kernel cannot run here (``device_type``: cuda | cpu | ...);
    ``weight_only``: the decided kernel computes with 16-bit activations (build it on ``computed_layer``)."""
    computed = computed_layer(layer, weight_only)
    stand_in = _choose(computed, activation_format, device_type, replaces, because)
    if computed is layer:
        return stand_in
    return replace(stand_in, label=f"{stand_in.label}, 16-bit activations", weight_only=True)


def _choose(layer, activation_format: ActivationFormat, device_type: str, replaces: str, because: str) -> StandIn:
    batched = activation_format is ActivationFormat.BATCHED
    quant = layer.quant
    # moe-fsm's Triton experts run unquantized and FP8 w8a8 layers (not FP8 weights with 16-bit activations)
    triton = layer.family is QuantFamily.UNQUANTIZED or (layer.family is QuantFamily.FP8 and quant.activation is not None)
    if device_type == "cuda" and layer.dtype in ("bfloat16", "float16"):
        if batched:
            if triton:
                return StandIn(replaces, TRITON_BATCHED, "moe-fsm batched Triton", because)
        elif layer.family is QuantFamily.MXFP4 and quant.weight.dtype == MX_FP4 and quant.activation is None:
            return StandIn(replaces, TRITON_MXFP4, "moe-fsm Triton MXFP4", because)
        elif layer.family is QuantFamily.NVFP4 and quant.activation is None:
            return StandIn(replaces, TRITON_NVFP4, "moe-fsm Triton NVFP4", because)
        elif layer.family is QuantFamily.INT_WNA16:
            return StandIn(replaces, TRITON_WNA16, f"moe-fsm Triton W{quant.weight_bits}A16", because)
        elif triton:
            return StandIn(replaces, TRITON, "moe-fsm Triton", because)
    if batched:
        return StandIn(replaces, TORCH_BATCHED, "moe-fsm batched torch experts", because)
    return StandIn(replaces, TORCH, "moe-fsm torch experts", because)
