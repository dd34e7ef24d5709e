"""moe_fsm inside transformers: tiny random models of four MoE architectures, built from their config classes.

Each model runs once with transformers' own ``eager`` experts and once through
``moe_fsm``, on the same weights and tokens: the logits agree within the dtype's
tolerance, a backward pass gives the eager gradients, every experts module
wrote its trace, and later forwards never decide again.
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.integrations.moe", reason="needs transformers >= 5 (ExpertsInterface)")

import moe_fsm.plan.decider as decider_module  # noqa: E402
from moe_fsm.errors import InputError, MoeFsmError, TraceWriteError  # noqa: E402
from moe_fsm.inputs.platform import preset  # noqa: E402
from moe_fsm.experts.torch_experts import TorchExperts  # noqa: E402
from moe_fsm.integrations.transformers import enable, experts_modules, moe_fsm_ids, torch_kernel  # noqa: E402
from moe_fsm.modular.kernel import ModularKernel  # noqa: E402
from moe_fsm.prepare_finalize.local import LocalPrepareFinalize  # noqa: E402
from moe_fsm.trace.dir_lock import LOCK_NAME, trace_dir_lock  # noqa: E402
from moe_fsm.trace.manifest import MODEL_MANIFEST_NAME  # noqa: E402

COMMON = dict(vocab_size=96, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64)


def qwen3_moe():
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **COMMON, head_dim=16, intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True))


def mixtral():
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **COMMON, head_dim=16, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2))


def deepseek_v3():
    """Shared experts, grouped routing (n_group / topk_group), a dense first layer, routed scaling."""
    return transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        **{**COMMON, "num_key_value_heads": COMMON["num_attention_heads"]}, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=16, num_experts_per_tok=4,
        n_shared_experts=1, n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
        q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16))


def olmoe():
    return transformers.OlmoeForCausalLM(transformers.OlmoeConfig(
        **COMMON, intermediate_size=32, num_experts=8, num_experts_per_tok=3))


def qwen2_moe():
    return transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        **COMMON, intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=6,
        num_experts_per_tok=2))


MODELS = {"qwen3_moe": qwen3_moe, "mixtral": mixtral, "deepseek_v3": deepseek_v3, "olmoe": olmoe, "qwen2_moe": qwen2_moe}
# Max |logits - eager| / max |eager|: fp32 differs by summation order only; bf16 by its 8-bit mantissa
# (eager rounds each slot's weighted output to bf16 before summing, moe-fsm sums in fp32 once).
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


def build(name: str, dtype):
    torch.manual_seed(0)
    model = MODELS[name]().to(dtype)
    with torch.no_grad():
        for module_name, module in experts_modules(model):
            module.gate_up_proj.normal_(0, 0.2)
            module.down_proj.normal_(0, 0.2)
    return model.eval()


def tokens(batch=2, length=9):
    return torch.randint(0, COMMON["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(1))


def eager_logits(model, ids, grad=False):
    model.set_experts_implementation("eager")
    if grad:
        model.zero_grad()
        logits = model(ids).logits
        logits.float().square().mean().backward()
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    with torch.no_grad():
        return model(ids).logits


def rel_error(a, b) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_logits_match_eager_and_traces_are_written(name, dtype, tmp_path, monkeypatch):
    """fp32: the whole model's logits match eager. bf16: every experts module matches eager on the inputs it got in
    eager's forward; whole-model bf16 logits are no fair check, since a tiny random router has near-ties that flip
    under any rounding difference (seen with transformers 5.24: 0.63 on one Qwen3-MoE token, each module within 6e-3)."""
    model = build(name, dtype)
    ids = tokens()
    seen = []
    hooks = [m.register_forward_hook(lambda mod, args, out: seen.append((mod, args, out))) for _, m in experts_modules(model)]
    reference = eager_logits(model, ids)
    for hook in hooks:
        hook.remove()
    decisions = []
    real_decide = decider_module.decide
    monkeypatch.setattr(decider_module, "decide", lambda *a, **k: decisions.append(k.get("layer_name")) or real_decide(*a, **k))

    enabled = enable(model, env={}, trace_dir=tmp_path, policy="seeds")
    names = [n for n, _ in experts_modules(model)]
    assert model.config._experts_implementation == "moe_fsm"
    assert list(enabled.modules) == names and len(names) >= 2
    # identical layers share one decision and one trace, named after the first module; model.manifest maps them all
    assert decisions == [names[0]] and enabled.engine.distinct_decisions == 1
    traces = sorted(tmp_path.glob("*.json"))
    assert len(traces) == 1
    document = json.loads(traces[0].read_text())
    assert document["layer_name"] == names[0] and names[0] in traces[0].name
    assert document["inputs"]["layer"]["dtype"] == str(dtype).removeprefix("torch.")
    assert document["outcome"]["kernel"] == "TorchExperts"
    assert document["inputs"]["profile"]["name"] == "seeds"
    manifest = json.loads((tmp_path / "model.manifest").read_text())
    assert [(row["name"], row["trace"]) for row in manifest["layers"]] == [(n, traces[0].name) for n in names]
    from moe_fsm.cli.main import main

    assert main(["explain", str(tmp_path / "model.manifest"), "--layer", names[-1]]) == 0

    with torch.no_grad():
        first = model(ids).logits
        second = model(tokens(3, 5)).logits
    assert second.shape == (3, 5, COMMON["vocab_size"])
    assert decisions == [names[0]], "a forward decided again"
    if dtype is torch.float32:
        assert rel_error(first, reference) < TOLERANCE[dtype]
    assert len(seen) == len(names)
    for module, args, expected in seen:
        with torch.no_grad():
            assert rel_error(module(*args), expected) < TOLERANCE[dtype]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_backward_matches_eager_gradients(name, tmp_path):
    model = build(name, torch.float32).train()
    ids = tokens()
    reference, reference_grads = eager_logits(model, ids, grad=True)
    enable(model, env={}, trace_dir=tmp_path)
    model.zero_grad()
    logits = model(ids).logits
    logits.square().mean().backward()
    assert rel_error(logits.detach(), reference) < 1e-5
    experts_grads = [n for n in reference_grads if "gate_up_proj" in n or "down_proj" in n and "experts" in n]
    assert experts_grads
    for param_name, param in model.named_parameters():
        if param_name in reference_grads:
            assert param.grad is not None, f"{param_name} got no gradient through moe_fsm"
            assert rel_error(param.grad, reference_grads[param_name]) < 1e-4, param_name


def test_bf16_backward_runs(tmp_path):
    model = build("deepseek_v3", torch.bfloat16).train()
    enable(model, env={}, trace_dir=tmp_path)
    model(tokens()).logits.float().square().mean().backward()
    experts = dict(experts_modules(model))
    for module in experts.values():
        assert module.gate_up_proj.grad is not None and torch.isfinite(module.gate_up_proj.grad.float()).all()


class InferenceOnlyExperts(TorchExperts):
    """Stands in for a Triton/FlashInfer kernel: same numerics, but not in the differentiable set."""

    name = "InferenceOnlyExperts"


@pytest.mark.parametrize("training", ["torch", "refuse"])
def test_inference_only_kernels_in_training(training, tmp_path):
    model = build("qwen3_moe", torch.float32).train()
    enabled = enable(model, env={}, trace_dir=tmp_path, training=training)
    calls = []
    for prepared in enabled.modules.values():
        prepared.kernel = ModularKernel(LocalPrepareFinalize(), InferenceOnlyExperts(prepared.layer), prepared.layer)
        # what enable prepares for an inference-only kernel: the torch experts, or nothing when refused
        substitute = torch_kernel(prepared.layer)
        spy = lambda *a, _k=substitute, **kw: calls.append(1) or _k(*a, **kw)  # noqa: E731
        prepared.training_kernel = spy if training == "torch" else None
    with torch.no_grad():
        model(tokens())  # inference runs the decided kernel either way
    assert calls == []
    if training == "refuse":
        with pytest.raises(MoeFsmError, match="inference-only"):
            model(tokens())
    else:
        model(tokens()).logits.sum().backward()
        assert len(calls) == len(enabled.modules)
        assert enabled.training_substitutes == list(enabled.modules)


def test_dropped_experts_convert_at_the_boundary(tmp_path):
    """transformers marks another rank's slots with id >= E; they contribute nothing."""
    model = build("qwen3_moe", torch.float32)
    enable(model, env={}, trace_dir=tmp_path)
    module = dict(experts_modules(model))["model.layers.0.mlp.experts"]
    module._is_expert_parallel = True
    hidden = torch.randn(5, 64)
    ids = torch.tensor([[0, 8], [8, 3], [1, 2], [8, 8], [7, 0]])
    weights = torch.rand(5, 2)
    out = module(hidden, ids, weights)
    model.set_experts_implementation("eager")
    with torch.no_grad():  # eager on the same slots with the dropped ones given weight 0
        expected = module(hidden, ids.clamp(max=7), weights * (ids < 8))
    assert torch.allclose(out, expected, atol=1e-6)
    converted, expert_map = moe_fsm_ids(ids, 8)
    assert converted.tolist() == [[0, -1], [-1, 3], [1, 2], [-1, -1], [7, 0]]
    assert expert_map.tolist() == list(range(8))


def test_gpt_oss_layout_is_refused_naming_class_and_features(tmp_path):
    config = transformers.GptOssConfig(**{**COMMON, "num_key_value_heads": 2}, head_dim=16, intermediate_size=32,
                                       num_local_experts=4, num_experts_per_tok=2)
    model = transformers.GptOssForCausalLM(config)
    with pytest.raises(InputError) as err:
        enable(model, env={}, trace_dir=tmp_path)
    message = str(err.value)
    for part in ("GptOssForCausalLM", "GptOssExperts", "expert biases", "interleaved gate/up", "custom gate"):
        assert part in message
    assert not list(tmp_path.glob("*.json"))


def test_transposed_weights_run_as_views(tmp_path):
    """A layout with gate_up_proj [E, H, 2I] and down_proj [E, I, H] (is_transposed) needs no copy."""
    model = build("qwen3_moe", torch.float32)
    ids = tokens()
    reference = eager_logits(model, ids)
    for _, module in experts_modules(model):
        module.gate_up_proj = torch.nn.Parameter(module.gate_up_proj.detach().transpose(1, 2).contiguous())
        module.down_proj = torch.nn.Parameter(module.down_proj.detach().transpose(1, 2).contiguous())
        module.is_transposed = True
    enable(model, env={}, trace_dir=tmp_path)
    with torch.no_grad():
        assert rel_error(model(ids).logits, reference) < 1e-5


def test_a_module_moved_after_enable_is_reported(tmp_path):
    model = build("mixtral", torch.float32)
    enable(model, env={}, trace_dir=tmp_path)
    model.to(torch.bfloat16)
    with pytest.raises(MoeFsmError, match="call enable"), torch.no_grad():
        model(tokens())


def test_enable_into_a_trace_directory_another_writer_holds_is_refused_before_it_writes(tmp_path):
    """enable() holds the directory's writer lock from its first trace to its manifest, as `run` and `plan` do."""
    model = build("mixtral", torch.float32)
    with trace_dir_lock(tmp_path):  # another writer (a flock of its own open file: it conflicts within one process too)
        with pytest.raises(TraceWriteError, match=r"in use by another moe-fsm run .*give this one another trace_dir"):
            enable(model, env={}, trace_dir=tmp_path)
        assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_NAME]
    enable(model, env={}, trace_dir=tmp_path)
    assert LOCK_NAME not in {p.name for p in tmp_path.iterdir()} and (tmp_path / MODEL_MANIFEST_NAME).exists()


def test_unknown_training_mode_and_model_without_experts():
    with pytest.raises(InputError, match="training='maybe'"):
        enable(build("olmoe", torch.float32), training="maybe")
    with pytest.raises(InputError, match="no experts module"):
        enable(transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON, intermediate_size=32)), env={})


def test_a_decided_kernel_that_cannot_be_built_here_runs_the_torch_experts(tmp_path):
    """Deciding for an H100 picks TRITON; its kernels run on CUDA (and compute no float32), so on this CPU model the
    torch experts stand in, said so."""
    model = build("olmoe", torch.float32)
    ids = tokens()
    reference = eager_logits(model, ids)
    enabled = enable(model, env={}, trace_dir=tmp_path, platform=preset("sm90"), policy="seeds")
    assert {p.loaded.decision.backend for p in enabled.modules.values()} == {"TRITON"}
    assert set(enabled.substitutes) == set(enabled.modules)
    assert "TritonExperts runs on CUDA; this run is on cpu" in next(iter(enabled.substitutes.values()))
    assert "runs as moe-fsm torch experts (stand-in)" in enabled.summary()
    with torch.no_grad():
        assert rel_error(model(ids).logits, reference) < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_model_runs_the_decided_kernel_and_trains_through_the_torch_experts(dtype, tmp_path):
    """On a GPU enable() decides for the probed platform; a forward that needs gradients takes the torch experts.

    Each experts module is compared with eager on the same routing: whole-model logits in bf16 are not a
    fair check, since a tiny random router has near-ties that flip under any rounding difference (transformers'
    own grouped_mm differs from its eager by as much).
    """
    model = build("qwen3_moe", dtype).cuda()
    ids = tokens().cuda()
    reference = eager_logits(model, ids)
    enabled = enable(model, env={}, trace_dir=tmp_path)
    prepared = next(iter(enabled.modules.values()))
    assert prepared.device.type == "cuda"
    generator = torch.Generator().manual_seed(3)
    for name, module in experts_modules(model):
        hidden = torch.randn(33, 64, generator=generator).to("cuda", dtype)
        weights, expert_ids = torch.topk(torch.rand(33, 8, generator=generator), 2)
        weights, expert_ids = weights.to("cuda", dtype), expert_ids.cuda()
        with torch.no_grad():
            model.set_experts_implementation("moe_fsm")
            out = module(hidden, expert_ids, weights)
            model.set_experts_implementation("eager")
            expected = module(hidden, expert_ids, weights)
        assert rel_error(out, expected) < TOLERANCE[dtype], name
    model.set_experts_implementation("moe_fsm")
    if dtype is torch.float32:
        with torch.no_grad():
            assert rel_error(model(ids).logits, reference) < TOLERANCE[dtype]
    if prepared.inference_only:
        assert enabled.training_substitutes == list(enabled.modules)
    model.train()
    _, reference_grads = eager_logits(model, ids, grad=True)
    model.set_experts_implementation("moe_fsm")
    model.zero_grad()
    model(ids).logits.float().square().mean().backward()
    for name, module in experts_modules(model):
        grad = module.gate_up_proj.grad
        assert grad is not None and torch.isfinite(grad.float()).all()
        if dtype is torch.float32:
            assert rel_error(grad, reference_grads[f"{name}.gate_up_proj"]) < 1e-4


def test_integrations_transformers_example_runs_as_shown(tmp_path, monkeypatch, capsys):
    """docs/integrations.md's transformers example prints what the page shows, and its `ls` lists what it wrote."""
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "integrations.md").read_text()
    section = page.split("\n## Inside transformers\n", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, re.DOTALL)
    (shown,) = re.findall(r"```text\n(.*?)```", section, re.DOTALL)
    printed, listing = shown.split("$ ls moe-fsm-traces/qwen3\n")
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "docs/integrations.md", "exec"), {})
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == printed.splitlines()
    assert out[0] == "moe_fsm: 4 experts module(s) of Qwen3MoeForCausalLM, 1 distinct decision(s); traces in moe-fsm-traces/qwen3/"
    assert out[1] == "    4 x CPU (TorchExperts + LocalPrepareFinalize, float32): model.layers.0.mlp.experts ..."
    written = sorted(p.name for p in (tmp_path / "moe-fsm-traces" / "qwen3").iterdir())
    assert listing.split() == written  # one trace per distinct decision, and the manifest


def test_cpu_models_do_not_replay_cuda_graphs(tmp_path):
    """Eager CUDA-graph replay is for capturable kernels on a GPU; the CPU's torch experts read routing on the host."""
    model = build("qwen3_moe", torch.float32)
    enabled = enable(model, env={}, trace_dir=tmp_path, eager_graphs=True)
    assert not any(p.eager_graphs for p in enabled.modules.values())


def test_a_bad_graph_token_limit_fails_enable_naming_the_variable(tmp_path, monkeypatch):
    from moe_fsm.modular import eager_graphs, ops

    monkeypatch.setattr(ops, "_eager_graphs", None)
    monkeypatch.setenv(eager_graphs.MAX_TOKENS_ENV, "all")
    with pytest.raises(ValueError, match=f"{eager_graphs.MAX_TOKENS_ENV}='all' is not an integer; accepted"):
        enable(build("qwen3_moe", torch.float32), env={}, trace_dir=tmp_path)
    monkeypatch.delenv(eager_graphs.MAX_TOKENS_ENV)
    monkeypatch.setattr(ops, "_eager_graphs", None)
    enable(build("qwen3_moe", torch.float32), env={}, trace_dir=tmp_path, eager_graphs=True)
