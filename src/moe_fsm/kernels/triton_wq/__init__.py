"""Triton fused MoE with quantized weights and 16-bit activations, dequantized inside the GEMMs.

Serves gpt-oss-style MXFP4 layers (biases, SwiGLU-OAI with its clamp, stacked or
interleaved gate/up rows) and weight-only INT4/INT8 layers with group scales and
optional zero points (GPTQ, AWQ, compressed-tensors W4A16/W8A16). Importing this
package needs neither Triton nor CUDA; launching does, and fails with
``BackendUnavailableError`` saying which is missing. The alignment step is the
one of ``kernels.triton_moe``.
"""

from moe_fsm.kernels.triton_wq.fused import WeightQuant, fused_wq_experts

__all__ = ["WeightQuant", "fused_wq_experts"]
