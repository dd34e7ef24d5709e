"""One rank of ``moe-fsm run --nproc``'s CUDA-graph path, at any world size (one GPU suffices for world 1).

    python tests/distributed/capture_in_step_worker.py OUT_DIR

Needs one GPU per rank and NCCL (``test_capture_in_step.py`` starts it). Two layers, each its own Standard-format
all-to-all P/F built with ``max_tokens_per_rank`` and TritonExperts, run as ``engine.distributed_run`` runs a layer:
the kernel timer's eager warm-up call, then ``capture_in_step`` (eager warm-ups on a side stream, the capture of the
whole layer call, the agreement of every rank), then timed replays. The eager calls replay graphs the P/F captured
itself (``dispatch_graphs.py``) at the capacity's rows, while the call the run captures is the plain call at the
rank's own token count, which is never the capacity here: its kernels must all have been loaded before the capture.
Each layer's output must come from the run's graph (``replayed``), equal the float64 reference, and equal the plain
eager call (``MOE_FSM_DISPATCH_GRAPHS=0``) up to summation order. Results go to ``OUT_DIR/results.rank{r}.json``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dist_harness import worker_main  # noqa: E402

from moe_fsm.distributed import ExpertPlacement, shard_experts  # noqa: E402
from moe_fsm.engine.distributed_run import capture_in_step  # noqa: E402
from moe_fsm.engine.run import KernelTimer  # noqa: E402
from moe_fsm.experts.triton_experts import TritonExperts  # noqa: E402
from moe_fsm.inputs.layer import MoELayer  # noqa: E402
from moe_fsm.inputs.quant import QuantScheme  # noqa: E402
from moe_fsm.kernels.reference import moe_reference  # noqa: E402
from moe_fsm.modular.interfaces import ExpertScales  # noqa: E402
from moe_fsm.modular.kernel import ModularKernel, StageClock  # noqa: E402
from moe_fsm.prepare_finalize import dispatch_graphs  # noqa: E402
from moe_fsm.prepare_finalize.all2all import AllToAllPrepareFinalize  # noqa: E402
from moe_fsm.quantize.weights import quantize_experts  # noqa: E402

NUM_EXPERTS, HIDDEN, INTERMEDIATE, TOP_K, CAPACITY, LAYERS, REPEATS = 16, 256, 128, 4, 16, 2, 2


def tokens_of(rank: int) -> int:
    """This rank's tokens: fewer than the capacity, and a different count on each rank (as ``run`` holds)."""
    return CAPACITY - 7 + rank


def run_layer(index: int, rank: int, world: int, device: torch.device) -> dict:
    layer = MoELayer(quant=QuantScheme.unquantized(), num_experts=NUM_EXPERTS, top_k=TOP_K, hidden_size=HIDDEN,
                     intermediate_size=INTERMEDIATE, dtype="bfloat16")
    gen = torch.Generator().manual_seed(50 + index)  # the same weights on every rank
    w1 = (torch.randn(NUM_EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=gen) * 0.1).to(torch.bfloat16)
    w2 = (torch.randn(NUM_EXPERTS, HIDDEN, INTERMEDIATE, generator=gen) * 0.1).to(torch.bfloat16)
    w1q, w2q, scales = quantize_experts(w1, w2, layer)
    placement = ExpertPlacement(NUM_EXPERTS, world, rank)
    w1r, w2r, scales_r = shard_experts(w1q, w2q, scales, placement)
    w1r, w2r = w1r.to(device), w2r.to(device)
    scales_r = ExpertScales(**{k: None if v is None else v.to(device) for k, v in vars(scales_r).items()})
    expert_map = placement.expert_map(device)
    kernel = ModularKernel(AllToAllPrepareFinalize(placement, max_tokens_per_rank=CAPACITY), TritonExperts(layer), layer)
    kernel.stage_clock = StageClock()  # as the run attaches one: its events are recorded during the warm-ups

    data = torch.Generator().manual_seed(1000 * index + rank)
    tokens = tokens_of(rank)
    x = torch.randn(tokens, HIDDEN, generator=data).to(torch.bfloat16)
    ids = torch.rand(tokens, NUM_EXPERTS, generator=data).argsort(dim=1)[:, :TOP_K].to(torch.int32)
    weights = torch.rand(tokens, TOP_K, generator=data) + 0.1
    weights = (weights / weights.sum(dim=1, keepdim=True)).to(torch.float32)
    xd, idsd, weightsd = x.to(device), ids.to(device), weights.to(device)

    def call() -> torch.Tensor:
        return kernel(xd, w1r, w2r, weightsd, idsd, scales=scales_r, expert_map=expert_map, check_values=False)

    timer = KernelTimer(REPEATS)
    out, _ = timer(call, key=(id(kernel), tuple(x.shape[1:]), x.dtype), on_cuda=True,
                   capture=lambda c: capture_in_step(c, kernel, device, REPEATS))
    torch.cuda.synchronize(device)
    replayed = out.float().cpu()
    os.environ[dispatch_graphs.ENV] = "0"
    try:
        plain = call().float().cpu()
    finally:
        os.environ.pop(dispatch_graphs.ENV, None)
    ref = moe_reference(x.double(), w1.double(), w2.double(), weights, ids, activation=layer.activation.value)
    scale = max(float(ref.abs().max()), 1e-12)
    return {
        "scenario": f"capture-in-step-layer{index}", "rank": rank, "tokens": tokens, "replayed": timer.replayed,
        "finite": bool(torch.isfinite(replayed).all()),
        "ref_err": float((replayed.double() - ref).abs().max()) / scale,
        "plain_err": float((replayed - plain).abs().max()) / scale,
    }


def run_layers(ctx, results: list[dict]) -> None:
    for index in range(LAYERS):
        results.append(run_layer(index, ctx.rank, ctx.world_size, ctx.device))


def main(argv: list[str]) -> int:
    return worker_main(Path(argv[0]), "capture-in-step", run_layers)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
