"""Grouping (token, slot) pairs by expert: the permutation every experts kernel relies on."""

from __future__ import annotations

import torch
from torch_moe_cases import seed_for, single_thread  # noqa: F401

from moe_fsm.kernels.grouping import group_by_expert, local_expert_ids, num_local_experts


def test_pairs_are_grouped_stably_with_positions() -> None:
    gen = torch.Generator().manual_seed(seed_for("grouping"))
    ids = torch.randint(-1, 5, (40, 3), generator=gen)
    groups = group_by_expert(ids, 5)
    flat = ids.reshape(-1)
    valid = flat >= 0
    assert groups.num_pairs == int(valid.sum())
    assert torch.equal(groups.counts, torch.bincount(flat[valid], minlength=5))
    assert torch.equal(flat[groups.pair], groups.expert)
    assert torch.equal(groups.token, groups.pair // 3) and torch.equal(groups.slot, groups.pair % 3)
    for e in range(5):
        rows = groups.rows(e)
        assert (groups.expert[rows] == e).all()
        assert torch.equal(groups.pair[rows], (flat == e).nonzero().squeeze(1)), "not stable"
        assert torch.equal(groups.position[rows], torch.arange(rows.stop - rows.start))
    assert groups.active_experts == [e for e in range(5) if groups.counts[e] > 0]
    assert groups.max_count == int(groups.counts.max())


def test_empty_and_all_skipped() -> None:
    for ids in (torch.empty(0, 2, dtype=torch.int64), torch.full((3, 2), -1)):
        groups = group_by_expert(ids, 4)
        assert groups.num_pairs == 0 and groups.active_experts == [] and groups.max_count == 0
        assert groups.counts.tolist() == [0, 0, 0, 0]


def test_local_expert_ids_follow_the_map() -> None:
    expert_map = torch.tensor([-1, 0, -1, 1, 2, -1])
    ids = torch.tensor([[0, 1], [3, 5], [4, -1]], dtype=torch.int32)
    local = local_expert_ids(ids, expert_map)
    assert local.dtype == torch.int32
    assert local.tolist() == [[-1, 0], [1, -1], [2, -1]]
    assert local_expert_ids(ids, None) is ids
    assert num_local_experts(6, expert_map) == 3 and num_local_experts(6, None) == 6
