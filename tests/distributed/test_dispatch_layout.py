"""The device-side index arithmetic of the all-to-all P/Fs, and the P/Fs that send fixed blocks on one rank, in one process."""

from __future__ import annotations

import pytest
import torch

from moe_fsm.distributed import ExpertPlacement, exchange_counts, pack_row_bytes, unpack_row_bytes
from moe_fsm.errors import KernelInputError
from moe_fsm.engine.distributed_run import captures_in_step
from moe_fsm.experts.torch_experts import TorchBatchedExperts, TorchExperts
from moe_fsm.experts.triton_experts import TritonExperts
from moe_fsm.inputs.layer import MoELayer
from moe_fsm.kernels.grouping import group_by_expert
from moe_fsm.kernels.reference import moe_reference
from moe_fsm.modular.interfaces import ActivationFormat
from moe_fsm.modular.kernel import ModularKernel
from moe_fsm.prepare_finalize import dispatch_layout
from moe_fsm.prepare_finalize.all2all import AllToAllPrepareFinalize
from moe_fsm.prepare_finalize.dispatch_layout import (
    destinations,
    empty_row,
    send_order,
    send_slots,
    slabs_for,
)
from moe_fsm.prepare_finalize.fixed_all2all import FixedCapacityAllToAllPrepareFinalize
from moe_fsm.prepare_finalize.local import LocalBatchedPrepareFinalize, LocalPrepareFinalize
from moe_fsm.prepare_finalize.reduce import BatchedLayout, reduce_batched
from moe_fsm.prepare_finalize.wire_kernels import add_returned_rows


def _random_ids(rows: int, top_k: int, num_experts: int, gen: torch.Generator, hot: bool = False) -> torch.Tensor:
    scores = torch.rand(rows, num_experts, generator=gen)
    if hot:
        scores[:, 0] += 2.0
    return scores.argsort(dim=1, descending=True)[:, :top_k].to(torch.int32)


@pytest.mark.parametrize("tokens,capacity", [(0, 4), (7, 7), (9, 16)])
def test_send_order_groups_tokens_by_destination_in_order(tokens: int, capacity: int) -> None:
    gen = torch.Generator().manual_seed(tokens)
    placement = ExpertPlacement(10, 3, 0)
    ids = _random_ids(tokens, 3, 10, gen)
    if tokens:
        ids[0, 0] = -1  # a skipped slot reaches no rank
    dest = destinations(ids, placement.owner_mask())
    owners = placement.owner_table().tolist()
    expected_dest = [[any(e >= 0 and owners[e] == d for e in row) for d in range(3)] for row in ids.tolist()]
    assert dest.tolist() == (expected_dest or [])

    # Variable size: rank d's rows start where the previous ranks' end.
    counts = dest.sum(0)
    order = send_order(send_slots(dest, torch.cumsum(counts, 0) - counts, int(counts.sum())), int(counts.sum()))
    assert order.tolist() == [t for d in range(3) for t in range(tokens) if expected_dest[t][d]]

    # Fixed capacity: rank d's block starts at d * capacity; unfilled rows name the empty row (index M).
    fixed = send_order(send_slots(dest, torch.arange(3) * capacity, 3 * capacity), 3 * capacity).view(3, capacity).tolist()
    for d in range(3):
        mine = [t for t in range(tokens) if expected_dest[t][d]]
        assert fixed[d] == mine + [tokens] * (capacity - len(mine))


def test_empty_row_has_no_expert_and_no_weight() -> None:
    rows = [torch.randn(2, 6).to(torch.bfloat16), torch.randint(0, 5, (2, 3), dtype=torch.int64), torch.rand(2, 3)]
    packed, layout = pack_row_bytes(rows, spare_rows=1)
    packed[-1] = empty_row(layout, -2, packed.device)
    payload, ids, weights = unpack_row_bytes(packed, layout)
    assert torch.equal(payload[:2], rows[0]) and torch.equal(ids[:2], rows[1])
    assert payload[2].abs().sum() == 0 and ids[2].tolist() == [-1, -1, -1] and weights[2].abs().sum() == 0


@pytest.mark.parametrize("hot,pass_bytes", [(False, None), (True, None), (False, 1)])
def test_slabs_match_the_local_batched_layout(hot: bool, pass_bytes, monkeypatch) -> None:
    """Same (expert, position) as group_by_expert for every routed pair; the reduction matches reduce_batched.

    ``pass_bytes=1`` makes scatter and reduce take one top-k slot per pass, as large calls do.
    """
    if pass_bytes is not None:
        monkeypatch.setattr(dispatch_layout, "SLOT_PASS_BYTES", pass_bytes)
    gen = torch.Generator().manual_seed(3)
    rows, top_k, num_local, hidden = 12, 3, 4, 5
    ids = _random_ids(rows, top_k, 8, gen, hot=hot)
    local = torch.where(ids < num_local, ids, torch.full_like(ids, -1))  # experts 4..7 live elsewhere
    local[-2:] = -1  # empty rows
    slabs = slabs_for(local, num_local, capacity=rows)
    groups = group_by_expert(local, num_local)
    assert slabs.counts.tolist() == groups.counts.tolist()
    flat = slabs.flat.reshape(-1)
    placed = groups.expert * rows + groups.position
    assert torch.equal(flat[groups.pair], placed)
    unplaced = torch.ones(flat.numel(), dtype=torch.bool)
    unplaced[groups.pair] = False
    assert bool((flat[unplaced] == slabs.trash).all())

    x = torch.randn(rows, hidden, generator=gen)
    slab = slabs.scatter(x)
    assert slab.shape == (num_local, rows, hidden)
    assert torch.equal(slab[groups.expert, groups.position], x[groups.token])

    expert_out = torch.full((num_local, rows, hidden), float("nan"))  # unwritten rows may hold anything
    expert_out[groups.expert, groups.position] = torch.randn(groups.num_pairs, hidden, generator=gen)
    weights = torch.rand(rows, top_k, generator=gen)
    layout = BatchedLayout(groups.token, groups.slot, groups.expert, groups.position)
    for w, on_input in ((weights, False), (None, True)):
        got = slabs.reduce(expert_out, w, torch.float32)
        want = torch.empty(rows, hidden)
        reduce_batched(want, expert_out, layout, weights, apply_router_weight_on_input=on_input)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_slabs_scatter_fp8_and_keep_a_shared_scale() -> None:
    local = torch.tensor([[0, -1], [1, 0]], dtype=torch.int32)
    slabs = slabs_for(local, 2, capacity=2)
    q = torch.randn(2, 4).to(torch.float8_e4m3fn)
    slab = slabs.scatter(q)
    assert slab.dtype == torch.float8_e4m3fn
    assert torch.equal(slab[0, :2].view(torch.uint8), q.view(torch.uint8)) and torch.equal(slab[1, 0].view(torch.uint8), q[1].view(torch.uint8))
    shared = torch.tensor(0.5)
    assert slabs.scatter(shared) is shared and slabs.scatter(None) is None


def test_slabs_give_a_row_naming_an_expert_twice_one_slab_row_for_both_slots() -> None:
    """A row whose top-k names one expert twice takes one slab row (both slots point at it), as the slab kernel does:
    every row fits the capacity of one row per expert, so no slot is dropped, and the reduce sums both weights."""
    local = torch.tensor([[0, 0], [0, 0], [1, 0], [-1, -1]], dtype=torch.int32)
    slabs = slabs_for(local, 2, capacity=3)
    assert slabs.counts.tolist() == [3, 1]
    assert slabs.flat.tolist() == [[0, 0], [1, 1], [3, 2], [6, 6]]
    expert_out = torch.full((2, 3, 2), float("nan"))
    expert_out[0, :3] = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    expert_out[1, 0] = torch.tensor([7.0, 8.0])
    weights = torch.tensor([[0.25, 0.5], [1.0, 2.0], [0.5, 0.25], [1.0, 1.0]])
    got = slabs.reduce(expert_out, weights, torch.float64)
    want = torch.tensor([[0.75, 1.5], [9.0, 12.0], [0.5 * 7 + 0.25 * 5, 0.5 * 8 + 0.25 * 6], [0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(got, want)


def test_returned_rows_add_into_their_tokens() -> None:
    order = torch.tensor([0, 2, 3, 3, 1, 2])  # token 3 is the empty row of a 3-token rank
    returned = torch.arange(6, dtype=torch.float32).unsqueeze(1).repeat(1, 2).to(torch.bfloat16)
    total = add_returned_rows(returned, order, 3)
    assert total[:, 0].tolist() == [0.0, 4.0, 1.0 + 5.0]


def test_counts_exchange_into_the_second_half_of_one_buffer(world_of_one) -> None:
    """The variable dispatch sends its records from the first half of one int64 buffer into its second half, so one
    host read gets both; an ``out`` that is not a contiguous int64 tensor of the records' shape is refused by name."""
    records = torch.tensor([[5, 7, 9], [0, 0, 0]], dtype=torch.int64)
    got = exchange_counts(records[:1], out=records[1:])
    assert got.data_ptr() == records[1:].data_ptr() and records.tolist() == [[5, 7, 9], [5, 7, 9]]
    for bad in (torch.empty(1, 3, dtype=torch.int32), torch.empty(1, 2, dtype=torch.int64),
                torch.empty(1, 6, dtype=torch.int64)[:, ::2]):
        with pytest.raises(KernelInputError, match=r"exchange_counts needs out as contiguous int64 \(1, 3\)"):
            exchange_counts(records[:1], out=bad)


@pytest.mark.parametrize("capped_pf, experts, local_pf", [
    (FixedCapacityAllToAllPrepareFinalize, TorchBatchedExperts, LocalBatchedPrepareFinalize),
    (AllToAllPrepareFinalize, TorchExperts, LocalPrepareFinalize),  # the Standard-format P/F sending fixed blocks
], ids=["fixed-capacity", "all-to-all"])
def test_a_capacity_bound_pf_on_one_rank_matches_the_local_kernel(world_of_one, capped_pf, experts, local_pf) -> None:
    """With max_tokens_per_rank the unfilled rows (empty, ids -1) change nothing; too many tokens, and a capacity
    that is not a positive integer, are refused by name."""
    gen = torch.Generator().manual_seed(5)
    layer = MoELayer(num_experts=6, top_k=2, hidden_size=16, intermediate_size=8, dtype="float32")
    x = torch.randn(5, 16, generator=gen)
    ids = _random_ids(5, 2, 6, gen, hot=True)
    weights = torch.rand(5, 2, generator=gen)
    w1, w2 = torch.randn(6, 16, 16, generator=gen) * 0.2, torch.randn(6, 16, 8, generator=gen) * 0.2
    placement = ExpertPlacement(6, 1, 0)
    capped = capped_pf(placement, max_tokens_per_rank=8)
    got = ModularKernel(capped, experts(layer), layer)(x, w1, w2, weights, ids, expert_map=placement.expert_map())
    want = ModularKernel(local_pf(), experts(layer), layer)(x, w1, w2, weights, ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    # A token naming one expert twice (both slots) is computed once per slot weight: nothing is dropped, even
    # where every row does so and the pairs outnumber the slab's rows (one per token a rank may send).
    twice = torch.zeros(5, 2, dtype=torch.int32)
    twice[3] = torch.tensor([4, 4], dtype=torch.int32)
    full = capped_pf(placement, max_tokens_per_rank=5)
    got = ModularKernel(full, experts(layer), layer)(x, w1, w2, weights, twice, expert_map=placement.expert_map())
    want = moe_reference(x.double(), w1.double(), w2.double(), weights.double(), twice.long())
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)

    small = capped_pf(placement, max_tokens_per_rank=4)
    with pytest.raises(KernelInputError, match="at most 4 tokens per rank"):
        ModularKernel(small, experts(layer), layer)(x, w1, w2, weights, ids, expert_map=placement.expert_map())
    for bad in (0, True, 2.0):
        with pytest.raises(KernelInputError, match="max_tokens_per_rank must be a positive integer"):
            capped_pf(placement, max_tokens_per_rank=bad)


def test_which_pfs_every_rank_may_capture_in_a_cuda_graph_at_once() -> None:
    """Fixed blocks (no host read after the first call, collectives of fixed sizes) with experts that read nothing on
    the host: ``run`` replays those layers from CUDA graphs in step; the variable all-to-all reads its splits on the
    host, and the Batched format's local packing reads a count, so they run eagerly. No EP P/F is ``host_sync_free``:
    a graph one process captured alone (``eager_graphs``) would hold collectives the other ranks do not make."""
    layer = MoELayer(num_experts=6, top_k=2, hidden_size=16, intermediate_size=8, dtype="bfloat16")
    placement = ExpertPlacement(6, 2, 0)
    capped = AllToAllPrepareFinalize(placement, max_tokens_per_rank=8)
    assert capped.captures_in_step and FixedCapacityAllToAllPrepareFinalize(placement, max_tokens_per_rank=8).captures_in_step
    assert not AllToAllPrepareFinalize(placement).captures_in_step
    assert not AllToAllPrepareFinalize(placement, max_tokens_per_rank=8, activation_format=ActivationFormat.BATCHED,
                                       max_num_tokens=16).captures_in_step
    assert not any(pf.host_sync_free for pf in (capped, AllToAllPrepareFinalize(placement)))
    assert captures_in_step(ModularKernel(capped, TritonExperts(layer), layer))
    assert not captures_in_step(ModularKernel(capped, TorchExperts(layer), layer))  # the torch experts read counts
    assert not captures_in_step(ModularKernel(AllToAllPrepareFinalize(placement), TritonExperts(layer), layer))

