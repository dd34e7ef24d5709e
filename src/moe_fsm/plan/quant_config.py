"""A checkpoint's ``quantization_config`` to the QuantScheme of each MoE layer's experts.

One reader per ``quant_method``, each following how vLLM resolves that format
for a fused-MoE layer (``vllm/model_executor/layers/quantization/``):

- ``fp8`` (DeepSeek-V3 style): ``weight_block_size`` [128, 128] -> block weights with
  dynamic 1x128 activation groups; no block size -> per-tensor weights, activation
  scales static or dynamic per ``activation_scheme`` (required, exactly "dynamic" or "static", as vLLM's
  ``Fp8Config`` refuses anything else); ``modules_to_not_convert`` /
  ``ignored_layers`` leave layers unquantized.
- ``modelopt``: ``quant_algo`` (flat, or under ``quantization`` as in
  ``hf_quant_config.json``); ``MIXED_PRECISION`` picks each layer's algo from
  ``quantized_layers`` (the first key under the experts' prefix, as vLLM does);
  ``exclude_modules`` are wildcards (fnmatch) or substrings.
- ``compressed-tensors``: the experts' unfused linears ``<experts>.0.{gate,up,down}_proj``
  are matched against ``ignore`` and each group's ``targets`` (``Linear``, exact names
  or ``re:`` patterns); all three must agree; the group's weight and input-activation
  args give the scheme, with vLLM's CUTLASS FP8 kernels allowed; each args' ``dynamic`` is read as
  compressed-tensors' pydantic model reads it (``_ct_dynamic``).
- ``mxfp4`` (gpt-oss): its family is a table entry below.

A format or family moe-fsm has no scheme for becomes an ``Unmapped`` layer with
the reason, never a skipped one. A field of the wrong type (a block size that is
not a list, a group that is not an object) is an ``InputError`` naming it. The
module-name lists (exclusions, ``quantized_layers``, ``targets``) are indexed once
per config (:class:`QuantReader`), so a plan's cost does not grow with layers x
list length, and lists of wildcard or regex patterns are capped (``MAX_PATTERNS``). Adding a scheme is one entry in ``ALGO_SCHEMES``
or ``FAMILY_SCHEMES``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fnmatch import fnmatch, translate
from typing import Callable, Optional, Union

import regex

from moe_fsm.errors import InputError
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

# Wildcard and regex patterns are tried one by one against each layer's name, so a list holds at most this many
# (published checkpoints list tens: one per excluded attention block); plain names are looked up, any number of them.
MAX_PATTERNS = 4096
# vLLM's fp8 ACTIVATION_SCHEMES (fp8.py): Fp8Config refuses a config whose activation_scheme is absent or not exactly one of these.
FP8_ACTIVATION_SCHEMES = ("dynamic", "static")
REGEX_TIMEOUT_S = 0.5  # a re: pattern's match against one module name (~50 characters) takes microseconds
MAX_GROUPS = 256  # compressed-tensors config_groups, each tried for every layer's three projections
INDEX_DEPTH = 16  # quantized_layers keys are indexed by their first 16 dotted prefixes (module names have ~6)


# -- typed reads ------------------------------------------------------------------------------------------------


def _bad(where: str, wanted: str, value) -> InputError:
    shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return InputError(f"quantization_config: {where} must be {wanted}, got {shown}")


def _obj(value, where: str, default: Optional[dict] = None) -> dict:
    if value is None and default is not None:
        return default
    if not isinstance(value, dict):
        raise _bad(where, "an object", value)
    return value


def _names(value, where: str) -> list[str]:
    """A list of module names or patterns (None or absent: empty)."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _bad(where, "a list of module names (strings)", value)
    return value


def _wild(pattern: str) -> bool:
    return any(c in pattern for c in "*?[")


def _capped(patterns: list, where: str, kind: str) -> list:
    if len(patterns) > MAX_PATTERNS:
        raise InputError(f"quantization_config: {where} holds {len(patterns)} {kind} patterns; moe-fsm takes at most "
                         f"{MAX_PATTERNS} (each is tried against every layer; list plain module names instead)")
    return patterns


def _substrings(name: str):
    return (name[i:j] for i in range(len(name)) for j in range(i + 1, len(name) + 1))


class _SubstringOrGlob:
    """The first pattern (in list order) that is a substring of a name, or (``glob``) matches it as a wildcard.

    ``glob``: ModelOpt's ``exclude_modules`` rule (fnmatch, or the pattern inside the name, or ``prefix*`` covering
    the module's children). Without it: FP8's ``modules_to_not_convert`` (a name or a part of it).
    """

    def __init__(self, patterns: list[str], where: str, glob: bool) -> None:
        self.plain: dict[str, int] = {}
        wild = []
        for order, pattern in enumerate(patterns):
            if not pattern:
                continue
            if glob and _wild(pattern):
                wild.append((order, pattern, re.compile(translate(pattern)).match))
            else:
                self.plain.setdefault(pattern, order)
        self.wild = _capped(wild, where, "wildcard")
        self.patterns = patterns

    def first(self, name: str) -> Optional[str]:
        hits = [self.plain[s] for s in _substrings(name) if s in self.plain]
        for order, pattern, match in self.wild:
            if hits and order > min(hits):
                break
            if match(name) or pattern in name or pattern.endswith("*") and match(name + "."):
                hits.append(order)
                break
        return self.patterns[min(hits)] if hits else None


class _ModuleGlob:
    """mxfp4's ``modules_to_not_convert``: the module itself or a parent of it, names or wildcards (fnmatch)."""

    def __init__(self, patterns: list[str], where: str) -> None:
        self.plain = {p: order for order, p in reversed(list(enumerate(patterns))) if not _wild(p)}
        self.wild = _capped([(o, p, re.compile(translate(p)).match, re.compile(translate(p + ".*")).match)
                             for o, p in enumerate(patterns) if _wild(p)], where, "wildcard")
        self.patterns = patterns

    def first(self, name: str) -> Optional[str]:
        parts = name.split(".")
        hits = [self.plain[q] for q in (".".join(parts[:i]) for i in range(1, len(parts) + 1)) if q in self.plain]
        for order, _, whole, child in self.wild:
            if hits and order > min(hits):
                break
            if whole(name) or child(name):
                hits.append(order)
                break
        return self.patterns[min(hits)] if hits else None


class _CtTargets:
    """compressed-tensors names: exact module names, ``re:`` regexes (matched from the start), and the class ``Linear``.

    vLLM matches a ``re:`` pattern with ``re.match``; a pattern that backtracks without end, such as
    ``re:(.|.)*Z``, would hang ``plan`` there. So a pattern must compile under ``re`` (it means what it means to
    vLLM) and is matched by the ``regex`` package in its re-compatible mode (VERSION0: same syntax, same match),
    whose repeat guards finish most such patterns at once and whose ``timeout`` bounds the rest
    (``REGEX_TIMEOUT_S``, an InputError naming the pattern and the module name).
    """

    def __init__(self, patterns: list[str], where: str) -> None:
        self.exact = {p: order for order, p in reversed(list(enumerate(patterns))) if not p.startswith("re:")}
        regexes = []
        for order, p in enumerate(patterns):
            if p.startswith("re:"):
                try:
                    re.compile(p[3:])
                except (re.error, RecursionError, OverflowError) as err:
                    raise InputError(f"quantization_config: {where} pattern {p!r} is not a regular expression: {err}") from None
                try:
                    regexes.append((order, p, regex.compile(p[3:], flags=regex.VERSION0).match))
                except (regex.error, RecursionError, OverflowError) as err:
                    raise InputError(f"quantization_config: {where} pattern {p!r} is one moe-fsm's bounded matcher "
                                     f"(the regex package) cannot compile: {err}") from None
        self.regexes = _capped(regexes, where, "regex")
        self.patterns = patterns
        self.where = where
        self.linear = "Linear" in self.exact

    def first(self, name: str, linear: bool = True) -> Optional[str]:
        """The first pattern matching ``name`` (``linear``: the class target "Linear" counts)."""
        hits = [self.exact[name]] if name in self.exact else []
        if linear and self.linear:
            hits.append(self.exact["Linear"])
        for order, pattern, match in self.regexes:
            if hits and order > min(hits):
                break
            try:
                matched = match(name, timeout=REGEX_TIMEOUT_S)
            except TimeoutError:
                raise InputError(f"quantization_config: {self.where} pattern {pattern!r} was still matching module "
                                 f"{name!r} after {REGEX_TIMEOUT_S} s (it backtracks without end, as nested "
                                 "repeats such as (.|.)* can); write it without repeats inside repeats") from None
            if matched is not None:
                hits.append(order)
                break
        return self.patterns[min(hits)] if hits else None


class _PrefixIndex:
    """The first key (in order) that starts with a dotted prefix: ``quantized_layers`` looked up per layer."""

    def __init__(self, keys) -> None:
        self.keys = list(keys)
        self.index: dict[str, str] = {}
        for key in self.keys:
            end = -1
            for _ in range(INDEX_DEPTH):
                end = key.find(".", end + 1)
                if end < 0:
                    break
                self.index.setdefault(key[:end + 1], key)

    def first(self, prefix: str) -> Optional[str]:
        if prefix.endswith(".") and prefix.count(".") <= INDEX_DEPTH:
            return self.index.get(prefix)
        return next((k for k in self.keys if k.startswith(prefix)), None)


def _family(name: str, where: str) -> LayerQuant:
    make = FAMILY_SCHEMES.get(name)
    if make is None:
        return Unmapped(f"{where}: the {name.upper()} family is not mapped yet (no {name} policy in this moe-fsm)")
    return Mapped(make(), where)


def _unquantized(why: str) -> Mapped:
    return Mapped(QuantScheme.unquantized(), why)


# -- fp8 (DeepSeek-V3) ---------------------------------------------------------------


class _Fp8:
    def __init__(self, config: dict) -> None:
        skipped = _names(config.get("modules_to_not_convert"), "modules_to_not_convert") + _names(
            config.get("ignored_layers"), "ignored_layers")
        self.skipped = _SubstringOrGlob(skipped, "modules_to_not_convert / ignored_layers", glob=False)
        block = config.get("weight_block_size")
        if block is not None and (not isinstance(block, list) or not all(
                isinstance(b, (int, float)) and not isinstance(b, bool) for b in block)):
            raise _bad("weight_block_size", "a list of numbers such as [128, 128]", block)
        self.block = block
        if "activation_scheme" not in config:
            raise InputError("quantization_config: activation_scheme is missing; vLLM's fp8 reader requires it "
                             f"(one of {', '.join(map(repr, FP8_ACTIVATION_SCHEMES))})")
        scheme = config["activation_scheme"]
        if not isinstance(scheme, str) or scheme not in FP8_ACTIVATION_SCHEMES:
            raise _bad("activation_scheme", "'dynamic' or 'static', in lower case (vLLM's fp8 reader takes no other "
                       "spelling)", scheme)
        self.dynamic = scheme == "dynamic"

    def layer(self, experts: str) -> LayerQuant:
        hit = self.skipped.first(experts)
        if hit:
            return _unquantized(f"fp8: not converted ({hit!r})")
        block, dynamic = self.block, self.dynamic
        if block is None:
            return Mapped(QuantScheme.fp8("tensor", "tensor", static_activation=not dynamic),
                          f"fp8 per-tensor, {'dynamic' if dynamic else 'static'} activations")
        if block != [128, 128]:
            return Unmapped(f"fp8 weight_block_size {_short(block)}: moe-fsm's FP8 schemes take 128x128 blocks only")
        if not dynamic:
            return Unmapped("fp8 with 128x128 weight blocks and static activation scales: no such scheme in vLLM's oracles")
        return Mapped(QuantScheme.fp8("block", "group"), "fp8 block 128x128, dynamic 1x128 activations")


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _text(value) -> str:
    text = str(value)
    return text if len(text) <= 40 else text[:37] + "..."


# -- modelopt ----------------------------------------------------------------------------


def _algo(value, where: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise _bad(where, "a quant_algo name (a string)", value)
    return value.upper()


class _ModelOpt:
    def __init__(self, config: dict) -> None:
        body = config.get("quantization") if isinstance(config.get("quantization"), dict) else config
        self.algo = _algo(body.get("quant_algo"), "quant_algo")
        for key, source in (("exclude_modules", body), ("ignore", body), ("ignore", config)):
            if source.get(key):
                excluded = _names(source.get(key), key)
                break
        else:
            excluded = []
        self.excluded = _SubstringOrGlob(excluded, "exclude_modules", glob=True)
        self.layers = _obj(body.get("quantized_layers"), "quantized_layers", {}) if self.algo == "MIXED_PRECISION" else {}
        for key, entry in self.layers.items():  # every entry checked up front: no layer is decided from a malformed config
            _algo(_obj(entry, f"quantized_layers[{key!r}]").get("quant_algo"), f"quantized_layers[{key!r}].quant_algo")
        self.index = _PrefixIndex(self.layers)

    def layer(self, experts: str) -> LayerQuant:
        excluded = self.excluded.first(experts)
        if excluded:
            return _unquantized(f"modelopt: excluded by {excluded!r}")
        algo = self.algo
        if algo == "MIXED_PRECISION":
            parent = experts.rsplit(".experts", 1)[0] + "."
            key = self.index.first(experts + ".") or self.index.first(parent)
            if key is None:
                return _unquantized("modelopt MIXED_PRECISION: not in quantized_layers")
            entry = _obj(self.layers[key], f"quantized_layers[{key!r}]")
            algo = _algo(entry.get("quant_algo", ""), f"quantized_layers[{key!r}].quant_algo")
            where = f"modelopt MIXED_PRECISION: {algo} ({key})"
        else:
            where = f"modelopt {algo}"
        if algo in ALGO_SCHEMES:
            return Mapped(ALGO_SCHEMES[algo](), where)
        if algo.lower() in FAMILY_SCHEMES:
            return _family(algo.lower(), where)
        return Unmapped(f"{where}: quant_algo {_short(algo) if algo else '(none)'} is not one of {sorted(ALGO_SCHEMES)}")


# -- compressed-tensors ---------------------------------------------------------------


def _args(group: dict, key: str, name: str) -> Optional[dict]:
    value = group.get(key)
    return None if value is None else _obj(value, f"config_groups[{name!r}].{key}")


def _ct_dynamic(args: dict, where: str) -> bool:
    """A compressed-tensors ``dynamic`` read as compressed-tensors' ``QuantizationArgs`` (the pydantic model vLLM
    validates every group's weights and input_activations with) reads it; whatever that model refuses is refused here.

    Accepted: true / false (also the numbers 1 / 0), absent meaning false, and "local" (any case) with the
    ``tensor_group`` strategy, which counts as dynamic. Any other string is refused there, "true" and "false"
    included: its validator turns strings into its ``DynamicType`` enum, whose only member is "local".
    """
    value = args.get("dynamic", False)
    if isinstance(value, str):
        strategy = args.get("strategy")
        if value.lower() == "local" and isinstance(strategy, str) and strategy.lower() == "tensor_group":
            return True
    elif isinstance(value, (bool, int, float)) and value in (0, 1):
        return bool(value)
    raise _bad(f"{where}.dynamic", "true or false (JSON booleans, not strings), or \"local\" with strategy tensor_group",
               value)


def _ct_scheme(group: dict, name: str = "group") -> tuple[Optional[Mapped], str]:
    """A compressed-tensors group's (weights, input_activations) as an experts scheme, or why not."""
    w, a = _args(group, "weights", name) or {}, _args(group, "input_activations", name)
    kind = f"{_text(w.get('type'))} W{_text(w.get('num_bits'))}" + (f"A{_text(a.get('num_bits'))}" if a else "A16")
    if w.get("type") == "float" and w.get("num_bits") == 8 and a and a.get("type") == "float" and a.get("num_bits") == 8:
        strategy, act = w.get("strategy"), a.get("strategy")
        dynamic = _ct_dynamic(a, f"config_groups[{name!r}].input_activations")
        weight_scale = {"tensor": "tensor", "channel": "channel", "block": "block"}.get(strategy) if isinstance(strategy, str) else None
        act_scale = {"tensor": "tensor", "token": "token", "group": "group"}.get(act) if isinstance(act, str) else None
        structure = w.get("block_structure") or [128, 128]
        if strategy == "block" and structure != [128, 128]:
            return None, f"FP8 block {_short(structure)}: moe-fsm takes 128x128 blocks only"
        if weight_scale and act_scale:
            scheme = QuantScheme.fp8(weight_scale, act_scale, static_activation=not dynamic)
            return Mapped(scheme, f"compressed-tensors FP8 {strategy} weights, {act} {'dynamic' if dynamic else 'static'} activations",
                          allow_vllm_cutlass=True), ""
        return None, f"FP8 weights by {_text(strategy)}, activations by {_text(act)}: no such FP8 scheme"
    if w.get("type") == "float" and w.get("num_bits") == 4 and w.get("strategy") == "tensor_group" and w.get("group_size") == 16:
        if a is None:
            return Mapped(QuantScheme(QuantFamily.NVFP4, NVFP4_STATIC, None), "compressed-tensors NVFP4 W4A16"), ""
        if a.get("type") == "float" and a.get("num_bits") == 4:
            return Mapped(QuantScheme.nvfp4(), "compressed-tensors NVFP4 W4A4"), ""
    if w.get("type") == "float" and w.get("num_bits") == 4 and w.get("group_size") == 32:
        mapped = _family("mxfp4", "compressed-tensors MXFP4")
        return (mapped, "") if isinstance(mapped, Mapped) else (None, mapped.reason)
    return None, f"{kind} ({_text(w.get('strategy'))}) is not mapped yet"


class _CompressedTensors:
    def __init__(self, config: dict) -> None:
        self.ignore = _CtTargets(_names(config.get("ignore"), "ignore"), "ignore")
        groups = _obj(config.get("config_groups"), "config_groups", {})
        if len(groups) > MAX_GROUPS:
            raise InputError(f"quantization_config: config_groups holds {len(groups)} groups; moe-fsm takes at most "
                             f"{MAX_GROUPS} (published checkpoints have one to three)")
        self.groups = []
        for name, group in groups.items():
            group = _obj(group, f"config_groups[{name!r}]")
            for key in ("weights", "input_activations"):  # checked up front, as vLLM validates every group
                args = _args(group, key, name)
                if args is not None:
                    _ct_dynamic(args, f"config_groups[{name!r}].{key}")
            targets = _CtTargets(_names(group.get("targets"), f"config_groups[{name!r}].targets"),
                                 f"config_groups[{name!r}].targets")
            self.groups.append((name, group, targets))
        _capped([r for _, _, t in self.groups for r in t.regexes] + self.ignore.regexes, "config_groups and ignore", "regex")

    def layer(self, experts: str) -> LayerQuant:
        names = [f"{experts}.0.{proj}" for proj in ("gate_proj", "up_proj", "down_proj")]
        ignored = [self.ignore.first(n, linear=False) for n in names]
        if all(ignored):
            return _unquantized(f"compressed-tensors: ignored ({ignored[0]!r})")
        if any(ignored):
            return Unmapped("compressed-tensors: the ignore list covers only some of the experts' projections")
        chosen = []
        for module in names:
            # exact names and patterns win over the class target "Linear", as in compressed-tensors
            match = sorted((g for g in self.groups if g[2].first(module)), key=lambda g: g[2].linear)
            chosen.append(match[0] if match else None)
        if any(c is None for c in chosen):
            return _unquantized("compressed-tensors: no config group targets the experts")
        if any(c is not chosen[0] for c in chosen):
            return Unmapped("compressed-tensors: the experts' projections fall in different config groups (vLLM refuses this)")
        name, group, _ = chosen[0]
        mapped, why = _ct_scheme(group, name)
        return mapped if mapped is not None else Unmapped(f"compressed-tensors: {why}")


# -- mxfp4 (gpt-oss) ------------------------------------------------------------------


class _Mxfp4:
    def __init__(self, config: dict) -> None:
        self.skipped = _ModuleGlob(_names(config.get("modules_to_not_convert"), "modules_to_not_convert"),
                                   "modules_to_not_convert")

    def layer(self, experts: str) -> LayerQuant:
        hit = self.skipped.first(experts)
        if hit:
            return _unquantized(f"mxfp4: not converted ({hit!r})")
        return _family("mxfp4", "mxfp4 (gpt-oss)")


QUANT_METHODS: dict[str, Callable[[dict], object]] = {
    "fp8": _Fp8,
    "modelopt": _ModelOpt,
    "compressed-tensors": _CompressedTensors,
    "mxfp4": _Mxfp4,
}


class QuantReader:
    """A checkpoint's quantization_config, read (and its name lists indexed) once; ``layer(experts)`` per layer.

    InputError (naming the field) when a field the reader needs has the wrong type; an unknown
    ``quant_method`` maps every layer to ``Unmapped`` with the reason.
    """

    def __init__(self, quantization: Optional[dict]) -> None:
        self.reader, self.unmapped = None, None
        if not quantization:
            return
        quantization = _obj(quantization, "quantization_config")
        method = quantization.get("quant_method", "")
        method = method.lower() if isinstance(method, str) else _short(method)
        make = QUANT_METHODS.get(method)
        if make is None:
            self.unmapped = Unmapped(f"quant_method {method or '(none)'!r} is not mapped (moe-fsm reads {sorted(QUANT_METHODS)})")
        else:
            self.reader = make(quantization)

    def layer(self, experts: str) -> LayerQuant:
        if self.unmapped is not None:
            return self.unmapped
        if self.reader is None:
            return _unquantized("unquantized")
        return self.reader.layer(experts)


def layer_quant(quantization: Optional[dict], experts: str) -> LayerQuant:
    """The scheme of the experts module ``experts`` under a checkpoint's quantization_config."""
    return QuantReader(quantization).layer(experts)
