"""The torch grouped-GEMM experts on a CUDA device, against the float64 reference.

Same tolerances as test_triton_moe: 1e-2 for bf16; FP8 row-wise 8e-2 against the
reference on dequantized weights (two e4m3 activation quantizations).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

from moe_fsm.experts.grouped_mm_experts import GroupedMMExperts, grouped_mm_eligibility  # noqa: E402
from moe_fsm.inputs.layer import MoELayer  # noqa: E402
from moe_fsm.inputs.quant import QuantScheme  # noqa: E402
from moe_fsm.kernels.grouped_mm import grouped_mm_moe  # noqa: E402
from moe_fsm.modular.interfaces import ExpertScales  # noqa: E402

from .moe_gpu_cases import (  # noqa: E402
    MIXTRAL_8X7B,
    QWEN3_30B,
    float_weights,
    hidden_states,
    poison_allocator,
    quantize_rowwise,
    reference,
    rel_err,
    routing,
)

CAPABILITY = torch.cuda.get_device_capability() if torch.cuda.is_available() else None


def _eligible(quant: QuantScheme) -> None:
    ok, reason = grouped_mm_eligibility(MoELayer(quant=quant), CAPABILITY, torch.__version__)
    if not ok:
        pytest.skip(reason)


@pytest.mark.parametrize(
    "shape,num_tokens", [(QWEN3_30B, 1), (QWEN3_30B, 37), (QWEN3_30B, 300), (MIXTRAL_8X7B, 37)], ids=lambda v: getattr(v, "name", str(v))
)
def test_bf16_matches_reference(shape, num_tokens):
    _eligible(QuantScheme.unquantized())
    w1, w2 = float_weights(shape)
    x = hidden_states(num_tokens, shape.hidden, torch.bfloat16, seed=num_tokens)
    g, ids = routing(num_tokens, shape.num_experts, shape.top_k, seed=num_tokens)
    ids[::4, 0] = -1  # slots another rank owns
    poison_allocator()
    out = grouped_mm_moe(x, w1, w2, g, ids, activation="swigluoai", swiglu_limit=0.5)
    assert rel_err(out, reference(x, w1, w2, g, ids, activation="swigluoai", swiglu_limit=0.5)) < 1e-2


@pytest.mark.parametrize("weight,activation", [("channel", "token"), ("tensor", "tensor")])
def test_fp8_rowwise(weight, activation):
    quant = QuantScheme.fp8(weight, activation)
    _eligible(quant)
    shape, num_tokens = QWEN3_30B, 37
    w1, w2 = float_weights(shape)
    w1q, w2q, s1, s2, deq = quantize_rowwise(w1, w2, weight)
    x = hidden_states(num_tokens, shape.hidden, torch.bfloat16, seed=21)
    g, ids = routing(num_tokens, shape.num_experts, shape.top_k, seed=21)
    out = grouped_mm_moe(x, w1q, w2q, g, ids, fp8_activation=activation, w1_scale=s1, w2_scale=s2)
    assert rel_err(out, reference(x, w1q, w2q, g, ids, dequantize=deq)) < 8e-2


def test_experts_through_modular_kernel():
    from moe_fsm.modular.kernel import ModularKernel
    from moe_fsm.prepare_finalize.local import LocalPrepareFinalize

    _eligible(QuantScheme.unquantized())
    shape, num_tokens = QWEN3_30B, 37
    layer = MoELayer(
        num_experts=shape.num_experts, top_k=shape.top_k, hidden_size=shape.hidden, intermediate_size=shape.intermediate
    )
    w1, w2 = float_weights(shape)
    x = hidden_states(num_tokens, shape.hidden, torch.bfloat16, seed=22)
    g, ids = routing(num_tokens, shape.num_experts, shape.top_k, seed=22)
    out = ModularKernel(LocalPrepareFinalize(), GroupedMMExperts(layer), layer)(x, w1, w2, g, ids, scales=ExpertScales())
    assert rel_err(out, reference(x, w1, w2, g, ids)) < 1e-2


def test_eligibility_on_this_device_names_its_reason():
    ok, reason = grouped_mm_eligibility(MoELayer(quant=QuantScheme.fp8("block", "group")), CAPABILITY, torch.__version__)
    assert not ok
    if CAPABILITY >= (9, 0):
        assert "row-wise" in reason
