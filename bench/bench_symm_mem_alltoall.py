"""PyTorch's NVSHMEM all-to-all with device-side splits next to NCCL's, on EP-dispatch-shaped rows.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        timeout -k 5 45 python3 -m torch.distributed.run --nproc-per-node N bench/bench_symm_mem_alltoall.py

Answers whether ``torch.ops.symm_mem.all_to_all_vdev`` (symmetric memory on NVSHMEM, splits read on the device,
so no host synchronisation) runs on this machine with NVLink multicast off, and what it costs against
``dist.all_to_all_single`` with host splits (what ``AllToAllPrepareFinalize`` uses). For at most 64 and at most
2048 uint8 rows of 14,400 bytes (a DeepSeek-V3 bf16 dispatch row) per peer, with random counts per peer, rank 0
prints: the received splits and offsets against NCCL's, whether the received bytes are equal, the slowest rank's
median of 20 timed calls (each after a barrier, ended by a device sync) of both, and the median of a CUDA-graph
replay of the vdev call. Needs one CUDA device per rank; docs/perf/distributed.md has the 4 x H200 figures.
"""

from __future__ import annotations

import os
import statistics
import time
import traceback
from typing import Callable

import torch
import torch.distributed as dist

ROW_BYTES = 14400
ROWS_PER_PEER = (64, 2048)


def slowest_median_ms(fn: Callable[[], object], device: torch.device, iters: int = 20, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    median = torch.tensor([statistics.median(times)], device=device)
    dist.all_reduce(median, op=dist.ReduceOp.MAX)
    return median.item() * 1e3


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)

    def say(*parts: object) -> None:
        if rank == 0:
            print(*parts, flush=True)

    import torch.distributed._symmetric_memory as symm_mem

    say("torch", torch.__version__, "world", world,
        {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")})
    say("has op", hasattr(torch.ops.symm_mem, "all_to_all_vdev"), "nvshmem available", symm_mem.is_nvshmem_available())
    try:
        symm_mem.set_backend("NVSHMEM")
        say("backend", symm_mem.get_backend(device))
        group_name = dist.group.WORLD.group_name
        for rows_per_peer in ROWS_PER_PEER:
            max_rows = rows_per_peer * world
            inp = symm_mem.empty((max_rows, ROW_BYTES), dtype=torch.uint8, device=device)
            out = symm_mem.empty((max_rows * 2, ROW_BYTES), dtype=torch.uint8, device=device)
            in_splits = symm_mem.empty(world, dtype=torch.int64, device=device)
            out_splits_offsets = symm_mem.empty((2, world), dtype=torch.int64, device=device)
            gen = torch.Generator().manual_seed(rank)
            send = torch.randint(rows_per_peer // 2, rows_per_peer + 1, (world,), generator=gen).tolist()
            inp.copy_(torch.randint(0, 255, (max_rows, ROW_BYTES), generator=gen, dtype=torch.uint8).to(device))
            in_splits.copy_(torch.tensor(send))
            dist.barrier()
            torch.ops.symm_mem.all_to_all_vdev(inp, out, in_splits, out_splits_offsets, group_name)
            torch.cuda.synchronize()
            recv_counts = torch.empty(world, dtype=torch.int64, device=device)
            dist.all_to_all_single(recv_counts, torch.tensor(send, device=device))
            recv = recv_counts.tolist()
            expected = torch.empty((sum(recv), ROW_BYTES), dtype=torch.uint8, device=device)
            dist.all_to_all_single(expected, inp[: sum(send)], output_split_sizes=recv, input_split_sizes=send)
            got = out_splits_offsets[0].tolist()
            same = got == recv and torch.equal(out[: sum(recv)], expected)
            say(f"rows/peer<= {rows_per_peer}: splits {got} vs {recv}, offsets {out_splits_offsets[1].tolist()}, "
                f"bytes equal: {same}")

            def vdev() -> None:
                torch.ops.symm_mem.all_to_all_vdev(inp, out, in_splits, out_splits_offsets, group_name)

            def nccl() -> None:
                dist.all_to_all_single(expected, inp[: sum(send)], output_split_sizes=recv, input_split_sizes=send)

            mb = sum(send) * ROW_BYTES / 1e6
            t_vdev, t_nccl = slowest_median_ms(vdev, device), slowest_median_ms(nccl, device)
            say(f"  {mb:.1f} MB sent/rank: all_to_all_vdev {t_vdev:.3f} ms ({mb / t_vdev:.0f} GB/s), "
                f"all_to_all_single {t_nccl:.3f} ms ({mb / t_nccl:.0f} GB/s)")
            try:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    vdev()
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    vdev()
                say(f"  vdev captured in a CUDA graph: replay {slowest_median_ms(graph.replay, device):.3f} ms")
            except Exception as err:  # noqa: BLE001 - a failed capture is a finding to print, not a crash
                say("  graph capture failed:", repr(err)[:300])
    except Exception:  # noqa: BLE001 - where symmetric memory does not run, print why and still end every rank
        if rank == 0:
            traceback.print_exc()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
