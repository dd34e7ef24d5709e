"""One rank of the dispatch-graphs test: the eager ``max_tokens_per_rank`` call, replayed against the plain call.

    python tests/distributed/dispatch_graphs_worker.py OUT_DIR

Needs one GPU per rank and NCCL (``test_dispatch_graphs.py`` starts it). For each payload (bf16; FP8 per 1x128
group, quantized by the send-row kernel) and each call of a sequence of token counts that grows and shrinks (the
capacity, fewer, none, the capacity again: the padding rows' ids must be -1 again after a shrink), the same P/F
runs prepare and finalize twice on the same inputs, once with ``MOE_FSM_DISPATCH_GRAPHS=0`` (the plain path) and
once replayed, every output poisoned first (NaN, or 0xFF bytes); the prepared tokens and the outputs must be equal
bit for bit. The replayed calls are counted: each must replay its two graphs and call none of the plain path's
wire kernels or collectives from Python. Then the fallback for tokens still held: a second prepare while the
first one's tokens are held runs the plain path and leaves those tokens as they were. The combine is also checked
against a float64 reference (the experts' output stand-in is each received row scaled per rank, so every token's
output is a known sum). Each payload has a P/F of its own, made after the previous one was dropped with its graphs
while the lane still keeps that P/F's last tokens: its captures join the lane's memory pool, which must outlive
every P/F's graphs. Results go to ``OUT_DIR/results.rank{r}.json``.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dist_harness import worker_main  # noqa: E402

from moe_fsm.distributed import ExpertPlacement  # noqa: E402
from moe_fsm.modular.interfaces import DynamicFP8RowQuantizer, WeightAndReduce  # noqa: E402
from moe_fsm.prepare_finalize import all2all as all2all_module  # noqa: E402
from moe_fsm.prepare_finalize import dispatch_graphs  # noqa: E402
from moe_fsm.prepare_finalize.all2all import AllToAllPrepareFinalize  # noqa: E402

NUM_EXPERTS, HIDDEN, TOP_K, CAPACITY = 32, 512, 4, 48
TOKEN_SEQUENCE = (CAPACITY, 20, 33, 0, 7, CAPACITY)  # per call; rank r holds max(0, n - 3r) tokens
PLAIN_STEPS = ("route", "send_rows", "all_to_all_equal", "local_ids", "combine_returned")


def quantizer(name: str):
    if name == "none":
        return None
    from moe_fsm.kernels.triton_moe import quantize_activation

    return DynamicFP8RowQuantizer("group", lambda hidden: quantize_activation(hidden, "group"))


def routing(tokens: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    scores = torch.rand(tokens, NUM_EXPERTS, generator=gen)
    ids = scores.argsort(dim=1, descending=True)[:, :TOP_K].to(torch.int32)
    weights = torch.rand(tokens, TOP_K, generator=gen) + 0.1
    return ids, (weights / weights.sum(dim=1, keepdim=True)).to(torch.float32)


class Counter:
    """Calls of the plain path's steps (looked up by all2all at call time) and of CUDA-graph replays."""

    def __init__(self) -> None:
        self.calls = {name: 0 for name in (*PLAIN_STEPS, "replay")}
        self._restore = []
        for name in PLAIN_STEPS:
            original = getattr(all2all_module, name)
            self._restore.append((all2all_module, name, original))
            setattr(all2all_module, name, self._wrap(name, original))
        original_replay = torch.cuda.CUDAGraph.replay
        self._restore.append((torch.cuda.CUDAGraph, "replay", original_replay))
        torch.cuda.CUDAGraph.replay = self._wrap("replay", original_replay)

    def _wrap(self, name, fn):
        def wrapped(*args, **kwargs):
            self.calls[name] += 1
            return fn(*args, **kwargs)
        return wrapped

    def take(self) -> dict:
        taken = dict(self.calls)
        for name in self.calls:
            self.calls[name] = 0
        return taken

    def close(self) -> None:
        for owner, name, original in self._restore:
            setattr(owner, name, original)


def dequantized(rows: torch.Tensor, scale) -> torch.Tensor:
    """float32 rows: bf16 as they are, FP8 times their 1x128-group scales."""
    if scale is None:
        return rows.float()
    groups = scale.shape[1]
    return (rows.float().view(rows.shape[0], groups, -1) * scale.float().view(rows.shape[0], groups, 1)).view(rows.shape)


def same_bytes(a, b) -> bool:
    """Bit-identical (NaN payloads included), or both None."""
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def poison_like(t: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(t)
    if out.is_floating_point() and out.element_size() > 1:
        return out.fill_(float("nan"))
    return out.view(torch.uint8).fill_(0xFF).view(out.dtype) if out.dtype != torch.bool else out.fill_(True)


def run_payload(quant: str, rank: int, world: int, device: torch.device) -> list[dict]:
    placement = ExpertPlacement(NUM_EXPERTS, world, rank)
    expert_map = placement.expert_map(device)
    pf = AllToAllPrepareFinalize(placement, max_tokens_per_rank=CAPACITY)
    quantize = quantizer(quant)
    gen = torch.Generator().manual_seed(1000 + rank)
    results = []
    counter = Counter()

    def call(hidden, ids, weights, graphs: bool):
        os.environ[dispatch_graphs.ENV] = "1" if graphs else "0"
        prepared = pf.prepare(hidden, weights, ids, num_experts=NUM_EXPERTS, expert_map=expert_map,
                              apply_router_weight_on_input=False, quantize=quantize)
        # The experts' output stand-in: each received row (dequantized) times 1 + this rank, so the sums are known.
        expert_output = (dequantized(prepared.hidden, prepared.scale) * (1 + rank)).to(torch.bfloat16)
        output = poison_like(hidden)
        pf.finalize(output, expert_output, prepared, topk_weights=prepared.topk_weights, topk_ids=prepared.topk_ids,
                    apply_router_weight_on_input=False, reduce=WeightAndReduce.EXPERTS)
        snapshot = [None if t is None else t.clone() for t in
                    (prepared.hidden, prepared.scale, prepared.topk_ids, prepared.topk_weights)]
        return snapshot, output, type(prepared.state).__name__

    try:
        for index, n in enumerate(TOKEN_SEQUENCE):
            tokens = max(0, n - 3 * rank)
            hidden = torch.randn(tokens, HIDDEN, generator=gen).to(torch.bfloat16).to(device)
            ids, weights = (t.to(device) for t in routing(tokens, gen))
            counter.take()
            plain, plain_out, plain_state = call(hidden, ids, weights, graphs=False)
            plain_calls = counter.take()
            graphed, graph_out, graph_state = call(hidden, ids, weights, graphs=True)
            graph_calls = counter.take()
            torch.cuda.synchronize(device)
            same_prepared = all(same_bytes(a, b) for a, b in zip(plain, graphed))
            # float64 reference of the combine: token t's output is the sum over the ranks d it went to of (1 + d)
            # times its row as it travelled (FP8: quantized per 1x128 group, as the send-row kernel does)
            owner = placement.owner_table(device)
            reached = torch.zeros(tokens, world, dtype=torch.bool, device=device)
            if tokens:
                reached.scatter_(1, owner[ids.long()].long(), True)
            factor = (reached.double() * torch.arange(1, world + 1, dtype=torch.float64, device=device)).sum(1)
            sent = dequantized(*quantize(hidden)) if quantize is not None and tokens else hidden.float()
            reference = sent.double() * factor[:, None]
            ref_err = float((graph_out.double() - reference).abs().max()) if tokens else 0.0
            ref_tol = 1e-2 * max(float(reference.abs().max()) if tokens else 0.0, 1e-12)
            results.append({
                "scenario": f"graphs-{quant}-n{n}", "call": index, "rank": rank, "tokens": tokens,
                "prepared_equal": same_prepared,
                "output_equal": same_bytes(plain_out, graph_out),
                "output_finite": bool(torch.isfinite(graph_out.float()).all()),
                "plain_state": plain_state, "graph_state": graph_state,
                "plain_calls": plain_calls, "graph_calls": graph_calls,
                "ref_err": ref_err, "ref_tol": ref_tol,
            })

        # Tokens a replay handed out and the caller still holds are never overwritten: the next prepare is plain.
        os.environ[dispatch_graphs.ENV] = "1"
        tokens = max(0, CAPACITY - 3 * rank)
        hidden = torch.randn(tokens, HIDDEN, generator=gen).to(torch.bfloat16).to(device)
        ids, weights = (t.to(device) for t in routing(tokens, gen))
        held = pf.prepare(hidden, weights, ids, num_experts=NUM_EXPERTS, expert_map=expert_map,
                          apply_router_weight_on_input=False, quantize=quantize)
        kept = held.hidden.clone()
        other = torch.randn(tokens, HIDDEN, generator=gen).to(torch.bfloat16).to(device)
        second = pf.prepare(other, weights, ids, num_experts=NUM_EXPERTS, expert_map=expert_map,
                            apply_router_weight_on_input=False, quantize=quantize)
        torch.cuda.synchronize(device)
        results.append({
            "scenario": f"graphs-{quant}-held", "rank": rank, "tokens": tokens,
            "first_state": type(held.state).__name__, "second_state": type(second.state).__name__,
            "held_unchanged": same_bytes(kept, held.hidden),
        })
        for prepared in (second, held):  # finish both calls in the same order on every rank
            out = torch.empty_like(hidden)
            pf.finalize(out, prepared.hidden.float().to(torch.bfloat16) * 0, prepared,
                        topk_weights=prepared.topk_weights, topk_ids=prepared.topk_ids,
                        apply_router_weight_on_input=False, reduce=WeightAndReduce.EXPERTS)
    finally:
        counter.close()
        os.environ.pop(dispatch_graphs.ENV, None)
    return results


def main(argv: list[str]) -> int:
    def run_payloads(ctx, results: list[dict]) -> None:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for quant in ("none", "group"):
                results += run_payload(quant, ctx.rank, ctx.world_size, ctx.device)
        # a capture that failed makes its calls run plainly, and says why only in a warning
        failed = [str(w.message) for w in caught if "could not be captured" in str(w.message)]
        if failed:
            results.append({"scenario": "graphs", "rank": ctx.rank, "error": "; ".join(failed)})

    return worker_main(Path(argv[0]), "graphs", run_payloads)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
