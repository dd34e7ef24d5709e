"""One rank of the CUDA-graph test: dispatch + Triton experts + combine, captured once, replayed.

    python tests/distributed/graph_worker.py OUT_DIR [QUANT ...]

Needs one GPU per rank and NCCL (``test_graph_capture.py`` starts it). For each
format and quantization (``none``, ``fp8_block_group``) the rank builds the P/F
that sends fixed blocks in that format with its Triton experts (Batched: the
fixed-capacity all-to-all and BatchedTritonExperts; Standard: the all-to-all P/F
with ``max_tokens_per_rank`` and TritonExperts), runs one eager call
(which also agrees on the row layout and checks the expert map, the only steps
that wait on the host), captures prepare -> experts -> finalize in a CUDA graph
with static input buffers, then copies new tokens and routings (uniform, hot
experts, every token on the last rank's experts) into those buffers, replays,
and compares each replay with the float64 reference on the same tokens and
with an eager call of the same P/F. Ranks hold different numbers of tokens
(a graph is captured per batch size, as engines capture per size). Results go
to ``OUT_DIR/results.rank{r}.json``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dist_harness import worker_main  # noqa: E402

from moe_fsm.distributed import ExpertPlacement, shard_experts  # noqa: E402
from moe_fsm.experts.triton_experts import BatchedTritonExperts, TritonExperts  # noqa: E402
from moe_fsm.inputs.layer import MoELayer  # noqa: E402
from moe_fsm.inputs.quant import QuantScheme  # noqa: E402
from moe_fsm.kernels.reference import moe_reference  # noqa: E402
from moe_fsm.modular.interfaces import ExpertScales  # noqa: E402
from moe_fsm.prepare_finalize.all2all import AllToAllPrepareFinalize  # noqa: E402
from moe_fsm.prepare_finalize.fixed_all2all import FixedCapacityAllToAllPrepareFinalize  # noqa: E402
from moe_fsm.quantize.weights import dequantize_weights, quantize_experts  # noqa: E402

NUM_EXPERTS, HIDDEN, INTERMEDIATE, TOP_K, CAPACITY = 16, 256, 128, 4, 16
QUANT = {"none": QuantScheme.unquantized, "fp8_block_group": lambda: QuantScheme.fp8("block", "group")}
TOLERANCE = {"none": 2e-2, "fp8_block_group": 0.1}  # relative to max |reference|: bf16, and e4m3 activations
ROUTINGS = ("uniform", "hot", "last_rank")
# Per activation format: the P/F that sends fixed blocks of CAPACITY rows (no host read), and its experts.
FORMATS = {
    "batched": (lambda placement: FixedCapacityAllToAllPrepareFinalize(placement, max_tokens_per_rank=CAPACITY),
                BatchedTritonExperts),
    "standard": (lambda placement: AllToAllPrepareFinalize(placement, max_tokens_per_rank=CAPACITY), TritonExperts),
}


def routing(kind: str, tokens: int, world: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    scores = torch.rand(tokens, NUM_EXPERTS, generator=gen)
    if kind == "hot":
        scores[:, 0] += 2.0
        scores[:, 1] += 0.8
    elif kind == "last_rank":
        last = ExpertPlacement(NUM_EXPERTS, world, world - 1)
        scores[:, last.local_start : last.local_end] += 2.0
    ids = scores.argsort(dim=1, descending=True)[:, :TOP_K].to(torch.int32)
    weights = torch.rand(tokens, TOP_K, generator=gen) + 0.1
    return ids, (weights / weights.sum(dim=1, keepdim=True)).to(torch.float32)


def run_case(fmt: str, quant: str, rank: int, world: int, device: torch.device) -> list[dict]:
    layer = MoELayer(quant=QUANT[quant](), num_experts=NUM_EXPERTS, top_k=TOP_K, hidden_size=HIDDEN,
                     intermediate_size=INTERMEDIATE, dtype="bfloat16")
    gen = torch.Generator().manual_seed(7)  # the same weights on every rank
    w1 = torch.randn(NUM_EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=gen) * 0.1
    w2 = torch.randn(NUM_EXPERTS, HIDDEN, INTERMEDIATE, generator=gen) * 0.1
    if layer.quant.weight is None:
        w1, w2 = w1.to(torch.bfloat16), w2.to(torch.bfloat16)
    w1q, w2q, scales = quantize_experts(w1, w2, layer)
    w1d, w2d = dequantize_weights(w1q, w2q, scales, layer.quant, torch.float64)
    placement = ExpertPlacement(NUM_EXPERTS, world, rank)
    w1r, w2r, scales_r = shard_experts(w1q, w2q, scales, placement)
    w1r, w2r = w1r.to(device), w2r.to(device)
    scales_r = ExpertScales(**{k: None if v is None else v.to(device) for k, v in vars(scales_r).items()})
    expert_map = placement.expert_map(device)

    make_pf, experts_class = FORMATS[fmt]
    pf = make_pf(placement)
    experts = experts_class(layer)
    quantize = experts.input_quantizer(scales_r)
    tokens = CAPACITY - 3 * rank  # ranks hold different batch sizes
    hidden = torch.zeros(tokens, HIDDEN, dtype=torch.bfloat16, device=device)
    ids = torch.zeros(tokens, TOP_K, dtype=torch.int32, device=device)
    weights = torch.zeros(tokens, TOP_K, dtype=torch.float32, device=device)
    output = torch.empty(tokens, HIDDEN, dtype=torch.bfloat16, device=device)

    def layer_call(out: torch.Tensor) -> None:
        prepared = pf.prepare(hidden, weights, ids, num_experts=NUM_EXPERTS, expert_map=expert_map,
                              apply_router_weight_on_input=False, quantize=quantize)
        expert_output = experts.apply(prepared, w1r, w2r, scales_r, apply_router_weight_on_input=False)
        pf.finalize(out, expert_output, prepared, topk_weights=prepared.topk_weights, topk_ids=prepared.topk_ids,
                    apply_router_weight_on_input=False, reduce=experts.weight_and_reduce)

    data_gen = torch.Generator().manual_seed(100 + rank)

    def load(kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = torch.randn(tokens, HIDDEN, generator=data_gen).to(torch.bfloat16)
        i, w = routing(kind, tokens, world, data_gen)
        hidden.copy_(x)
        ids.copy_(i)
        weights.copy_(w)
        return x, i, w

    load("uniform")
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            layer_call(output)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layer_call(output)

    results = []
    eager = torch.empty_like(output)
    for kind in ROUTINGS:
        x, i, w = load(kind)
        output.fill_(float("nan"))  # an element the replay does not write fails the comparison
        graph.replay()
        torch.cuda.synchronize(device)
        replayed = output.float().cpu()
        layer_call(eager)
        torch.cuda.synchronize(device)
        ref = moe_reference(x.double(), w1d, w2d, w, i, activation=layer.activation.value)
        scale = max(float(ref.abs().max()), 1e-12)
        results.append({
            "scenario": f"graph-{fmt}-{quant}-{kind}",
            "rank": rank,
            "tokens": tokens,
            "ref_err": float((replayed.double() - ref).abs().max()) / scale,
            "eager_err": float((replayed - eager.float().cpu()).abs().max()) / scale,
            "tol": TOLERANCE[quant],
        })
    return results


def main(argv: list[str]) -> int:
    quants = argv[1:] or list(QUANT)

    def run_cases(ctx, results: list[dict]) -> None:
        for fmt in FORMATS:
            for quant in quants:
                results += run_case(fmt, quant, ctx.rank, ctx.world_size, ctx.device)

    return worker_main(Path(argv[0]), "graph", run_cases)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
