"""How each activation quantization key quantizes, dequantizes and calibrates, as one table.

The experts quantize activations twice: the layer input (through prepare, so the
tokens travel quantized) and the intermediate after the activation function
(re-quantized before the second GEMM, the way vLLM's kernels feed it). Both use
the entry of the scheme's activation key; what differs between keys is data here,
not branches in the experts.

Static parts of a key live in ExpertScales: FP8 static keys read ``a1_scale`` /
``a2_scale`` (one fp32 scale, or one per token for a static per-token ``a1_scale``);
NVFP4 reads the quantization multipliers ``a1_global_scale`` / ``a2_global_scale``
(one, or one per expert, reduced to the smallest, i.e. the largest input scale,
as vLLM's emulation does when they differ).

Some kernels quantize activations themselves although the scheme's activation
key is None (vLLM passes unquantized inputs): W4A8-INT8's CPU kernel quantizes
both GEMM inputs to INT8 per token, asymmetrically (KleidiAI's qai8dx). Their
entry is ``kernel_activation_quant``: the experts apply it, prepare does not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from moe_fsm.errors import KernelInputError
from moe_fsm.inputs.quant import (
    FP8_DYNAMIC_GROUP128,
    FP8_DYNAMIC_TENSOR,
    FP8_DYNAMIC_TOKEN,
    FP8_STATIC_TENSOR,
    FP8_STATIC_TOKEN,
    INT8_DYNAMIC_TENSOR,
    INT8_DYNAMIC_TENSOR_ASYM,
    INT8_DYNAMIC_TOKEN,
    INT8_DYNAMIC_TOKEN_ASYM,
    INT8_STATIC_TENSOR,
    MXFP4_DYNAMIC,
    MXFP8_DYNAMIC,
    NVFP4_DYNAMIC,
    Granularity,
    QuantFamily,
    QuantKey,
    QuantScheme,
)
from moe_fsm.kernels import fp8, intq, mx, nvfp4
from moe_fsm.modular.interfaces import DynamicFP8RowQuantizer, ExpertScales, InputQuantizer

Quantize = Callable[[torch.Tensor, Optional[torch.Tensor]], tuple[torch.Tensor, torch.Tensor]]
Dequantize = Callable[[torch.Tensor, torch.Tensor, Optional[torch.Tensor], torch.dtype], torch.Tensor]


@dataclass(frozen=True)
class ActivationQuant:
    """One activation key: ``quantize(x, static) -> (q, scale)``, ``dequantize(q, scale, static, dtype)``.

    ``fields`` names the ExpertScales fields holding the static part for the layer
    input and the intermediate (None: fully dynamic). ``calibrate(amax)`` turns a
    calibration amax into that static value; ``shared(static)`` reduces what a
    checkpoint may hold per expert to the one value the kernels use.
    ``packing`` is how many values share one stored element of ``q``.
    """

    key: QuantKey
    quantize: Quantize
    dequantize: Dequantize
    fields: Optional[tuple[str, str]] = None
    calibrate: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
    shared: Callable[[torch.Tensor], torch.Tensor] = lambda static: static
    packing: int = 1

    def fake_quantize(self, x: torch.Tensor, static: Optional[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """Quantize then dequantize: what the next GEMM sees of ``x``."""
        q, scale = self.quantize(x, static)
        return self.dequantize(q, scale, static, dtype)


def _fp8_dequantize(q: torch.Tensor, scale: torch.Tensor, _static: Optional[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    return fp8.dequantize_activation(q, scale, dtype)


def _fp8_dynamic(quantizer: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]) -> Quantize:
    return lambda x, _static: quantizer(x)


def _fp8_calibrate(amax: torch.Tensor) -> torch.Tensor:
    return fp8.dynamic_scale(amax.to(torch.float32)).reshape(1)


def _nvfp4_calibrate(amax: torch.Tensor) -> torch.Tensor:
    return nvfp4.activation_global_scale(amax).reshape(1)


def _smallest(static: torch.Tensor) -> torch.Tensor:
    return static.amin().reshape(1)


_FP8_STATIC = ("a1_scale", "a2_scale")


def _mx(quantize, dequantize) -> tuple[Quantize, Dequantize]:
    return (lambda x, _static: quantize(x)), (lambda q, scale, _static, dtype: dequantize(q, scale, dtype))


def _int8(key: QuantKey) -> ActivationQuant:
    per_token = key.granularity is Granularity.TOKEN

    def quantize(x: torch.Tensor, static: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return intq.quantize_int8_activation(x, per_token=per_token, symmetric=key.symmetric, static_scale=static)

    def dequantize(q: torch.Tensor, scale: torch.Tensor, _static: Optional[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return intq.dequantize_int8_activation(q, scale, key.symmetric, dtype)

    static = dict(fields=_FP8_STATIC, calibrate=lambda amax: intq.divide(amax.to(torch.float32), 127).clamp(min=1e-10).reshape(1)) if key.static else {}
    return ActivationQuant(key, quantize, dequantize, **static)

ACTIVATION_QUANT: dict[QuantKey, ActivationQuant] = {
    FP8_STATIC_TENSOR: ActivationQuant(FP8_STATIC_TENSOR, fp8.quantize_per_tensor, _fp8_dequantize, _FP8_STATIC, _fp8_calibrate),
    FP8_DYNAMIC_TENSOR: ActivationQuant(FP8_DYNAMIC_TENSOR, _fp8_dynamic(fp8.quantize_per_tensor), _fp8_dequantize),
    FP8_STATIC_TOKEN: ActivationQuant(FP8_STATIC_TOKEN, fp8.quantize_per_token, _fp8_dequantize, _FP8_STATIC, _fp8_calibrate),
    FP8_DYNAMIC_TOKEN: ActivationQuant(FP8_DYNAMIC_TOKEN, _fp8_dynamic(fp8.quantize_per_token), _fp8_dequantize),
    FP8_DYNAMIC_GROUP128: ActivationQuant(FP8_DYNAMIC_GROUP128, _fp8_dynamic(fp8.quantize_per_group), _fp8_dequantize),
    NVFP4_DYNAMIC: ActivationQuant(
        NVFP4_DYNAMIC,
        nvfp4.quantize,
        nvfp4.dequantize_activation,
        ("a1_global_scale", "a2_global_scale"),
        _nvfp4_calibrate,
        _smallest,
        packing=2,
    ),
    MXFP4_DYNAMIC: ActivationQuant(MXFP4_DYNAMIC, *_mx(mx.quantize_mxfp4, mx.dequantize_mxfp4), packing=2),
    MXFP8_DYNAMIC: ActivationQuant(MXFP8_DYNAMIC, *_mx(mx.quantize_mxfp8, mx.dequantize_mxfp8)),
    **{key: _int8(key) for key in (INT8_DYNAMIC_TOKEN, INT8_DYNAMIC_TOKEN_ASYM, INT8_DYNAMIC_TENSOR,
                                   INT8_DYNAMIC_TENSOR_ASYM, INT8_STATIC_TENSOR)},
}
KERNEL_ACTIVATION_QUANT: dict[QuantFamily, ActivationQuant] = {
    QuantFamily.W4A8_INT8: ACTIVATION_QUANT[INT8_DYNAMIC_TOKEN_ASYM],
}


def activation_quant(scheme: QuantScheme) -> Optional[ActivationQuant]:
    """The scheme's activation entry; None when activations stay in the layer dtype."""
    if scheme.activation is None:
        return None
    try:
        return ACTIVATION_QUANT[scheme.activation]
    except KeyError:
        accepted = sorted(str(k) for k in ACTIVATION_QUANT)
        raise KernelInputError(f"activation quantization {scheme.activation} has no emulation; accepted: {accepted}") from None


def kernel_activation_quant(scheme: QuantScheme) -> Optional[ActivationQuant]:
    """The quantization a kernel applies to 16-bit inputs on its own (both GEMMs), or None."""
    return KERNEL_ACTIVATION_QUANT.get(scheme.family) if scheme.activation is None else None


def static_scale(quant: ActivationQuant, scales: Optional[ExpertScales], stage: int) -> Optional[torch.Tensor]:
    """The static value for the layer input (stage 0) or the intermediate (stage 1), or None if dynamic."""
    if quant.fields is None:
        return None
    field = quant.fields[stage]
    value = getattr(scales, field) if scales is not None else None
    if value is None:
        raise KernelInputError(f"activation quantization {quant.key} needs ExpertScales.{field}; it is missing")
    return quant.shared(value.to(torch.float32))


def input_quantizer(scheme: QuantScheme, scales: Optional[ExpertScales]) -> Optional[InputQuantizer]:
    """What prepare calls on the layer input: the scheme's quantizer bound to its static scale."""
    quant = activation_quant(scheme)
    if quant is None:
        return None
    static = static_scale(quant, scales, 0)
    if quant.key in _DYNAMIC_FP8_ROWS:
        return DynamicFP8RowQuantizer(_DYNAMIC_FP8_ROWS[quant.key], lambda hidden: quant.quantize(hidden, None))
    return lambda hidden: quant.quantize(hidden, static)


# Keys whose input quantizer says what it is (DynamicFP8RowQuantizer), so a dispatch can apply it while packing.
_DYNAMIC_FP8_ROWS = {FP8_DYNAMIC_TOKEN: "token", FP8_DYNAMIC_GROUP128: "group"}
