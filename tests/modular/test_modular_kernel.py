"""The modular kernel end to end on the edges: zero/one token, idle experts, top-k extremes,
non-contiguous inputs, expert maps, batched capacity. Tolerances as in tests/kernels/test_torch_experts.py."""

from __future__ import annotations

import pytest
import torch
from modular_cases import (
    FORMATS, REFERENCE_TOL, SCHEMES, kernel_for, layer_for, make_call, rel_fro, seed_for, single_thread,  # noqa: F401
)

from moe_fsm.errors import KernelInputError
from moe_fsm.inputs.quant import QuantFamily
from moe_fsm.modular.interfaces import ExpertScales
from moe_fsm.modular.kernel import ModularKernel
from moe_fsm.experts.torch_experts import TorchBatchedExperts
from moe_fsm.prepare_finalize.local import LocalBatchedPrepareFinalize

scheme_ids = lambda s: s.describe()  # noqa: E731


def check(out: torch.Tensor, call, expected: torch.Tensor | None = None) -> None:
    assert out.shape == call.hidden.shape and out.dtype == call.hidden.dtype
    assert torch.isfinite(out).all()
    expected = call.reference() if expected is None else expected
    assert rel_fro(out, expected) <= REFERENCE_TOL[call.layer.quant.family.value]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("scheme", SCHEMES, ids=scheme_ids)
def test_zero_tokens_give_an_empty_output(fmt, scheme) -> None:
    layer = layer_for(scheme)
    call = make_call(layer, 0, seed_for("zero", fmt, scheme))
    out = kernel_for(layer, fmt)(*call.args(), scales=call.scales)
    assert out.shape == (0, layer.hidden_size) and out.dtype == torch.float32


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("scheme", SCHEMES, ids=scheme_ids)
def test_one_token(fmt, scheme) -> None:
    layer = layer_for(scheme)
    call = make_call(layer, 1, seed_for("one", fmt, scheme))
    check(kernel_for(layer, fmt)(*call.args(), scales=call.scales), call)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("scheme", SCHEMES, ids=scheme_ids)
def test_experts_without_tokens(fmt, scheme) -> None:
    layer = layer_for(scheme)
    call = make_call(layer, 16, seed_for("idle", fmt, scheme), experts_used=2)
    assert set(call.topk_ids.unique().tolist()) == {0, 1}
    check(kernel_for(layer, fmt)(*call.args(), scales=call.scales), call)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("top_k", [1, 6])
@pytest.mark.parametrize("scheme", [SCHEMES[0], SCHEMES[1], SCHEMES[4]], ids=scheme_ids)
def test_top_k_one_and_all_experts(fmt, top_k, scheme) -> None:
    layer = layer_for(scheme, top_k=top_k)
    call = make_call(layer, 12, seed_for("topk", fmt, top_k, scheme))
    check(kernel_for(layer, fmt)(*call.args(), scales=call.scales), call)


def _strided(t: torch.Tensor) -> torch.Tensor:
    """The same values in a non-contiguous layout (column-major storage of the last two dims)."""
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("scheme", SCHEMES, ids=scheme_ids)
def test_non_contiguous_inputs(fmt, scheme) -> None:
    layer = layer_for(scheme)
    call = make_call(layer, 10, seed_for("strided", fmt, scheme))
    kernel = kernel_for(layer, fmt)
    expected = kernel(*call.args(), scales=call.scales)
    wide = torch.zeros(10, 2 * layer.hidden_size)
    wide[:, ::2] = call.hidden
    hidden = wide[:, ::2]
    scales = ExpertScales(**{k: (_strided(v) if v is not None and v.dim() >= 2 else v) for k, v in vars(call.scales).items()})
    args = (hidden, _strided(call.w1), _strided(call.w2), _strided(call.topk_weights), _strided(call.topk_ids))
    assert not any(t.is_contiguous() for t in args)
    out = kernel(*args, scales=scales)
    if scheme.family is QuantFamily.UNQUANTIZED:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    else:
        # Strided weights may take another GEMM kernel: float32 sums differ in the last
        # bits, which can move a value across an e4m3/e2m1 rounding boundary.
        assert rel_fro(out, expected.double()) <= 5e-3
    check(out, call)


def _local(t, local: list[int]):
    return None if t is None or t.dim() == 0 or t.shape[0] == 1 else t[local]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("scheme", [SCHEMES[0], SCHEMES[1], SCHEMES[3], SCHEMES[4]], ids=scheme_ids)
def test_expert_map_computes_only_local_experts(fmt, scheme) -> None:
    """One EP rank holding experts 1, 3 and 4 of 6: the output is their share of the sum."""
    layer = layer_for(scheme)
    call = make_call(layer, 20, seed_for("ep", fmt, scheme))
    local = [1, 3, 4]
    expert_map = torch.full((6,), -1, dtype=torch.int64)
    expert_map[local] = torch.arange(3)
    fields = {k: v for k, v in vars(call.scales).items()}
    for name in ("w1_scale", "w2_scale", "w1_global_scale", "w2_global_scale"):
        fields[name] = _local(fields[name], local)
    out = kernel_for(layer, fmt)(call.hidden, call.w1[local], call.w2[local], call.topk_weights, call.topk_ids,
                                 scales=ExpertScales(**fields), expert_map=expert_map)
    is_local = torch.isin(call.topk_ids, torch.tensor(local))
    check(out, call, call.reference(topk_weights=call.topk_weights * is_local))


@pytest.mark.parametrize("fmt", FORMATS)
def test_skipped_slots_contribute_nothing(fmt) -> None:
    layer = layer_for()
    call = make_call(layer, 12, seed_for("skip", fmt))
    ids = call.topk_ids.clone()
    ids[::3, 1] = -1
    ids[5, :] = -1
    out = kernel_for(layer, fmt)(call.hidden, call.w1, call.w2, call.topk_weights, ids, scales=call.scales,
                                 expert_map=torch.arange(6))
    kept = ids >= 0
    check(out, call, call.reference(topk_weights=call.topk_weights * kept, topk_ids=ids.clamp(min=0)))
    assert out[5].abs().max() == 0


def test_batched_capacity() -> None:
    layer = layer_for()
    call = make_call(layer, 12, seed_for("capacity"))
    roomy = ModularKernel(LocalBatchedPrepareFinalize(max_num_tokens=64), TorchBatchedExperts(layer), layer)
    check(roomy(*call.args()), call)
    busiest = int(torch.bincount(call.topk_ids.reshape(-1)).max())
    tight = ModularKernel(LocalBatchedPrepareFinalize(max_num_tokens=busiest - 1), TorchBatchedExperts(layer), layer)
    with pytest.raises(KernelInputError, match=f"an expert received {busiest} tokens, more than this prepare/finalize's max_num_tokens={busiest - 1}"):
        tight(*call.args())
    with pytest.raises(KernelInputError, match="max_num_tokens must be a positive integer or None; got 0"):
        LocalBatchedPrepareFinalize(max_num_tokens=0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_inputs_are_not_modified(fmt) -> None:
    layer = layer_for(router_weight_on_input=True, top_k=1)
    call = make_call(layer, 8, seed_for("pure", fmt))
    before = [t.clone() for t in call.args()]
    kernel_for(layer, fmt)(*call.args(), scales=call.scales)
    assert all(torch.equal(a, b) for a, b in zip(call.args(), before))


def test_kernel_name_joins_both_sides() -> None:
    assert kernel_for(layer_for()).name == "LocalPrepareFinalize+TorchExperts"
