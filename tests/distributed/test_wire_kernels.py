"""The Triton passes around the wire (pack, combine, slab scatter and reduce) against references, on CPU.

``TRITON_INTERPRET=1`` runs the kernels on CPU tensors; on a CUDA machine the same
tests also run them on the GPU; and the torch operations that stand in for them off
CUDA are held to the same checks. Inputs are fresh random values, outputs are
poisoned first (NaN or 0x5A bytes), sums are checked against float64.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from moe_fsm.distributed.collectives import row_layout  # noqa: E402
from moe_fsm.prepare_finalize import wire_kernels  # noqa: E402
from moe_fsm.distributed import ExpertPlacement  # noqa: E402
from moe_fsm.prepare_finalize.dispatch_layout import destinations, empty_row, send_order, send_slots, slabs_for  # noqa: E402

# "torch": the torch operations the functions use off CUDA; "interpreter": the kernels on CPU tensors.
PATHS = ["torch", "interpreter"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=PATHS)
def device(request, monkeypatch):
    if request.param == "interpreter":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    return torch.device("cuda" if request.param == "cuda" else "cpu")


def _routing(tokens: int, world: int, gen: torch.Generator) -> torch.Tensor:
    dest = torch.rand(tokens, world, generator=gen) < 0.6
    dest[::5] = False  # some tokens go nowhere
    return dest


@pytest.mark.parametrize("payload_dtype,hidden,with_scale", [(torch.bfloat16, 256, False), (torch.float8_e4m3fn, 384, True),
                                                              (torch.uint8, 52, False)])
@pytest.mark.parametrize("tokens", [0, 1, 37])
def test_send_rows_hold_each_tokens_packed_row(device, monkeypatch, payload_dtype, hidden, with_scale, tokens) -> None:
    gen = torch.Generator().manual_seed(tokens * 7 + hidden)
    if payload_dtype == torch.uint8:
        payload = torch.randint(0, 256, (tokens, hidden), generator=gen, dtype=torch.uint8)
    else:
        payload = torch.randn(tokens, hidden, generator=gen).to(payload_dtype)
    fields = [payload.view(torch.uint8) if payload.element_size() == 1 else payload]
    if with_scale:
        fields.append(torch.rand(tokens, hidden // 128, generator=gen))
    fields += [torch.randint(0, 64, (tokens, 8), generator=gen, dtype=torch.int32), torch.rand(tokens, 8, generator=gen)]
    fields = [f.to(device) for f in fields]
    layout = row_layout(fields)
    world = 3
    dest = _routing(tokens, world, gen).to(device)
    counts = dest.sum(0)
    empty = empty_row(layout, -2, device)
    packed = wire_kernels.pack_source(fields, layout, empty)

    def check(sent: torch.Tensor, s: int, token: int) -> None:
        for t, f in zip(fields, layout.fields):
            expect = t[token].contiguous().view(torch.uint8).reshape(-1) if token < tokens else empty[f.start : f.start + f.nbytes]
            assert torch.equal(sent[s, f.start : f.start + f.nbytes], expect), (s, token, f)

    # fixed blocks: rows past a rank's count hold the empty row (the send buffer poisoned first); with 2 programs
    # a rank, each writes several of them
    buffers = wire_kernels.WireBuffers()
    capacity = max(tokens, 1) + 2
    total = world * capacity
    slot = send_slots(dest, torch.arange(world, device=device) * capacity, total)
    order = send_order(slot, total)
    for pad_programs in (wire_kernels.PAD_PROGRAMS, 2):
        monkeypatch.setattr(wire_kernels, "PAD_PROGRAMS", pad_programs)
        buffers.rows("send", total, (layout.row_bytes,), torch.uint8, device).fill_(0x5A)
        sent = wire_kernels.send_rows(packed, slot, total, counts=counts, capacity=capacity, buffers=buffers)
        for d in range(world):
            for i in range(capacity):
                check(sent, d * capacity + i, int(order[d * capacity + i]) if i < int(counts[d]) else tokens)
    # variable counts: every send row filled, in destination and token order
    total = int(counts.sum())
    slot = send_slots(dest, torch.cumsum(counts, 0) - counts, dest.numel())
    buffers.rows("send", total, (layout.row_bytes,), torch.uint8, device).fill_(0x5A)
    sent = wire_kernels.send_rows(packed, slot, total, buffers=buffers)
    assert sent.shape == (total, layout.row_bytes)
    expected_order = [t for d in range(world) for t in range(tokens) if bool(dest[t, d])]
    for s, token in enumerate(expected_order):
        check(sent, s, token)


@pytest.mark.parametrize("given", ["counts", "capacity"])
def test_send_rows_takes_counts_and_capacity_together(given) -> None:
    """Fixed blocks need both the per-rank counts and the block size; one without the other is refused in one line."""
    from moe_fsm.errors import KernelInputError

    fields = [torch.zeros(2, 16, dtype=torch.bfloat16), torch.zeros(2, 4, dtype=torch.int32)]
    layout = row_layout(fields)
    packed = wire_kernels.pack_source(fields, layout, empty_row(layout, -1, torch.device("cpu")))
    slot = torch.zeros(2, 2, dtype=torch.int64)
    extra = {"counts": torch.ones(2, dtype=torch.int64)} if given == "counts" else {"capacity": 2}
    with pytest.raises(KernelInputError, match="counts and capacity together"):
        wire_kernels.send_rows(packed, slot, 4, **extra)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens,world", [(0, 2), (1, 2), (29, 4)])
def test_combine_returned_sums_each_tokens_rows_in_float32(device, out_dtype, tokens, world) -> None:
    gen = torch.Generator().manual_seed(tokens + world)
    hidden = 1100  # not a multiple of the block: the last block is partial
    dest = _routing(tokens, world, gen)
    counts = dest.sum(0)
    total = int(counts.sum())
    slot = send_slots(dest, torch.cumsum(counts, 0) - counts, dest.numel())
    order = send_order(slot, total)
    returned = torch.randn(total, hidden, generator=gen).to(out_dtype)
    output = torch.full((tokens, hidden), float("nan"), dtype=out_dtype)
    expect = torch.zeros(tokens, hidden, dtype=torch.float64)
    for s in range(total):
        expect[int(order[s])] += returned[s].double()
    output, returned, slot = (t.to(device) for t in (output, returned, slot))
    wire_kernels.combine_returned(output, returned, slot)
    tol = 1e-2 if out_dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(output.cpu().double(), expect, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float32])
def test_slabs_scatter_and_weighted_reduce(device, dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    rows_n, top_k, num_experts, hidden = 23, 4, 5, 160
    ids = torch.stack([torch.randperm(8, generator=gen)[:top_k] for _ in range(rows_n)]) - 3  # local ids, < 0: elsewhere
    ids[::6] = -1
    rows = torch.randn(rows_n, hidden, generator=gen).to(dtype)
    slabs = slabs_for(ids.to(device), num_experts, rows_n)
    flat = slabs.flat.cpu()

    slab = slabs.scatter(rows.to(device)).cpu()
    assert slab.shape == (num_experts, rows_n, hidden) and slab.dtype == dtype
    flat_slab = slab.view(-1, hidden)
    for r in range(rows_n):
        for j in range(top_k):
            if int(flat[r, j]) < slabs.trash:
                assert torch.equal(flat_slab[int(flat[r, j])].view(torch.uint8), rows[r].view(torch.uint8))

    expert_out = torch.randn(num_experts, rows_n, hidden, generator=gen).to(torch.bfloat16)
    poison = expert_out.clone().view(-1, hidden)
    used = set(int(v) for v in flat.reshape(-1) if int(v) < slabs.trash)
    for i in range(poison.shape[0]):
        if i not in used:
            poison[i] = float("nan")  # rows no valid slot names must never be read
    weights = torch.rand(rows_n, top_k, generator=gen)
    for w in (weights, None):
        got = slabs.reduce(poison.view(num_experts, rows_n, hidden).to(device), None if w is None else w.to(device),
                           torch.bfloat16).cpu()
        expect = torch.zeros(rows_n, hidden, dtype=torch.float64)
        for r in range(rows_n):
            for j in range(top_k):
                if int(flat[r, j]) < slabs.trash:
                    expect[r] += (1.0 if w is None else float(w[r, j])) * poison[int(flat[r, j])].double()
        torch.testing.assert_close(got.double(), expect, atol=2e-2, rtol=1e-2)


def test_the_kernels_apply_only_on_cuda_or_under_the_interpreter(monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not wire_kernels.kernels_apply(torch.zeros(1))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert wire_kernels.kernels_apply(torch.zeros(1))


@pytest.mark.parametrize("capacity", [None, 40])
@pytest.mark.parametrize("tokens,world,top_k,programs", [(0, 2, 8, None), (1, 2, 8, None), (37, 3, 6, None),
                                                         (1500, 4, 8, None), (1500, 4, 8, (32, 3))])
def test_route_gives_the_slots_and_counts_of_the_torch_scan(device, monkeypatch, tokens, world, top_k, capacity,
                                                            programs) -> None:
    """The route's programs each scan their tokens after counting the ones before; ``programs`` (tokens per scan
    step, most programs) small makes each program take several steps."""
    if device.type == "cpu" and not wire_kernels.kernels_apply(torch.zeros(1)):
        pytest.skip("route() is the kernel only; send_slots is its torch form")
    if programs is not None:
        monkeypatch.setattr(wire_kernels, "ROUTE_BLOCK_T", programs[0])
        monkeypatch.setattr(wire_kernels, "ROUTE_PROGRAMS", programs[1])
    if capacity is not None and tokens > capacity:
        capacity = tokens
    gen = torch.Generator().manual_seed(tokens + world)
    num_experts = 16 * world
    placement = ExpertPlacement(num_experts, world, 0)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(tokens)]).to(torch.int32) \
        if tokens else torch.empty((0, top_k), dtype=torch.int32)
    if tokens:
        ids[::4, : top_k // 2] = -1  # skipped slots
        ids[::7] = -1  # tokens that go nowhere
    dest = destinations(ids, placement.owner_mask())
    counts = dest.sum(0)
    if capacity is None:
        expect = send_slots(dest, torch.cumsum(counts, 0) - counts, tokens * world)
    else:
        expect = send_slots(dest, torch.arange(world) * capacity, world * capacity)
    routes = wire_kernels.route(ids.to(device), placement.owner_table(device).to(torch.int32), world,
                                capacity=capacity)
    assert torch.equal(routes.counts.cpu(), counts)
    assert torch.equal(routes.slot.cpu(), expect)
    records = torch.full((world, 3), 7, dtype=torch.int64, device=device)  # counts written into a column
    wire_kernels.route(ids.to(device), placement.owner_table(device).to(torch.int32), world, counts_out=records[:, 0])
    assert torch.equal(records[:, 0].cpu(), counts) and bool((records[:, 1:] == 7).all())


@pytest.mark.parametrize("rows_kind", ["token", "group"])
@pytest.mark.parametrize("tokens", [0, 1, 37])
# 320 columns: one program's column of groups, the last group 64 columns; 1344: two columns of programs (8 groups
# and 3, the last 64 columns). 37 tokens leave the last program of several tokens partly empty.
@pytest.mark.parametrize("hidden,world", [(320, 3), (1344, 2)])
def test_send_rows_quantized_while_packing_hold_the_quantizers_bytes(device, monkeypatch, rows_kind, tokens, hidden,
                                                                      world) -> None:
    """FP8 per token / per 1x128 group applied by the send-row kernel: the same bytes and scales as the torch
    quantizer, in every send row the token goes to, with empty rows past each rank's count in fixed blocks."""
    if not wire_kernels.kernels_apply(torch.zeros(1, device=device)):
        pytest.skip("quantizing while packing is the kernels' path (CUDA, or TRITON_INTERPRET=1)")
    from moe_fsm.kernels import fp8

    gen = torch.Generator().manual_seed(tokens + len(rows_kind) + hidden)
    x = (torch.randn(tokens, hidden, generator=gen) * 4).to(torch.bfloat16)
    if tokens:
        x[0, :4] = torch.tensor([0.0, -0.0, 1e-6, -3e-4])  # values that land on e4m3 subnormals
        x[-1, 128:256] = 0.0  # an all-zero group
    q, scale = (fp8.quantize_per_token if rows_kind == "token" else fp8.quantize_per_group)(x)
    ids = torch.randint(0, 64, (tokens, 8), generator=gen, dtype=torch.int32)
    weights = torch.rand(tokens, 8, generator=gen)
    layout = row_layout([q.view(torch.uint8), scale, ids, weights])
    empty = empty_row(layout, -2, device)
    fields = [x.to(device), torch.empty(scale.shape, dtype=torch.float32, device="meta"), ids.to(device), weights.to(device)]
    buffers = wire_kernels.WireBuffers()
    packed = wire_kernels.pack_source(fields, layout, empty, fp8_rows=rows_kind, buffers=buffers)
    dest = _routing(tokens, world, gen).to(device)
    counts = dest.sum(0)
    expected_fields = [q.view(torch.uint8), scale, ids, weights]

    def check(sent: torch.Tensor, s: int, token: int) -> None:
        for t, f in zip(expected_fields, layout.fields):
            expect = t[token].contiguous().view(torch.uint8).reshape(-1) if token < tokens else empty[f.start : f.start + f.nbytes].cpu()
            assert torch.equal(sent[s, f.start : f.start + f.nbytes], expect), (s, token, f)

    capacity = max(tokens, 1) + 2
    total = world * capacity
    slot = send_slots(dest, torch.arange(world, device=device) * capacity, total)
    order = send_order(slot, total)
    for pad_programs in (wire_kernels.PAD_PROGRAMS, 2):  # with 2 programs a rank, each writes several empty rows
        monkeypatch.setattr(wire_kernels, "PAD_PROGRAMS", pad_programs)
        buffers.rows("send", total, (layout.row_bytes,), torch.uint8, device).fill_(0x5A)  # poisoned, then reused
        sent = wire_kernels.send_rows(packed, slot, total, counts=counts, capacity=capacity, buffers=buffers).cpu()
        for d in range(world):
            for i in range(capacity):
                check(sent, d * capacity + i, int(order[d * capacity + i]) if i < int(counts[d]) else tokens)
    total = int(counts.sum())
    slot = send_slots(dest, torch.cumsum(counts, 0) - counts, dest.numel())
    buffers.rows("send", total, (layout.row_bytes,), torch.uint8, device).fill_(0x5A)
    sent = wire_kernels.send_rows(packed, slot, total, buffers=buffers).cpu()
    expected_order = [t for d in range(world) for t in range(tokens) if bool(dest[t, d])]
    for s, token in enumerate(expected_order):
        check(sent, s, token)


@pytest.mark.parametrize("rows,top_k,world", [(0, 4, 2), (1, 8, 2), (300, 8, 4), (41, 6, 3)])
def test_local_ids_and_slab_layout_match_the_torch_forms(device, rows, top_k, world) -> None:
    if not wire_kernels.kernels_apply(torch.zeros(1, device=device)):
        pytest.skip("local_ids and slab_layout are the kernels' path; local_expert_ids and slabs_for their torch form")
    from moe_fsm.kernels.grouping import local_expert_ids

    gen = torch.Generator().manual_seed(rows + top_k)
    num_experts = 8 * world
    placement = ExpertPlacement(num_experts, world, world - 1)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(rows)]).to(torch.int32) \
        if rows else torch.empty((0, top_k), dtype=torch.int32)
    if rows:
        ids[::3, -1] = -1  # skipped slots
        ids[::5, 0] = placement.local_start  # a hot local expert
        ids[::5, 1:] = torch.where(ids[::5, 1:] == placement.local_start, -1, ids[::5, 1:])
    expert_map = placement.expert_map()
    wire = torch.full((rows, top_k + 3), 99, dtype=torch.int32)  # ids as a strided view, as they arrive
    wire[:, 1 : top_k + 1] = ids
    strided = wire.to(device)[:, 1 : top_k + 1]
    expect_local = local_expert_ids(ids, expert_map)
    got = wire_kernels.local_ids(strided, expert_map.to(torch.int32).to(device))
    assert torch.equal(got.cpu(), expect_local)
    capacity = max(rows, 1)
    expect = slabs_for(expect_local, placement.num_local_experts, capacity)
    got_local, flat, counts = wire_kernels.slab_layout(strided, expert_map.to(torch.int32).to(device),
                                                       placement.num_local_experts, capacity)
    assert torch.equal(got_local.cpu(), expect_local)
    assert torch.equal(flat.cpu(), expect.flat)
    assert torch.equal(counts.cpu(), expect.counts)
