"""Fuzz test (issue 12): every outcome is a decision or a documented error with a message, never another exception.

Three drivers, each with arbitrary (including wrongly typed) input:

- the library: ``MoELayer(...)``, ``select(...)`` and ``decide(...)`` with values drawn from
  valid ones and from any JSON-ish or Python value;
- the CLI verbs ``select``/``explain``/``replay``/``diagram``/``golden`` with arbitrary argv;
- ``explain`` and ``replay`` on arbitrary trace files: golden traces with random edits, and raw text;
- ``plan`` on arbitrary config.json files (issue 24): real checkpoints' configs and drawn ones of every kind plan
  reads, with garbage values, missing and extra fields, wrong types, bytes that are not UTF-8 JSON;
- the readers of traces, plan manifests, --input specs (JSON and TOML) and config.json files given integers past a
  float's range (past 4300 digits too) and strings with terminal escape sequences (issue 39): a huge integer is one
  line saying so, and no control character reaches the terminal raw.

A decision must carry a trace that validates; a documented error is a ``MoeFsmError`` (InputError,
the selection errors, TraceWriteError...) whose message is not empty; the CLI must return one of its
documented exit statuses. CI runs a short pass (``MOE_FSM_FUZZ_EXAMPLES``, default 60 per driver, 300 for ``plan``);
a maintainer runs the long mode, e.g.::

    MOE_FSM_FUZZ_EXAMPLES=34000 MOE_FSM_FUZZ_REPORT=fuzz.json python -m pytest -q tests/hardening/test_fuzz.py

and records the figures in docs/fuzz.md.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import tempfile
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from moe_fsm import (
    Decision, MoeFsmError, MoELayer, ParallelConfig, PlatformFacts, QuantScheme,
    decide, make_inputs, preset, select,
)
from moe_fsm.cli.main import main
from moe_fsm.inputs.layer import Activation
from moe_fsm.inputs.parallel import AllToAllKind
from moe_fsm.inputs.platform import PRESETS
from moe_fsm.trace import schema

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = sorted((ROOT / "traces").glob("*/golden/*.json"))
EXAMPLES = int(os.environ.get("MOE_FSM_FUZZ_EXAMPLES", "60"))
REPORT = os.environ.get("MOE_FSM_FUZZ_REPORT")
CLI_STATUSES = {0, 1, 2, 3, 4}
# No shrinking: a failing example is printed as drawn, and shrinking garbage inputs takes minutes.
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=REPORT is None,
                suppress_health_check=list(HealthCheck), phases=(Phase.explicit, Phase.generate))
OUTCOMES: Counter = Counter()


def _write_report() -> None:
    """The counts so far, rewritten whole (a long run stopped from outside still leaves its figures)."""
    path = Path(REPORT)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(dict(sorted(OUTCOMES.items())), indent=2) + "\n")
    tmp.replace(path)


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    if REPORT:
        _write_report()


def _count(driver: str, outcome: str) -> None:
    OUTCOMES[f"{driver}: {outcome}"] += 1
    OUTCOMES[f"{driver}: examples"] += 1
    if REPORT and OUTCOMES[f"{driver}: examples"] % 250 == 0:
        _write_report()


# -- values --------------------------------------------------------------------------------------------------------

junk = st.one_of(
    st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12), st.binary(max_size=6), st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2), st.just(()), st.just(object()),
)


def mostly(valid, *others):
    """``valid`` about 13 times in 16, each of ``others`` about once (one_of would weigh them alike)."""
    # Not i == 0: Hypothesis draws boundary integers far more often than the others.
    return st.integers(0, 15).flatmap(lambda i: others[i - 11] if 11 <= i < 11 + len(others) else valid)


def maybe(valid):
    """Mostly valid values (so the machine is exercised), one time in sixteen anything at all."""
    return mostly(valid, junk)


class Later:
    """An input object built inside the test (its constructor may refuse the arguments drawn)."""

    def __init__(self, make, *args, **kwargs) -> None:
        self.make, self.args, self.kwargs = make, args, kwargs

    def __repr__(self) -> str:
        return f"{getattr(self.make, '__qualname__', self.make)}(*{self.args!r}, **{self.kwargs!r})"


def later(make, *args, **kwargs):
    return st.builds(lambda *a, **k: Later(make, *a, **k), *args, **kwargs)


def build(value):
    if isinstance(value, Later):
        return value.make(*(build(a) for a in value.args), **{k: build(v) for k, v in value.kwargs.items()})
    return value


quant_schemes = st.one_of(
    st.just(QuantScheme.unquantized()), st.just(QuantScheme.nvfp4()),
    later(QuantScheme.fp8, maybe(st.sampled_from(["tensor", "channel", "block"])),
          maybe(st.sampled_from(["tensor", "token", "group"])), maybe(st.booleans())),
    later(QuantScheme, maybe(st.sampled_from(["unquantized", "fp8", "nvfp4"]))),
)
sizes = st.one_of(st.sampled_from([16, 64, 96, 100, 128, 256, 2048, 7168]), st.integers(-3, 10_000))


@st.composite
def layer_kwargs(draw):
    kwargs = {}
    for name, valid in (
        ("quant", quant_schemes), ("num_experts", st.integers(1, 600)), ("top_k", st.integers(1, 10)),
        ("hidden_size", sizes), ("intermediate_size", sizes), ("activation", st.sampled_from([a.value for a in Activation])),
        ("swiglu_limit", st.one_of(st.none(), st.floats(0.1, 50))), ("lora", st.booleans()),
        ("router_weight_on_input", st.sampled_from([False, False, False, True])), ("dtype", st.sampled_from(["bfloat16", "float16", "float32"])),
        ("allow_vllm_cutlass", st.booleans()),
    ):
        if draw(st.integers(0, 3)) == 2:  # a few fields per layer, so that most layers are valid
            kwargs[name] = draw(maybe(valid))
    return kwargs


parallels = mostly(st.sampled_from([None, ParallelConfig(), ParallelConfig(dp_size=2, ep_size=2)]), later(
    ParallelConfig, tp_size=maybe(st.sampled_from([1, 2, 8])), dp_size=maybe(st.sampled_from([1, 2, 8])),
    ep_size=maybe(st.sampled_from([1, 2, 16])), batched_activation_format=maybe(st.booleans()),
    all2all=maybe(st.sampled_from([k.value for k in AllToAllKind])),
), junk)
backends = maybe(st.one_of(
    st.sampled_from(["auto", "triton", "deep_gemm", "flashinfer_cutlass", "flashinfer_trtllm", "marlin", "cutlass",
                     "flashinfer_b12x", "emulation", "aiter", "nonsense"]),
    st.dictionaries(st.sampled_from(["fp8", "nvfp4", "unquantized", "default", "int4"]),
                    st.sampled_from(["auto", "triton", "flashinfer_b12x", "marlin", ""]), max_size=3),
    st.just("nvfp4=flashinfer_b12x,fp8=triton"),
))
env_names = st.sampled_from(["VLLM_USE_DEEP_GEMM", "VLLM_MOE_USE_DEEP_GEMM", "VLLM_USE_FLASHINFER_MOE_FP8",
                             "VLLM_USE_FLASHINFER_MOE_FP4", "VLLM_FLASHINFER_MOE_BACKEND", "VLLM_TEST_FORCE_FP8_MARLIN",
                             "VLLM_USE_FLASHINFER_MOE_FP16", "VLLM_USE_DEEP_GEM", "PATH"])
env_values = st.sampled_from(["0", "1", "true", "false", "latency", "throughput", "masked_gemm", "maybe", ""])
good_env = st.one_of(
    st.just({}), st.just({"VLLM_USE_DEEP_GEMM": "0"}), st.just({"VLLM_USE_FLASHINFER_MOE_FP8": "1"}),
    st.just({"VLLM_USE_FLASHINFER_MOE_FP4": "0"}), st.just({"VLLM_FLASHINFER_MOE_BACKEND": "throughput"}),
    st.just({"VLLM_TEST_FORCE_FP8_MARLIN": "true"}), st.just({"VLLM_USE_DEEP_GEMM": "1", "VLLM_MOE_USE_DEEP_GEMM": "1"}),
)
envs = mostly(good_env, st.dictionaries(env_names, env_values, max_size=3), junk)
presets = st.sampled_from(sorted(PRESETS)).map(preset)
platforms = mostly(presets, st.sampled_from(sorted(PRESETS)), junk,
                      later(PlatformFacts, vendor=maybe(st.sampled_from(["cuda", "rocm", "cpu"])),
                                capability=maybe(st.tuples(st.integers(0, 12), st.integers(0, 9))),
                                libraries=maybe(st.frozensets(st.sampled_from(["triton", "deep_gemm", "x"]), max_size=2))))
policies = mostly(st.sampled_from([None, None, "seeds", "vllm-0.33", "default"]), st.just("vllm-0.0"), junk)
layer_names = st.one_of(st.none(), st.text(max_size=30), junk)


def _check_decision(decision) -> None:
    assert isinstance(decision, Decision)
    text = json.dumps(decision.trace, allow_nan=False)
    assert schema.errors(json.loads(text)) == []


def _check_error(err: BaseException) -> str:
    if not isinstance(err, MoeFsmError) or not str(err).strip():
        raise AssertionError(f"undocumented outcome {type(err).__name__}: {err!r}") from err
    return type(err).__name__


# -- driver 1: the library ----------------------------------------------------------------------------------------------


@FUZZ
@given(data=st.data())
def test_library_select_and_decide_end_in_a_decision_or_a_documented_error(data):
    kwargs = data.draw(layer_kwargs(), "layer")
    with tempfile.TemporaryDirectory() as tmp, contextlib.chdir(tmp):  # a junk relative trace path lands in tmp
        trace_path = data.draw(st.one_of(st.none(), st.just(str(Path(tmp) / "t.json")), st.just(""), junk), "trace_path")
        try:
            drawn = {k: data.draw(v, k) for k, v in (("parallel", parallels), ("backend", backends), ("env", envs),
                                                     ("platform", platforms), ("policy", policies))}
            use_kwargs = data.draw(st.booleans(), "build layer")
            other = data.draw(maybe(st.just(MoELayer())), "other layer")
            layer = MoELayer(**{k: build(v) for k, v in kwargs.items()}) if use_kwargs else other
            args = {k: build(v) for k, v in drawn.items()}
            if data.draw(st.booleans(), "via decide"):
                decision = decide(make_inputs(layer, **args), layer_name=data.draw(layer_names, "name"), trace_path=trace_path)
            else:
                decision = select(layer, **args, layer_name=data.draw(layer_names, "name"), trace_path=trace_path)
        except Exception as err:  # noqa: BLE001 - the point: classify every exception
            _count("library", _check_error(err))
        else:
            _check_decision(decision)
            if isinstance(trace_path, str) and trace_path:
                assert schema.errors(json.loads(Path(trace_path).read_text())) == []
            _count("library", f"decision {decision.status}")


# -- driver 2: CLI argv ------------------------------------------------------------------------------------------------

FLAG_VALUES = {
    "--quant": st.sampled_from(["fp8", "nvfp4", "unquantized", "int8"]),
    "--weight-scale": st.sampled_from(["tensor", "channel", "block", "row"]),
    "--act-scale": st.sampled_from(["tensor", "token", "group"]),
    "--experts": st.sampled_from(["8", "256", "0", "-1", "1e3", "x"]),
    "--top-k": st.sampled_from(["1", "2", "8", "300"]),
    "--hidden": sizes.map(str), "--intermediate": sizes.map(str),
    "--activation": st.sampled_from(["silu", "gelu", "swigluoai", "relu"]),
    "--swiglu-limit": st.sampled_from(["7", "inf", "nan", "-1", "0", "1e999"]),
    "--dtype": st.sampled_from(["bfloat16", "float16", "float64"]),
    "--tp": st.sampled_from(["1", "2", "0"]), "--dp": st.sampled_from(["1", "2"]), "--ep": st.sampled_from(["1", "4"]),
    "--all2all": st.sampled_from([k.value for k in AllToAllKind] + ["bogus"]),
    "--backend": st.sampled_from(["auto", "triton", "deep_gemm", "nvfp4=flashinfer_b12x,fp8=triton", "fp8=x,fp8=y", "", "=="]),
    "--env": st.tuples(env_names, env_values).map("=".join) | st.text(max_size=8),
    "--platform": st.sampled_from(sorted(PRESETS) + ["probe", "sm99", ""]),
    "--policy": st.sampled_from(["seeds", "default", "nope"]),
    "--layer-name": st.text(max_size=20),
    "--trace-out": st.sampled_from(["t.json", "d/t.json", ".", "t.json/x.json"]),
    "--input": st.sampled_from(["in.json", "in.toml", "missing.json", "t.json", "."]),
    "--dir": st.sampled_from(["traces", str(ROOT / "traces"), "."]),
}
SWITCHES = ["--static-act", "--weight-only", "--lora", "--router-weight-on-input", "--allow-vllm-cutlass", "--batched",
            "--no-env", "--json", "--verbose", "--strict", "--check", "--update", "--list", "--help"]


@st.composite
def argvs(draw):
    verb = draw(st.sampled_from(["select", "select", "select", "explain", "replay", "diagram", "golden", "bogus", "--version"]))
    argv = [verb]
    for _ in range(draw(st.integers(0, 7))):
        kind = draw(st.integers(0, 9))
        if kind < 6:
            flag = draw(st.sampled_from(sorted(FLAG_VALUES)))
            argv += [flag, draw(FLAG_VALUES[flag])]
        elif kind < 8:
            argv.append(draw(st.sampled_from(SWITCHES)))
        else:
            argv.append(draw(st.sampled_from(["t.json", "in.json", "notes.md", "x", "-", ""]) | st.text(max_size=6)))
    if verb == "diagram" and "--update" in argv:  # keep writes inside the scratch directory
        argv = [a for a in argv if a != "--update"]
    if verb == "golden":
        argv = [a for a in argv if a != "--update"]
    return argv


def _scratch(tmp: Path) -> None:
    (tmp / "in.json").write_text(json.dumps({"layer": {"quant": "fp8", "experts": 16}, "platform": "sm90", "env": {}}))
    (tmp / "in.toml").write_text('platform = "sm100"\n[layer]\nquant = "nvfp4"\n')
    (tmp / "notes.md").write_text("# notes\n```mermaid\nstateDiagram-v2\n```\n")
    (tmp / "t.json").write_text(GOLDEN[0].read_text())


def _captured_main(argv: list[str], cwd: Path) -> tuple[int, str, str]:
    """``main(argv)`` run in ``cwd``: its status, standard output and standard error."""
    out, err = io.StringIO(), io.StringIO()
    old = os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
    finally:
        os.chdir(old)
    return code, out.getvalue(), err.getvalue()


def _run_cli(argv: list[str], cwd: Path) -> int:
    code, out, err = _captured_main(argv, cwd)
    assert "Traceback" not in out + err, (argv, err)
    assert code in CLI_STATUSES, (argv, code, err)
    if code == 2:
        assert err.strip(), argv
    return code


@FUZZ
@given(argv=argvs())
def test_cli_argv_ends_in_a_documented_exit_status(argv):
    with tempfile.TemporaryDirectory() as tmp:
        _scratch(Path(tmp))
        os.environ.pop("VLLM_USE_DEEP_GEMM", None)
        code = _run_cli(argv, Path(tmp))
    _count("cli argv", f"exit {code}")


# -- driver 3: arbitrary trace files ----------------------------------------------------------------------------------------

json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**20), st.floats(allow_nan=False, allow_infinity=False),
              st.text(max_size=10)),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _paths(value, (*prefix, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _paths(value, (*prefix, i))


@st.composite
def trace_texts(draw):
    kind = draw(st.integers(0, 9))
    if kind == 0:
        return draw(st.text(max_size=60))
    document = json.loads(draw(st.sampled_from(GOLDEN)).read_text())
    for _ in range(draw(st.integers(1, 3))):
        paths = [p for p in _paths(document) if p]
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent = document
        for key in path[:-1]:
            parent = parent[key]
        action = draw(st.sampled_from(["replace", "replace", "delete", "add"]))
        if action == "delete":
            del parent[path[-1]]
        elif action == "add" and isinstance(parent, dict):
            parent[draw(st.text(max_size=6))] = draw(json_values)
        else:
            parent[path[-1]] = draw(json_values)
    return json.dumps(document)


@FUZZ
@given(text=trace_texts(), verb=st.sampled_from(["explain", "replay", "replay --strict"]))
def test_explain_and_replay_of_arbitrary_traces_end_in_a_documented_exit_status(text, verb):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        path.write_text(text)
        code = _run_cli([*verb.split(), str(path)], Path(tmp))
    _count("trace files", f"{verb} exit {code}")
    try:
        document = json.loads(text)
    except ValueError:
        return
    if schema.jsonschema_installed():
        import jsonschema

        from moe_fsm.trace.mini_schema import MiniValidator

        official = jsonschema.Draft202012Validator(schema.load_schema()).is_valid(document)
        assert MiniValidator(schema.load_schema()).is_valid(document) == official, "the validators disagree"



# -- driver 4: `moe-fsm plan` on arbitrary config.json files (issue 24) ------------------------------------------------

CONFIGS = ROOT / "tests" / "data" / "configs"
REAL_CONFIGS = {p.parent.name: json.loads(p.read_text()) for p in sorted(CONFIGS.glob("*/config.json"))}
# The keys plan reads (every spelling), so that edits hit them often.
PLAN_KEYS = ["num_hidden_layers", "n_routed_experts", "num_local_experts", "num_experts", "moe_num_experts",
             "num_experts_per_tok", "experts_per_token", "moe_topk", "top_k", "hidden_size", "moe_intermediate_size",
             "expert_intermediate_size", "intermediate_size", "torch_dtype", "dtype", "n_shared_experts",
             "num_shared_experts", "shared_expert_intermediate_size", "hidden_act", "swiglu_limit", "architectures",
             "model_type", "first_k_dense_replace", "moe_layer_freq", "decoder_sparse_step", "interleave_moe_layer_step",
             "mlp_only_layers", "text_config", "quantization_config"]
QUANT_KEYS = ["quant_method", "weight_block_size", "activation_scheme", "modules_to_not_convert", "ignored_layers",
              "quant_algo", "quantization", "exclude_modules", "quantized_layers", "ignore", "config_groups", "targets",
              "weights", "input_activations", "num_bits", "type", "strategy", "group_size", "dynamic", "block_structure",
              "bits", "sym", "desc_act", "zero_point", "version"]
config_junk = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 3000), st.integers(-2**70, 2**70), st.sampled_from([1024, 1025, 4096, 4097]),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
    st.sampled_from(["silu", "gelu", "relu", "bfloat16", "float8_e4m3fn", "fp8", "modelopt", "NVFP4", "FP8", "MIXED_PRECISION",
                     "Linear", "re:.*experts.*", "re:(", "model.layers.1*", "*", "[", "lm_head", "dynamic", "static",
                     "channel", "token", "group", "tensor", "block", "tensor_group", "float", "int"]),
    st.lists(st.one_of(st.integers(-2, 200), st.text(max_size=8), st.sampled_from(["model.layers.3.mlp", "re:.*", "*.mlp*"])),
             max_size=4),
    st.dictionaries(st.text(max_size=6), st.one_of(st.integers(), st.text(max_size=6), st.none()), max_size=3),
)
geometry = st.fixed_dictionaries({
    "architectures": st.sampled_from([["Qwen3MoeForCausalLM"], ["MixtralForCausalLM"], ["DeepseekV3ForCausalLM"],
                                      ["GptOssForCausalLM"], ["SomethingNew"]]),
    "num_hidden_layers": st.integers(1, 24), "hidden_size": st.sampled_from([64, 128, 2048, 2880, 7168, 100]),
    "num_experts": st.sampled_from([1, 8, 32, 128, 256]), "num_experts_per_tok": st.sampled_from([1, 2, 4, 8]),
    "moe_intermediate_size": st.sampled_from([64, 768, 2048, 96]), "hidden_act": st.sampled_from(["silu", "gelu", "swish"]),
    "torch_dtype": st.sampled_from(["bfloat16", "float16", "float32"]),
}, optional={"first_k_dense_replace": st.integers(0, 3), "decoder_sparse_step": st.integers(1, 3),
             "mlp_only_layers": st.lists(st.integers(0, 24), max_size=3), "interleave_moe_layer_step": st.integers(1, 2),
             "n_shared_experts": st.integers(0, 2), "swiglu_limit": st.floats(0.5, 10)})
ct_group = st.fixed_dictionaries({
    "targets": st.sampled_from([["Linear"], ["re:.*experts.*"], ["re:.*down_proj$"], []]),
    "weights": st.fixed_dictionaries({"type": st.sampled_from(["float", "int"]), "num_bits": st.sampled_from([4, 8]),
                                      "strategy": st.sampled_from(["tensor", "channel", "block", "group", "tensor_group"]),
                                      "group_size": st.sampled_from([None, 16, 32, 128]),
                                      "block_structure": st.sampled_from([None, [128, 128], [64, 64]])}),
    "input_activations": st.one_of(st.none(), st.fixed_dictionaries({
        "type": st.sampled_from(["float", "int"]), "num_bits": st.sampled_from([4, 8]),
        "strategy": st.sampled_from(["tensor", "token", "group", "tensor_group"]), "dynamic": st.sampled_from([True, False, "local"])})),
})
module_names = st.builds("model.layers.{}.{}".format, st.integers(0, 24),
                        st.sampled_from(["mlp.experts.0.up_proj", "mlp.experts.3.down_proj", "mlp.gate_proj", "self_attn.q_proj",
                                         "block_sparse_moe.experts.1.w1"]))
quantization_configs = st.one_of(
    st.none(),
    st.fixed_dictionaries({"quant_method": st.just("fp8"), "weight_block_size": st.sampled_from([[128, 128], [64, 64], None]),
                           "activation_scheme": st.sampled_from(["dynamic", "static"])},
                          optional={"modules_to_not_convert": st.lists(st.sampled_from(["lm_head", "model.layers.1.mlp", "gate"]), max_size=2),
                                    "ignored_layers": st.lists(module_names, max_size=2)}),
    st.fixed_dictionaries({"quant_method": st.just("modelopt"), "quant_algo": st.sampled_from(
        ["NVFP4", "FP8", "FP8_PB_WO", "FP8_PER_CHANNEL_PER_TOKEN", "W4A16_NVFP4", "MXFP4", "INT4_AWQ", "MIXED_PRECISION"])},
        optional={"exclude_modules": st.lists(st.sampled_from(["lm_head", "model.layers.0.mlp*", "*self_attn*", "model.layers.?.mlp",
                                                               "experts", "[", ""]), max_size=3),
                  "quantized_layers": st.dictionaries(module_names, st.fixed_dictionaries(
                      {"quant_algo": st.sampled_from(["NVFP4", "FP8", "MXFP8", "bogus"])}), max_size=6)}),
    st.builds(lambda inner: {"quant_method": "modelopt", "quantization": inner}, st.fixed_dictionaries(
        {"quant_algo": st.sampled_from(["NVFP4", "FP8", "MIXED_PRECISION"])},
        optional={"exclude_modules": st.lists(st.sampled_from(["lm_head", "model.layers.1*"]), max_size=2)})),
    st.fixed_dictionaries({"quant_method": st.just("compressed-tensors"),
                           "config_groups": st.dictionaries(st.sampled_from(["group_0", "group_1", "down"]), ct_group, max_size=2)},
                          optional={"ignore": st.lists(st.sampled_from(["lm_head", "re:.*mlp.gate$", "re:.*experts.*",
                                                                        "re:.*down_proj$", "model.layers.2.mlp.experts.0.up_proj"]), max_size=3)}),
    st.fixed_dictionaries({"quant_method": st.just("mxfp4")},
                          optional={"modules_to_not_convert": st.lists(st.sampled_from(
                              ["model.layers.*.self_attn", "model.layers.*.mlp.router", "lm_head", "model.layers.2.mlp"]), max_size=3)}),
    st.fixed_dictionaries({"quant_method": st.sampled_from(["gptq", "awq", "GPTQ", "awq_marlin"]), "bits": st.sampled_from([4, 8, 3]),
                           "group_size": st.sampled_from([128, 32, -1]), "sym": st.booleans(), "desc_act": st.booleans()},
                          optional={"zero_point": st.booleans(), "version": st.sampled_from(["gemm", "gemv"])}),
    st.fixed_dictionaries({"quant_method": config_junk}),
)


@st.composite
def config_dicts(draw):
    if draw(st.integers(0, 3)) == 0:
        config = json.loads(json.dumps(REAL_CONFIGS[draw(st.sampled_from(sorted(REAL_CONFIGS)))]))
        if config.get("num_hidden_layers", 0) > 24 and draw(st.booleans()):
            config["num_hidden_layers"] = draw(st.integers(1, 24))  # keep most examples cheap
    else:
        config = dict(draw(geometry))
        quant = draw(quantization_configs)
        if quant is not None:
            config["quantization_config"] = quant
        config = json.loads(json.dumps(config))  # a copy: sampled_from hands out the same list objects every time
        if draw(st.integers(0, 9)) == 0:
            config = {"architectures": config.pop("architectures"), "text_config": config}
    for _ in range(draw(st.sampled_from([0, 0, 0, 1, 1, 2, 3, 4]))):  # a third untouched, so plan gets to decide
        paths = [p for p in _paths(config) if p]
        action = draw(st.sampled_from(["replace", "replace", "delete", "add", "add_known"]))
        if action == "add_known" or not paths:
            target = config
            if isinstance(config.get("quantization_config"), dict) and draw(st.booleans()):
                target = config["quantization_config"]
                target[draw(st.sampled_from(QUANT_KEYS))] = draw(config_junk)
            else:
                target[draw(st.sampled_from(PLAN_KEYS))] = draw(config_junk)
            continue
        path = draw(st.sampled_from(paths))
        parent = config
        for key in path[:-1]:
            parent = parent[key]
        if action == "delete":
            del parent[path[-1]]
        elif action == "add" and isinstance(parent, dict):
            parent[draw(st.text(max_size=6))] = draw(config_junk)
        else:
            parent[path[-1]] = draw(config_junk)
    return config


@st.composite
def config_files(draw):
    """config.json bytes: mostly a drawn config dict, sometimes broken text (not UTF-8, truncated, not an object)."""
    config = draw(config_dicts())
    text = json.dumps(config, indent=draw(st.sampled_from([None, 1])))
    kind = draw(st.integers(0, 19))
    if kind == 0:
        return text.encode("utf-16"), config
    if kind == 1:
        data = bytearray(text.encode())
        data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0x80, 0xff))
        return bytes(data), config
    if kind == 2:
        return text.encode()[:draw(st.integers(0, len(text)))], config
    if kind == 3:
        return json.dumps(draw(config_junk)).encode(), config
    return text.encode(), config


PLAN_STATUSES = {0, 1, 2}  # a decision for every layer; some layer not mapped or failed; bad input
# A plan example costs ~15 ms: CI runs a few hundred (derandomized); MOE_FSM_FUZZ_EXAMPLES sets the long mode's count.
PLAN_FUZZ = settings(FUZZ, max_examples=int(os.environ.get("MOE_FSM_FUZZ_EXAMPLES", "300")))


@PLAN_FUZZ
@given(drawn=config_files(), platform=st.sampled_from(sorted(PRESETS)), policy=st.sampled_from(["seeds", "vllm-0.33"]),
       extra=st.lists(st.sampled_from([["--json"], ["--tp", "2"], ["--dp", "2", "--ep", "2"], ["--backend", "triton"],
                                       ["--backend", "nvfp4=flashinfer_b12x"], ["--batched"], ["--env", "VLLM_USE_DEEP_GEMM=0"]]),
                      max_size=2))
def test_plan_of_arbitrary_config_files_ends_in_a_documented_exit_status(drawn, platform, policy, extra):
    data, config = drawn
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "config.json").write_bytes(data)
        argv = ["plan", str(tmp / "config.json"), "--platform", platform, "--policy", policy, "--no-env",
                "--trace-dir", str(tmp / "traces"), *(arg for group in extra for arg in group)]
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
        assert "Traceback" not in out.getvalue() + err.getvalue(), (argv, err.getvalue())
        assert code in PLAN_STATUSES, (code, err.getvalue(), config)
        if code == 2:
            assert err.getvalue().strip() and not out.getvalue(), config
        written = sorted((tmp / "traces").glob("*")) if (tmp / "traces").is_dir() else []
        if code == 2:
            assert written == [], "bad input was refused after traces were written"
        else:
            # bounded: at most one file per MoE layer (plus a manifest), and what was written is a valid trace
            assert len(written) <= 1024 + 1
            for path in written[:1] + written[-1:]:
                if path.suffix == ".json":
                    assert schema.errors(json.loads(path.read_text())) == []
            if "--json" in argv:
                rows = json.loads(out.getvalue())["layers"]
                assert (code == 0) == all(r["status"] in ("selected", "fallback_none") for r in rows)
    _count("plan configs", f"exit {code}")


# -- driver 5: huge integers and escape sequences in the files the readers take (issue 39) -----------------------------
# An integer past a float's range (past 4300 digits Python cannot even read one) must be one line naming the file; a
# string with terminal escape sequences (from a trace, a manifest, a config, an --input spec) must never reach the
# terminal raw, whatever command prints it.

HUGE_MARK = "@@huge-integer@@"  # json.dumps cannot write an int past 4300 digits: drawn ones travel as this text
huge_integers = st.builds(lambda digits, sign: f"{HUGE_MARK}{sign}{'9' * digits}",
                          st.sampled_from([309, 400, 4300, 4301, 5000]), st.sampled_from(["", "-"]))
ESCAPE_SEQUENCES = ["\x1b[31m", "\x1b]0;retitled\x07", "\x1b[2J", "\x9b1;1H", "\x1bc", "\r", "\n", "\t", "\x00", "\x7f",
                    "\u2028", "\x08"]
escape_texts = st.builds(lambda before, escape, after: before + escape + after, st.text(max_size=4),
                         st.sampled_from(ESCAPE_SEQUENCES), st.text(max_size=4))
hostile_values = st.one_of(huge_integers, escape_texts, st.lists(st.one_of(huge_integers, escape_texts), max_size=2),
                           st.dictionaries(escape_texts, st.one_of(huge_integers, escape_texts), max_size=2))
RAW_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029]")  # what cli.text.printable escapes


def _with_huge_integers(text: str) -> tuple[str, bool]:
    """JSON text whose huge-integer marks (drawn as strings) become the integers themselves; and whether it has one."""
    text, huge = re.subn(rf'"{HUGE_MARK}(-?\d+)"', r"\1", text)
    return text, huge > 0


def _edit(draw, document, values, edits: int) -> None:
    """Replace or add ``edits`` values anywhere in ``document`` (a dict), drawn from ``values``, or end a string
    with an escape sequence."""
    for _ in range(edits):
        paths = [p for p in _paths(document) if p]
        if not paths:
            return
        path = draw(st.sampled_from(paths))
        parent = document
        for key in path[:-1]:
            parent = parent[key]
        action = draw(st.sampled_from(["replace", "replace", "add", "taint", "taint"]))
        if action == "taint" and isinstance(parent[path[-1]], str):  # free text keeps its type: it reaches the output
            parent[path[-1]] += draw(st.sampled_from(ESCAPE_SEQUENCES))
        elif action == "add" and isinstance(parent, dict):
            parent[draw(st.one_of(st.text(max_size=6), escape_texts))] = draw(values)
        else:
            parent[path[-1]] = draw(values)


def _run_checked(argv: list[str], cwd: Path, statuses: set[int], huge: bool) -> int:
    """``main(argv)``: no traceback, a documented status, no control character printed raw, and a file holding a
    huge integer (``huge``) refused in one line that says so."""
    code, out, err = _captured_main(argv, cwd)
    printed = out + err
    assert "Traceback" not in printed and code in statuses, (argv, code, err)
    assert RAW_CONTROL.search(printed) is None, (argv, printed)
    if code == 2:
        assert err.strip(), argv
    if huge:
        assert code == 2 and err.count("\n") == 1 and "holds an integer" in err, (argv, err)
    return code


@st.composite
def hostile_traces(draw):
    document = json.loads(draw(st.sampled_from(GOLDEN)).read_text())
    _edit(draw, document, st.one_of(hostile_values, hostile_values, json_values), draw(st.integers(1, 3)))
    return _with_huge_integers(json.dumps(document))


@FUZZ
@given(drawn=hostile_traces(), verb=st.sampled_from(["explain", "replay", "replay --strict"]))
def test_traces_with_huge_integers_and_escape_sequences_end_in_a_documented_exit_status(drawn, verb):
    text, huge = drawn
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "trace.json").write_text(text)
        code = _run_checked([*verb.split(), "trace.json"], Path(tmp), CLI_STATUSES, huge)
    _count("hostile traces", f"{verb} exit {code}")


@pytest.fixture(scope="module")
def planned(tmp_path_factory) -> Path:
    """A plan's trace directory (three distinct decisions), made once: each manifest example copies its traces."""
    folder = tmp_path_factory.mktemp("planned")
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["plan", str(CONFIGS / "synthetic-mixed-nvfp4-fp8"), "--platform", "sm100", "--no-env",
                     "--policy", "seeds", "--trace-dir", str(folder)]) == 0
    return folder


@FUZZ
@given(data=st.data(), verb=st.sampled_from(["explain", "replay"]),
       layer=st.one_of(st.none(), st.sampled_from(["0", "3", "47", "model.layers.5.mlp.experts"]), escape_texts))
def test_manifests_with_huge_integers_and_escape_sequences_end_in_a_documented_exit_status(planned, data, verb, layer):
    manifest = json.loads((planned / "plan.manifest").read_text())
    _edit(data.draw, manifest, st.one_of(hostile_values, hostile_values, json_values), data.draw(st.integers(1, 3)))
    text, huge = _with_huge_integers(json.dumps(manifest))
    with tempfile.TemporaryDirectory() as tmp:
        for trace in planned.glob("*.json"):
            shutil.copy(trace, tmp)
        (Path(tmp) / "plan.manifest").write_text(text)
        argv = [verb, "plan.manifest", *([f"--layer={layer}"] if layer is not None else [])]
        code = _run_checked(argv, Path(tmp), CLI_STATUSES, huge)
    _count("hostile manifests", f"{verb} exit {code}")


@st.composite
def hostile_specs(draw):
    """An --input spec, JSON or TOML (whose 0x integers have no length limit at all), with hostile values in it."""
    spec = {"layer": {"quant": "fp8", "experts": 16}, "platform": "sm90", "env": {}}
    _edit(draw, spec, hostile_values, draw(st.integers(1, 3)))
    if draw(st.booleans()):
        return "in.json", *_with_huge_integers(json.dumps(spec))
    lines = []
    for section, body in spec.items():
        if isinstance(body, dict):
            lines.append(f"[{_toml_string(section)}]")
            lines += [f"{_toml_string(key)} = {_toml_value(draw, value)}" for key, value in body.items()]
        else:
            lines.insert(0, f"{_toml_string(section)} = {_toml_value(draw, body)}")
    return "in.toml", "\n".join(lines) + "\n", _with_huge_integers(json.dumps(spec))[1]


def _toml_value(draw, value) -> str:
    if isinstance(value, str) and re.fullmatch(rf"{HUGE_MARK}-?\d+", value):
        digits = value[len(HUGE_MARK):]
        return digits if digits.startswith("-") or draw(st.booleans()) else "0x" + digits
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(draw, v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_toml_string(k)} = {_toml_value(draw, v)}" for k, v in value.items()) + "}"
    return _toml_string(value) if isinstance(value, str) else json.dumps(value)


def _toml_string(text: str) -> str:
    """A TOML basic string: JSON's escapes are TOML's, but astral characters go raw and DEL must be escaped too."""
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")


@FUZZ
@given(spec=hostile_specs(), verb=st.sampled_from([["select"], ["diff", "--from", "seeds", "--to", "vllm-0.33"]]))
def test_input_specs_with_huge_integers_and_escape_sequences_end_in_a_documented_exit_status(spec, verb):
    name, text, huge = spec
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / name).write_text(text)
        code = _run_checked([*verb, "--input", name, "--no-env"], Path(tmp), CLI_STATUSES, huge)
    _count("hostile --input specs", f"{verb[0]} exit {code}")


@st.composite
def hostile_configs(draw):
    config = draw(config_dicts())
    _edit(draw, config, hostile_values, draw(st.integers(1, 3)))
    return _with_huge_integers(json.dumps(config))


@PLAN_FUZZ
@given(drawn=hostile_configs(), platform=st.sampled_from(sorted(PRESETS)), json_output=st.booleans())
def test_plan_of_configs_with_huge_integers_and_escape_sequences_ends_in_a_documented_exit_status(drawn, platform,
                                                                                                  json_output):
    text, huge = drawn
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(text)
        argv = ["plan", "config.json", "--platform", platform, "--policy", "seeds", "--no-env", "--trace-dir", "traces",
                *(["--json"] if json_output else [])]
        code = _run_checked(argv, Path(tmp), PLAN_STATUSES, huge)
    _count("hostile plan configs", f"exit {code}")


# -- driver 6: files that are not regular files, given to every file reader (issue 39) -----------------------------------
# A FIFO would block a reader forever and opening a device can act on it; a directory or a dangling symlink is no file.
# Whatever its name and whichever command reads it (a trace, a manifest's trace, an --input spec, a plan config, a
# diagram, a golden scenario), each is refused in one line (exit 2) without blocking.

NON_REGULAR = {  # kind -> what the refusal says
    "fifo": "is a FIFO (named pipe), not a regular file",
    "socket": "is a socket, not a regular file",
    "directory": "is a directory, not a file",
    "dangling symlink": "does not exist",
    "symlink to a fifo": "is a FIFO (named pipe), not a regular file",
}
FILE_READERS = {  # reader -> (where the odd file goes, argv)
    "explain": ("{name}", ["explain", "{name}"]),
    "replay": ("{name}", ["replay", "--strict", "{name}"]),
    "select --input": ("{name}", ["select", "--input", "{name}", "--no-env"]),
    "diff --input": ("{name}", ["diff", "--input", "{name}", "--no-env"]),
    "plan": ("{name}", ["plan", "{name}", "--platform", "sm90", "--no-env", "--trace-dir", "traces"]),
    "diagram --check": ("{name}", ["diagram", "--check", "{name}"]),
    "golden scenario": ("g/seeds/scenarios/{name}.toml", ["golden", "--check", "--dir", "g"]),
    "a manifest's trace": ("{name}", ["explain", "run.manifest", "--layer", "0"]),
}
file_names = st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,11}", fullmatch=True).filter(lambda n: n != "run.manifest")


def _make_non_regular(path: Path, kind: str) -> None:
    import socket

    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":
        server = socket.socket(socket.AF_UNIX)
        server.bind(os.path.relpath(path))  # relative: a socket's path must fit bind()'s 108 bytes
        server.close()
    elif kind == "directory":
        path.mkdir()
    elif kind == "dangling symlink":
        path.symlink_to("no-such-file")
    else:
        os.mkfifo(path.with_name(path.name + "-target"))
        path.symlink_to(path.name + "-target")


def _unblock_later(fifo: Path, after: float):
    """Should a reader block on ``fifo`` (the bug this driver guards against), open it for writing after ``after``
    seconds, so the example ends (and fails on its message) rather than hangs. Returns the event that stops it."""
    import threading

    stop = threading.Event()

    def unblock():
        if not stop.wait(after):
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass

    threading.Thread(target=unblock, daemon=True).start()
    return stop


@FUZZ
@given(kind=st.sampled_from(sorted(NON_REGULAR)), reader=st.sampled_from(sorted(FILE_READERS)), name=file_names)
def test_file_readers_refuse_files_that_are_not_regular_in_one_line(kind, reader, name):
    where, argv = FILE_READERS[reader]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        odd = tmp / where.format(name=name)
        if reader == "a manifest's trace":
            (tmp / "run.manifest").write_text(json.dumps({"schema": "moe-fsm/run-manifest", "schema_version": 1, "layers": [
                {"index": 0, "name": "model.layers.0.mlp.experts", "trace_files": [name]}]}))
        _make_non_regular(odd, kind)
        stop = _unblock_later(odd, 10)
        out, err = io.StringIO(), io.StringIO()
        old = os.getcwd()
        os.chdir(tmp)
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = main([arg.format(name=name) for arg in argv])
        finally:
            os.chdir(old)
            stop.set()
    message = NON_REGULAR[kind] if not (reader == "plan" and kind == "directory") else "config.json does not exist"
    assert "Traceback" not in out.getvalue() + err.getvalue()
    assert code == 2 and err.getvalue().count("\n") == 1 and message in err.getvalue(), (reader, kind, name, err.getvalue())
    _count("non-regular files", f"{reader}: {kind}")
