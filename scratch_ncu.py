"""Temporary (not committed): two eager calls of the tuned Gluon DeepSeek-V3 layer at 8192 tokens, for ncu."""
import torch
from moe_fsm.kernels.triton_moe.config import GemmConfig, MoEConfig
from moe_fsm.kernels.triton_moe.tuning import NAMED_SHAPES, layer_fn, make_weights, routings

f = dict(warp_specialize=True, persistent=True)
config = MoEConfig(128, GemmConfig(64, 128, 8, 8, 4, **f), GemmConfig(128, 128, 8, 8, 4, **f), False, True, True, True)
shape = NAMED_SHAPES["deepseek-v3-fp8-block"]
weights = make_weights(shape)
t = 8192
(g, ids), = routings(t, shape.num_experts, shape.top_k, 1, seed=t)
x = torch.randn(t, shape.hidden, device="cuda", dtype=torch.bfloat16)
fn = layer_fn(shape, weights, config)
for _ in range(2):
    fn(x, g, ids)
torch.cuda.synchronize()
