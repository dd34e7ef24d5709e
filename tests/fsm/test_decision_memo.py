"""What the decision-cost work may not change: memoized answers equal computed ones, and nothing is skipped.

Each distinct requirement is evaluated once per context; equal requirements
share one memo entry; verdicts pair each requirement with its outcome; quant
keys are interned; a registry hands back its own equal context; forgetting the
per-input caches really makes the next decision compute everything again.
"""

from collections import Counter

import pytest
from transitions import MachineError

from moe_fsm import profiles
from moe_fsm.backends import requirements as req
from moe_fsm.backends.registry import Registry
from moe_fsm.backends.verdict import Check, SupportContext
from moe_fsm.decision import DecisionInputs, decide, forget_input_caches, make_inputs
from moe_fsm.errors import SelectionError
from moe_fsm.fsm.decide import DecisionRun
from moe_fsm.fsm.machine import machine_for
from moe_fsm.inputs import quant
from moe_fsm.inputs.formats import ActivationFormat
from moe_fsm.inputs.layer import MoELayer
from moe_fsm.inputs.platform import Library, Vendor, preset
from moe_fsm.inputs.quant import QuantScheme
from moe_fsm.trace.recorder import Recorder

FP8_BLOCK = MoELayer(quant=QuantScheme.fp8("block", "group"), num_experts=256, top_k=8, hidden_size=7168,
                     intermediate_size=2048)


def _decide(inputs, registry):
    try:
        return decide(inputs, registry=registry).trace
    except SelectionError as err:
        return err.trace


@pytest.fixture
def counted(monkeypatch):
    """Counts every requirement evaluation, by (requirement value, context identity)."""
    calls = Counter()

    def wrap(cls):
        original = cls.failure

        def failure(self, ctx):
            calls[(self, id(ctx))] += 1
            return original(self, ctx)

        monkeypatch.setattr(cls, "failure", failure)

    def subclasses(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from subclasses(sub)

    for cls in subclasses(req.Requirement):
        if "failure" in cls.__dict__:
            wrap(cls)
    return calls


@pytest.mark.parametrize("profile", [profiles.SEEDS, "vllm-0.33"])
@pytest.mark.parametrize("platform", ["cpu", "sm90", "rocm-mi300", "sm121"])
def test_each_distinct_requirement_is_evaluated_once_per_context(counted, profile, platform):
    inputs = make_inputs(FP8_BLOCK, None, "auto", {}, preset(platform), policy=profile)
    _decide(inputs, Registry.builtin_only(profile))
    assert counted, "the decision evaluated no requirement at all"
    repeated = {key: n for key, n in counted.items() if n > 1}
    assert not repeated


def test_a_memoized_decision_traces_what_a_fresh_one_traces():
    for profile in (profiles.SEEDS, "vllm-0.33"):
        for platform in ("cpu", "sm90", "sm100", "rocm-mi355", "xpu"):
            inputs = make_inputs(FP8_BLOCK, None, "auto", {}, preset(platform), policy=profile)
            registry = Registry.builtin_only(profile)
            first = _decide(inputs, registry)
            again = _decide(inputs, registry)
            fresh = _decide(DecisionInputs.from_json(inputs.to_json()), Registry.builtin_only(profile))
            for doc in (again, fresh):
                assert doc["events"] == first["events"] and doc["outcome"] == first["outcome"]


def test_equal_requirements_share_a_memo_key_and_different_ones_do_not():
    a, b = req.OnVendor((Vendor.CUDA,)), req.OnVendor((Vendor.CUDA,))
    assert a is not b and a.memo_key == b.memo_key
    assert req.OnVendor((Vendor.ROCM,)).memo_key != a.memo_key
    assert req.Importable(Library.TRITON).memo_key != req.Importable(Library.AITER).memo_key
    holds = lambda ctx: True  # noqa: E731
    assert req.Condition("x", holds).memo_key == req.Condition("x", holds).memo_key
    assert req.Condition("x", holds).memo_key != req.Condition("x", lambda ctx: True).memo_key


def _context(registry, layer=FP8_BLOCK, platform="cpu"):
    inputs = make_inputs(layer, None, "auto", {}, preset(platform), policy=registry.profile.name)
    return SupportContext(inputs.layer, inputs.parallel, inputs.platform,
                          registry.profile.env.reader(inputs.env), ActivationFormat.STANDARD)


def test_a_verdict_pairs_every_requirement_with_its_own_outcome():
    registry = Registry.builtin_only("vllm-0.33")
    ctx = _context(registry)
    for name, spec in registry.kernels.items():
        verdict = registry.kernel_verdict(name, ctx)
        assert verdict.checks == tuple(Check(r, r.failure(ctx)) for r in spec.requirements)
        assert verdict.failures == tuple(c.failure for c in verdict.checks if not c.passed)


def test_holds_stops_at_the_first_failing_requirement(counted):
    registry = Registry.builtin_only(profiles.SEEDS)
    ctx = _context(registry)
    on_cuda, on_cpu = req.OnVendor((Vendor.CUDA,)), req.OnVendor((Vendor.CPU,))
    assert registry.holds((on_cpu,), ctx)
    assert not registry.holds((on_cuda, req.NoLoRA()), ctx)
    assert (req.NoLoRA(), id(ctx)) not in counted


def test_scheme_keys_are_the_interned_constants():
    scheme = QuantScheme.from_json(QuantScheme.fp8("block", "group").to_json())
    assert scheme.weight is quant.FP8_STATIC_BLOCK128 and scheme.activation is quant.FP8_DYNAMIC_GROUP128
    assert scheme.keys == (scheme.weight, scheme.activation)
    weight = quant.QuantKey(quant.FP8, quant.Granularity.BLOCK_128x128, True)
    activation = quant.QuantKey(quant.FP8, quant.Granularity.GROUP_1x128, False)
    built = QuantScheme(quant.QuantFamily.FP8, weight, activation)
    assert weight is not quant.FP8_STATIC_BLOCK128 and built.weight is quant.FP8_STATIC_BLOCK128
    assert built.activation is quant.FP8_DYNAMIC_GROUP128 and built == scheme


def test_canonical_hands_back_the_registrys_own_equal_context():
    registry = Registry.builtin_only(profiles.SEEDS)
    first = registry.canonical(_context(registry))
    other = _context(registry, MoELayer.from_json(FP8_BLOCK.to_json()))
    assert other is not first and registry.canonical(other) is first
    assert registry.canonical(_context(registry, platform="sm90")) is not first


def test_forget_input_caches_makes_the_next_decision_compute_its_env_readings():
    inputs = make_inputs(FP8_BLOCK, None, "auto", {"VLLM_USE_DEEP_GEMM": "0"}, preset("sm90"), policy="vllm-0.33")
    _decide(inputs, Registry.builtin_only("vllm-0.33"))
    env = profiles.get("vllm-0.33").env
    reader = env.reader(inputs.env)
    assert reader.guards
    forget_input_caches()
    assert env.reader(inputs.env) is not reader and not env.reader(inputs.env).guards


def test_the_machine_refuses_to_advance_from_a_terminal_state():
    policy = profiles.get(profiles.SEEDS).policies[FP8_BLOCK.family]
    registry = Registry.builtin_only(profiles.SEEDS)
    run = DecisionRun(registry.canonical(_context(registry)), policy, "auto", "backend", registry, Recorder())
    run.run()
    with pytest.raises(MachineError):
        machine_for(policy).events["advance"].trigger(run)
