"""Shared input parsing for the CLI: flags, --input files, and scenario specs.

One spec format serves ``select`` flags, ``--input FILE`` (JSON or TOML) and the
golden scenario matrix. A spec is a mapping with the sections

``layer``     quant = "unquantized" | "fp8" | "nvfp4" | "mxfp4" | "mxfp8" | "int8" |
              "int_wna16" | "w4a8" | "w4a8_int8" (or the trace's quant object),
              weight_scale, act_scale, static_act (FP8, INT8), weight_only (NVFP4 W4A16),
              act_quant (MXFP4), asym_act (INT8), bits, group_size, zero_point,
              checkpoint, act_order (integer weights), bias,
              num_experts (experts), top_k, hidden_size (hidden), intermediate_size
              (intermediate), activation, swiglu_limit, lora, router_weight_on_input,
              dtype, allow_vllm_cutlass
``parallel``  tp_size (tp), dp_size (dp), ep_size (ep), batched_activation_format
              (batched), all2all
``backend``   "auto", a name, "nvfp4=flashinfer_b12x,fp8=triton" or a table
              (``request`` is accepted too: it is what a trace calls it)
``env``       table of registered variable -> value
``platform``  "probe", a preset name, a table in the trace's platform form, or
              {preset = "sm90", add_libraries = [...], remove_libraries = [...]}
``policy``    a policy profile name ("seeds", "vllm-0.33") or "default" (the
              installed vLLM's); ``profile`` is the trace's {name, reason} form

A decision trace is a valid ``--input`` as well: its recorded inputs are used,
so ``select --input TRACE.json --backend triton`` asks "what if" of a past
decision. Flags given on the command line override the file.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping

from moe_fsm.decision import DecisionInputs, probed_platform
from moe_fsm.errors import InputError
from moe_fsm import profiles
from moe_fsm.inputs.env import EnvSnapshot, known_env_vars
from moe_fsm.inputs.layer import Activation, MoELayer
from moe_fsm.inputs.parallel import AllToAllKind, ParallelConfig
from moe_fsm.inputs.platform import PRESETS, Library, PlatformFacts, preset
from moe_fsm.inputs.quant import (
    FP8_ACTIVATION_SCALES, FP8_WEIGHT_SCALES, FLOAT_DTYPES, MXFP4_ACTIVATIONS, NVFP4_STATIC, WNA16_CHECKPOINTS,
    QuantFamily, QuantScheme,
)
from moe_fsm.inputs.request import BackendRequest
from moe_fsm.trace import document as trace_doc

SECTIONS = ("layer", "parallel", "backend", "request", "env", "platform", "policy", "profile")

LAYER_ALIASES = {
    "experts": "num_experts",
    "hidden": "hidden_size",
    "intermediate": "intermediate_size",
    "weight-scale": "weight_scale",
    "act-scale": "act_scale",
    "static-act": "static_act",
    "weight-only": "weight_only",
    "act-quant": "act_quant",
    "asym-act": "asym_act",
    "group-size": "group_size",
    "zero-point": "zero_point",
    "act-order": "act_order",
}
QUANT_WORDS = (
    "weight_scale", "act_scale", "static_act", "weight_only", "act_quant", "asym_act", "bits", "group_size",
    "zero_point", "checkpoint", "act_order",
)
LAYER_KEYS = (
    "quant", *QUANT_WORDS, "num_experts", "top_k", "hidden_size",
    "intermediate_size", "activation", "swiglu_limit", "lora", "router_weight_on_input", "dtype", "allow_vllm_cutlass",
    "bias",
)
QUANT_KEYS = ("quant", *QUANT_WORDS)
# The quant words each new family takes (FP8 and NVFP4 keep their own checks below).
FAMILY_WORDS = {
    QuantFamily.MXFP4: ("act_quant",),
    QuantFamily.MXFP8: (),
    QuantFamily.INT8: ("weight_scale", "act_scale", "static_act", "asym_act"),
    QuantFamily.INT_WNA16: ("bits", "group_size", "zero_point", "checkpoint", "act_order"),
    QuantFamily.W4A8: ("group_size",),
    QuantFamily.W4A8_INT8: ("group_size",),
}
_BOOL_WORDS = ("static_act", "weight_only", "asym_act", "zero_point", "act_order")
PARALLEL_ALIASES = {"tp": "tp_size", "dp": "dp_size", "ep": "ep_size", "batched": "batched_activation_format"}
PARALLEL_KEYS = ("tp_size", "dp_size", "ep_size", "batched_activation_format", "all2all")
PLATFORM_SPEC_KEYS = ("preset", "add_libraries", "remove_libraries")

# The activation scale a weight scale usually comes with (the checkpoint formats vLLM sees).
DEFAULT_ACT_SCALE = {"block": "group", "channel": "token", "tensor": "tensor"}
_GRANULARITY_WORD = {"tensor": "tensor", "channel": "channel", "block128x128": "block", "token": "token", "group1x128": "group"}


# -- argparse ------------------------------------------------------------------------


def add_input_arguments(parser) -> None:
    """The layer / parallel / request / env / platform flags (all default to None: unset)."""
    src = parser.add_argument_group("inputs from a file")
    src.add_argument("--input", metavar="FILE",
                     help="JSON or TOML with layer/parallel/backend/env/platform sections, or a decision trace "
                          "(its recorded inputs); flags override the file")

    layer = parser.add_argument_group("the layer")
    layer.add_argument("--quant", choices=[f.value for f in QuantFamily], help="quantization family (default unquantized)")
    layer.add_argument("--weight-scale", choices=sorted(FP8_WEIGHT_SCALES),
                       help="FP8 weight scale granularity (default block)")
    layer.add_argument("--act-scale", choices=sorted({g for g, _ in FP8_ACTIVATION_SCALES}),
                       help="FP8 activation scale granularity (default: group for block weights, token for channel, "
                            "tensor for tensor)")
    layer.add_argument("--static-act", action="store_true", default=None,
                       help="FP8 activation scales are static (calibrated), not computed per batch")
    layer.add_argument("--weight-only", action="store_true", default=None,
                       help="NVFP4 weights with 16-bit activations (W4A16)")
    layer.add_argument("--act-quant", choices=list(MXFP4_ACTIVATIONS),
                       help="MXFP4 activation quantization (default none: 16-bit activations, as gpt-oss ships)")
    layer.add_argument("--asym-act", action="store_true", default=None,
                       help="INT8 W8A8 activations are asymmetric (with a zero point)")
    layer.add_argument("--bits", type=int, choices=(4, 8), help="int_wna16 weight bits (default 4)")
    layer.add_argument("--group-size", type=_group_size, metavar="G",
                       help="columns per weight scale for int_wna16/w4a8/w4a8_int8 (default 128; -1: per channel)")
    layer.add_argument("--zero-point", action="store_true", default=None,
                       help="int_wna16 weights are asymmetric, with zero points")
    layer.add_argument("--checkpoint", choices=list(WNA16_CHECKPOINTS),
                       help="int_wna16 checkpoint format (default gptq)")
    layer.add_argument("--act-order", action="store_true", default=None,
                       help="int_wna16 checkpoint uses activation ordering (GPTQ desc_act)")
    layer.add_argument("--bias", action="store_true", default=None, help="the experts add biases (gpt-oss)")
    layer.add_argument("--experts", type=_positive_int, metavar="E", help="number of experts (default 8)")
    layer.add_argument("--top-k", type=_positive_int, metavar="K", help="experts per token (default 2)")
    layer.add_argument("--hidden", type=_positive_int, metavar="H", help="hidden size (default 1024)")
    layer.add_argument("--intermediate", type=_positive_int, metavar="N", help="intermediate size per expert (default 512)")
    layer.add_argument("--activation", choices=[a.value for a in Activation], help="gated activation (default silu)")
    layer.add_argument("--swiglu-limit", type=_positive_float, metavar="LIMIT", help="the model's SwiGLU clamp")
    layer.add_argument("--lora", action="store_true", default=None, help="LoRA adapters on the experts")
    layer.add_argument("--router-weight-on-input", action="store_true", default=None,
                       help="apply the router weight to the expert input (needs --top-k 1)")
    layer.add_argument("--dtype", choices=list(FLOAT_DTYPES), help="activation dtype (default bfloat16)")
    layer.add_argument("--allow-vllm-cutlass", action="store_true", default=None,
                       help="the checkpoint allows vLLM's own CUTLASS FP8 kernels (compressed-tensors)")

    par = parser.add_argument_group("the parallel config")
    par.add_argument("--tp", type=_positive_int, metavar="N", help="tensor-parallel size (default 1)")
    par.add_argument("--dp", type=_positive_int, metavar="N", help="data-parallel size (default 1)")
    par.add_argument("--ep", type=_positive_int, metavar="N", help="expert-parallel size (default 1)")
    par.add_argument("--batched", action="store_true", default=None,
                     help="experts take the batched activation format [E_local, T, K]")
    par.add_argument("--all2all", choices=[k.value for k in AllToAllKind],
                     help="how tokens travel with DP and EP both on (default allgather_reducescatter)")

    ctx = parser.add_argument_group("request, environment and platform")
    ctx.add_argument("--backend", metavar="SPEC",
                     help="'auto' (default), one backend name, or per family: 'nvfp4=flashinfer_b12x,fp8=triton'")
    ctx.add_argument("--env", action="append", metavar="K=V",
                     help="an environment variable the selection reads (repeatable); with any --env, the process "
                          "environment is ignored")
    ctx.add_argument("--no-env", action="store_true", help="ignore the process environment (as if no variable were set)")
    ctx.add_argument("--platform", metavar="NAME",
                     help=f"'probe' (this machine, the default) or a preset: {', '.join(PRESETS)}")
    ctx.add_argument("--policy", metavar="PROFILE",
                     help="whose rules decide: a policy profile (seeds, vllm-0.33, ...; see moe-fsm diagram --list) or "
                          "'default': the installed vLLM's profile, else seeds")


def _positive_int(text: str) -> int:
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def _group_size(text: str) -> int:
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1 and value != -1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive group size or -1 (per channel)")
    return value


def _positive_float(text: str) -> float:
    import argparse

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"{value} is not a positive finite number")
    return value


def inputs_from_args(args) -> DecisionInputs:
    """Build the decision inputs from parsed flags (and --input); InputError on anything malformed."""
    spec: dict[str, Any] = load_input_file(args.input) if args.input else {}

    layer_flags = {
        "quant": args.quant, "weight_scale": args.weight_scale, "act_scale": args.act_scale,
        "static_act": args.static_act, "weight_only": args.weight_only, "num_experts": args.experts,
        "top_k": args.top_k, "hidden_size": args.hidden, "intermediate_size": args.intermediate,
        "activation": args.activation, "swiglu_limit": args.swiglu_limit, "lora": args.lora,
        "router_weight_on_input": args.router_weight_on_input, "dtype": args.dtype,
        "allow_vllm_cutlass": args.allow_vllm_cutlass, "act_quant": args.act_quant, "asym_act": args.asym_act,
        "bits": args.bits, "group_size": args.group_size, "zero_point": args.zero_point,
        "checkpoint": args.checkpoint, "act_order": args.act_order, "bias": args.bias,
    }
    parallel_flags = {
        "tp_size": args.tp, "dp_size": args.dp, "ep_size": args.ep,
        "batched_activation_format": args.batched, "all2all": args.all2all,
    }
    layer = _merge_layer(spec.get("layer"), {k: v for k, v in layer_flags.items() if v is not None})
    parallel = _merge_parallel(spec.get("parallel"), {k: v for k, v in parallel_flags.items() if v is not None})
    spec["layer"], spec["parallel"] = layer, parallel

    if args.backend is not None:
        spec["backend"] = args.backend
        spec.pop("request", None)
    if args.platform is not None:
        spec["platform"] = args.platform
    if args.policy is not None:
        spec["policy"] = args.policy
        spec.pop("profile", None)

    if args.env:
        env = dict(spec.get("env") or {})
        env.update(parse_env_flags(args.env))
        spec["env"] = env
    elif "env" not in spec and not args.no_env:
        spec["env"] = None  # the process environment
    return inputs_from_spec(spec)


def parse_env_flags(flags: list[str]) -> dict[str, str]:
    env = {}
    for flag in flags:
        name, sep, value = flag.partition("=")
        name = name.strip()
        if not sep or not name:
            raise InputError(f"--env {flag!r} must look like NAME=VALUE, e.g. --env VLLM_USE_FLASHINFER_MOE_FP8=1")
        env[name] = value
    return env


# -- files ---------------------------------------------------------------------------


def load_input_file(path: str | os.PathLike) -> dict:
    """Read a JSON/TOML spec or a decision trace into a spec mapping."""
    path = Path(path)
    text = trace_doc.read_text(path, "input file")
    if path.suffix.lower() == ".toml":
        import tomllib

        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as err:
            raise InputError(f"input file {path} is not valid TOML: {err}") from None
        except RecursionError:
            raise InputError(f"input file {path} nests tables or arrays too deeply") from None
    else:
        try:
            data = trace_doc.parse_json(text, f"input file {path}")
        except InputError as err:
            raise InputError(f"{err}; TOML files need a .toml suffix") from None
    if not isinstance(data, dict):
        raise InputError(f"input file {path} must hold an object with sections {list(SECTIONS)}")
    if data.get("schema") == trace_doc.SCHEMA_ID:
        if not isinstance(data.get("inputs"), dict):
            raise InputError(f"decision trace {path} has no 'inputs' object")
        return dict(data["inputs"])
    unknown = sorted(set(data) - set(SECTIONS))
    if unknown:
        raise InputError(f"input file {path} has unknown section(s) {unknown}; accepted: {list(SECTIONS)}")
    return dict(data)


# -- specs ---------------------------------------------------------------------------


def inputs_from_spec(spec: Mapping[str, Any]) -> DecisionInputs:
    """A spec mapping (see the module docstring) to DecisionInputs.

    ``env`` None means the process environment; a missing ``env`` means none set.
    """
    unknown = sorted(set(spec) - set(SECTIONS))
    if unknown:
        raise InputError(f"unknown input section(s) {unknown}; accepted: {list(SECTIONS)}")
    if "backend" in spec and "request" in spec:
        raise InputError("give the backend request as 'backend' or 'request', not both")
    if "policy" in spec and "profile" in spec:
        raise InputError("give the policy profile as 'policy' (a name) or 'profile' (a trace's table), not both")
    layer = spec.get("layer")
    if not isinstance(layer, MoELayer):
        layer = layer_from_spec(layer or {})
    parallel = spec.get("parallel")
    if not isinstance(parallel, ParallelConfig):
        parallel = parallel_from_spec(parallel or {})
    request = BackendRequest.parse(spec.get("backend", spec.get("request")))
    env_spec = spec.get("env", {})
    if env_spec is None:
        env = EnvSnapshot.from_process()
    elif isinstance(env_spec, EnvSnapshot):
        env = env_spec
    elif isinstance(env_spec, Mapping):
        env = EnvSnapshot.from_mapping({str(k): _env_text(v) for k, v in env_spec.items()}, strict_names=True)
    else:
        raise InputError(f"env must be a table of NAME = VALUE, got {type(env_spec).__name__}")
    platform = platform_from_spec(spec.get("platform", "probe"))
    if "profile" in spec:
        choice = profiles.ProfileChoice.from_json(spec["profile"])
    else:
        policy = spec.get("policy")
        if policy is not None and not isinstance(policy, str):
            raise InputError(f"policy must be a profile name ({profiles.names()}) or 'default', got {policy!r}")
        choice = profiles.choose(policy)
    return DecisionInputs(layer=layer, parallel=parallel, request=request, env=env, platform=platform, profile=choice)


def _env_text(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, (str, int)):
        return str(value)
    raise InputError(f"environment values must be strings, got {value!r}")


def _normalize(section: str, data: Mapping, aliases: Mapping[str, str], keys: tuple[str, ...]) -> dict:
    if not isinstance(data, Mapping):
        raise InputError(f"{section} must be a table/object, got {type(data).__name__}")
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = aliases.get(str(key), str(key)).replace("-", "_")
        name = aliases.get(name, name)
        if name not in keys:
            raise InputError(f"unknown {section} field {key!r}; accepted: {list(keys)}")
        if name in out:
            raise InputError(f"{section} field {name!r} is given twice (once as {key!r})")
        out[name] = value
    return out


def _merge_layer(base: Any, flags: dict) -> dict:
    """The file's layer section with flags on top; a quant flag replaces the file's whole quant scheme."""
    layer = _normalize("layer", base or {}, LAYER_ALIASES, LAYER_KEYS)
    if any(k in flags for k in QUANT_KEYS):
        if isinstance(layer.get("quant"), Mapping):
            layer.update(_quant_words(layer.pop("quant")))
        if "quant" in flags and flags["quant"] != layer.get("quant"):
            for key in QUANT_KEYS:
                layer.pop(key, None)
    layer.update(flags)
    return layer


def _merge_parallel(base: Any, flags: dict) -> dict:
    parallel = _normalize("parallel", base or {}, PARALLEL_ALIASES, PARALLEL_KEYS)
    parallel.update(flags)
    return parallel


def _quant_words(data: Mapping) -> dict:
    """A trace's quant object in the flag vocabulary (so flags can amend it)."""
    scheme = QuantScheme.from_json(data)
    if scheme.family is QuantFamily.UNQUANTIZED:
        return {"quant": "unquantized"}
    if scheme.family is QuantFamily.NVFP4:
        return {"quant": "nvfp4", "weight_only": scheme.activation is None}
    if scheme.family is QuantFamily.MXFP4:
        return {"quant": "mxfp4", "act_quant": next(w for w, k in MXFP4_ACTIVATIONS.items() if k == scheme.activation)}
    if scheme.family is QuantFamily.MXFP8:
        return {"quant": "mxfp8"}
    if scheme.family is QuantFamily.INT8:
        return {
            "quant": "int8",
            "weight_scale": _GRANULARITY_WORD[scheme.weight.granularity.value],
            "act_scale": _GRANULARITY_WORD[scheme.activation.granularity.value],
            "static_act": scheme.activation.static,
            "asym_act": not scheme.activation.symmetric,
        }
    if scheme.family is QuantFamily.INT_WNA16:
        return {
            "quant": "int_wna16", "bits": scheme.weight_bits, "group_size": scheme.group_size,
            "zero_point": scheme.zero_point, "checkpoint": scheme.checkpoint, "act_order": scheme.act_order,
        }
    if scheme.family in (QuantFamily.W4A8, QuantFamily.W4A8_INT8):
        return {"quant": scheme.family.value, "group_size": scheme.group_size}
    return {
        "quant": "fp8",
        "weight_scale": _GRANULARITY_WORD[scheme.weight.granularity.value],
        "act_scale": _GRANULARITY_WORD[scheme.activation.granularity.value],
        "static_act": scheme.activation.static,
    }


def quant_from_spec(layer: Mapping) -> QuantScheme:
    quant = layer.get("quant", "unquantized")
    words = {k: layer[k] for k in QUANT_WORDS if layer.get(k) is not None}
    if isinstance(quant, Mapping):
        if words:
            raise InputError(f"layer gives quant as an object and also {sorted(words)}; use one form")
        try:
            return QuantScheme.from_json(quant)
        except (KeyError, ValueError, TypeError) as err:
            if isinstance(err, InputError):
                raise
            raise InputError(f"layer quant object {dict(quant)!r} is malformed: {err}") from None
    if not isinstance(quant, str):
        raise InputError(f"layer quant must be one of {[f.value for f in QuantFamily]}, got {quant!r}")
    family = quant.strip().lower()
    if family == QuantFamily.UNQUANTIZED.value:
        words = {k: v for k, v in words.items() if not (k in _BOOL_WORDS and v is False)}
        if words:
            raise InputError(f"{sorted(words)} only apply to quantized layers (quant = fp8, nvfp4, ...)")
        return QuantScheme.unquantized()
    if family in {f.value for f in FAMILY_WORDS}:
        return _new_family_scheme(QuantFamily(family), words)
    if family == QuantFamily.NVFP4.value:
        extra = sorted(k for k, v in words.items() if k != "weight_only" and not (k in _BOOL_WORDS and v is False))
        if extra:
            raise InputError(f"{extra} do not apply to an NVFP4 layer; it takes only weight_only")
        if _bool("weight_only", words.get("weight_only", False)):
            return QuantScheme(QuantFamily.NVFP4, NVFP4_STATIC, None)
        return QuantScheme.nvfp4()
    if family == QuantFamily.FP8.value:
        if "weight_only" in words and words["weight_only"]:
            raise InputError("weight_only is an NVFP4 option (W4A16); FP8 layers are w8a8 here")
        foreign = sorted(k for k, v in words.items()
                         if k not in ("weight_scale", "act_scale", "static_act", "weight_only") and not (k in _BOOL_WORDS and v is False))
        if foreign:
            raise InputError(f"{foreign} do not apply to an fp8 layer; it takes weight_scale, act_scale, static_act")
        weight = str(words.get("weight_scale", "block"))
        act = str(words.get("act_scale", DEFAULT_ACT_SCALE.get(weight, "group")))
        return QuantScheme.fp8(weight, act, _bool("static_act", words.get("static_act", False)))
    raise InputError(f"layer quant {quant!r} is not one of {[f.value for f in QuantFamily]}")


def _new_family_scheme(family: QuantFamily, words: dict) -> QuantScheme:
    """The scheme of the MX / INT families from their words; unset booleans count as not given."""
    allowed = FAMILY_WORDS[family]
    extra = sorted(k for k, v in words.items() if k not in allowed and not (k in _BOOL_WORDS and v is False))
    if extra:
        accepted = f"takes only {list(allowed)}" if allowed else "takes no quant options"
        raise InputError(f"{extra} do not apply to a {family.value} layer; it {accepted}")
    w = {k: (_bool(k, v) if k in _BOOL_WORDS else v) for k, v in words.items() if k in allowed}
    for key in ("bits", "group_size"):
        if key in w and (isinstance(w[key], bool) or not isinstance(w[key], int)):
            raise InputError(f"{key} must be an integer, got {w[key]!r}")
    if family is QuantFamily.MXFP4:
        return QuantScheme.mxfp4(str(w.get("act_quant", "none")))
    if family is QuantFamily.MXFP8:
        return QuantScheme.mxfp8()
    if family is QuantFamily.INT8:
        weight = str(w.get("weight_scale", "channel"))
        act = str(w.get("act_scale", "token" if weight == "channel" else "tensor"))
        return QuantScheme.int8(weight, act, w.get("static_act", False), not w.get("asym_act", False))
    if family is QuantFamily.INT_WNA16:
        return QuantScheme.int_wna16(w.get("bits", 4), w.get("group_size", 128), w.get("zero_point", False),
                                     str(w.get("checkpoint", "gptq")), w.get("act_order", False))
    if family is QuantFamily.W4A8:
        return QuantScheme.w4a8(w.get("group_size", 128))
    return QuantScheme.w4a8_int8(w.get("group_size", 128))


def layer_from_spec(data: Mapping) -> MoELayer:
    layer = _normalize("layer", data, LAYER_ALIASES, LAYER_KEYS)
    values: dict[str, Any] = {"quant": quant_from_spec(layer)}
    for key in ("num_experts", "top_k", "hidden_size", "intermediate_size"):
        if key in layer:
            values[key] = layer[key]
    for key in ("lora", "router_weight_on_input", "allow_vllm_cutlass", "bias"):
        if key in layer:
            values[key] = _bool(key, layer[key])
    for key in ("activation", "dtype", "swiglu_limit"):
        if key in layer:
            values[key] = layer[key]
    try:
        return MoELayer(**values)
    except TypeError as err:
        raise InputError(f"layer is malformed: {err}") from None


def parallel_from_spec(data: Mapping) -> ParallelConfig:
    parallel = _normalize("parallel", data, PARALLEL_ALIASES, PARALLEL_KEYS)
    if "batched_activation_format" in parallel:
        parallel["batched_activation_format"] = _bool("batched_activation_format", parallel["batched_activation_format"])
    return ParallelConfig(**parallel)


def platform_from_spec(spec: Any) -> PlatformFacts:
    if isinstance(spec, PlatformFacts):
        return spec
    if isinstance(spec, str):
        name = spec.strip()
        return probed_platform() if name == "probe" else preset(name)
    if not isinstance(spec, Mapping):
        raise InputError(f"platform must be 'probe', a preset name or a table, got {spec!r}")
    if "preset" in spec:
        unknown = sorted(set(spec) - set(PLATFORM_SPEC_KEYS))
        if unknown:
            raise InputError(f"a platform table with 'preset' accepts only {list(PLATFORM_SPEC_KEYS)}; got {unknown}")
        base = platform_from_spec(spec["preset"])
        add, remove = _libraries(spec.get("add_libraries", ())), _libraries(spec.get("remove_libraries", ()))
        return replace(base, libraries=(base.libraries | add) - remove)
    try:
        return PlatformFacts.from_json(dict(spec))
    except TypeError as err:
        raise InputError(f"platform table is malformed: {err}") from None


def _libraries(names: Any) -> frozenset[Library]:
    if isinstance(names, str) or not isinstance(names, (list, tuple)):
        raise InputError(f"library lists must be arrays of names, got {names!r}")
    out = set()
    for name in names:
        try:
            out.add(Library(name))
        except ValueError:
            raise InputError(f"library {name!r} is not one of {[lib.value for lib in Library]}") from None
    return frozenset(out)


def _bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        return value.strip().lower() in ("1", "true", "yes", "on")
    raise InputError(f"{name} must be true or false, got {value!r}")


def env_var_names() -> list[str]:
    return sorted(known_env_vars())
