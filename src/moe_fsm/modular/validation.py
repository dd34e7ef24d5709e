"""Checks on a modular-kernel call, run before any kernel so that bad input fails with a reason.

A kernel handed the wrong shape either crashes deep inside a GEMM or, worse,
computes something plausible. Each check here names the tensor, what it got and
what the layer accepts. Expected shapes come from the layer and the scheme's
weight table entry, so a new weight format is validated without new code here.

Shapes, dtypes and devices are host metadata and always checked. Checks of
tensor *values* (expert ids in range, the expert map a permutation, static
scales finite and positive) read device memory, which on a GPU is a host
synchronization: it stalls the launch queue and makes the forward impossible
to capture in a CUDA graph. They run where the tensors live on the CPU, and on
a GPU only in debug mode (``MOE_FSM_DEBUG_CHECKS=1``) and never during a graph
capture. Without them the Triton kernels still skip an out-of-range id (the slot
contributes nothing) rather than read outside the weights.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

import torch

from moe_fsm.errors import KernelInputError
from moe_fsm.inputs.layer import MoELayer
from moe_fsm.inputs.quant import Granularity
from moe_fsm.modular.interfaces import ExpertScales
from moe_fsm.quantize.activations import activation_quant
from moe_fsm.quantize.weights import weight_format

INDEX_DTYPES = (torch.int32, torch.int64)
DEBUG_ENV = "MOE_FSM_DEBUG_CHECKS"


def debug_checks() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def values_checkable(t: torch.Tensor) -> bool:
    """Whether reading ``t``'s values here costs no device synchronization, or debug mode asks for it anyway."""
    if t.device.type == "cpu":
        return True
    if not debug_checks():
        return False
    return not (t.device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def _shape(t: torch.Tensor) -> list[int]:
    return list(t.shape)


def _expect_shape(name: str, t: torch.Tensor, expected: Sequence[int], meaning: str) -> None:
    if tuple(t.shape) != tuple(expected):
        raise KernelInputError(f"{name} has shape {_shape(t)}; this layer accepts {list(expected)} ({meaning})")


def _expect_dtype(name: str, t: torch.Tensor, accepted: Sequence[torch.dtype]) -> None:
    if t.dtype not in accepted:
        raise KernelInputError(f"{name} has dtype {t.dtype}; accepted: {', '.join(str(d) for d in accepted)}")


def _expect_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise KernelInputError(f"{name} is on {t.device}; every tensor must be on hidden_states' device {device}")


def check_hidden(hidden: torch.Tensor, layer: MoELayer) -> None:
    if hidden.dim() != 2 or hidden.shape[1] != layer.hidden_size:
        raise KernelInputError(f"hidden_states has shape {_shape(hidden)}; this layer accepts [M, {layer.hidden_size}] (M tokens, K hidden)")
    _expect_dtype("hidden_states", hidden, [getattr(torch, layer.dtype)])


def check_weights(w1: torch.Tensor, w2: torch.Tensor, layer: MoELayer, num_local: int) -> None:
    k, n = layer.hidden_size, layer.intermediate_size
    fmt = weight_format(layer.quant)
    storage = fmt.storage_dtype if fmt else getattr(torch, layer.dtype)
    if fmt is not None and n % fmt.column_multiple:
        raise KernelInputError(f"{fmt.key} weights need intermediate_size divisible by {fmt.column_multiple}; got {n}")
    packing = fmt.packing if fmt else 1
    last = (lambda dim: f"{dim}/{packing}, {packing} values per byte") if packing > 1 else (lambda dim: dim)
    _expect_shape("w1", w1, (num_local, 2 * n, k // packing), f"[E, 2N, {last('K')}]")
    _expect_shape("w2", w2, (num_local, k, n // packing), f"[E, K, {last('N')}]")
    _expect_dtype("w1", w1, [storage])
    _expect_dtype("w2", w2, [storage])


def check_routing(topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_tokens: int, layer: MoELayer, has_map: bool,
                  values: bool = True) -> None:
    expected = (num_tokens, layer.top_k)
    _expect_shape("topk_ids", topk_ids, expected, "[M, top_k]")
    _expect_shape("topk_weights", topk_weights, expected, "[M, top_k]")
    _expect_dtype("topk_ids", topk_ids, INDEX_DTYPES)
    if not topk_weights.is_floating_point():
        raise KernelInputError(f"topk_weights has dtype {topk_weights.dtype}; accepted: a floating dtype (float32 preferred)")
    if not values or topk_ids.numel() == 0 or not values_checkable(topk_ids):
        return
    low, high = int(topk_ids.min()), int(topk_ids.max())
    lowest = -1 if has_map else 0
    if low < lowest or high >= layer.num_experts:
        bad = low if low < lowest else high
        accepted = f"0..{layer.num_experts - 1}" + (" or -1 (slot skipped)" if has_map else " (-1 only with an expert_map)")
        raise KernelInputError(f"topk_ids holds expert id {bad}; accepted: {accepted}")


def check_expert_map(expert_map: torch.Tensor, layer: MoELayer, num_local: int, values: bool = True) -> None:
    _expect_shape("expert_map", expert_map, (layer.num_experts,), "[E] global -> local expert id, -1 if not local")
    _expect_dtype("expert_map", expert_map, INDEX_DTYPES)
    if not values or not values_checkable(expert_map):
        return
    local = expert_map[expert_map >= 0]
    if bool(((expert_map < -1) | (expert_map >= num_local)).any()):
        raise KernelInputError(f"expert_map values must lie in -1..{num_local - 1} (w1 holds {num_local} local experts)")
    if local.numel() != num_local or torch.unique(local).numel() != num_local:
        raise KernelInputError(
            f"expert_map must name each of the {num_local} local experts exactly once; it maps {local.numel()} "
            f"global experts to {torch.unique(local).numel()} distinct local ids"
        )


def _scale(scales: ExpertScales, field: str, why: str) -> torch.Tensor:
    value = getattr(scales, field)
    if value is None:
        raise KernelInputError(f"ExpertScales.{field} is missing; {why} needs it")
    return value


def check_weight_scales(scales: ExpertScales, layer: MoELayer, num_local: int) -> None:
    fmt = weight_format(layer.quant)
    if fmt is None:
        check_biases(scales, layer, num_local)
        return
    k, n = layer.hidden_size, layer.intermediate_size
    why = f"weight quantization {fmt.key}"
    for prefix, rows, cols in (("w1", 2 * n, k), ("w2", k, n)):
        scale = _scale(scales, f"{prefix}_scale", why)
        _expect_shape(f"ExpertScales.{prefix}_scale", scale, (num_local, *fmt.scale_shape(rows, cols)), f"{fmt.key} scales of {prefix}")
        _expect_dtype(f"ExpertScales.{prefix}_scale", scale, [fmt.scale_dtype])
        if fmt.has_global_scale:
            g = _scale(scales, f"{prefix}_global_scale", why)
            _expect_shape(f"ExpertScales.{prefix}_global_scale", g, (num_local,), "one fp32 dequantization multiplier per expert")
            _expect_dtype(f"ExpertScales.{prefix}_global_scale", g, [torch.float32])
        if "zero_point" in fmt.extras:
            z = _scale(scales, f"{prefix}_zero_point", why)
            _expect_shape(f"ExpertScales.{prefix}_zero_point", z, tuple(scale.shape), f"one zero point per scale of {prefix}")
            _expect_dtype(f"ExpertScales.{prefix}_zero_point", z, [torch.uint8])
        if "g_idx" in fmt.extras:
            g_idx = _scale(scales, f"{prefix}_g_idx", f"{why} in activation order")
            _expect_shape(f"ExpertScales.{prefix}_g_idx", g_idx, (num_local, cols), f"the group of every column of {prefix}")
            _expect_dtype(f"ExpertScales.{prefix}_g_idx", g_idx, [torch.int32])
    check_biases(scales, layer, num_local)


def check_biases(scales: ExpertScales, layer: MoELayer, num_local: int) -> None:
    """Layers with biases need both, one float row per expert; layers without must not get any."""
    for prefix, rows in (("w1", 2 * layer.intermediate_size), ("w2", layer.hidden_size)):
        bias = getattr(scales, f"{prefix}_bias")
        if not layer.bias:
            if bias is not None:
                raise KernelInputError(f"ExpertScales.{prefix}_bias is given but the layer has no biases (MoELayer.bias=False)")
            continue
        bias = _scale(scales, f"{prefix}_bias", "a layer with biases (MoELayer.bias=True)")
        _expect_shape(f"ExpertScales.{prefix}_bias", bias, (num_local, rows), f"one bias per output row of {prefix}")
        if not bias.is_floating_point():
            raise KernelInputError(f"ExpertScales.{prefix}_bias has dtype {bias.dtype}; accepted: a floating dtype")


def check_activation_scales(scales: ExpertScales, layer: MoELayer, num_tokens: int, num_local: int, values: bool = True) -> None:
    quant = activation_quant(layer.quant)
    if quant is None or quant.fields is None:
        return
    for stage, field in enumerate(quant.fields):
        value = _scale(scales, field, f"activation quantization {quant.key}")
        accepted = {1}
        if stage == 0 and quant.key.granularity is Granularity.TOKEN:
            accepted.add(num_tokens)
        if quant.key.granularity is Granularity.GROUP_1x16:
            accepted.add(num_local)
        if value.numel() not in accepted:
            raise KernelInputError(
                f"ExpertScales.{field} has {value.numel()} elements; {quant.key} accepts {sorted(accepted)} "
                f"(one shared value{', one per token' if num_tokens in accepted and num_tokens != 1 else ''}"
                f"{', one per local expert' if quant.key.granularity is Granularity.GROUP_1x16 else ''})"
            )
        _expect_dtype(f"ExpertScales.{field}", value, [torch.float32])
        if values and value.numel() and values_checkable(value) and not bool(torch.isfinite(value).all() and (value > 0).all()):
            raise KernelInputError(f"ExpertScales.{field} must be finite and positive; got {value.flatten()[:4].tolist()}")


def check_devices(hidden: torch.Tensor, named: dict[str, Optional[torch.Tensor]]) -> None:
    for name, t in named.items():
        if t is not None:
            _expect_device(name, t, hidden.device)


def validate_call(
    layer: MoELayer,
    hidden_states: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    scales: ExpertScales,
    expert_map: Optional[torch.Tensor],
    seen: Optional[set] = None,
    *,
    values: bool = True,
) -> None:
    """Every check, cheapest first; raises KernelInputError on the first problem.

    With ``seen`` (a set the caller keeps), a call whose tensors have the shapes,
    dtypes and devices of one that already passed, and whose values are not to be
    read (see ``values_checkable``), is not checked again: eager decode calls then
    pay one tuple comparison instead of the whole walk.

    ``values=False`` checks the metadata alone (shapes, dtypes, devices), never a
    tensor's values: what a trace can check (``torch.compile``'s fake tensors have none).
    """
    key = None
    if seen is not None and (not values or not values_checkable(topk_ids)):
        key = tuple(
            None if t is None else (t.shape, t.dtype, t.device)
            for t in (hidden_states, w1, w2, topk_weights, topk_ids, expert_map, *vars(scales).values())
        )
        if key in seen:
            return
    _validate(layer, hidden_states, w1, w2, topk_weights, topk_ids, scales, expert_map, values)
    if key is not None:
        seen.add(key)


def _validate(layer, hidden_states, w1, w2, topk_weights, topk_ids, scales, expert_map, values: bool = True) -> None:
    scale_tensors = {f"ExpertScales.{k}": v for k, v in vars(scales).items()}
    check_devices(hidden_states, {"w1": w1, "w2": w2, "topk_weights": topk_weights, "topk_ids": topk_ids, "expert_map": expert_map, **scale_tensors})
    check_hidden(hidden_states, layer)
    num_local = w1.shape[0] if expert_map is not None and w1.dim() == 3 else layer.num_experts
    check_weights(w1, w2, layer, num_local)
    if expert_map is not None:
        check_expert_map(expert_map, layer, num_local, values)
    num_tokens = hidden_states.shape[0]
    check_routing(topk_weights, topk_ids, num_tokens, layer, expert_map is not None, values)
    check_weight_scales(scales, layer, num_local)
    check_activation_scales(scales, layer, num_tokens, num_local, values)
