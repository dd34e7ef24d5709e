"""Property tests: any input ends in a Decision or one of our documented errors.

Generated inputs cover every family, scheme, activation and layer option,
parallel configs (including impossible ones), requests (known names of every
family, unknown names, per-family mappings), env snapshots with every
registered variable unset, on, off or (rarely) malformed, every platform preset
and made-up platforms. Whatever comes in, the outcome is a Decision or an
InputError (bad input) / BackendUnsupportedError / NoBackendError (no backend),
never another exception; deciding twice gives byte-identical canonical traces,
and every trace validates against the published schema.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from moe_fsm.backends.registry import default_registry
from moe_fsm.decision import Decision, DecisionInputs, decide, replay
from moe_fsm.errors import BackendUnsupportedError, InputError, NoBackendError, NoPolicyError, SelectionError
from moe_fsm import profiles
from moe_fsm.inputs.env import EnvSnapshot
from moe_fsm.profiles.seeds.env import ENV as ENV_VARS
from moe_fsm.profiles.seeds.env import FLASHINFER_MOE_BACKEND_CHOICES

# These properties are stated for the seeds profile, whatever vLLM the test machine has.
POLICIES = profiles.get("seeds").policies
SEEDS = profiles.ProfileChoice("seeds", "property tests")
from moe_fsm.inputs.layer import Activation, MoELayer
from moe_fsm.inputs.parallel import AllToAllKind, ParallelConfig
from moe_fsm.inputs.platform import PRESETS, Library, PlatformFacts, Vendor
from moe_fsm.inputs.quant import FLOAT_DTYPES, NVFP4_STATIC, QuantFamily, QuantScheme
from moe_fsm.inputs.request import BackendRequest
from moe_fsm.trace import document as trace_doc

jsonschema = pytest.importorskip("jsonschema")
from moe_fsm.trace import schema  # noqa: E402

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# -- strategies ----------------------------------------------------------------------


FP8_VALID = [(w, a, static) for w in ("tensor", "channel", "block") for a, static in
             (("tensor", True), ("tensor", False), ("token", True), ("token", False), ("group", False))]


# One scheme of each family that has no policy in the seeds profile yet: they must fail as NoPolicyError.
NEW_FAMILIES = {
    "mxfp4": QuantScheme.mxfp4(), "mxfp8": QuantScheme.mxfp8(), "int8": QuantScheme.int8(),
    "int_wna16": QuantScheme.int_wna16(4, 32, True, "compressed-tensors"), "w4a8": QuantScheme.w4a8(),
    "w4a8_int8": QuantScheme.w4a8_int8(-1),
}


@st.composite
def quant_schemes(draw, valid=False):
    kinds = ["unquantized", "fp8", "nvfp4", "nvfp4-w4a16"]
    kind = draw(st.sampled_from(kinds if valid else kinds + list(NEW_FAMILIES)))
    if kind in NEW_FAMILIES:
        return NEW_FAMILIES[kind]
    if kind == "unquantized":
        return QuantScheme.unquantized()
    if kind == "nvfp4":
        return QuantScheme.nvfp4()
    if kind == "nvfp4-w4a16":
        return QuantScheme(QuantFamily.NVFP4, NVFP4_STATIC, None)
    if valid:
        return QuantScheme.fp8(*draw(st.sampled_from(FP8_VALID)))
    # FP8: every weight x activation combination; the impossible ones (static group) raise InputError.
    return QuantScheme.fp8(
        draw(st.sampled_from(["tensor", "channel", "block"])),
        draw(st.sampled_from(["tensor", "token", "group"])),
        draw(st.booleans()),
    )


@st.composite
def layers(draw, valid=False):
    quant = draw(quant_schemes(valid))
    num_experts = draw(st.one_of(st.integers(1, 300), st.sampled_from([1024, 2048, 4096])))
    top_k = draw(st.integers(1, min(num_experts, 16)))
    aligned = st.integers(1, 512).map(lambda k: 16 * k)
    hidden = draw(aligned if valid else st.one_of(*[aligned] * 7, st.integers(1, 9000)))
    return MoELayer(
        quant=quant,
        num_experts=num_experts,
        top_k=top_k,
        hidden_size=hidden,
        # NVFP4 needs both sizes divisible by 16 (issue 12 item 5): a valid layer gets aligned ones.
        intermediate_size=draw(aligned if valid else st.one_of(aligned, st.integers(1, 9000))),
        activation=draw(st.sampled_from(list(Activation))),
        swiglu_limit=draw(st.one_of(st.none(), st.floats(0.5, 20.0))),
        lora=draw(st.booleans()),
        router_weight_on_input=draw(st.booleans()) and top_k == 1,
        dtype=draw(st.sampled_from(FLOAT_DTYPES)),
        allow_vllm_cutlass=draw(st.booleans()),
    )


@st.composite
def parallel_configs(draw):
    if draw(st.booleans()):
        return ParallelConfig(batched_activation_format=draw(st.booleans()))
    return ParallelConfig(
        tp_size=draw(st.sampled_from([1, 1, 2, 4, 8])),
        dp_size=draw(st.sampled_from([1, 1, 2, 4, 8])),
        ep_size=draw(st.sampled_from([1, 1, 2, 4, 8, 16])),
        batched_activation_format=draw(st.booleans()),
        all2all=draw(st.sampled_from(list(AllToAllKind))),
    )


def _all_user_names() -> list[str]:
    names = set()
    for policy in POLICIES.values():
        names.update(policy.user_names)
    for extension in default_registry("seeds").extension_names.values():
        names.update(extension)
    return sorted(names)


BACKEND_NAMES = _all_user_names() + ["foo", "Flashinfer-Cutlass", "DEEP-GEMM", "fastest", "none"]

requests = st.one_of(
    st.just("auto"),
    st.just("auto"),
    st.just("auto"),
    st.sampled_from(BACKEND_NAMES),
    st.sampled_from(BACKEND_NAMES),
    st.dictionaries(
        st.sampled_from(["unquantized", "fp8", "nvfp4", "default", "FP8", " NvFp4 ", "*"]),
        st.sampled_from(BACKEND_NAMES + ["auto"]),
        min_size=1,
        max_size=4,
    ),  # 'fp8' and 'FP8' together name a family twice: an InputError
    st.dictionaries(st.sampled_from(["int8", "mxfp4"]), st.sampled_from(BACKEND_NAMES), min_size=1, max_size=1),
)


def _values(name: str):
    if name == "VLLM_FLASHINFER_MOE_BACKEND":
        good = list(FLASHINFER_MOE_BACKEND_CHOICES) + ["LATENCY", " throughput "]
    elif ENV_VARS[name].accepted == "0 or 1":
        good = ["0", "1"]
    else:
        good = ["0", "1", "true", "false", "True", "FALSE"]
    # Unset half the time, a valid value otherwise (env_mappings adds the malformed ones).
    return st.one_of(st.none(), st.none(), st.sampled_from(good), st.sampled_from(good))


@st.composite
def env_mappings(draw):
    env = {}
    for name in sorted(ENV_VARS):
        value = draw(_values(name))
        if value is not None:
            env[name] = value
    if draw(st.sampled_from([False] * 19 + [True])):  # now and then, one malformed value (an InputError naming it)
        env[draw(st.sampled_from(sorted(ENV_VARS)))] = draw(st.sampled_from(["maybe", "2", "", "yes", "fast"]))
    return env


CAPABILITIES = [(7, 5), (8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (10, 3), (11, 0), (12, 0), (12, 1)]


@st.composite
def platforms(draw):
    if draw(st.booleans()):
        return PRESETS[draw(st.sampled_from(sorted(PRESETS)))]
    vendor = draw(st.sampled_from(list(Vendor)))
    return PlatformFacts(
        vendor=vendor,
        capability=draw(st.sampled_from(CAPABILITIES)) if vendor is Vendor.CUDA else None,
        gcn_arch=draw(st.sampled_from(["gfx90a", "gfx942", "gfx950", None])) if vendor is Vendor.ROCM else None,
        device_name="generated",
        libraries=frozenset(draw(st.sets(st.sampled_from(list(Library))))),
    )


def _build(data) -> DecisionInputs:
    """Draw an input; InputError (a documented error) propagates from wherever the input is malformed."""
    layer = data.draw(layers(), label="layer")
    parallel = data.draw(parallel_configs(), label="parallel")
    request = BackendRequest.parse(data.draw(requests, label="request"))
    env = EnvSnapshot.from_mapping(data.draw(env_mappings(), label="env"), strict_names=True)
    ENV_VARS.reader(env)  # a value the profile cannot parse is an InputError naming it
    platform = data.draw(platforms(), label="platform")
    return DecisionInputs(layer, parallel, request, env, platform, SEEDS)


def _decide(inputs: DecisionInputs, **kwargs) -> tuple[dict, type | None]:
    try:
        decision = decide(inputs, **kwargs)
    except SelectionError as err:
        assert isinstance(err, (BackendUnsupportedError, NoBackendError, NoPolicyError)), f"undocumented selection error {type(err)}"
        # vLLM's oracles raise these built-ins; engines that catch them keep working.
        assert isinstance(err, ValueError) if isinstance(err, BackendUnsupportedError) else isinstance(err, NotImplementedError)
        assert err.trace is not None and err.trace["outcome"]["status"] == "failed"
        assert err.trace["outcome"]["error"]["type"] == type(err).__name__
        assert err.trace["outcome"]["error"]["message"] == err.message
        return err.trace, type(err)
    assert isinstance(decision, Decision)
    assert decision.trace["outcome"]["status"] in ("selected", "fallback_none")
    assert decision.backend == decision.trace["outcome"]["backend"]
    return decision.trace, None


@st.composite
def realistic_inputs(draw):
    """Valid inputs a deployment would pass: a preset, a valid env, auto or a name the layer's family knows."""
    layer = draw(layers(valid=True))
    policy = POLICIES[layer.family]
    request = draw(st.one_of(st.just("auto"), st.just("auto"), st.sampled_from(sorted(policy.user_names))))
    env = {}
    for name in sorted(ENV_VARS):
        value = draw(_values(name))
        if value is not None:
            env[name] = value
    return DecisionInputs(
        layer=layer,
        parallel=draw(st.one_of(st.just(ParallelConfig()), st.just(ParallelConfig(batched_activation_format=True)),
                                st.sampled_from([ParallelConfig(tp_size=2, ep_size=2), ParallelConfig(dp_size=2),
                                                 ParallelConfig(dp_size=2, ep_size=2, all2all=AllToAllKind.TORCH_ALL2ALL),
                                                 ParallelConfig(dp_size=2, ep_size=2, batched_activation_format=True,
                                                                all2all=AllToAllKind.DEEPEP_LOW_LATENCY)]))),
        request=BackendRequest.parse(request),
        env=EnvSnapshot.from_mapping(env, strict_names=True),
        platform=PRESETS[draw(st.sampled_from(sorted(PRESETS)))],
        profile=SEEDS,
    )


# -- properties ----------------------------------------------------------------------


def _check_decision(inputs: DecisionInputs) -> None:
    document, error = _decide(inputs)
    event(f"{document['family']}: {error.__name__ if error else document['outcome']['status']}")

    # The trace is valid and complete.
    problems = schema.errors(document)
    assert not problems, "\n".join(problems)

    # Deciding twice gives the same canonical trace, byte for byte.
    again, error_again = _decide(inputs)
    assert error_again is error
    assert trace_doc.dumps(document, include_volatile=False) == trace_doc.dumps(again, include_volatile=False)

    # Tracing off changes nothing but the events.
    quiet, error_quiet = _decide(inputs, trace=False)
    assert error_quiet is error
    assert quiet["outcome"] == document["outcome"] and quiet["path"] == document["path"]
    assert quiet["events"] == []

    # The trace alone replays the decision (its inputs survive the JSON round trip).
    assert DecisionInputs.from_json(document["inputs"]) == inputs
    assert trace_doc.dumps(replay(document), include_volatile=False) == trace_doc.dumps(document, include_volatile=False)


@SETTINGS
@given(st.data())
def test_any_input_ends_in_a_decision_or_a_documented_error(data):
    try:
        inputs = _build(data)
    except InputError:
        event("input error")
        return  # malformed input is reported as an InputError (and nothing else)
    _check_decision(inputs)


@SETTINGS
@given(realistic_inputs())
def test_any_valid_deployment_input_decides_deterministically(inputs):
    _check_decision(inputs)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_explain_tells_any_trace(data):
    """explain (and its what-to-change analysis) never fails on a trace the engine wrote."""
    from moe_fsm.cli.explain import explain_lines

    try:
        inputs = _build(data)
    except InputError:
        return
    document, _ = _decide(inputs)
    lines = explain_lines(document, "trace.json")
    text = "\n".join(lines)
    assert "What was asked" in text and "To get a different backend" in text
    outcome = document["outcome"]
    assert (outcome.get("backend") or outcome["error"]["message"]) in text


def test_a_family_named_twice_in_a_mapping_is_refused():
    with pytest.raises(InputError, match="names family 'fp8' twice"):
        BackendRequest.parse({"fp8": "triton", "FP8": "deep_gemm"})
    with pytest.raises(InputError, match="names a family twice"):
        BackendRequest.parse("fp8=triton,FP8=deep_gemm")
