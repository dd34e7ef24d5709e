"""The spec language: decision inputs written as a mapping of sections, parsed into the frozen inputs.

One spec format serves ``select`` flags and ``--input FILE`` (JSON or TOML),
the golden scenario matrix and the parity harness; it is part of the decision
core, which the commands and golden use alike. A spec is a mapping with the sections

``layer``     quant = "unquantized" | "fp8" | "nvfp4" | "mxfp4" | "mxfp8" | "int8" |
              "int_wna16" | "w4a8" | "w4a8_int8" (or the trace's quant object),
              weight_scale, act_scale, static_act (FP8, INT8), weight_only (NVFP4 W4A16),
              act_quant (MXFP4), asym_act (INT8), bits, group_size, zero_point,
              checkpoint, act_order (integer weights), bias,
              num_experts (experts), top_k, hidden_size (hidden), intermediate_size
              (intermediate), activation, swiglu_limit, lora, router_weight_on_input,
              dtype, allow_vllm_cutlass; what an engine reads beyond the layer: architecture,
              quant_method, quantization, draft (or the trace's ``model`` table)
``parallel``  tp_size (tp), dp_size (dp), ep_size (ep), batched_activation_format
              (batched), all2all; SGLang's a2a_backend (moe_a2a_backend), deepep_mode
``backend``   "auto", a name, "nvfp4=flashinfer_b12x,fp8=triton" or a table
              (``request`` is accepted too: it is what a trace calls it)
``env``       table of registered variable -> value
``platform``  "probe", a preset name, a table in the trace's platform form, or
              {preset = "sm90", add_libraries = [...], remove_libraries = [...]}
``policy``    a policy profile name ("seeds", "vllm-0.33") or "default" (the
              installed vLLM's); ``profile`` is the trace's {name, reason} form
``speed_table`` a measured speed table's file path, the trace's table form, or false (none, and
              no look in the user's config directory); read only by a profile that orders by
              measured speed (``fastest-vllm-0.33``; ``inputs/speed.py``)

A decision trace's recorded inputs are a spec as well. This module parses each
section into its input object; ``moe_fsm.decision.inputs_from_spec`` joins them
with the policy profile into ``DecisionInputs``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping

from moe_fsm.errors import InputError
from moe_fsm.inputs.env import EnvSnapshot
from moe_fsm.inputs.layer import MoELayer
from moe_fsm.inputs.model_facts import ModelFacts
from moe_fsm.inputs.parallel import ParallelConfig
from moe_fsm.inputs.platform import Library, PlatformFacts, preset, probed_platform
from moe_fsm.inputs.quant import MXFP4_ACTIVATIONS, NVFP4_STATIC, QuantFamily, QuantScheme

SECTIONS = ("layer", "parallel", "backend", "request", "env", "platform", "policy", "profile", "speed_table")

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
    "quant-method": "quant_method",
}
QUANT_WORDS = (
    "weight_scale", "act_scale", "static_act", "weight_only", "act_quant", "asym_act", "bits", "group_size",
    "zero_point", "checkpoint", "act_order",
)
MODEL_WORDS = ("architecture", "quant_method", "quantization", "draft")  # ModelFacts, flat in the layer section
LAYER_KEYS = (
    "quant", *QUANT_WORDS, "num_experts", "top_k", "hidden_size",
    "intermediate_size", "activation", "swiglu_limit", "lora", "router_weight_on_input", "dtype", "allow_vllm_cutlass",
    "bias", *MODEL_WORDS, "model",
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
PARALLEL_ALIASES = {"tp": "tp_size", "dp": "dp_size", "ep": "ep_size", "batched": "batched_activation_format",
                    "moe_a2a_backend": "a2a_backend"}
PARALLEL_KEYS = ("tp_size", "dp_size", "ep_size", "batched_activation_format", "all2all", "a2a_backend", "deepep_mode")
PLATFORM_SPEC_KEYS = ("preset", "add_libraries", "remove_libraries")

# The activation scale a weight scale usually comes with (the checkpoint formats vLLM sees).
DEFAULT_ACT_SCALE = {"block": "group", "channel": "token", "tensor": "tensor"}
_GRANULARITY_WORD = {"tensor": "tensor", "channel": "channel", "block128x128": "block", "token": "token", "group1x128": "group"}


def env_from_spec(env_spec: Any) -> EnvSnapshot:
    """The ``env`` section: None is the process environment, a table names each variable (unknown names refused)."""
    if env_spec is None:
        return EnvSnapshot.from_process()
    if isinstance(env_spec, EnvSnapshot):
        return env_spec
    if isinstance(env_spec, Mapping):
        return EnvSnapshot.from_mapping({str(k): _env_text(v) for k, v in env_spec.items()}, strict_names=True)
    raise InputError(f"env must be a table of NAME = VALUE, got {type(env_spec).__name__}")


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


def merge_layer(base: Any, flags: dict) -> dict:
    """The file's layer section with flags on top; a quant flag replaces the file's whole quant scheme."""
    layer = _normalize("layer", base or {}, LAYER_ALIASES, LAYER_KEYS)
    if any(k in flags for k in QUANT_KEYS):
        if isinstance(layer.get("quant"), Mapping):
            layer.update(_quant_words(layer.pop("quant")))
        if "quant" in flags and flags["quant"] != layer.get("quant"):
            for key in QUANT_KEYS:
                layer.pop(key, None)
    if any(k in flags for k in MODEL_WORDS) and isinstance(layer.get("model"), Mapping):
        layer.update(layer.pop("model"))  # a trace's model table, in words the flags amend
    layer.update(flags)
    return layer


def merge_parallel(base: Any, flags: dict) -> dict:
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
    model = _model_facts(layer)
    if model is not None:
        values["model"] = model
    try:
        return MoELayer(**values)
    except TypeError as err:
        raise InputError(f"layer is malformed: {err}") from None


def _model_facts(layer: Mapping) -> ModelFacts | None:
    """The layer's model facts: the trace's ``model`` table or the flat words, not both; None when neither is given."""
    words = {k: layer[k] for k in MODEL_WORDS if k in layer}
    table = layer.get("model")
    if table is not None and words:
        raise InputError(f"layer gives model as a table and also {sorted(words)}; use one form")
    if table is not None:
        return ModelFacts.from_json(dict(table) if isinstance(table, Mapping) else table)
    if not words:
        return None
    if "draft" in words:
        words["draft"] = _bool("draft", words["draft"])
    return ModelFacts(**words)


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
