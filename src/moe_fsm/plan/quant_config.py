"""A checkpoint's ``quantization_config`` to the QuantScheme of each MoE layer's experts.

One reader per ``quant_method``, each following how vLLM resolves that format
for a fused-MoE layer (``vllm/model_executor/layers/quantization/``):

- ``fp8`` (DeepSeek-V3 style): ``weight_block_size`` [128, 128] -> block weights with
  dynamic 1x128 activation groups; no block size -> per-tensor weights, activation
  scales static or dynamic per ``activation_scheme``; ``modules_to_not_convert`` /
  ``ignored_layers`` leave layers unquantized.
- ``modelopt``: ``quant_algo`` (flat, or under ``quantization`` as in
  ``hf_quant_config.json``); ``MIXED_PRECISION`` picks each layer's algo from
  ``quantized_layers`` (the first key under the experts' prefix, as vLLM does);
  ``exclude_modules`` are wildcards (fnmatch) or substrings.
- ``compressed-tensors``: the experts' unfused linears ``<experts>.0.{gate,up,down}_proj``
  are matched against ``ignore`` and each group's ``targets`` (``Linear``, exact names
  or ``re:`` patterns); all three must agree; the group's weight and input-activation
  args give the scheme, with vLLM's CUTLASS FP8 kernels allowed.
- ``mxfp4`` (gpt-oss): its family is a table entry below.

A format or family moe-fsm has no scheme for becomes an ``Unmapped`` layer with
the reason, never a skipped one. Adding a scheme is one entry in ``ALGO_SCHEMES``
or ``FAMILY_SCHEMES``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fnmatch import fnmatch
from typing import Callable, Optional, Union

from moe_fsm.inputs.quant import NVFP4_STATIC, QuantFamily, QuantScheme


@dataclass(frozen=True)
class Mapped:
    scheme: QuantScheme
    source: str  # how the config said it, for the table
    allow_vllm_cutlass: bool = False


@dataclass(frozen=True)
class Unmapped:
    reason: str


LayerQuant = Union[Mapped, Unmapped]

# Quantization families moe-fsm's policies do not have yet: name -> the experts' scheme once they do
# (None: reported "not mapped yet"). When the MXFP4 family lands, its entry becomes its constructor
# (gpt-oss: MXFP4 weights, bf16 activations).
FAMILY_SCHEMES: dict[str, Optional[Callable[[], QuantScheme]]] = {
    "mxfp4": None,
    "mxfp8": None,
}

# ModelOpt quant_algo -> the experts' scheme (vLLM's LINEAR_ALGOS, as the fused-MoE methods read them).
ALGO_SCHEMES: dict[str, Callable[[], QuantScheme]] = {
    "FP8": lambda: QuantScheme.fp8("tensor", "tensor", static_activation=True),
    "FP8_PER_CHANNEL_PER_TOKEN": lambda: QuantScheme.fp8("channel", "token"),
    "FP8_PB_WO": lambda: QuantScheme.fp8("block", "group"),
    "NVFP4": QuantScheme.nvfp4,
    "W4A16_NVFP4": lambda: QuantScheme(QuantFamily.NVFP4, NVFP4_STATIC, None),
}


def _family(name: str, where: str) -> LayerQuant:
    make = FAMILY_SCHEMES.get(name)
    if make is None:
        return Unmapped(f"{where}: the {name.upper()} family is not mapped yet (no {name} policy in this moe-fsm)")
    return Mapped(make(), where)


def _unquantized(why: str) -> Mapped:
    return Mapped(QuantScheme.unquantized(), why)


# -- fp8 (DeepSeek-V3) ---------------------------------------------------------------


def _fp8(config: dict, experts: str) -> LayerQuant:
    skipped = list(config.get("modules_to_not_convert") or []) + list(config.get("ignored_layers") or [])
    hit = next((m for m in skipped if m and (experts.startswith(m) or m in experts)), None)
    if hit:
        return _unquantized(f"fp8: not converted ({hit!r})")
    block = config.get("weight_block_size")
    dynamic = config.get("activation_scheme", "dynamic") == "dynamic"
    if block is None:
        return Mapped(QuantScheme.fp8("tensor", "tensor", static_activation=not dynamic),
                      f"fp8 per-tensor, {'dynamic' if dynamic else 'static'} activations")
    if list(block) != [128, 128]:
        return Unmapped(f"fp8 weight_block_size {list(block)}: moe-fsm's FP8 schemes take 128x128 blocks only")
    if not dynamic:
        return Unmapped("fp8 with 128x128 weight blocks and static activation scales: no such scheme in vLLM's oracles")
    return Mapped(QuantScheme.fp8("block", "group"), "fp8 block 128x128, dynamic 1x128 activations")


# -- modelopt ----------------------------------------------------------------------------


def _modelopt_excluded(experts: str, patterns: list[str]) -> Optional[str]:
    for pattern in patterns:
        if fnmatch(experts, pattern) or (pattern != experts and pattern and pattern in experts):
            return pattern
        if pattern.endswith("*") and fnmatch(experts + ".", pattern):
            return pattern
    return None


def _modelopt(config: dict, experts: str) -> LayerQuant:
    body = config.get("quantization") if isinstance(config.get("quantization"), dict) else config
    algo = str(body.get("quant_algo") or "").upper()
    excluded = _modelopt_excluded(experts, list(body.get("exclude_modules") or body.get("ignore") or config.get("ignore") or []))
    if excluded:
        return _unquantized(f"modelopt: excluded by {excluded!r}")
    if algo == "MIXED_PRECISION":
        layers = body.get("quantized_layers") or {}
        parent = experts.rsplit(".experts", 1)[0] + "."
        key = next((k for k in layers if k.startswith(experts + ".")), None) or next(
            (k for k in layers if k.startswith(parent)), None)
        if key is None:
            return _unquantized("modelopt MIXED_PRECISION: not in quantized_layers")
        algo = str(layers[key].get("quant_algo", "")).upper()
        where = f"modelopt MIXED_PRECISION: {algo} ({key})"
    else:
        where = f"modelopt {algo}"
    if algo in ALGO_SCHEMES:
        return Mapped(ALGO_SCHEMES[algo](), where)
    if algo.lower() in FAMILY_SCHEMES:
        return _family(algo.lower(), where)
    return Unmapped(f"{where}: quant_algo {algo or '(none)'} is not one of {sorted(ALGO_SCHEMES)}")


# -- compressed-tensors ---------------------------------------------------------------


def _ct_matches(name: str, pattern: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return pattern == name or pattern == "Linear"


def _ct_scheme(group: dict) -> tuple[Optional[Mapped], str]:
    """A compressed-tensors group's (weights, input_activations) as an experts scheme, or why not."""
    w, a = group.get("weights") or {}, group.get("input_activations")
    kind = f"{w.get('type')} W{w.get('num_bits')}" + (f"A{a.get('num_bits')}" if a else "A16")
    if w.get("type") == "float" and w.get("num_bits") == 8 and a and a.get("type") == "float" and a.get("num_bits") == 8:
        strategy, act, dynamic = w.get("strategy"), a.get("strategy"), bool(a.get("dynamic"))
        weight_scale = {"tensor": "tensor", "channel": "channel", "block": "block"}.get(strategy)
        act_scale = {"tensor": "tensor", "token": "token", "group": "group"}.get(act)
        if strategy == "block" and list(w.get("block_structure") or [128, 128]) != [128, 128]:
            return None, f"FP8 block {w.get('block_structure')}: moe-fsm takes 128x128 blocks only"
        if weight_scale and act_scale:
            scheme = QuantScheme.fp8(weight_scale, act_scale, static_activation=not dynamic)
            return Mapped(scheme, f"compressed-tensors FP8 {strategy} weights, {act} {'dynamic' if dynamic else 'static'} activations",
                          allow_vllm_cutlass=True), ""
        return None, f"FP8 weights by {strategy}, activations by {act}: no such FP8 scheme"
    if w.get("type") == "float" and w.get("num_bits") == 4 and w.get("strategy") == "tensor_group" and w.get("group_size") == 16:
        if a is None:
            return Mapped(QuantScheme(QuantFamily.NVFP4, NVFP4_STATIC, None), "compressed-tensors NVFP4 W4A16"), ""
        if a.get("type") == "float" and a.get("num_bits") == 4:
            return Mapped(QuantScheme.nvfp4(), "compressed-tensors NVFP4 W4A4"), ""
    if w.get("type") == "float" and w.get("num_bits") == 4 and w.get("group_size") == 32:
        mapped = _family("mxfp4", "compressed-tensors MXFP4")
        return (mapped, "") if isinstance(mapped, Mapped) else (None, mapped.reason)
    return None, f"{kind} ({w.get('strategy')}) is not mapped yet"


def _compressed_tensors(config: dict, experts: str) -> LayerQuant:
    names = [f"{experts}.0.{proj}" for proj in ("gate_proj", "up_proj", "down_proj")]
    ignore = list(config.get("ignore") or [])
    ignored = [next((p for p in ignore if _ct_matches(n, p) and p != "Linear"), None) for n in names]
    if all(ignored):
        return _unquantized(f"compressed-tensors: ignored ({ignored[0]!r})")
    if any(ignored):
        return Unmapped("compressed-tensors: the ignore list covers only some of the experts' projections")
    groups = config.get("config_groups") or {}
    chosen = []
    for name in names:
        # exact names and patterns win over the class target "Linear", as in compressed-tensors
        match = sorted((g for g in groups.values() if any(_ct_matches(name, t) for t in g.get("targets") or ())),
                       key=lambda g: "Linear" in (g.get("targets") or ()))
        chosen.append(match[0] if match else None)
    if any(c is None for c in chosen):
        return _unquantized("compressed-tensors: no config group targets the experts")
    if any(c is not chosen[0] for c in chosen):
        return Unmapped("compressed-tensors: the experts' projections fall in different config groups (vLLM refuses this)")
    mapped, why = _ct_scheme(chosen[0])
    return mapped if mapped is not None else Unmapped(f"compressed-tensors: {why}")


# -- mxfp4 (gpt-oss) ------------------------------------------------------------------


def _mxfp4(config: dict, experts: str) -> LayerQuant:
    skipped = list(config.get("modules_to_not_convert") or [])
    hit = next((m for m in skipped if fnmatch(experts, m) or fnmatch(experts, m + ".*")), None)
    if hit:
        return _unquantized(f"mxfp4: not converted ({hit!r})")
    return _family("mxfp4", "mxfp4 (gpt-oss)")


QUANT_METHODS: dict[str, Callable[[dict, str], LayerQuant]] = {
    "fp8": _fp8,
    "modelopt": _modelopt,
    "compressed-tensors": _compressed_tensors,
    "mxfp4": _mxfp4,
}


def layer_quant(quantization: Optional[dict], experts: str) -> LayerQuant:
    """The scheme of the experts module ``experts`` under a checkpoint's quantization_config."""
    if not quantization:
        return _unquantized("unquantized")
    method = str(quantization.get("quant_method", "")).lower()
    reader = QUANT_METHODS.get(method)
    if reader is None:
        return Unmapped(f"quant_method {method or '(none)'!r} is not mapped (moe-fsm reads {sorted(QUANT_METHODS)})")
    return reader(quantization, experts)
