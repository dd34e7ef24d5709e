"""Local prepare/finalize and the shared weight-and-reduce helpers, with NaN-poisoned outputs."""

from __future__ import annotations

import pytest
import torch
from modular_cases import seed_for, single_thread  # noqa: F401

from moe_fsm.errors import KernelInputError
from moe_fsm.kernels import fp8
from moe_fsm.modular.interfaces import ActivationFormat, PreparedTokens, WeightAndReduce
from moe_fsm.prepare_finalize.local import LocalBatchedPrepareFinalize, LocalPrepareFinalize
from moe_fsm.prepare_finalize.reduce import apply_router_weight_to_input, reduce_contiguous, reduce_standard


def routing(m: int, top_k: int, e: int, seed: object) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed_for(seed))
    hidden = torch.randn(m, 8, generator=gen)
    ids = torch.argsort(torch.rand(m, e, generator=gen), dim=1)[:, :top_k]
    return hidden, torch.rand(m, top_k, generator=gen), ids


def poisoned(m: int, k: int = 8) -> torch.Tensor:
    return torch.full((m, k), float("nan"))


def prepare(pf, hidden, weights, ids, **kw):
    options = dict(num_experts=4, expert_map=None, apply_router_weight_on_input=False, quantize=None)
    return pf.prepare(hidden, weights, ids, **{**options, **kw})


def test_formats() -> None:
    assert LocalPrepareFinalize().activation_format is ActivationFormat.STANDARD
    assert LocalBatchedPrepareFinalize().activation_format is ActivationFormat.BATCHED


def test_standard_prepare_quantizes_and_maps_ids() -> None:
    hidden, weights, ids = routing(5, 2, 4, "std-prepare")
    prepared = prepare(LocalPrepareFinalize(), hidden, weights, ids, quantize=fp8.quantize_per_token,
                       expert_map=torch.tensor([1, -1, 0, -1]))
    assert prepared.hidden.dtype == fp8.FP8_DTYPE and prepared.scale.shape == (5, 1)
    expected = torch.tensor([1, -1, 0, -1])[ids]
    assert torch.equal(prepared.topk_ids, expected)


def test_standard_finalize_weights_and_sums_every_row() -> None:
    hidden, weights, ids = routing(6, 3, 4, "std-finalize")
    expert_output = torch.randn(6, 3, 8)
    output = poisoned(6)
    pf = LocalPrepareFinalize()
    prepared = prepare(pf, hidden, weights, ids)
    pf.finalize(output, expert_output, prepared, topk_weights=weights, topk_ids=ids,
                apply_router_weight_on_input=False, reduce=WeightAndReduce.CONTIGUOUS)
    torch.testing.assert_close(output, (expert_output * weights.unsqueeze(-1)).sum(1))
    pf.finalize(output.fill_(float("nan")), expert_output, prepared, topk_weights=weights, topk_ids=ids,
                apply_router_weight_on_input=True, reduce=WeightAndReduce.CONTIGUOUS)
    torch.testing.assert_close(output, expert_output.sum(1))


def test_reduce_standard_copies_reduced_output_and_refuses_batched() -> None:
    output, reduced = poisoned(3), torch.randn(3, 8)
    reduce_standard(WeightAndReduce.EXPERTS, output, reduced, torch.ones(3, 1), apply_router_weight_on_input=False)
    assert torch.equal(output, reduced)
    with pytest.raises(KernelInputError, match="a Standard-format finalize takes reduce 'experts' or 'contiguous'; got 'batched'"):
        reduce_standard(WeightAndReduce.BATCHED, output, reduced, torch.ones(3, 1), apply_router_weight_on_input=False)


def test_reduce_contiguous_sums_in_float32() -> None:
    out = torch.empty(1, 4, dtype=torch.bfloat16)
    per_slot = torch.tensor([[[1.0] * 4, [2.0**-8] * 4, [2.0**-8] * 4]], dtype=torch.bfloat16)
    reduce_contiguous(out, per_slot, torch.ones(1, 3), apply_router_weight_on_input=False)
    assert out.float().tolist() == [[1.0 + 2.0**-7] * 4]


def test_batched_prepare_packs_rows_and_row_scales() -> None:
    hidden, weights, ids = routing(7, 2, 4, "pack")
    prepared = prepare(LocalBatchedPrepareFinalize(), hidden, weights, ids, quantize=fp8.quantize_per_group)
    counts = torch.bincount(ids.reshape(-1), minlength=4)
    assert torch.equal(prepared.expert_num_tokens, counts.to(torch.int32))
    assert prepared.hidden.shape == (4, int(counts.max()), 8) and prepared.scale.shape == (4, int(counts.max()), 1)
    q, scale = fp8.quantize_per_group(hidden)
    for e in range(4):
        tokens = (ids == e).any(1).nonzero().squeeze(1)
        assert torch.equal(prepared.hidden[e, : len(tokens)].float(), q[tokens].float())
        assert torch.equal(prepared.scale[e, : len(tokens)], scale[tokens])
        assert prepared.hidden[e, len(tokens):].float().abs().sum() == 0


def test_batched_prepare_keeps_a_shared_scale() -> None:
    hidden, weights, ids = routing(3, 1, 4, "shared")
    prepared = prepare(LocalBatchedPrepareFinalize(max_num_tokens=5), hidden, weights, ids, quantize=fp8.quantize_per_tensor)
    assert prepared.scale.shape == (1,) and prepared.hidden.shape == (4, 5, 8)


def test_batched_finalize_scatters_back_with_weights() -> None:
    hidden, weights, ids = routing(9, 2, 4, "scatter")
    ids[4] = -1
    pf = LocalBatchedPrepareFinalize()
    prepared = prepare(pf, hidden, weights, ids, expert_map=torch.arange(4))
    # Experts that return each packed row times (expert + 1) make the expected output easy to state.
    expert_output = prepared.hidden * (torch.arange(4, dtype=torch.float32) + 1).reshape(4, 1, 1)
    output = poisoned(9)
    pf.finalize(output, expert_output, prepared, topk_weights=weights, topk_ids=ids,
                apply_router_weight_on_input=False, reduce=WeightAndReduce.BATCHED)
    factor = ((ids + 1) * (ids >= 0)).float() * weights
    torch.testing.assert_close(output, hidden * factor.sum(1, keepdim=True))
    assert output[4].abs().max() == 0
    with pytest.raises(KernelInputError, match="a Batched-format finalize takes reduce 'batched'; got 'contiguous'"):
        pf.finalize(output, expert_output, prepared, topk_weights=weights, topk_ids=ids,
                    apply_router_weight_on_input=False, reduce=WeightAndReduce.CONTIGUOUS)


def test_router_weight_on_input() -> None:
    hidden, weights, _ = routing(4, 1, 4, "on-input")
    before = hidden.clone()
    torch.testing.assert_close(apply_router_weight_to_input(hidden, weights), hidden * weights)
    assert torch.equal(hidden, before)
    with pytest.raises(KernelInputError, match=r"router weight on input needs top_k == 1 \(the weight scales the one expert's input\); got top_k=2"):
        apply_router_weight_to_input(hidden, torch.ones(4, 2))


def test_prepared_tokens_keep_weights() -> None:
    hidden, weights, ids = routing(4, 2, 4, "keep")
    prepared = prepare(LocalPrepareFinalize(), hidden, weights, ids)
    assert isinstance(prepared, PreparedTokens) and prepared.topk_weights is weights and prepared.hidden is hidden
