"""Temporary probe: per-kernel times of chosen Gluon configs, for the tree given by --src."""
import argparse, json, sys
ap = argparse.ArgumentParser()
ap.add_argument("--src", required=True)
ap.add_argument("--tokens", type=int, default=8192)
args = ap.parse_args()
sys.path.insert(0, args.src)
import torch
from moe_fsm.kernels.triton_moe.config import GemmConfig, MoEConfig
from moe_fsm.kernels.triton_moe.tuning import NAMED_SHAPES, layer_fn, make_weights, routings, time_graph
from torch.profiler import ProfilerActivity, profile

def cfg(bm, warps, stages, g, ws, pers):
    f = dict(warp_specialize=ws, persistent=pers)
    return MoEConfig(bm, GemmConfig(64, 128, g, warps, stages, **f), GemmConfig(128, 128, g, warps, stages, **f), False, True, True, True)

shape = NAMED_SHAPES["deepseek-v3-fp8-block"]
weights = make_weights(shape)
t = args.tokens
routes = routings(t, shape.num_experts, shape.top_k, 2, seed=t)
gen = torch.Generator(device="cuda").manual_seed(t)
inputs = [(torch.randn(t, shape.hidden, device="cuda", dtype=torch.bfloat16, generator=gen), g, ids) for g, ids in routes]
import os
todo = [(f"ws-pers s{st} g{g}", cfg(128, 8, st, g, True, True)) for st, g in [(4, 8), (4, 16), (4, 32), (3, 16)]] + [("ws s4 g16", cfg(128, 8, 4, 16, True, False))]
for label, c in todo:
    fn = layer_fn(shape, weights, c)
    fn(*inputs[0]); torch.cuda.synchronize()
    us = time_graph(fn, inputs, 40.0)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(*inputs[0]); torch.cuda.synchronize()
    ev = [(e.name[:28], round(e.device_time_total, 1)) for e in prof.events() if e.device_type.name == "CUDA"]
    print(args.src, label, round(us, 1), "us", round(6.0 * t * shape.top_k * shape.intermediate * shape.hidden / us / 1e6, 1), "TF/s", ev, flush=True)
