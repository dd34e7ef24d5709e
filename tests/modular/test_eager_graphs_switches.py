"""Which calls may be replayed from CUDA graphs, and the switches, on any machine (GPU replay: tests/gpu)."""

from __future__ import annotations

import pytest
import torch

from moe_fsm.experts.torch_experts import TorchExperts
from moe_fsm.experts.triton_experts import BatchedTritonExperts, TritonExperts
from moe_fsm.inputs.layer import MoELayer
from moe_fsm.modular import eager_graphs, ops
from moe_fsm.modular.kernel import ModularKernel
from moe_fsm.prepare_finalize.local import LocalBatchedPrepareFinalize, LocalPrepareFinalize

LAYER = MoELayer(num_experts=8, top_k=2, hidden_size=64, intermediate_size=32, dtype="bfloat16")


def test_only_kernels_that_never_read_the_device_are_capturable():
    assert ModularKernel(LocalPrepareFinalize(), TritonExperts(LAYER), LAYER).capturable
    # the torch experts group pairs with .tolist(); the batched prepare sizes its slabs from the busiest expert
    assert not ModularKernel(LocalPrepareFinalize(), TorchExperts(LAYER), LAYER).capturable
    assert not ModularKernel(LocalBatchedPrepareFinalize(), BatchedTritonExperts(LAYER), LAYER).capturable


@pytest.mark.parametrize("value,expected", [(None, True), ("1", True), ("0", False), ("off", False)])
def test_env_switch(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv(eager_graphs.ENV, raising=False)
    else:
        monkeypatch.setenv(eager_graphs.ENV, value)
    assert eager_graphs.enabled_by_env() is expected


@pytest.mark.parametrize("raw", ["many", "-3"])
def test_a_bad_token_limit_names_the_variable_and_what_is_accepted(monkeypatch, raw):
    monkeypatch.setenv(eager_graphs.MAX_TOKENS_ENV, raw)
    with pytest.raises(ValueError, match=f"{eager_graphs.MAX_TOKENS_ENV}=.*accepted: a token count >= 0"):
        eager_graphs.EagerGraphs()


def test_token_limit_from_env(monkeypatch):
    monkeypatch.setenv(eager_graphs.MAX_TOKENS_ENV, "64")
    assert eager_graphs.EagerGraphs().max_tokens == 64
    monkeypatch.delenv(eager_graphs.MAX_TOKENS_ENV)
    assert eager_graphs.EagerGraphs().max_tokens == eager_graphs.DEFAULT_MAX_TOKENS


def test_cpu_calls_never_touch_the_graphs():
    layer = MoELayer(num_experts=8, top_k=2, hidden_size=64, intermediate_size=32, dtype="float32")
    kernel = ModularKernel(LocalPrepareFinalize(), TorchExperts(layer), layer)
    handle = ops.register(kernel)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, generator=gen)
    w1, w2 = torch.randn(8, 64, 64, generator=gen) / 8, torch.randn(8, 64, 32, generator=gen) / 6
    weights, ids = torch.topk(torch.rand(3, 8, generator=gen), 2)
    before = ops.eager_graphs().num_graphs
    for _ in range(3):
        out = ops.call(handle, kernel, x, w1, w2, weights, ids, graphs=True)
    assert torch.equal(out, kernel(x, w1, w2, weights, ids))
    assert ops.eager_graphs().num_graphs == before


def test_pinned_graphs_serve_up_to_256_tokens_unless_set(monkeypatch):
    monkeypatch.delenv(eager_graphs.PINNED_MAX_TOKENS_ENV, raising=False)
    assert eager_graphs.EagerGraphs().pinned_max_tokens == 256
    assert eager_graphs.EagerGraphs(max_tokens=16).pinned_max_tokens == 16  # never above the capture limit
    monkeypatch.setenv(eager_graphs.PINNED_MAX_TOKENS_ENV, "0")
    assert eager_graphs.EagerGraphs().pinned_max_tokens == 0
    monkeypatch.setenv(eager_graphs.PINNED_MAX_TOKENS_ENV, "lots")
    with pytest.raises(ValueError, match=f"{eager_graphs.PINNED_MAX_TOKENS_ENV}='lots' is not an integer"):
        eager_graphs.EagerGraphs()


@pytest.mark.parametrize("enabled_before", [True, False])
def test_captures_hold_off_garbage_collection_and_restore_it(enabled_before):
    """A cyclic collection during a capture can free an old CUDA graph, which invalidates the capture; the
    collector is off while capturing and back as it was afterwards, also when the captured body raises."""
    import gc

    from moe_fsm.modular.eager_graphs import _no_garbage_collection

    was = gc.isenabled()
    try:
        (gc.enable if enabled_before else gc.disable)()
        with _no_garbage_collection():
            assert not gc.isenabled()
        assert gc.isenabled() == enabled_before
        with pytest.raises(RuntimeError, match="body failed"), _no_garbage_collection():
            raise RuntimeError("body failed")
        assert gc.isenabled() == enabled_before
    finally:
        (gc.enable if was else gc.disable)()
