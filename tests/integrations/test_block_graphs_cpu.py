"""The MoE-block replay's host side, without a GPU (``integrations/block_graphs.py``; replays: tests/gpu).

Installing a replay must leave every call it does not replay exactly the block's own forward, and
``torch.compile(fullgraph=True)`` must trace through it to the block's forward with no graph break.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from moe_fsm.integrations.block_graphs import BlockGraphs, installed, uninstall  # noqa: E402
from moe_fsm.integrations.transformers import enable  # noqa: E402
from moe_fsm.modular import ops  # noqa: E402


def _model(tmp_path):
    config = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        max_position_embeddings=32, head_dim=32, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    enabled = enable(model, env={}, trace_dir=tmp_path)
    return model, enabled


def test_enable_replays_no_block_whose_kernel_cannot_be_captured(tmp_path):
    _, enabled = _model(tmp_path)  # the torch experts on the CPU: no graphs
    assert enabled.blocks is None
    assert "replay router and experts" not in enabled.summary()


def test_an_installed_replay_runs_the_blocks_own_forward_off_the_gpu(tmp_path):
    model, _ = _model(tmp_path)
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = model(ids).logits
    blocks = BlockGraphs(ops.eager_graphs())
    for i, layer in enumerate(model.model.layers):
        blocks.install(layer.mlp, f"model.layers.{i}.mlp", active=lambda: True)
    replay = installed(model.model.layers[0].mlp)
    assert replay is not None and replay.block is model.model.layers[0].mlp
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(model(ids).logits, expected)
    assert blocks.num_graphs == 0
    again = blocks.install(model.model.layers[0].mlp, "model.layers.0.mlp", active=lambda: True)
    assert again.forward == replay.forward, "a second install wraps the block's own forward, not the first replay"
    assert uninstall(model.model.layers[0].mlp) is again
    assert installed(model.model.layers[0].mlp) is None and uninstall(model.model.layers[0].mlp) is None


def test_compile_traces_through_an_installed_replay(tmp_path):
    model, _ = _model(tmp_path)
    blocks = BlockGraphs(ops.eager_graphs())
    for i, layer in enumerate(model.model.layers):
        blocks.install(layer.mlp, f"model.layers.{i}.mlp", active=lambda: True)
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = model(ids).logits
        explained = torch._dynamo.explain(model)(ids)
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")(ids).logits
    assert explained.graph_break_count == 0
    assert float((compiled - expected).abs().max()) < 1e-5


def test_a_block_is_eligible_only_where_a_replay_gives_its_forward(tmp_path):
    model, _ = _model(tmp_path)
    blocks = BlockGraphs(ops.eager_graphs())
    active = [True]
    replay = blocks.install(model.model.layers[0].mlp, "model.layers.0.mlp", active=lambda: active[0])
    x = torch.randn(1, 3, 64)
    with torch.no_grad():
        assert replay.eligible(x)
        active[0] = False  # the model switched to another experts implementation
        assert not replay.eligible(x)
        active[0] = True
        handle = model.model.layers[0].mlp.gate.register_forward_hook(lambda *_: None)
        assert not replay.eligible(x), "a user's hook would not run on a replay"
        handle.remove()
        assert replay.eligible(x)
        model.train()
        assert not replay.eligible(x)
        model.eval()
        assert not replay.eligible(torch.randn(1, 9000, 64)), "over the token limit"
    assert not replay.eligible(x), "grad mode records autograd history"
    seen = []
    own = replay.forward
    replay.forward = lambda h: (seen.append(replay.eligible(h)), own(h))[1]
    ids = torch.randint(0, 64, (1, 4))
    with torch.no_grad():
        model(ids)
        out = model(ids, output_router_logits=True)  # installs transformers' recorder hooks and collects
        model(ids)
    assert len(out.router_logits) == 2
    assert seen == [True, False, True], "eligible unless the recorder collects; its idle hooks do not count"


def test_a_replaced_router_is_surveyed_again(tmp_path):
    model, _ = _model(tmp_path)
    block = model.model.layers[1].mlp
    replay = BlockGraphs(ops.eager_graphs()).install(block, "model.layers.1.mlp", active=lambda: True)
    x = torch.randn(1, 2, 64)
    old = {id(m) for m, _ in replay.tensors}
    block.gate = type(block.gate)(model.config)
    with torch.no_grad():
        assert replay.eligible(x)
    assert id(block.gate) in {id(m) for m, _ in replay.tensors} and id(block.gate) not in old
    block.gate.register_forward_hook(lambda *_: None)
    with torch.no_grad():
        assert not replay.eligible(x), "the new router's hook is seen"
