"""Float experts to their quantized form and back, one table entry per weight key.

FP8, NVFP4, MX (E8M0 per 32), INT8 W8A8 come from the key alone; integer
group formats (INT4/INT8 with group scales and zero points) also need the
scheme's group size and zero-point flag, so their entry is made per scheme.

``quantize_weights`` is what a checkpoint loader would have produced: w1 [E, 2N, K]
and w2 [E, K, N] in the scheme's storage dtype plus their scales in ExpertScales.
``calibrate_activation_scales`` adds the static activation scales a scheme reads
(FP8 static ``a1_scale``/``a2_scale``, NVFP4 ``a1_global_scale``/``a2_global_scale``)
from a sample batch. ``dequantize_weights`` is the float view the float64
reference runs on, so a quantized kernel is judged against the weights it
actually holds.

NVFP4 stores ``w*_global_scale`` as the *dequantization* multiplier
``amax / (448 * 6)`` (vLLM's ``weight_scale_2``): w = e2m1 * block_scale * global.
Asymmetric integer weights store ``w*_zero_point`` beside their scales, and
activation-ordered ones (GPTQ ``desc_act``) ``w*_g_idx``, each column's group.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch

from moe_fsm.errors import KernelInputError
from moe_fsm.inputs.layer import MoELayer
from moe_fsm.inputs.quant import (
    FP8_STATIC_BLOCK128, FP8_STATIC_CHANNEL, FP8_STATIC_TENSOR, GROUPED_FAMILIES, INT8_STATIC_CHANNEL,
    INT8_STATIC_TENSOR, MXFP4_STATIC, MXFP8_STATIC, NVFP4_STATIC, QuantKey, QuantScheme,
)
from moe_fsm.kernels import fp8, intq, mx, nvfp4
from moe_fsm.kernels.activations import apply_activation
from moe_fsm.modular.interfaces import ExpertScales
from moe_fsm.quantize.activations import activation_quant

Extras = dict[str, torch.Tensor]
Quantized = tuple[torch.Tensor, torch.Tensor, Extras]


@dataclass(frozen=True)
class WeightFormat:
    """One weight key: storage, scale layout, and the quantize/dequantize pair.

    ``quantize(w [.., R, C]) -> (q, scale, extras)`` and
    ``dequantize(q, scale, extras, dtype) -> [.., R, C]``, where ``extras`` maps each
    name of ``extras`` to the ExpertScales term ``w1_<name>``/``w2_<name>``: NVFP4's
    ``global_scale``; the ``zero_point`` of asymmetric integer weights; the ``g_idx``
    (group of each column, int32 [.., C]) of activation-ordered ones. ``scale_shape(R, C)``
    is the per-expert scale shape (zero points share it); ``packing`` values share one
    stored element, so q is ``[.., R, C / packing]``.
    """

    key: QuantKey
    storage_dtype: torch.dtype
    scale_dtype: torch.dtype
    scale_shape: Callable[[int, int], tuple[int, ...]]
    quantize: Callable[[torch.Tensor], Quantized]
    dequantize: Callable[[torch.Tensor, torch.Tensor, Extras, torch.dtype], torch.Tensor]
    extras: tuple[str, ...] = ()  # of "global_scale", "zero_point", "g_idx"
    packing: int = 1
    column_multiple: int = 1

    @property
    def has_global_scale(self) -> bool:
        return "global_scale" in self.extras

    def stored_shape(self, rows: int, cols: int) -> tuple[int, int]:
        return rows, cols // self.packing


def _no_global(quantize: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]) -> Callable[[torch.Tensor], Quantized]:
    return lambda w: (*quantize(w), {})


def _ignore_global(dequantize: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    return lambda q, scale, _extras, dtype: dequantize(q, scale, dtype)


def _nvfp4_quantize(w: torch.Tensor) -> Quantized:
    packed, scale, global_scale = nvfp4.quantize_weight(w)
    return packed, scale, {"global_scale": global_scale}


def _nvfp4_dequantize(q: torch.Tensor, scale: torch.Tensor, extras: Extras, dtype: torch.dtype) -> torch.Tensor:
    return nvfp4.dequantize_weight(q, scale, extras["global_scale"], dtype)


def _blocks(rows: int, cols: int) -> tuple[int, int]:
    return -(-rows // fp8.BLOCK_SIZE), -(-cols // fp8.BLOCK_SIZE)


WEIGHT_FORMATS: dict[QuantKey, WeightFormat] = {
    FP8_STATIC_TENSOR: WeightFormat(
        FP8_STATIC_TENSOR, fp8.FP8_DTYPE, torch.float32, lambda r, c: (),
        _no_global(fp8.quantize_weight_per_tensor), _ignore_global(fp8.dequantize_weight_per_tensor),
    ),
    FP8_STATIC_CHANNEL: WeightFormat(
        FP8_STATIC_CHANNEL, fp8.FP8_DTYPE, torch.float32, lambda r, c: (r,),
        _no_global(fp8.quantize_weight_per_channel), _ignore_global(fp8.dequantize_weight_per_channel),
    ),
    FP8_STATIC_BLOCK128: WeightFormat(
        FP8_STATIC_BLOCK128, fp8.FP8_DTYPE, torch.float32, _blocks,
        _no_global(fp8.quantize_weight_block), _ignore_global(fp8.dequantize_weight_block),
    ),
    NVFP4_STATIC: WeightFormat(
        NVFP4_STATIC, torch.uint8, nvfp4.SCALE_DTYPE, lambda r, c: (r, c // nvfp4.BLOCK),
        _nvfp4_quantize, _nvfp4_dequantize,
        extras=("global_scale",), packing=2, column_multiple=nvfp4.BLOCK,
    ),
    MXFP4_STATIC: WeightFormat(
        MXFP4_STATIC, torch.uint8, torch.uint8, lambda r, c: (r, c // mx.BLOCK),
        _no_global(mx.quantize_mxfp4), _ignore_global(mx.dequantize_mxfp4), packing=2, column_multiple=mx.BLOCK,
    ),
    MXFP8_STATIC: WeightFormat(
        MXFP8_STATIC, mx.FP8_DTYPE, torch.uint8, lambda r, c: (r, c // mx.BLOCK),
        _no_global(mx.quantize_mxfp8), _ignore_global(mx.dequantize_mxfp8), column_multiple=mx.BLOCK,
    ),
    INT8_STATIC_CHANNEL: WeightFormat(
        INT8_STATIC_CHANNEL, torch.int8, torch.float32, lambda r, c: (r,),
        _no_global(lambda w: intq.quantize_int8_weight(w, per_channel=True)), _ignore_global(intq.dequantize_int8_weight),
    ),
    INT8_STATIC_TENSOR: WeightFormat(
        INT8_STATIC_TENSOR, torch.int8, torch.float32, lambda r, c: (),
        _no_global(lambda w: intq.quantize_int8_weight(w, per_channel=False)), _ignore_global(intq.dequantize_int8_weight),
    ),
}
_SCALE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, None: torch.float32}


def grouped_int_format(scheme: QuantScheme) -> WeightFormat:
    """INT4/INT8 codes with group scales (zero points if asymmetric) along the row, for this scheme's group size.

    Activation order changes nothing for one scale per row (``desc_act`` is then a no-op, as vLLM treats it).
    """
    bits, group, zero_point = scheme.weight_bits, scheme.group_size, scheme.zero_point
    scale_dtype = _SCALE_DTYPES[scheme.weight.scale_dtype]
    per_row = group == -1
    act_order = scheme.act_order and not per_row
    extras = ("zero_point",) * zero_point + ("g_idx",) * act_order

    def quantize(w: torch.Tensor) -> Quantized:
        if act_order:
            codes, scale, zeros, g_idx = intq.act_order_quantize_weight(w, bits, group, zero_point=zero_point,
                                                                        scale_dtype=scale_dtype)
            return codes, scale, {"g_idx": g_idx, **({"zero_point": zeros} if zero_point else {})}
        codes, scale, zeros = intq.quantize_weight(w, bits, group, zero_point=zero_point, scale_dtype=scale_dtype)
        return codes, scale, ({"zero_point": zeros} if zero_point else {})

    def dequantize(q: torch.Tensor, scale: torch.Tensor, extras: Extras, dtype: torch.dtype) -> torch.Tensor:
        return intq.dequantize_weight(q, scale, extras.get("zero_point"), bits, dtype, extras.get("g_idx"))

    return WeightFormat(
        scheme.weight, torch.uint8, scale_dtype, lambda r, c: (r, 1 if per_row else c // group), quantize, dequantize,
        extras=extras, packing=8 // bits, column_multiple=(8 // bits if per_row else group),
    )


def weight_format(scheme: QuantScheme) -> Optional[WeightFormat]:
    """The scheme's weight entry; None for unquantized weights."""
    if scheme.weight is None:
        return None
    if scheme.family in GROUPED_FAMILIES:
        return grouped_int_format(scheme)
    try:
        return WEIGHT_FORMATS[scheme.weight]
    except KeyError:
        accepted = sorted(str(k) for k in WEIGHT_FORMATS)
        raise KernelInputError(f"weight quantization {scheme.weight} has no emulation; accepted: {accepted}") from None


def _check_float_experts(w1: torch.Tensor, w2: torch.Tensor) -> None:
    if w1.dim() != 3 or w2.dim() != 3 or w1.shape[0] != w2.shape[0] or w1.shape[1] != 2 * w2.shape[2] or w1.shape[2] != w2.shape[1]:
        raise KernelInputError(
            f"float experts must be w1 [E, 2N, K] and w2 [E, K, N]; got w1 {list(w1.shape)}, w2 {list(w2.shape)}"
        )
    if not (w1.is_floating_point() and w2.is_floating_point()):
        raise KernelInputError(f"float experts must be floating point; got w1 {w1.dtype}, w2 {w2.dtype}")


def quantize_weights(w1: torch.Tensor, w2: torch.Tensor, scheme: QuantScheme) -> tuple[torch.Tensor, torch.Tensor, ExpertScales]:
    """``(w1q, w2q, scales)`` with the weight scales of ``scheme``; unquantized returns the inputs."""
    _check_float_experts(w1, w2)
    fmt = weight_format(scheme)
    if fmt is None:
        return w1, w2, ExpertScales()
    for name, w in (("w1", w1), ("w2", w2)):
        if w.shape[-1] % fmt.column_multiple:
            raise KernelInputError(f"{fmt.key} needs {name}'s last dim divisible by {fmt.column_multiple}; got {list(w.shape)}")
    w1q, w1s, w1x = fmt.quantize(w1)
    w2q, w2s, w2x = fmt.quantize(w2)
    extras = {f"{prefix}_{name}": t for prefix, terms in (("w1", w1x), ("w2", w2x)) for name, t in terms.items()}
    return w1q, w2q, ExpertScales(w1_scale=w1s, w2_scale=w2s, **extras)


def dequantize_weights(
    w1q: torch.Tensor, w2q: torch.Tensor, scales: Optional[ExpertScales], scheme: QuantScheme, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """The float weights the quantized ones stand for: ``[E, 2N, K]`` and ``[E, K, N]`` in ``dtype``."""
    fmt = weight_format(scheme)
    if fmt is None:
        return w1q.to(dtype), w2q.to(dtype)
    scales = scales or ExpertScales()
    return (
        fmt.dequantize(w1q, scales.w1_scale, weight_extras(fmt, scales, "w1"), dtype),
        fmt.dequantize(w2q, scales.w2_scale, weight_extras(fmt, scales, "w2"), dtype),
    )


def weight_extras(fmt: WeightFormat, scales: ExpertScales, prefix: str) -> Extras:
    """The format's extra per-expert terms for ``prefix`` (w1 or w2) by name: global scales, zero points, g_idx."""
    return {name: getattr(scales, f"{prefix}_{name}") for name in fmt.extras}


def intermediate_amax(
    sample: torch.Tensor, w1: torch.Tensor, activation: str, swiglu_limit: Optional[float]
) -> torch.Tensor:
    """amax of act(w1[e] @ x) over every expert and sample token: routing-independent, so it never under-covers."""
    x = sample.to(torch.float32)
    amax = torch.zeros((), dtype=torch.float32, device=x.device)
    for e in range(w1.shape[0]):
        inter = apply_activation(activation, x @ w1[e].to(torch.float32).T, swiglu_limit)
        amax = torch.maximum(amax, fp8.abs_max(inter))
    return amax


def calibrate_activation_scales(
    w1q: torch.Tensor, w2q: torch.Tensor, scales: ExpertScales, layer: MoELayer, sample: torch.Tensor
) -> ExpertScales:
    """``scales`` plus the static activation values the layer's scheme reads, from ``sample`` [M, K]."""
    quant = activation_quant(layer.quant)
    if quant is None or quant.fields is None:
        return scales
    w1, _ = dequantize_weights(w1q, w2q, scales, layer.quant)
    input_amax = fp8.abs_max(sample.to(torch.float32))
    inter_amax = intermediate_amax(sample, w1, layer.activation.value, layer.swiglu_limit)
    a1, a2 = quant.fields
    return replace(scales, **{a1: quant.calibrate(input_amax), a2: quant.calibrate(inter_amax)})


def quantize_experts(
    w1: torch.Tensor, w2: torch.Tensor, layer: MoELayer, sample: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor, ExpertScales]:
    """Weights in the layer's scheme plus, when it has static activation parts, scales calibrated on ``sample``."""
    w1q, w2q, scales = quantize_weights(w1, w2, layer.quant)
    quant = activation_quant(layer.quant)
    if quant is None or quant.fields is None:
        return w1q, w2q, scales
    if sample is None:
        raise KernelInputError(
            f"activation quantization {quant.key} reads static scales {list(quant.fields)}; pass a sample batch to calibrate them"
        )
    return w1q, w2q, calibrate_activation_scales(w1q, w2q, scales, layer, sample)


def interleave_gate_up(t: torch.Tensor) -> torch.Tensor:
    """w1-shaped rows [E, 2N, ...] from stacked (gate rows, then up rows) to interleaved (gate n at 2n, up n at 2n+1).

    The layout gpt-oss checkpoints ship; rows are quantized independently, so it
    applies as well to packed weights, their scales and the w1 bias.
    """
    gate, up = t.chunk(2, dim=1)
    return torch.stack((gate, up), dim=2).reshape(t.shape)
