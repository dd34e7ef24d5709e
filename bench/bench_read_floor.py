"""What reading a decode layer's bytes costs by itself: the floor under any kernel that has to read them.

The weight-bandwidth roofline divides bytes by the copy bandwidth of a 2 GiB transfer. A one-token MoE layer
reads a few MB to a few hundred MB, where a kernel's start, its ramp to full bandwidth and its tail are not
small against the transfer. This times Triton kernels that do nothing but stream the same number of bytes
(each program reads one contiguous chunk and keeps an xor of it), timed the way the layers are timed
(``tuning.time_graph``: a CUDA graph replaying one call per buffer, L2 flushed per replay, each call on a
buffer of its own as each layer call reads other experts), over a few grid sizes and tiles, the fastest kept:

* ``one_kernel_us``: all the bytes in one launch;
* ``two_kernels_us``: the w1 share (2/3 of the weights) then the w2 share (1/3) in two launches, one after
  the other: the least a layer pays whose second GEMM waits for the whole first one (every expert kernel here
  and vLLM's), unless one kernel holds a grid-wide barrier.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_fsm.kernels.triton_moe.tuning import time_graph


@triton.jit
def stream_read_kernel(src_ptr, sink_ptr, n_words, words_per_program, BLOCK: tl.constexpr):
    """Read ``words_per_program`` int32 words from this program's chunk; store their xor (so no load is dead)."""
    start = tl.program_id(0).to(tl.int64) * words_per_program
    acc = tl.zeros((BLOCK,), dtype=tl.int32)
    for off in tl.range(0, words_per_program, BLOCK):
        idx = start + off + tl.arange(0, BLOCK)
        acc ^= tl.load(src_ptr + idx, mask=idx < n_words, other=0)
    tl.store(sink_ptr + tl.program_id(0), tl.xor_sum(acc, axis=0))


_GRIDS_PER_SM = (1, 2, 4, 8)
_TILES = ((1024, 4), (4096, 8))  # (int32 words per load, warps)


def _reader(n_words: int, programs: int, block: int, warps: int):
    per_program = -(-n_words // programs)
    per_program = -(-per_program // block) * block
    grid = -(-n_words // per_program)
    sink = torch.empty(grid, dtype=torch.int32, device="cuda")

    def read(buf: torch.Tensor) -> None:
        stream_read_kernel[(grid,)](buf, sink, n_words, per_program, BLOCK=block, num_warps=warps)

    return read


def _fastest(shares: list[int], count: int, rep_ms: float) -> float:
    """Fastest µs per call over the grid/tile choices of reading ``shares`` bytes one launch after another."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    # whole 64-byte runs, so Triton sees word counts divisible by 16 and loads 16 bytes a thread at a time
    bufs = [[torch.empty(-(-share // 64) * 16, dtype=torch.int32, device="cuda").random_() for share in shares]
            for _ in range(count)]
    best = float("inf")
    for per_sm in _GRIDS_PER_SM:
        for block, warps in _TILES:
            readers = [_reader(b.numel(), sms * per_sm, block, warps) for b in bufs[0]]

            def call(*call_bufs):
                for reader, buf in zip(readers, call_bufs):
                    reader(buf)

            best = min(best, time_graph(call, bufs, rep_ms))
    del bufs
    torch.cuda.empty_cache()
    return best


def read_floor(weight_bytes: int, other_bytes: int, count: int, rep_ms: float = 50.0) -> dict:
    """Floors for a layer call that reads ``weight_bytes`` of experts plus ``other_bytes`` (activations)."""
    w1_share = weight_bytes * 2 // 3
    return {
        "one_kernel_us": _fastest([weight_bytes + other_bytes], count, rep_ms),
        "two_kernels_us": _fastest([w1_share + other_bytes, weight_bytes - w1_share], count, rep_ms),
    }
