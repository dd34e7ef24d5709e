"""Host side of the Triton fused-MoE experts: checks, buffers and launches.

``fused_experts`` is the whole layer for tokens as rows: align the (token, slot)
pairs by expert, quantize the input if the layer is FP8, run the w1 GEMM with the
gated activation fused (and the intermediate's FP8 quantization too where it is
per-group or static), run the w2 GEMM with the top-k weights applied, and sum
over top-k (in a launch of its own, or inside w2 for a few unsorted tokens whose grid
is wide enough: ``w2_token_sum``, ``config.sums_slots_in_w2``). ``fused_experts_batched`` is the same pair of GEMMs on the batched
layout [E, max_tokens, K], whose output is left unweighted and unreduced for the
prepare/finalize object to scatter back.

Neither reads a device value on the host, so both can be captured in a CUDA
graph. Shapes and dtypes are checked on the host; ids are not (that would
synchronize): a slot whose expert id is negative or >= E contributes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from moe_fsm.errors import KernelInputError
from moe_fsm.kernels.activations import TRITON_ACTIVATION_CODES as ACTIVATIONS
from moe_fsm.kernels.triton_moe._runtime import device_name, kernels, launch, require_device
from moe_fsm.kernels.triton_moe.align import (
    AlignedRouting, PairBlocks, align_tokens, expert_runs, pair_blocks, pair_blocks_pay,
)
from moe_fsm.kernels.triton_moe.config import (
    FP8_GROUP,
    GemmConfig,
    MoEConfig,
    get_config,
    sums_slots_in_w2,
    token_sum_config,
    validate_config,
    weight_scale_span,
)
from moe_fsm.kernels.triton_moe.hopper import (
    gather_sorted,
    gluon_gemm,
    gluon_usable,
    hopper_usable,
    hopper_w1,
    hopper_w2,
    pair_slots,
    quantize_real_rows,
    quantize_sorted,
)
from moe_fsm.kernels.triton_moe.quant import FP8_DTYPE, quantize_activation

COMPUTE_DTYPES = (torch.bfloat16, torch.float16)
WEIGHT_GRANULARITIES = ("tensor", "channel", "block")
ACTIVATION_GRANULARITIES = ("tensor", "token", "group")


@dataclass(frozen=True)
class Fp8Spec:
    """FP8 w8a8 layout: weight scales per tensor/channel/128x128 block, activation scales per tensor/token/1x128 group.

    Block weights pair with group activations (the DeepSeek-V3 recipe) and only with them,
    because the kernel applies both scales inside the K loop, one 128-wide step at a time.
    """

    weight: str
    activation: str

    def __post_init__(self) -> None:
        if self.weight not in WEIGHT_GRANULARITIES:
            raise KernelInputError(f"FP8 weight granularity {self.weight!r} is not one of {list(WEIGHT_GRANULARITIES)}")
        if self.activation not in ACTIVATION_GRANULARITIES:
            raise KernelInputError(
                f"FP8 activation granularity {self.activation!r} is not one of {list(ACTIVATION_GRANULARITIES)}"
            )
        if (self.weight == "block") != (self.activation == "group"):
            raise KernelInputError(
                f"FP8 weight={self.weight} with activation={self.activation}: 128x128 block weights go with "
                "1x128 group activations and only with them; tensor/channel weights go with tensor/token activations"
            )

    @property
    def block(self) -> bool:
        return self.weight == "block"


@dataclass(frozen=True)
class BatchedRows:
    """Row source of the batched layout: expert e owns rows 0..expert_num_tokens[e] of its slab."""

    expert_num_tokens: torch.Tensor
    max_tokens: int
    block_m: int

    @property
    def num_row_blocks(self) -> int:
        return -(-self.max_tokens // self.block_m)


RowSource = Union[AlignedRouting, PairBlocks, BatchedRows]


def _weight_scale(
    spec: Optional[Fp8Spec], scale: Optional[torch.Tensor], num_experts: int, rows: int, cols: int, name: str
) -> tuple[int, Optional[torch.Tensor], tuple[int, int, int]]:
    """(kernel scale mode, fp32 scale tensor, its (expert, row, K-block) strides)."""
    if spec is None:
        return 0, None, (0, 0, 0)
    if scale is None:
        raise KernelInputError(f"FP8 weights need {name}; got None")
    s = scale.to(torch.float32)
    if spec.weight == "tensor":
        if s.numel() != num_experts:
            raise KernelInputError(f"per-tensor {name} has one value per expert ({num_experts}); got shape {tuple(scale.shape)}")
        s = s.reshape(num_experts).contiguous()
        return 1, s, (1, 0, 0)
    if spec.weight == "channel":
        if s.numel() != num_experts * rows:
            raise KernelInputError(f"per-channel {name} is [E={num_experts}, {rows}]; got shape {tuple(scale.shape)}")
        s = s.reshape(num_experts, rows).contiguous()
        return 2, s, (s.stride(0), s.stride(1), 0)
    expected = (num_experts, -(-rows // FP8_GROUP), -(-cols // FP8_GROUP))
    if tuple(s.shape) != expected:
        raise KernelInputError(f"128x128 block {name} is {list(expected)}; got {list(scale.shape)}")
    return 3, s, (s.stride(0), s.stride(1), s.stride(2))


def _activation_scale_mode(spec: Optional[Fp8Spec], scale: Optional[torch.Tensor]) -> int:
    if spec is None:
        return 0
    if spec.activation == "group":
        return 3
    return 1 if scale is not None and scale.numel() == 1 else 2


def _scale_strides(mode: int, scale: Optional[torch.Tensor], batched: bool) -> tuple[int, int, int]:
    """(expert, row, group) strides of an activation scale tensor in the kernel's addressing."""
    if mode in (0, 1):
        return 0, 0, 0
    if mode == 2:
        return (scale.stride(0), scale.stride(1), 0) if batched else (0, scale.stride(0), 0)
    return (scale.stride(0), scale.stride(1), scale.stride(2)) if batched else (0, scale.stride(0), scale.stride(1))


def _launch(
    a: torch.Tensor,
    a_scale: Optional[torch.Tensor],
    w: torch.Tensor,
    w_scale_info: tuple[int, Optional[torch.Tensor], tuple[int, int, int]],
    out: torch.Tensor,
    out_scale: Optional[torch.Tensor],
    out_static_scale: Optional[torch.Tensor],
    out_mode: int,
    rows: RowSource,
    row_weights: Optional[torch.Tensor],
    *,
    spec: Optional[Fp8Spec],
    n_out: int,
    k_in: int,
    gated: bool,
    activation: str,
    swiglu_limit: Optional[float],
    a_row_div: int,
    config: GemmConfig,
    out_row_div: int = 1,
) -> None:
    batched = isinstance(rows, BatchedRows)
    a_mode = _activation_scale_mode(spec, a_scale)
    w_mode, w_scale, (sws_e, sws_n, sws_k) = w_scale_info
    dummy = out if out_scale is None else out_scale
    as_e, as_m, as_k = _scale_strides(a_mode, a_scale, batched)
    if out_mode == 2:
        os_e, os_m, os_n = (out_scale.stride(0), out_scale.stride(1), out_scale.stride(2)) if batched else (0, out_scale.stride(0), out_scale.stride(1))
    else:
        os_e = os_m = os_n = 0
    if batched:
        ae, am, ak = a.stride()
        oe, om, on = out.stride()
        grid = (rows.num_row_blocks * -(-n_out // config.block_n), a.shape[0])
        sorted_ids = block_expert = num_padded = rows.expert_num_tokens
        expert_num_tokens, num_valid = rows.expert_num_tokens, 0
    else:
        ae, (am, ak) = 0, a.stride()
        oe, (om, on) = 0, out.stride()
        grid = (rows.num_row_blocks * -(-n_out // config.block_n),)
        if isinstance(rows, PairBlocks):
            sorted_ids = num_padded = expert_num_tokens = block_expert = rows.topk_ids
        else:
            sorted_ids, block_expert, num_padded = rows.sorted_ids, rows.block_expert, rows.num_padded
            expert_num_tokens = num_padded
        num_valid = rows.num_pairs
    we, wn, wk = w.stride()
    args = (
        a,
        dummy if a_scale is None else a_scale,
        w,
        dummy if w_scale is None else w_scale,
        out,
        dummy,
        dummy if out_static_scale is None else out_static_scale,
        dummy if row_weights is None else row_weights,
        sorted_ids,
        block_expert,
        num_padded,
        expert_num_tokens,
        n_out,
        k_in,
        num_valid,
        rows.num_row_blocks,
        w.shape[0],
        float(swiglu_limit) if swiglu_limit is not None else 0.0,
        ae, am, ak,
        we, wn, wk,
        oe, om, on,
        as_e, as_m, as_k,
        sws_e, sws_n, sws_k,
        os_e, os_m, os_n,
    )
    constexprs = dict(
        A_ROW_DIV=a_row_div,
        BATCHED=batched,
        PAIR_BLOCKS=isinstance(rows, PairBlocks),
        GATED=gated,
        ACTIVATION=ACTIVATIONS[activation],
        HAS_LIMIT=swiglu_limit is not None,
        WEIGHT_ROWS=row_weights is not None,
        A_SCALE=a_mode,
        W_SCALE=w_mode,
        OUT_MODE=out_mode,
        EVEN_K=k_in % config.block_k == 0,
        SWAP_AB=config.swap_ab,
        OUT_ROW_DIV=out_row_div,
        W_SCALE_SPAN=weight_scale_span(config.block_n, n_out, gated),
        BLOCK_M=rows.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        GROUP_M=config.group_m,
    )
    launch(kernels().moe_gemm_kernel, grid, args, constexprs, config.num_warps, config.num_stages)


def w1_gemm(
    a: torch.Tensor,
    a_scale: Optional[torch.Tensor],
    w1: torch.Tensor,
    w1_scale: Optional[torch.Tensor],
    rows: RowSource,
    *,
    spec: Optional[Fp8Spec],
    activation: str,
    swiglu_limit: Optional[float],
    row_weights: Optional[torch.Tensor],
    a2_scale: Optional[torch.Tensor],
    config: GemmConfig,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """act(a @ w1[e]^T) per row, quantized for the w2 GEMM when the layer is FP8.

    Standard rows give [num_pairs, N] (row = pair index); batched rows give [E, T, N].
    ``row_weights`` (flattened top-k weights) scale the rows before the activation:
    that is the router weight applied on the input, since w1 is linear.
    """
    num_experts, two_n, k_dim = w1.shape
    n = two_n // 2
    batched = isinstance(rows, BatchedRows)
    lead = (a.shape[0], a.shape[1]) if batched else (rows.num_pairs,)
    w_info = _weight_scale(spec, w1_scale, num_experts, two_n, k_dim, "w1_scale")
    out_mode, inter_dtype, out_static, zero_fill = _intermediate_layout(spec, config, a2_scale, out_dtype)
    out_scale = torch.empty(*lead, -(-n // FP8_GROUP), dtype=torch.float32, device=a.device) if out_mode == 2 else None
    inter = (torch.zeros if zero_fill else torch.empty)(*lead, n, dtype=inter_dtype, device=a.device)
    _launch(
        a, a_scale, w1, w_info, inter, out_scale, out_static, out_mode, rows, row_weights,
        spec=spec, n_out=n, k_in=k_dim, gated=True, activation=activation, swiglu_limit=swiglu_limit,
        a_row_div=1 if batched else rows.top_k, config=config,
    )
    return _finish_intermediate(inter, out_scale, out_static, out_mode, spec)


def _intermediate_layout(
    spec: Optional[Fp8Spec], config: GemmConfig, a2_scale: Optional[torch.Tensor], out_dtype: torch.dtype
) -> tuple[int, torch.dtype, Optional[torch.Tensor], bool]:
    """How the w1 GEMM writes the intermediate: (out mode, dtype, static FP8 scale, zero-filled?)."""
    if spec is None:
        return 0, out_dtype, None, False
    if spec.block and config.block_n % FP8_GROUP == 0:
        return 2, FP8_DTYPE, None, False
    if not spec.block and a2_scale is not None and a2_scale.numel() == 1:
        return 1, FP8_DTYPE, a2_scale.to(torch.float32).reshape(1), False
    # quantized after the GEMM (a block layer whose tile is narrower than a 1x128 group cannot take the
    # group's amax); a dynamic per-tensor scale reads every row, so rows no program writes (slots of other
    # ranks, batched rows past an expert's count, pads) must hold zeros rather than stale memory
    return 0, out_dtype, None, spec.activation == "tensor"


def _finish_intermediate(
    inter: torch.Tensor, out_scale: Optional[torch.Tensor], out_static: Optional[torch.Tensor], out_mode: int,
    spec: Optional[Fp8Spec],
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The intermediate as the w2 GEMM reads it: quantized now where the w1 epilogue did not."""
    if spec is None or out_mode != 0:
        return inter, out_scale if out_mode == 2 else out_static
    return quantize_activation(inter, spec.activation)


def w2_gemm(
    inter: torch.Tensor,
    inter_scale: Optional[torch.Tensor],
    w2: torch.Tensor,
    w2_scale: Optional[torch.Tensor],
    rows: RowSource,
    *,
    spec: Optional[Fp8Spec],
    row_weights: Optional[torch.Tensor],
    config: GemmConfig,
    out_dtype: torch.dtype,
    sum_into: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """inter @ w2[e]^T per row, times the row's top-k weight when given.

    With ``sum_into`` (a zeroed fp32 [M, K], standard rows only) each row is added
    into its token's row there (the top-k sum folded in) and ``sum_into`` is returned.
    """
    num_experts, k_dim, n = w2.shape
    batched = isinstance(rows, BatchedRows)
    lead = (inter.shape[0], inter.shape[1]) if batched else (rows.num_pairs,)
    w_info = _weight_scale(spec, w2_scale, num_experts, k_dim, n, "w2_scale")
    if sum_into is not None:
        y, out_mode, out_row_div = sum_into, 3, rows.top_k
    else:
        y, out_mode, out_row_div = torch.empty(*lead, k_dim, dtype=out_dtype, device=inter.device), 0, 1
    _launch(
        inter, inter_scale, w2, w_info, y, None, None, out_mode, rows, row_weights,
        spec=spec, n_out=k_dim, k_in=n, gated=False, activation="silu", swiglu_limit=None,
        a_row_div=1, config=config, out_row_div=out_row_div,
    )
    return y


# the pair's row is column 0 of an operand this wide: the narrowest a Triton dot takes
TOKEN_SUM_OPERAND_COLUMNS = 16


def w2_token_sum(
    inter: torch.Tensor,
    inter_scale: Optional[torch.Tensor],
    w2: torch.Tensor,
    w2_scale: Optional[torch.Tensor],
    topk_ids: torch.Tensor,
    out: torch.Tensor,
    *,
    spec: Optional[Fp8Spec],
    row_weights: Optional[torch.Tensor],
    config: GemmConfig,
) -> torch.Tensor:
    """out[m] = sum over token m's local slots j of ``row_weights[m * top_k + j]`` * (inter row m * top_k + j @
    w2[e]^T), the w2 GEMM and the top-k sum in one launch (``_kernels.w2_token_sum_kernel``): one program per
    (token, ``config.block_n`` output columns), the slots summed in fp32 registers in slot order, no [M * top_k, K]
    rows and no atomics. ``inter`` [M * top_k, N] holds one row per pair, in pair order (the pointer-path w1's
    layout); a token whose slots are all another rank's gets zeros."""
    num_experts, k_dim, n = w2.shape
    num_tokens, top_k = topk_ids.shape
    w_mode, w_scale, (sws_e, sws_n, sws_k) = _weight_scale(spec, w2_scale, num_experts, k_dim, n, "w2_scale")
    a_mode = _activation_scale_mode(spec, inter_scale)
    _, as_m, as_k = _scale_strides(a_mode, inter_scale, False)
    ids = topk_ids.contiguous()
    launch(
        kernels().w2_token_sum_kernel, (-(-k_dim // config.block_n), num_tokens),
        (inter, out if inter_scale is None else inter_scale, w2, out if w_scale is None else w_scale, out,
         out if row_weights is None else row_weights, ids, k_dim, n, num_experts,
         inter.stride(0), inter.stride(1), *w2.stride(), out.stride(0), as_m, as_k, sws_e, sws_n, sws_k),
        dict(TOP_K=top_k, WEIGHT_ROWS=row_weights is not None, A_SCALE=a_mode, W_SCALE=w_mode,
             EVEN_K=n % config.block_k == 0, W_SCALE_SPAN=weight_scale_span(config.block_n, k_dim, False),
             BLOCK_M=TOKEN_SUM_OPERAND_COLUMNS, BLOCK_N=config.block_n, BLOCK_K=config.block_k),
        config.num_warps, config.num_stages,
    )
    return out


def topk_sum(
    y: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, out: torch.Tensor,
    row_of_pair: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """out[m] = sum of pair (m, j)'s row of y over the slots j whose expert is in [0, num_experts): row
    m * top_k + j, or ``row_of_pair[m * top_k + j]`` where y is in another order (the Gluon path's sorted one)."""
    num_tokens, top_k = topk_ids.shape
    k_dim = y.shape[-1]
    block = min(1024, max(16, 1 << (k_dim - 1).bit_length()))
    if num_tokens:
        launch(
            kernels().topk_sum_kernel, (num_tokens, -(-k_dim // block)),
            (y, topk_ids.contiguous(), y if row_of_pair is None else row_of_pair, out, k_dim, num_experts,
             y.stride(0), out.stride(0)),
            dict(TOP_K=top_k, TOPK_POW2=max(2, 1 << (top_k - 1).bit_length()), BLOCK=block,
                 ROWS_BY_PAIR=row_of_pair is not None),
        )
    return out


def _check_weights(w1: torch.Tensor, w2: torch.Tensor, k_dim: int, spec: Optional[Fp8Spec]) -> tuple[int, int]:
    if w1.dim() != 3 or w2.dim() != 3:
        raise KernelInputError(f"w1 must be [E, 2N, K] and w2 [E, K, N]; got {tuple(w1.shape)} and {tuple(w2.shape)}")
    num_experts, two_n, w1_k = w1.shape
    n = two_n // 2
    if two_n % 2 or w1_k != k_dim or tuple(w2.shape) != (num_experts, k_dim, n):
        raise KernelInputError(
            f"shapes disagree: hidden K={k_dim}, w1 {tuple(w1.shape)} (want [E, 2N, K]), "
            f"w2 {tuple(w2.shape)} (want [E, K, N] = [{num_experts}, {k_dim}, {n}])"
        )
    want = FP8_DTYPE if spec is not None else None
    for name, w in (("w1", w1), ("w2", w2)):
        if want is not None and w.dtype != want:
            raise KernelInputError(f"FP8 layers need {name} in float8_e4m3fn; got {w.dtype}")
        if want is None and w.dtype not in COMPUTE_DTYPES:
            raise KernelInputError(f"{name} must be bfloat16 or float16 (or FP8 with an Fp8Spec); got {w.dtype}")
        if w.stride(-1) != 1:
            raise KernelInputError(f"{name} must be contiguous along its last (reduction) dimension")
    return num_experts, n


def _prepare_input(
    hidden: torch.Tensor, a1_scale: Optional[torch.Tensor], spec: Optional[Fp8Spec], out_dtype: Optional[torch.dtype],
    defer_groups: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.dtype]:
    """(A operand, its scale, the output dtype); quantizes float input for FP8 layers, except (``defer_groups``)
    into 1x128 groups: then the scale is None and the caller quantizes once it knows the rows' order
    (``_hopper_layer`` writes them straight into sorted order for the Gluon kernel)."""
    if hidden.dtype == FP8_DTYPE:
        if spec is None:
            raise KernelInputError("FP8 hidden states need an Fp8Spec (the weights' and activations' scale layouts)")
        if a1_scale is None:
            raise KernelInputError("FP8 hidden states need their a1_scale")
        return hidden, a1_scale.to(torch.float32), out_dtype or torch.bfloat16
    if hidden.dtype not in COMPUTE_DTYPES:
        raise KernelInputError(f"hidden states must be bfloat16, float16 or float8_e4m3fn; got {hidden.dtype}")
    if out_dtype is not None and out_dtype != hidden.dtype:
        raise KernelInputError(f"out_dtype {out_dtype} differs from the hidden states' {hidden.dtype}")
    if spec is None:
        if a1_scale is not None:
            raise KernelInputError("a1_scale was given but the layer is not FP8 (no Fp8Spec)")
        return hidden, None, hidden.dtype
    static = a1_scale if spec.activation != "group" else None
    if a1_scale is not None and spec.activation == "group":
        raise KernelInputError("1x128 group activation scales are dynamic; a static a1_scale is not accepted")
    if defer_groups and spec.activation == "group":
        return hidden, None, hidden.dtype
    q, scale = quantize_activation(hidden, spec.activation, static)
    return q, scale, hidden.dtype


def fused_experts(
    hidden: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str = "silu",
    swiglu_limit: Optional[float] = None,
    apply_router_weight_on_input: bool = False,
    fp8: Optional[Fp8Spec] = None,
    w1_scale: Optional[torch.Tensor] = None,
    w2_scale: Optional[torch.Tensor] = None,
    a1_scale: Optional[torch.Tensor] = None,
    a2_scale: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
    config: Optional[MoEConfig] = None,
    unsorted: Optional[bool] = None,
    sum_in_w2: Optional[bool] = None,
) -> torch.Tensor:
    """The MoE layer, out[t] = sum_j g[t,j] * w2[e] @ act(w1[e] @ x[t]) with e = topk_ids[t,j]: [M, K].

    ``hidden`` is [M, K] bf16/fp16, or FP8 already quantized (then ``a1_scale`` is its scale and
    ``out_dtype`` the output's dtype, bf16 by default). FP8 layers pass ``fp8`` and the weight
    scales (see ``Fp8Spec``); a2_scale, when given with one element, is the static scale of the
    intermediate, otherwise it is quantized dynamically. With ``apply_router_weight_on_input``
    (top-k 1) the weight scales the input (as ``moe_reference`` does) and not the output.
    ``unsorted`` gives each (token, slot) pair a row block of its own with no alignment launch
    (``align.pair_blocks``) when True, sorts the pairs by expert when False; None (the default) decides
    by ``align.pair_blocks_pay``. The benchmark times both layouts; either computes the same layer.
    ``sum_in_w2`` has the pointer path's w2 GEMM sum each token's slots itself, in one launch with no top-k sum
    kernel after it (``w2_token_sum``), when True; w2 writes a row per pair and a second launch sums them when
    False; None (the default) decides by ``sums_slots_in_w2``. The Hopper and Gluon kernels (prefill configs)
    always sum apart: True with a config that takes them is refused.
    """
    require_device(hidden, w1, w2, topk_weights, topk_ids)
    if activation not in ACTIVATIONS:
        raise KernelInputError(f"activation {activation!r} is not one of {sorted(ACTIVATIONS)}")
    if hidden.dim() != 2:
        raise KernelInputError(f"hidden states must be [M, K]; got shape {tuple(hidden.shape)}")
    num_tokens, k_dim = hidden.shape
    num_experts, n = _check_weights(w1, w2, k_dim, fp8)
    if topk_ids.dim() != 2 or topk_ids.shape[0] != num_tokens or tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise KernelInputError(
            f"topk_ids and topk_weights must both be [M={num_tokens}, top_k]; got "
            f"{tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}"
        )
    top_k = topk_ids.shape[1]
    if unsorted is not None and not isinstance(unsorted, bool):
        raise KernelInputError(f"unsorted must be True, False or None (the rule decides); got {unsorted!r}")
    if sum_in_w2 is not None and not isinstance(sum_in_w2, bool):
        raise KernelInputError(f"sum_in_w2 must be True, False or None (the rule decides); got {sum_in_w2!r}")
    if apply_router_weight_on_input and top_k != 1:
        raise KernelInputError(f"apply_router_weight_on_input needs top_k == 1, got top_k={top_k}")
    a, a_scale, result_dtype = _prepare_input(hidden, a1_scale, fp8, out_dtype, defer_groups=True)
    if out is None:
        out = torch.empty(num_tokens, k_dim, dtype=result_dtype, device=hidden.device)
    elif tuple(out.shape) != (num_tokens, k_dim) or out.dtype != result_dtype or out.stride(-1) != 1:
        raise KernelInputError(
            f"out must be a row-contiguous [{num_tokens}, {k_dim}] {result_dtype} tensor; got "
            f"{tuple(out.shape)} {out.dtype}"
        )
    if num_tokens == 0:
        return out
    if config is None:
        config = get_config(
            device_name(hidden.device), num_experts, n, k_dim, top_k, num_tokens,
            str(result_dtype).removeprefix("torch."), fp8.weight if fp8 else None,
        )
    else:
        validate_config(config, block_fp8=fp8 is not None and fp8.block)
    if fp8 is not None and a_scale is None and not (config.gluon and num_tokens > 1):
        # float input in 1x128 groups is left to the Gluon path, which quantizes it straight into sorted order
        a, a_scale = quantize_activation(a, fp8.activation)
    if unsorted is None:
        expert_bytes = (w1.numel() * w1.element_size() + w2.numel() * w2.element_size()) // num_experts
        unsorted = pair_blocks_pay(num_tokens, top_k, num_experts, expert_bytes)
    align = pair_blocks if unsorted else align_tokens
    routing = align(topk_ids, num_experts, config.block_m)
    flat_weights = topk_weights.reshape(-1)
    if hopper_usable(config, routing, a, w1, w2):
        if sum_in_w2:
            raise KernelInputError(
                "sum_in_w2=True: this config runs the Hopper/Gluon kernels, whose w2 writes rows in sorted order and "
                "leaves the top-k sum to its own launch; pass a pointer-path (decode) config or sum_in_w2=None/False"
            )
        return _hopper_layer(
            a, a_scale, w1, w2, w1_scale, w2_scale, a2_scale, routing, flat_weights, topk_ids, out,
            spec=fp8, activation=activation, swiglu_limit=swiglu_limit,
            apply_router_weight_on_input=apply_router_weight_on_input, config=config, result_dtype=result_dtype,
        )
    if fp8 is not None and a_scale is None:  # a gluon config where the Gluon kernel cannot run
        a, a_scale = quantize_activation(a, fp8.activation)
    inter, inter_scale = w1_gemm(
        a, a_scale, w1, w1_scale, routing, spec=fp8, activation=activation, swiglu_limit=swiglu_limit,
        row_weights=flat_weights if apply_router_weight_on_input else None, a2_scale=a2_scale,
        config=config.w1, out_dtype=result_dtype,
    )
    row_weights = None if apply_router_weight_on_input else flat_weights
    if sums_slots_in_w2(unsorted, config, num_tokens, k_dim) if sum_in_w2 is None else sum_in_w2:
        return w2_token_sum(
            inter, inter_scale, w2, w2_scale, topk_ids, out, spec=fp8, row_weights=row_weights,
            config=token_sum_config(config.w2, num_tokens, k_dim),
        )
    if config.fold_topk and top_k > 1:
        acc = torch.zeros(num_tokens, k_dim, dtype=torch.float32, device=hidden.device)
        w2_gemm(
            inter, inter_scale, w2, w2_scale, routing, spec=fp8, row_weights=row_weights,
            config=config.w2, out_dtype=result_dtype, sum_into=acc,
        )
        return out.copy_(acc)
    y = w2_gemm(
        inter, inter_scale, w2, w2_scale, routing, spec=fp8, row_weights=row_weights,
        config=config.w2, out_dtype=result_dtype,
    )
    return topk_sum(y, topk_ids, num_experts, out)


def _hopper_layer(
    a: torch.Tensor,
    a_scale: Optional[torch.Tensor],
    w1: torch.Tensor,
    w2: torch.Tensor,
    w1_scale: Optional[torch.Tensor],
    w2_scale: Optional[torch.Tensor],
    a2_scale: Optional[torch.Tensor],
    routing: AlignedRouting,
    flat_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    out: torch.Tensor,
    *,
    spec: Optional[Fp8Spec],
    activation: str,
    swiglu_limit: Optional[float],
    apply_router_weight_on_input: bool,
    config: MoEConfig,
    result_dtype: torch.dtype,
) -> torch.Tensor:
    """``fused_experts`` through the Hopper TMA kernels, the intermediate in sorted-row order (``hopper.py``); a
    block-FP8 layer whose config asks for it through the Gluon kernel (``MoEConfig.gluon``), over the input in
    sorted order (a bf16 input quantized straight into it, an FP8 one gathered), with the intermediate quantized
    in 1x128 groups after w1 (as vLLM does)."""
    num_experts, two_n, k_dim = w1.shape
    num_tokens, top_k = topk_ids.shape
    w1_info = _weight_scale(spec, w1_scale, num_experts, two_n, k_dim, "w1_scale")
    w2_info = _weight_scale(spec, w2_scale, num_experts, k_dim, two_n // 2, "w2_scale")
    w1_row_weights = flat_weights if apply_router_weight_on_input else None
    row_weights = None if apply_router_weight_on_input else flat_weights
    gluon = gluon_usable(config, routing, a, w1, w2, block_fp8=spec is not None and spec.block, out_dtype=result_dtype)
    if a_scale is None and spec is not None and not gluon:  # float input, 1x128 groups (``_prepare_input``)
        a, a_scale = quantize_activation(a, spec.activation)
    if gluon:
        slot_of_pair = pair_slots(routing)
        if a_scale is None:
            sorted_a, sorted_scale = quantize_sorted(a, routing, slot_of_pair)
        else:
            sorted_a, sorted_scale = gather_sorted(a, a_scale, _activation_scale_mode(spec, a_scale), routing)
        runs = expert_runs(routing)
        inter = torch.empty(routing.sorted_ids.numel(), two_n // 2, dtype=result_dtype, device=a.device)
        gluon_gemm(
            sorted_a, sorted_scale, w1, w1_info, inter, routing, runs, w1_row_weights, gated=True, n_out=two_n // 2,
            activation=activation, swiglu_limit=swiglu_limit, config=config.w1,
        )
        inter, inter_scale = quantize_real_rows(inter, routing)
    else:
        out_mode, inter_dtype, out_static, zero_fill = _intermediate_layout(spec, config.w1, a2_scale, result_dtype)
        inter, out_scale = hopper_w1(
            a, a_scale, _activation_scale_mode(spec, a_scale), w1, w1_info, routing,
            out_mode=out_mode, inter_dtype=inter_dtype, out_static_scale=out_static, zero_fill=zero_fill,
            activation=activation, swiglu_limit=swiglu_limit, row_weights=w1_row_weights, config=config.w1,
            gather_input=config.gather_input,
        )
        inter, inter_scale = _finish_intermediate(inter, out_scale, out_static, out_mode, spec)
    inter_mode = _activation_scale_mode(spec, inter_scale)
    if config.fold_topk and top_k > 1:  # never with gluon (validate_config)
        acc = torch.zeros(num_tokens, k_dim, dtype=torch.float32, device=a.device)
        hopper_w2(inter, inter_scale, inter_mode, w2, w2_info, routing, acc, 3, row_weights=row_weights, config=config.w2)
        return out.copy_(acc)
    if gluon:
        y = torch.empty(routing.sorted_ids.numel(), k_dim, dtype=result_dtype, device=a.device)
        gluon_gemm(
            inter, inter_scale, w2, w2_info, y, routing, runs, row_weights, gated=False, n_out=k_dim,
            activation=activation, swiglu_limit=None, config=config.w2,
        )
        return topk_sum(y, topk_ids, num_experts, out, row_of_pair=slot_of_pair)
    y = torch.empty(routing.num_pairs, k_dim, dtype=result_dtype, device=a.device)
    hopper_w2(inter, inter_scale, inter_mode, w2, w2_info, routing, y, 0, row_weights=row_weights, config=config.w2)
    return topk_sum(y, topk_ids, num_experts, out)


def fused_experts_batched(
    hidden: torch.Tensor,
    expert_num_tokens: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    *,
    activation: str = "silu",
    swiglu_limit: Optional[float] = None,
    fp8: Optional[Fp8Spec] = None,
    w1_scale: Optional[torch.Tensor] = None,
    w2_scale: Optional[torch.Tensor] = None,
    a1_scale: Optional[torch.Tensor] = None,
    a2_scale: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
    config: Optional[MoEConfig] = None,
) -> torch.Tensor:
    """Batched layout: hidden [E, T, K] with expert_num_tokens [E] -> unweighted [E, T, K].

    Rows at or past ``expert_num_tokens[e]`` are left unwritten. Router weights are not
    applied here: prepare scales the input when the weight goes on the input, finalize
    applies it otherwise. FP8 input scales (pre-quantized) are [1], [E, T] or [E, T, K/128].
    """
    require_device(hidden, w1, w2, expert_num_tokens)
    if activation not in ACTIVATIONS:
        raise KernelInputError(f"activation {activation!r} is not one of {sorted(ACTIVATIONS)}")
    if hidden.dim() != 3:
        raise KernelInputError(f"batched hidden states must be [E, max_tokens, K]; got shape {tuple(hidden.shape)}")
    num_local, max_tokens, k_dim = hidden.shape
    num_experts, n = _check_weights(w1, w2, k_dim, fp8)
    if num_local != num_experts or tuple(expert_num_tokens.shape) != (num_experts,):
        raise KernelInputError(
            f"batched input has {num_local} expert slabs and expert_num_tokens {tuple(expert_num_tokens.shape)}; "
            f"both must match the {num_experts} local experts of w1"
        )
    if hidden.stride(-1) != 1:
        raise KernelInputError("batched hidden states must be contiguous along K")
    if fp8 is not None and fp8.activation == "tensor" and a1_scale is None and hidden.dtype != FP8_DTYPE:
        # a dynamic per-tensor scale must not see the rows past each expert's count
        filled = torch.arange(max_tokens, device=hidden.device)[None, :] < expert_num_tokens[:, None]
        hidden = torch.where(filled[:, :, None], hidden, torch.zeros((), dtype=hidden.dtype, device=hidden.device))
    a, a_scale, result_dtype = _prepare_input(hidden, a1_scale, fp8, out_dtype)
    if max_tokens == 0:
        return torch.empty(num_experts, 0, k_dim, dtype=result_dtype, device=hidden.device)
    if config is None:
        # the slab height bounds rows per expert; as "tokens" it picks the tile for that many rows each
        config = get_config(
            device_name(hidden.device), num_experts, n, k_dim, 1, max_tokens * num_experts,
            str(result_dtype).removeprefix("torch."), fp8.weight if fp8 else None,
        )
    else:
        validate_config(config, block_fp8=fp8 is not None and fp8.block)
    rows = BatchedRows(expert_num_tokens.to(torch.int32), max_tokens, config.block_m)
    inter, inter_scale = w1_gemm(
        a, a_scale, w1, w1_scale, rows, spec=fp8, activation=activation, swiglu_limit=swiglu_limit,
        row_weights=None, a2_scale=a2_scale, config=config.w1, out_dtype=result_dtype,
    )
    return w2_gemm(inter, inter_scale, w2, w2_scale, rows, spec=fp8, row_weights=None, config=config.w2, out_dtype=result_dtype)
