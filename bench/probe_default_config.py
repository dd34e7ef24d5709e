"""The default config (a shape no table holds) at prefill sizes, against the same config with the top-k sum folded
the other way and against the prefill tile the tuner keeps picking, on one GPU.

For each named shape at each token count it times, as ``moe-fsm tune`` does (``tuning.time_graph``: CUDA-graph
replays on fresh routings, L2 flushed), four configs: ``default_config``, that config with ``fold_topk`` flipped,
the large tile (w1 128 / w2 256, 8 warps, 4 stages, group 16; block_m 64 for block FP8) and the large tile with
the folded sum. What ``config.default_config`` takes from 512 tokens on comes from these figures.

    python bench/probe_default_config.py [--tokens 2048 8192] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from moe_fsm.kernels.triton_moe.config import GemmConfig, MoEConfig, default_config  # noqa: E402
from moe_fsm.kernels.triton_moe.tuning import (  # noqa: E402
    NAMED_SHAPES,
    layer_fn,
    make_weights,
    precompile,
    replays_per_graph,
    routings,
    time_graph,
)


def variants(shape, num_tokens: int) -> list[tuple[str, MoEConfig]]:
    default = default_config(shape.num_experts, shape.intermediate, shape.hidden, shape.top_k, num_tokens,
                             block_fp8=shape.fp8 == "block", fp8=shape.fp8 is not None)
    block_k = 128 if shape.fp8 else 64
    large = MoEConfig(64 if shape.fp8 == "block" else 128, GemmConfig(128, block_k, 16, 8, 4),
                      GemmConfig(256, block_k, 16, 8, 4))
    return [("default", default), ("default, fold flipped", replace(default, fold_topk=not default.fold_topk)),
            ("large tile", large), ("large tile + fold", replace(large, fold_topk=True))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", nargs="*", type=int, default=[2048, 8192])
    ap.add_argument("--workers", type=int, default=14)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("probe_default_config.py needs a CUDA device")
    plan = {(name, t): variants(shape, t) for name, shape in NAMED_SHAPES.items() for t in args.tokens}
    for failure in precompile([(NAMED_SHAPES[n], t, c) for (n, t), vs in plan.items() for _, c in vs], args.workers):
        print("  cannot build:", failure, flush=True)
    rows = []
    for name, shape in NAMED_SHAPES.items():
        weights = make_weights(shape)
        for t in args.tokens:
            routes = routings(t, shape.num_experts, shape.top_k, replays_per_graph(t), seed=t)
            gen = torch.Generator(device="cuda").manual_seed(t + 1)
            inputs = [(torch.randn(t, shape.hidden, device="cuda", dtype=torch.bfloat16, generator=gen), g, ids)
                      for g, ids in routes]
            for label, config in plan[(name, t)]:
                us = time_graph(layer_fn(shape, weights, config), inputs, 60.0)
                rows.append(dict(shape=name, tokens=t, label=label, us=round(us, 1), config=config.to_json()))
                print(f"{name:28s} {t:5d} {label:22s} {us:9.1f} us  fold={config.fold_topk}", flush=True)
        del weights
        torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
