"""The w1 kernel asking L2 for w2's weights at decode: which bytes it asks for, and when it may.

``_kernels.w2_prefetch_ranges`` gives each w1 program its byte ranges of w2: together, every hit expert's w2 slice
exactly once (an expert several pairs chose, or several row blocks hold, asked for once), in 16-byte multiples as
the bulk prefetch takes them. It runs here under Triton's interpreter (``TRITON_INTERPRET=1 python3 -m pytest
tests/kernels/test_triton_w2_prefetch.py``) through a kernel that writes the ranges out, for pair blocks and for
sorted row blocks, with pad blocks and slots of another rank. The prefetch instruction itself needs an sm_90 GPU:
``tests/gpu/test_triton_moe.py`` checks that it changes no output bit, ``bench_experts_vs_vllm.py``'s
``prefetch_start``/``prefetch_end`` columns time it. ``fused._w2_prefetch_code`` (which mode a launch gets, and the
error for a mode that cannot run) is checked on CPU tensors without Triton.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from moe_fsm.errors import KernelInputError

HAS_TRITON = importlib.util.find_spec("triton") is not None
interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or not HAS_TRITON,
                                 reason="runs the kernels under Triton's interpreter: start pytest with TRITON_INTERPRET=1")


if HAS_TRITON:
    import triton
    import triton.language as tl

    from moe_fsm.kernels.triton_moe._kernels import w2_prefetch_ranges

    @triton.jit
    def ranges_kernel(block_expert_ptr, offsets_ptr, sizes_ptr, num_padded, num_experts, w2_expert_bytes,
                      BLOCK_M: tl.constexpr, PAIR_BLOCKS: tl.constexpr, LANES: tl.constexpr):
        """Each program's ``w2_prefetch_ranges`` written out (sizes 0 where the GEMM ends before its K loop)."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        num_pid_n = tl.num_programs(1)
        lane = tl.arange(0, LANES)
        out = (pid_m * num_pid_n + pid_n) * LANES + lane
        expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        # the programs the GEMM ends before its K loop (a pair of another rank, a block past the padded rows)
        if PAIR_BLOCKS:
            runs = (expert >= 0) & (expert < num_experts)
        else:
            runs = pid_m * BLOCK_M < num_padded
        if runs:
            offsets, sizes = w2_prefetch_ranges(pid_m, pid_n, num_pid_n, expert, block_expert_ptr, w2_expert_bytes,
                                                PAIR_BLOCKS, LANES)
            tl.store(offsets_ptr + out, offsets)
            tl.store(sizes_ptr + out, sizes)
        else:
            tl.store(sizes_ptr + out, tl.zeros((LANES,), tl.int64))


def _ranges(block_expert: torch.Tensor, num_padded: int, block_m: int, num_pid_n: int, w2_expert_bytes: int,
            pair_blocks: bool, lanes: int, num_experts: int) -> list[tuple[int, int]]:
    """Every program's (offset, size) ranges with a size, as the w1 kernel computes them."""
    blocks = block_expert.numel()
    offsets = torch.full((blocks * num_pid_n * lanes,), -7, dtype=torch.int64)  # poisoned
    sizes = torch.full_like(offsets, -7)
    ranges_kernel[(blocks, num_pid_n)](block_expert, offsets, sizes, num_padded, num_experts, w2_expert_bytes,
                                       BLOCK_M=block_m, PAIR_BLOCKS=pair_blocks, LANES=lanes)
    assert (sizes >= 0).all()
    return [(int(o), int(s)) for o, s in zip(offsets.tolist(), sizes.tolist()) if s > 0]


def _assert_cover_exactly(ranges: list[tuple[int, int]], experts: set[int], w2_expert_bytes: int) -> None:
    """The ranges, 16-byte aligned multiples of 16, tile the hit experts' slices with no gap and no overlap."""
    assert all(o % 16 == 0 and s % 16 == 0 for o, s in ranges)
    ranges = sorted(ranges)
    for (o1, s1), (o2, _) in zip(ranges, ranges[1:]):
        assert o1 + s1 <= o2, "two programs ask for the same bytes"
    covered = sum(s for _, s in ranges)
    assert covered == len(experts) * w2_expert_bytes
    for e in experts:
        lo, hi = e * w2_expert_bytes, (e + 1) * w2_expert_bytes
        assert sum(s for o, s in ranges if lo <= o < hi and o + s <= hi) == w2_expert_bytes


@interpreter
@pytest.mark.parametrize("num_pid_n,w2_expert_bytes,lanes", [(4, 2048 * 96 * 2, 32), (3, 1536 * 40, 64),
                                                            (12, 16 * 5, 32)])
def test_pair_blocks_ask_for_each_hit_expert_once(num_pid_n, w2_expert_bytes, lanes):
    """Pairs that share an expert (tokens 0 and 2 both chose 3) ask for it once; a slot of another rank (-1, and
    an id past the local experts) asks for nothing; a slice smaller than the lanes leaves lanes idle."""
    ids = torch.tensor([3, 1, 0, 3, 5, -1, 1, 7, 9], dtype=torch.int32)
    ranges = _ranges(ids, 0, 16, num_pid_n, w2_expert_bytes, True, lanes, num_experts=8)
    _assert_cover_exactly(ranges, {0, 1, 3, 5, 7}, w2_expert_bytes)


@interpreter
def test_pair_blocks_past_64_pairs():
    """The earlier-pair search runs in chunks of 64: a repeat 70 pairs on is still asked for once."""
    ids = torch.arange(80, dtype=torch.int32) % 70
    ranges = _ranges(ids, 0, 16, 2, 4096, True, 32, num_experts=70)
    _assert_cover_exactly(ranges, set(range(70)), 4096)


@interpreter
def test_sorted_row_blocks_ask_once_per_expert():
    """Sorted rows: an expert's first row block asks, its later ones do not; pad blocks past the padded rows
    (their ``block_expert`` holds -1) ask for nothing."""
    block_expert = torch.tensor([0, 0, 2, 5, 5, 5, 6, -1, -1], dtype=torch.int32)
    ranges = _ranges(block_expert, 7 * 16, 16, 5, 1536 * 64 * 2, False, 64, num_experts=8)
    _assert_cover_exactly(ranges, {0, 2, 5, 6}, 1536 * 64 * 2)


def _weights(num_experts: int, n: int, k: int, dtype=torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty(num_experts, 2 * n, k, dtype=dtype), torch.empty(num_experts, k, n, dtype=dtype)


def test_a_mode_that_cannot_run_is_an_error_and_the_rule_stays_off():
    from moe_fsm.kernels.triton_moe.fused import _w2_prefetch_code

    w1, w2 = _weights(4, 64, 128)
    assert _w2_prefetch_code(None, w1, w2, 1, 2, hopper=False) == 0
    assert _w2_prefetch_code("off", w1, w2, 1, 2, hopper=False) == 0
    with pytest.raises(KernelInputError, match="w2_prefetch='start' cannot run here: the weights are not on a CUDA"):
        _w2_prefetch_code("start", w1, w2, 1, 2, hopper=False)
    with pytest.raises(KernelInputError, match="the Hopper TMA path runs this config"):
        _w2_prefetch_code("end", w1, w2, 1, 2, hopper=True)
    with pytest.raises(KernelInputError, match=r"w2_prefetch 'early' is not one of \[None, 'off', 'start', 'end'\]"):
        _w2_prefetch_code("early", w1, w2, 1, 2, hopper=False)
