"""moe_fsm under ``torch.compile``: the experts call is the ``moe_fsm::experts`` operator, traced whole.

Tiny random Qwen3-MoE and OLMoE models (two layers) are compiled with ``fullgraph=True``
after ``enable()``: no graph break anywhere (``torch._dynamo.explain``), one
``moe_fsm::experts`` node per experts module, and logits equal to eager's within the
dtype's tolerance. Training compiles too, its gradients those of eager. The operators
themselves pass ``torch.library.opcheck`` (schema, fake implementation, autograd
registration). On a GPU: the Triton path compiled, and captured in a CUDA graph, against eager.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.integrations.moe", reason="needs transformers >= 5 (ExpertsInterface)")

from moe_fsm.errors import MoeFsmError  # noqa: E402
from moe_fsm.inputs.layer import MoELayer  # noqa: E402
from moe_fsm.integrations.transformers import enable, experts_modules, torch_kernel  # noqa: E402
from moe_fsm.modular import ops  # noqa: E402

COMMON = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64)
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


def qwen3_moe():
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **COMMON, head_dim=16, intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True))


def olmoe():
    return transformers.OlmoeForCausalLM(transformers.OlmoeConfig(
        **COMMON, intermediate_size=32, num_experts=8, num_experts_per_tok=3))


MODELS = {"qwen3_moe": qwen3_moe, "olmoe": olmoe}


def build(name: str, dtype=torch.float32):
    torch.manual_seed(0)
    model = MODELS[name]().to(dtype)
    with torch.no_grad():
        for _, module in experts_modules(model):
            module.gate_up_proj.normal_(0, 0.2)
            module.down_proj.normal_(0, 0.2)
    return model.eval()


def tokens(batch=2, length=9, seed=1):
    return torch.randint(0, COMMON["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(seed))


def rel_error(a, b) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def op_nodes(model, *args) -> list[str]:
    """The call targets of the one graph dynamo captures of ``model(*args)`` (fullgraph: it fails on a break)."""
    targets = []

    def backend(gm, example_inputs):
        targets.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=backend, fullgraph=True)(*args)
    return targets


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_explain_finds_no_graph_break_and_one_operator_per_layer(name, tmp_path):
    model = build(name)
    enable(model, env={}, trace_dir=tmp_path)
    ids = tokens()
    with torch.no_grad():
        explanation = torch._dynamo.explain(model)(ids)
        assert explanation.graph_break_count == 0, explanation.break_reasons
        assert explanation.graph_count == 1
        targets = op_nodes(model, ids)
    calls = [t for t in targets if t in ("moe_fsm.experts", "moe_fsm.experts.default")]
    assert len(calls) == len(experts_modules(model)) == COMMON["num_hidden_layers"]


@pytest.mark.parametrize(("name", "backend"), [("qwen3_moe", "inductor"), ("olmoe", "aot_eager")])
def test_fullgraph_compile_matches_eager(name, backend, tmp_path):
    """Inductor on Qwen3-MoE (what users run), AOTAutograd alone on OLMoE (the fake implementation's shapes)."""
    model = build(name)
    ids, other = tokens(), tokens(3, 5, seed=2)
    model.set_experts_implementation("eager")
    with torch.no_grad():
        reference, reference_other = model(ids).logits, model(other).logits
    enable(model, env={}, trace_dir=tmp_path)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    with torch.no_grad():
        assert rel_error(compiled(ids).logits, reference) < TOLERANCE[torch.float32]
        if backend != "inductor":  # (Inductor's C++ build of the second graph would double a CPU run's time)
            # a second shape recompiles, dynamic in the token count, and still agrees
            assert rel_error(compiled(other).logits, reference_other) < TOLERANCE[torch.float32]


def test_bf16_compiled_experts_match_eager_on_fixed_routing(tmp_path):
    """bf16: each experts module compiled alone against transformers' eager experts on the same routing."""
    model = build("olmoe", torch.bfloat16)
    enable(model, env={}, trace_dir=tmp_path)
    generator = torch.Generator().manual_seed(3)
    for _, module in experts_modules(model):
        hidden = torch.randn(17, COMMON["hidden_size"], generator=generator).to(torch.bfloat16)
        weights, expert_ids = torch.topk(torch.rand(17, 8, generator=generator), 3)
        weights = weights.to(torch.bfloat16)
        compiled = torch.compile(module, backend="aot_eager", fullgraph=True)
        with torch.no_grad():
            model.set_experts_implementation("moe_fsm")
            out = compiled(hidden, expert_ids, weights)
            model.set_experts_implementation("eager")
            expected = module(hidden, expert_ids, weights)
        assert out.dtype == torch.bfloat16
        assert rel_error(out, expected) < TOLERANCE[torch.bfloat16]


def test_compiled_training_gives_eager_gradients(tmp_path):
    model = build("qwen3_moe").train()
    ids = tokens()
    model.set_experts_implementation("eager")
    model.zero_grad()
    reference = model(ids).logits
    reference.square().mean().backward()
    reference_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    enable(model, env={}, trace_dir=tmp_path)
    model.zero_grad()
    logits = torch.compile(model, backend="aot_eager", fullgraph=True)(ids).logits
    logits.square().mean().backward()
    assert rel_error(logits.detach(), reference.detach()) < 1e-5
    experts_grads = [n for n in reference_grads if ".experts." in n]
    assert len(experts_grads) == 2 * COMMON["num_hidden_layers"]
    for name, param in model.named_parameters():
        if name in reference_grads:
            assert param.grad is not None, f"{name} got no gradient through the compiled moe_fsm"
            assert rel_error(param.grad, reference_grads[name]) < 1e-4, name


# the operators alone

LAYER = MoELayer(num_experts=6, top_k=2, hidden_size=16, intermediate_size=8, dtype="float32")


def layer_inputs(tokens_=5, grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens_, 16, generator=g, dtype=torch.float32)
    w1 = torch.randn(6, 16, 16, generator=g, dtype=torch.float32) * 0.3
    w2 = torch.randn(6, 16, 8, generator=g, dtype=torch.float32) * 0.3
    weights, ids = torch.topk(torch.rand(tokens_, 6, generator=g, dtype=torch.float32), 2)
    tensors = [hidden, w1, w2, weights]
    if grad:
        tensors = [t.requires_grad_() for t in tensors]
    return (*tensors, ids)


def test_operator_runs_the_registered_kernel_and_its_backward_gives_autograds_gradients():
    kernel = torch_kernel(LAYER)
    handle = ops.register(kernel, kernel)
    assert ops.register(kernel, kernel) == handle
    hidden, w1, w2, weights, ids = layer_inputs(grad=True)
    expected = kernel(hidden, w1, w2, weights, ids)
    grads = torch.autograd.grad(expected.square().sum(), [hidden, w1, w2, weights])
    out = torch.ops.moe_fsm.experts(hidden, w1, w2, weights, ids, None, handle)
    assert torch.equal(out, expected)
    op_grads = torch.autograd.grad(out.square().sum(), [hidden, w1, w2, weights])
    for got, want in zip(op_grads, grads):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


def test_operator_passes_opcheck():
    kernel = torch_kernel(LAYER)
    handle = ops.register(kernel, kernel)
    hidden, w1, w2, weights, ids = layer_inputs(grad=True)
    torch.library.opcheck(torch.ops.moe_fsm.experts.default, (hidden, w1, w2, weights, ids, None, handle))
    with torch.no_grad():
        torch.library.opcheck(torch.ops.moe_fsm.experts.default, (*layer_inputs(tokens_=1), None, handle))


def test_backward_of_an_inference_only_registration_is_refused():
    handle = ops.register(torch_kernel(LAYER), None)
    hidden, w1, w2, weights, ids = layer_inputs(grad=True)
    out = torch.ops.moe_fsm.experts(hidden, w1, w2, weights, ids, None, handle)
    with pytest.raises(MoeFsmError, match="inference-only"):
        out.sum().backward()
    with pytest.raises(MoeFsmError, match="no moe-fsm kernel is registered"):
        torch.ops.moe_fsm.experts(hidden, w1, w2, weights, ids, None, 10**6)


def test_fake_implementation_checks_shapes_while_tracing(tmp_path):
    model = build("qwen3_moe")
    enable(model, env={}, trace_dir=tmp_path)
    _, module = experts_modules(model)[0]
    hidden = torch.randn(3, COMMON["hidden_size"] + 1)
    ids, weights = torch.zeros(3, 2, dtype=torch.long), torch.rand(3, 2)
    with pytest.raises(Exception, match=r"hidden_states has shape \[3, 65\]"), torch.no_grad():
        torch.compile(module, backend="aot_eager", fullgraph=True)(hidden, ids, weights)


# GPU: the decided Triton kernels, compiled and captured

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def cuda_model(tmp_path, name="qwen3_moe"):
    model = build(name, torch.bfloat16).cuda()
    enabled = enable(model, env={}, trace_dir=tmp_path)
    return model, enabled


def fixed_routing(module, tokens_, seed=3):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens_, COMMON["hidden_size"], generator=g).to("cuda", torch.bfloat16)
    weights, ids = torch.topk(torch.rand(tokens_, module.num_experts, generator=g), module.config.num_experts_per_tok)
    return hidden, ids.cuda(), weights.to("cuda", torch.bfloat16)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("mode", [None, "reduce-overhead"], ids=["default", "cudagraphs"])
def test_cuda_compiled_triton_experts_match_eager(mode, tmp_path):
    model, enabled = cuda_model(tmp_path)
    for name, module in experts_modules(model)[:1]:  # the modules are alike; one keeps the compile time down
        compiled = torch.compile(module, fullgraph=True, mode=mode)
        for tokens_ in (1, 33):
            hidden, ids, weights = fixed_routing(module, tokens_)
            with torch.no_grad():
                model.set_experts_implementation("moe_fsm")
                eager = module(hidden, ids, weights).clone()
                for _ in range(3):  # cudagraph trees record on the second call, replay after
                    out = compiled(hidden, ids, weights).clone()
                model.set_experts_implementation("eager")
                expected = module(hidden, ids, weights)
            assert rel_error(out, eager) < 1e-2, (name, tokens_)
            assert rel_error(out, expected) < TOLERANCE[torch.bfloat16], (name, tokens_)
    ids = tokens().cuda()
    model.set_experts_implementation("moe_fsm")
    explanation = torch._dynamo.explain(model)(ids)
    assert explanation.graph_break_count == 0, explanation.break_reasons


@pytest.mark.gpu
@gpu
def test_cuda_graph_capture_of_the_eager_experts_call_replays_eager_results(tmp_path):
    """torch.cuda.graph captures a whole moe_fsm layer call (no host read of a device value in it) and replays it."""
    model, enabled = cuda_model(tmp_path)
    _, module = experts_modules(model)[0]
    model.set_experts_implementation("moe_fsm")
    hidden, ids, weights = fixed_routing(module, 8)
    with torch.no_grad():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                module(hidden, ids, weights)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = module(hidden, ids, weights)
        for seed in (4, 5):
            new_hidden, new_ids, new_weights = fixed_routing(module, 8, seed=seed)
            hidden.copy_(new_hidden), ids.copy_(new_ids), weights.copy_(new_weights)
            graph.replay()
            torch.cuda.synchronize()
            expected = module(new_hidden, new_ids, new_weights)
            assert rel_error(static_out, expected) < 1e-2
