"""Where the router weights are applied: on the input (top-1) or in the top-k reduction.

Shared by every prepare/finalize, local or distributed: whatever moves the tokens,
the weighting is the same arithmetic, and sharing it keeps their results
bit-identical on one rank. Sums run in float32 and are cast once to the output
dtype, as vLLM's ``moe_sum`` does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_fsm.errors import KernelInputError
from moe_fsm.modular.interfaces import WeightAndReduce


def apply_router_weight_to_input(hidden: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """``hidden * weight`` in the hidden dtype (a new tensor; the caller's input is left alone)."""
    if topk_weights.shape[1] != 1:
        raise KernelInputError(
            f"router weight on input needs top_k == 1 (the weight scales the one expert's input); got top_k={topk_weights.shape[1]}"
        )
    return hidden * topk_weights.to(hidden.dtype)


def reduce_contiguous(
    output: torch.Tensor,
    expert_output: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    apply_router_weight_on_input: bool,
) -> None:
    """``output[t] = sum_j w[t, j] * expert_output[t, j]`` (weights skipped if already on the input).

    One float32 accumulator of ``[M, K]`` and a pass per slot: no float32 copy of the
    whole ``[M, top_k, K]`` tensor, which halves the time of a large reduction.
    """
    total = torch.zeros(output.shape, dtype=torch.float32, device=output.device)
    weights = topk_weights.to(torch.float32)
    for slot in range(expert_output.shape[1]):
        if apply_router_weight_on_input:
            total.add_(expert_output[:, slot])
        else:
            total.addcmul_(expert_output[:, slot], weights[:, slot : slot + 1])
    output.copy_(total)


@dataclass(frozen=True)
class BatchedLayout:
    """Where each routed pair sits in a batched ``[E_local, max_tokens, K]`` tensor.

    ``token`` / ``slot``: the pair's token row and top-k slot on this rank;
    ``expert`` / ``position``: its expert batch and row in that batch.
    """

    token: torch.Tensor
    slot: torch.Tensor
    expert: torch.Tensor
    position: torch.Tensor


def reduce_batched(
    output: torch.Tensor,
    expert_output: torch.Tensor,
    layout: BatchedLayout,
    topk_weights: torch.Tensor,
    *,
    apply_router_weight_on_input: bool,
) -> None:
    """Scatter-add each pair's batched row, weighted, back to its token; tokens with no pair get 0."""
    rows = expert_output[layout.expert, layout.position].to(torch.float32)
    if not apply_router_weight_on_input:
        rows = rows * topk_weights[layout.token, layout.slot].to(torch.float32).unsqueeze(-1)
    total = torch.zeros(output.shape, dtype=torch.float32, device=output.device)
    total.index_add_(0, layout.token, rows)
    output.copy_(total)


def reduce_standard(
    reduce: WeightAndReduce,
    output: torch.Tensor,
    expert_output: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    apply_router_weight_on_input: bool,
) -> None:
    """Finish a Standard-format call: copy the experts' reduced result, or weight and sum the slots."""
    if reduce is WeightAndReduce.EXPERTS:
        output.copy_(expert_output)
    elif reduce is WeightAndReduce.CONTIGUOUS:
        reduce_contiguous(output, expert_output, topk_weights, apply_router_weight_on_input=apply_router_weight_on_input)
    else:
        raise KernelInputError(
            f"a Standard-format finalize takes reduce {WeightAndReduce.EXPERTS.value!r} or "
            f"{WeightAndReduce.CONTIGUOUS.value!r}; got {reduce.value!r}"
        )


def require_batched_reduce(reduce: WeightAndReduce) -> None:
    """A Batched-format finalize scatters per-expert rows back; the experts must have left the top-k sum to it."""
    if reduce is not WeightAndReduce.BATCHED:
        raise KernelInputError(
            f"a Batched-format finalize takes reduce {WeightAndReduce.BATCHED.value!r}; got {reduce.value!r}"
        )
