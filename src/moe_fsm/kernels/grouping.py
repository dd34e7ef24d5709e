"""Group (token, slot) pairs by expert, without a Python loop over tokens.

Every experts kernel and every batched prepare needs the same permutation: the
routed pairs sorted by expert, with each expert's rows contiguous. A stable sort
of the flattened ``topk_ids`` gives it; slots with id -1 (experts another rank
owns) sort last and are dropped. Only the per-expert counts cross to the host,
so callers can loop over the experts that received tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class ExpertGroups:
    """The routed pairs of one call, sorted by expert.

    ``pair``: flat index ``token * top_k + slot`` of each routed pair, grouped by expert
    (stable, so tokens keep their order within an expert). ``token``, ``expert`` and
    ``position`` (rank of the pair within its expert) are aligned with ``pair``.
    ``counts`` [E] is on the device; ``offsets`` (E + 1 prefix sums) is on the host.
    """

    pair: torch.Tensor
    token: torch.Tensor
    expert: torch.Tensor
    position: torch.Tensor
    counts: torch.Tensor
    offsets: tuple[int, ...]
    top_k: int

    @property
    def num_experts(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_pairs(self) -> int:
        return self.offsets[-1]

    @property
    def active_experts(self) -> list[int]:
        """Experts that received at least one pair, in id order."""
        return [e for e in range(self.num_experts) if self.offsets[e + 1] > self.offsets[e]]

    @property
    def max_count(self) -> int:
        return max((self.offsets[e + 1] - self.offsets[e] for e in range(self.num_experts)), default=0)

    def rows(self, expert: int) -> slice:
        """The slice of the sorted pairs that ``expert`` computes."""
        return slice(self.offsets[expert], self.offsets[expert + 1])

    @property
    def slot(self) -> torch.Tensor:
        return self.pair - self.token * self.top_k


def group_by_expert(topk_ids: torch.Tensor, num_experts: int) -> ExpertGroups:
    """Sort the pairs of ``topk_ids`` [M, top_k] (ids in 0..num_experts-1, or -1 to skip) by expert."""
    top_k = topk_ids.shape[1]
    ids = topk_ids.reshape(-1).long()
    key = torch.where(ids < 0, torch.full_like(ids, num_experts), ids)
    counts_all = torch.bincount(key, minlength=num_experts + 1)
    counts = counts_all[:num_experts]
    offsets = [0, *torch.cumsum(counts, 0).tolist()]
    num_pairs = offsets[-1]
    pair = torch.argsort(key, stable=True)[:num_pairs]
    expert = key[pair]
    starts = torch.tensor(offsets[:-1], dtype=torch.long, device=ids.device)
    position = torch.arange(num_pairs, device=ids.device) - starts[expert]
    return ExpertGroups(
        pair=pair,
        token=torch.div(pair, top_k, rounding_mode="floor"),
        expert=expert,
        position=position,
        counts=counts,
        offsets=tuple(offsets),
        top_k=top_k,
    )


def local_expert_ids(topk_ids: torch.Tensor, expert_map: Optional[torch.Tensor]) -> torch.Tensor:
    """Global expert ids to this rank's local ids via ``expert_map`` [E] (-1: not here); -1 stays -1."""
    if expert_map is None:
        return topk_ids
    local = expert_map.to(topk_ids.dtype)[topk_ids.clamp(min=0).long()]
    return torch.where(topk_ids < 0, torch.full_like(topk_ids, -1), local)


def num_local_experts(num_experts: int, expert_map: Optional[torch.Tensor]) -> int:
    return num_experts if expert_map is None else int((expert_map >= 0).sum())
