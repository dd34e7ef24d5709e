"""A checkpoint's ``quantization_config`` to the QuantScheme of each MoE layer's experts, as vLLM 0.31-0.33 read it.

vLLM reads a checkpoint's quantization in three steps (docs/vllm-config-path.md says where each rule
comes from), and this module follows each one as data:

1. **Which config class** (``vllm/config/model.py`` ``_verify_quantization``): the config's
   ``quant_method`` (ModelOpt's ``hf_quant_config.json`` form gets one from its ``quant_algo``), then the
   *override* classes in vLLM's order (``OVERRIDES``: GPTQ -> ``auto_gptq``, AWQ -> ``auto_awq`` except on
   CPUs, ModelOpt algos -> ``modelopt``/``modelopt_fp4``/``modelopt_mxfp8``/``modelopt_mixed``, gpt-oss's
   ``mxfp4`` -> ``gpt_oss_mxfp4``). A name vLLM does not know (``bitsandbytes``) or deprecates
   (``fbgemm_fp8``), one the platform refuses (``verify_quantization``), and a GPU under the class's minimum
   capability are refusals with vLLM's words (``Refused``).
2. **Which MoE method per layer** (the class's ``get_quant_method`` for a ``RoutedExperts`` layer, reading the
   layer's module name ``model.layers.N.mlp.experts``): exclusion lists, GPTQ's ``dynamic`` rules, the
   compressed-tensors config groups matched on the experts' unfused projections, ModelOpt's
   ``quantized_layers``, Quark's ``layer_quant_config`` -- and where vLLM falls back (GPTQ and AWQ to
   ``MoeWNA16Method`` when Marlin's shape rule fails). One reader class per vLLM config class
   (``CONFIG_READERS``); the larger ones live in modules of their own (``compressed_tensors_config``,
   ``modelopt_config``, ``quark_config``).
3. **The scheme the method hands its oracle**: the (weight, activation) keys and checkpoint facts, built
   here as a ``QuantScheme`` (``Mapped``), whose family picks moe-fsm's policy for that oracle.

What vLLM refuses is a ``Refused`` layer with vLLM's message and exception type; what vLLM decides outside
any oracle moe-fsm models (DeepSeek-V4's MXFP4 picker, compressed-tensors' MXFP4 W4A4 kernel choice, MXFP6)
is ``Unmapped`` with the reason -- never a skipped layer. A field of the wrong type, or a value
compressed-tensors' own schema refuses, is an ``InputError`` naming it. The few rules that differ between
releases are ``RELEASE_RULES`` (``quant_fields``, with the results and the typed reads SGLang's reader
shares). Name lists are indexed once per config (``QuantReader``) and pattern lists are capped
(``name_matching``), so a plan's cost does not grow with layers x list length.
"""

from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType
from typing import Callable, Optional, Union

from moe_fsm.errors import InputError
from moe_fsm.inputs.platform import Vendor
from moe_fsm.inputs.quant import QuantScheme
from moe_fsm.plan.compressed_tensors_config import CompressedTensorsReader
from moe_fsm.plan.modelopt_config import ModelOptReader
from moe_fsm.plan.name_matching import SubstringOrGlob, VllmRegex
from moe_fsm.plan.quant_fields import (
    ConfigRules, LayerContext, LayerQuant, Mapped, Reader, Refusal, Refused, bad_field, first_key, fp8_block_scheme,
    not_modelled, read_flag, read_int, read_names, read_object, short_text, unquantized,
)
from moe_fsm.plan.quark_config import QuarkReader


# vLLM's fp8 ACTIVATION_SCHEMES (fp8.py): Fp8Config refuses a config whose activation_scheme is absent or not exactly one of these.
FP8_ACTIVATION_SCHEMES = ("dynamic", "static")


# -- step 1: which vLLM config class reads the checkpoint --------------------------------------------------------

# vLLM's QuantizationMethods: every name get_quantization_config accepts (identical in 0.31-0.33).
VLLM_METHODS = (
    "awq", "auto_awq", "fp8", "fbgemm_fp8", "fp_quant", "modelopt", "modelopt_fp4", "modelopt_mxfp8", "modelopt_mixed",
    "auto_gptq", "gptq", "gptq_marlin", "awq_marlin", "humming", "compressed-tensors", "experts_int8", "quark",
    "moe_wna16", "torchao", "inc", "mxfp4", "gpt_oss_mxfp4", "deepseek_v4_fp8", "online", "fp8_per_tensor",
    "fp8_per_block", "fp8_per_channel", "int8_per_channel_weight_only", "nvfp4_per_token", "mxfp8",
)
DEPRECATED_METHODS = ("fbgemm_fp8", "fp_quant")
# The platforms that list the methods they take (Platform.supported_quantization; CUDA and CPU take all).
PLATFORM_METHODS = {
    Vendor.ROCM: ("awq", "auto_awq", "awq_marlin", "gptq", "auto_gptq", "fp8", "deepseek_v4_fp8", "compressed-tensors",
                  "fbgemm_fp8", "inc", "quark", "mxfp4", "mxfp8", "torchao", "modelopt", "modelopt_fp4",
                  "modelopt_mxfp8", "modelopt_mixed", "fp8_per_tensor", "fp8_per_block", "fp8_per_channel", "online",
                  "gpt_oss_mxfp4"),
    Vendor.XPU: ("awq", "gptq", "moe_wna16", "auto_awq", "auto_gptq", "inc", "fp8", "deepseek_v4_fp8", "mxfp4", "mxfp8",
                 "fp8_per_tensor", "fp8_per_block", "fp8_per_channel", "online", "gpt_oss_mxfp4", "modelopt",
                 "compressed-tensors"),
}
PLATFORM_NAMES = {Vendor.ROCM: "rocm", Vendor.XPU: "xpu"}
# ModelOpt hf_quant_config.json (producer modelopt): quant_algo -> quant_method (model_arch_config_convertor).
MODELOPT_PRODUCER_METHODS = {"FP8": "modelopt", "FP8_PER_CHANNEL_PER_TOKEN": "modelopt", "FP8_PB_WO": "modelopt",
                             "NVFP4": "modelopt_fp4", "MIXED_PRECISION": "modelopt_mixed"}


def _modelopt_algo(config: dict) -> Optional[str]:
    """ModelOptQuantConfigBase._extract_modelopt_quant_algo: the upper-cased quant_algo of a modelopt* config."""
    method = config.get("quant_method", "")
    if not isinstance(method, str) or not method.lower().startswith("modelopt"):
        return None
    if "quantization" in config:
        body = config["quantization"]
        return str(body.get("quant_algo", "")).upper() if isinstance(body, dict) else None
    return str(config.get("quant_algo", "")).upper()


def _gptq(config, ctx):
    return "auto_gptq" if config.get("quant_method", "").lower() == "gptq" else None


def _awq(config, ctx):
    if ctx.vendor is Vendor.CPU:  # "Don't override on CPU - let cpu_awq handle it"
        return None
    return "auto_awq" if config.get("quant_method", "").lower() == "awq" else None


def _algo_is(name: str, test: Callable[[str], bool]):
    def override(config, ctx):
        algo = _modelopt_algo(config)
        return name if algo is not None and test(algo) else None
    return override


def _gpt_oss(config, ctx):
    return "gpt_oss_mxfp4" if config.get("quant_method") in ("mxfp4", "gpt_oss_mxfp4") and ctx.model_type == "gpt_oss" else None


def _deepseek_v4(config, ctx):
    if config.get("quant_method") not in ("fp8", "deepseek_v4_fp8"):
        return None
    return "deepseek_v4_fp8" if ctx.model_type in ("deepseek_v4", "deepseek_v4_text", "deepseek_v41") else None


# vLLM's override classes, in the order _verify_quantization asks them (each QuantizationConfig's
# override_quantization_method; with no --quantization from the user). moe_wna16 and humming claim a checkpoint only
# when the user asks for them, so they never do here.
OVERRIDES: tuple[tuple[str, Callable], ...] = (
    ("auto_gptq", _gptq),
    ("auto_awq", _awq),
    ("inc", lambda config, ctx: "inc" if config.get("quant_method") == "auto-round" else None),
    ("modelopt", _algo_is("modelopt", lambda algo: algo == "FP8")),
    ("modelopt_fp4", _algo_is("modelopt_fp4", lambda algo: "NVFP4" in algo or "FP4" in algo)),
    ("modelopt_mxfp8", _algo_is("modelopt_mxfp8", lambda algo: "MXFP8" in algo)),
    ("modelopt_mixed", _algo_is("modelopt_mixed", lambda algo: algo == "MIXED_PRECISION")),
    ("gpt_oss_mxfp4", _gpt_oss),
    ("deepseek_v4_fp8", _deepseek_v4),
)


def resolve_method(config: dict, ctx: LayerContext) -> Union[str, Refused, None]:
    """vLLM's name for the checkpoint's quantization (None: unquantized), or its refusal."""
    return _resolve(dict(config), ctx)


def _resolve(config: dict, ctx: LayerContext) -> Union[str, Refused, None]:
    """``resolve_method`` on a copy of the config that it normalises in place, as vLLM's convertor normalises the
    dict its config classes then read (``quant_method`` lower-cased, ModelOpt's set from its ``quant_algo``)."""
    producer = config.get("producer")
    body = config.get("quantization")
    if isinstance(producer, dict) and producer.get("name") == "modelopt" or (
            isinstance(body, dict) and "modelopt_quant_config" in body):
        algo = body.get("quant_algo") if isinstance(body, dict) else None
        if algo is not None:
            if str(algo).upper() not in MODELOPT_PRODUCER_METHODS:
                return Refused(f"Unknown ModelOpt quant algo: {short_text(algo)}")
            config["quant_method"] = MODELOPT_PRODUCER_METHODS[str(algo).upper()]
    method = config.get("quant_method", "")
    if not isinstance(method, str):
        raise bad_field("quant_method", "a string", method)
    method = method.lower().replace("compressed_tensors", "compressed-tensors")
    config["quant_method"] = method
    for _, override in OVERRIDES:
        claimed = override(config, ctx)
        if claimed is not None:
            method = claimed
            break
    if not method:
        return None
    if method not in VLLM_METHODS:
        return Refused(f"Unknown quantization method: {short_text(method)}. Must be one of {list(VLLM_METHODS)}.")
    accepted = PLATFORM_METHODS.get(ctx.vendor)
    if accepted is not None and method not in accepted:
        return Refused(f"{method} quantization is currently not supported in {PLATFORM_NAMES[ctx.vendor]}.")
    if method in DEPRECATED_METHODS:
        return Refused(f"The quantization method {method} is deprecated and will be removed in future versions of "
                       "vLLM. To bypass, set `--allow-deprecated-quantization`.")
    return method


# -- step 2 and 3: each config class's MoE method and the scheme it hands the oracle ----------------------------------




def _marlin_fits(ctx: LayerContext, group_size: int) -> bool:
    """check_moe_marlin_supports_config(allow_tile_padding=True): what GPTQ and AWQ ask before their Marlin method."""
    if ctx.vendor is Vendor.ROCM:
        return False
    ispp = ctx.intermediate_per_partition
    shape = ctx.hidden_size % 128 == 0 and (group_size <= 0 or ispp % group_size == 0)
    return shape and group_size in (-1, 32, 64, 128)


def _desc_act(desc_act, group_size, dynamic: dict) -> bool:
    """normalize_and_validate_gptq_desc_act: act-order is a no-op per channel, and refused otherwise."""
    base = desc_act
    if desc_act and group_size == -1:
        desc_act = False
    if desc_act:
        raise Refusal("GPTQ group activation ordering (desc_act=True) is no longer supported. Use a checkpoint with "
                       "static activation ordering or desc_act=False.")
    for pattern, overrides in dynamic.items():
        if pattern.startswith("-:") or not isinstance(overrides, dict):
            continue
        if overrides.get("desc_act", base) and overrides.get("group_size", group_size) != -1:
            raise Refusal("GPTQ group activation ordering (desc_act=True) is no longer supported, but is enabled by "
                           f"dynamic rule {pattern!r}. Use a checkpoint with static activation ordering or desc_act=False.")
    return desc_act


class _MoeWNA16(Reader):
    """MoeWNA16Config (vLLM's fallback for GPTQ and AWQ layers Marlin cannot take): ``MoeWNA16Method``."""

    MIN_CAPABILITY = 70

    def __init__(self, config: dict, ctx: LayerContext, method: str = "moe_wna16") -> None:
        super().__init__(config, ctx, method)
        linear = first_key(config, ("quant_method",))
        self.bits = read_int(first_key(config, ("bits",)), "bits")
        self.group_size = read_int(first_key(config, ("group_size",)), "group_size")
        if linear == "gptq":
            self.zero_point = not read_flag(first_key(config, ("sym",)), "sym")
            self.skipped = SubstringOrGlob([], "modules_to_not_convert", glob=False)
            _desc_act(config.get("desc_act", False), self.group_size, config.get("dynamic") or {})
        elif linear in ("awq", "awq_marlin"):
            self.zero_point = read_flag(first_key(config, ("zero_point",)), "zero_point")
            self.skipped = SubstringOrGlob(read_names(config.get("modules_to_not_convert"), "modules_to_not_convert"),
                                            "modules_to_not_convert", glob=False)
            cap = ctx.capability
            if (-1 if cap is None else cap) < _AutoAWQ.MIN_CAPABILITY:
                raise Refusal("The quantization method moe_wna16 + awq is not supported for the current GPU. "
                               f"Minimum capability: {_AutoAWQ.MIN_CAPABILITY}. Current capability: "
                               f"{-1 if cap is None else cap}.")
        else:
            raise Refusal("moe_wna16 only support gptq and awq.")
        self.linear = linear

    def layer(self, experts: str) -> LayerQuant:
        hit = self.skipped.first(experts)
        if hit:
            return unquantized(f"moe_wna16: not converted ({hit!r})")
        if self.bits not in (4, 8):
            return Refused("MoeWNA16Method only supports int4 and int8 now.")
        scheme = QuantScheme.int_wna16(self.bits, self.group_size, self.zero_point, "moe_wna16")
        return Mapped(scheme, f"{self.linear} {self.bits}-bit group {self.group_size} via MoeWNA16 (Marlin's shape rule "
                      "fails)", method="MoeWNA16Method")


class _AutoGPTQ(Reader):
    """AutoGPTQConfig (``gptq``, ``gptq_marlin``, ``auto_gptq``): ``AutoGPTQMoEMethod``, or MoeWNA16 where Marlin's
    shape rule fails; ``dynamic`` rules (GPTQModel) skip a module (``-:``) or override its bits / group / sym."""

    MIN_CAPABILITY = 60
    TYPES = {(4, True), (8, True)}  # AutoGPTQConfig.TYPE_MAP

    def __init__(self, config: dict, ctx: LayerContext, method: str) -> None:
        super().__init__(config, ctx, method)
        dynamic = config.get("dynamic") or {}
        if not isinstance(dynamic, dict) or not all(isinstance(v, dict) for v in dynamic.values()):
            raise bad_field("dynamic", "an object of module regexes -> overrides (objects)", dynamic)
        self.dynamic = dynamic
        self.bits = read_int(first_key(config, ("bits",)), "bits")
        self.group_size = read_int(first_key(config, ("group_size",)), "group_size")
        self.desc_act = read_flag(first_key(config, ("desc_act",)), "desc_act")
        self.sym = read_flag(first_key(config, ("sym",)), "sym")
        _desc_act(self.desc_act, self.group_size, dynamic)
        if (self.bits, self.sym) not in self.TYPES:
            raise Refusal(f"Unsupported quantization config: bits={self.bits}, sym={self.sym}")
        # GPTQModel's rules, in order: "-:regex" skips the module, "+:regex" or a bare regex overrides its fields
        self.rule_keys = list(dynamic)
        self.rules = VllmRegex(["re:" + k.removeprefix("-:").removeprefix("+:") for k in dynamic], "dynamic")
        self.fallback = None

    def _rule(self, experts: str) -> tuple[Optional[str], Optional[dict]]:
        """get_dynamic_override: the first rule (in the config's order) whose regex matches the module."""
        for entry in self.rules.regexes:
            if self.rules.matches(entry, experts):
                key = self.rule_keys[entry[0]]
                return key, self.dynamic[key]
        return None, None

    def layer(self, experts: str) -> LayerQuant:
        ctx = self.ctx
        if not _marlin_fits(ctx, self.group_size):  # before the dynamic rules, with the base group size
            if self.fallback is None:
                self.fallback = _MoeWNA16(self.config, ctx)
            return self.fallback.layer(experts)
        pattern, values = self._rule(experts)
        if pattern is not None and pattern.startswith("-:"):
            return unquantized(f"gptq: dynamic rule {pattern!r} skips it")
        bits, group, desc_act, sym = self.bits, self.group_size, self.desc_act, self.sym
        if values:
            bits = values.get("bits", bits) if isinstance(values.get("bits", bits), int) else bits
            group = values.get("group_size", group) if isinstance(values.get("group_size", group), int) else group
            desc_act = values["desc_act"] if isinstance(values.get("desc_act"), bool) else desc_act
            sym = values["sym"] if isinstance(values.get("sym"), bool) else sym
            if (bits, sym) not in self.TYPES:
                return Refused(f"Unsupported quantization config: bits={bits}, sym={sym}")
        if desc_act and group != -1:
            return Refused("GPTQ group activation ordering (desc_act=True) is no longer supported. Use a checkpoint "
                           "with static activation ordering or desc_act=False.")
        scheme = QuantScheme.int_wna16(bits, group, not sym, "gptq")
        rule = f", dynamic rule {pattern!r}" if pattern else ""
        return Mapped(scheme, f"gptq {bits}-bit group {group}{rule}", method="AutoGPTQMoEMethod")


class _AutoAWQ(Reader):
    """AutoAWQConfig (``awq``, ``awq_marlin``, ``auto_awq``): ``AutoAWQMoEMethod``, or MoeWNA16 where Marlin's shape
    rule fails; ``modules_to_not_convert`` by substring."""

    MIN_CAPABILITY = 75

    def __init__(self, config: dict, ctx: LayerContext, method: str) -> None:
        super().__init__(config, ctx, method)
        self.bits = read_int(first_key(config, ("w_bit", "bits")), "bits")
        self.group_size = read_int(first_key(config, ("q_group_size", "group_size")), "group_size")
        self.zero_point = read_flag(first_key(config, ("zero_point",)), "zero_point")
        self.skipped = SubstringOrGlob(read_names(config.get("modules_to_not_convert"), "modules_to_not_convert"),
                                        "modules_to_not_convert", glob=False)
        if self.bits != 4:
            raise Refusal(f"Unsupported num_bits = {self.bits}. Supported: 4. For 8-bit AWQ, use Marlin backend by "
                           "setting backend='awq:marlin' or backend='marlin'.")
        self.fallback = None

    def layer(self, experts: str) -> LayerQuant:
        hit = self.skipped.first(experts)
        if hit:
            return unquantized(f"awq: not converted ({hit!r})")
        if not _marlin_fits(self.ctx, self.group_size):
            if self.fallback is None:  # MoeWNA16Config.from_config(full_config), quant_method normalised to "awq"
                self.fallback = _MoeWNA16({**self.config, "quant_method": "awq"}, self.ctx)
            return self.fallback.layer(experts)
        scheme = QuantScheme.int_wna16(4, self.group_size, self.zero_point, "awq")
        return Mapped(scheme, f"awq 4-bit group {self.group_size}{' zero-point' if self.zero_point else ''}",
                      method="AutoAWQMoEMethod")


# fp8 -------------------------------------------------------------------------------------------------------------


class _Fp8(Reader):
    """Fp8Config: ``Fp8MoEMethod`` (block or per-tensor); ``ignored_layers`` (else ``modules_to_not_convert``)
    name whole modules exactly; ``store_dtype: mxfp4`` is DeepSeek-V4's MXFP4 method."""

    MIN_CAPABILITY = 75

    def __init__(self, config: dict, ctx: LayerContext, method: str) -> None:
        super().__init__(config, ctx, method)
        ignored = read_names(config.get("ignored_layers"), "ignored_layers") or read_names(
            config.get("modules_to_not_convert"), "modules_to_not_convert")
        self.ignored = {name: name for name in ignored}
        block = config.get("weight_block_size")
        if block is not None and (not isinstance(block, list) or not all(
                isinstance(b, (int, float)) and not isinstance(b, bool) and b > 0 for b in block)):
            raise bad_field("weight_block_size", "a list of positive numbers such as [128, 128]", block)
        if "activation_scheme" not in config:
            raise InputError("quantization_config: activation_scheme is missing; vLLM's fp8 reader requires it "
                             f"(one of {', '.join(map(repr, FP8_ACTIVATION_SCHEMES))})")
        scheme = config["activation_scheme"]
        if not isinstance(scheme, str) or scheme not in FP8_ACTIVATION_SCHEMES:
            raise bad_field("activation_scheme", "'dynamic' or 'static', in lower case (vLLM's fp8 reader takes no other "
                       "spelling)", scheme)
        self.dynamic = scheme == "dynamic"
        if block is not None:
            if len(block) != 2:
                raise Refusal("The quantization block size of weight must have 2 dimensions, but got "
                               f"{len(block)} dimensions")
            if not self.dynamic:
                raise Refusal("The block-wise quantization only supports dynamic activation scheme for now, but got "
                               "static activation scheme.")
        self.block = block
        self.store_dtype = config.get("store_dtype")

    def layer(self, experts: str) -> LayerQuant:
        if experts in self.ignored:
            return unquantized(f"fp8: ignored ({experts!r})")
        if self.store_dtype == "mxfp4":
            return not_modelled("fp8 with store_dtype mxfp4: vLLM's Mxfp4MoEMethod picks DeepSeek-V4's MXFP4 backend "
                                 "list, which moe-fsm does not model")
        if self.block is not None:
            return fp8_block_scheme(self.ctx, self.block, "fp8", "Fp8MoEMethod")
        if not self.dynamic:
            return Mapped(QuantScheme.fp8("tensor", "tensor", static_activation=True),
                          "fp8 per-tensor, static activations", method="Fp8MoEMethod")
        if self.ctx.rules.fp8_batch_invariant_token and self.ctx.batch_invariant:
            return Mapped(QuantScheme.fp8("tensor", "token"), "fp8 per-tensor, dynamic per-token activations "
                          "(VLLM_BATCH_INVARIANT)", method="Fp8MoEMethod")
        return Mapped(QuantScheme.fp8("tensor", "tensor"), "fp8 per-tensor, dynamic activations", method="Fp8MoEMethod")


# mxfp4 (gpt-oss) --------------------------------------------------------------------------------------------------


class _GptOssMxfp4(Reader):
    """GptOssMxfp4Config (``quant_method: mxfp4`` on a gpt_oss model): every experts layer is MXFP4 with 16-bit
    activations (``GptOssMxfp4MoEMethod``); vLLM reads no exclusion list for the experts."""

    MIN_CAPABILITY = 80

    def layer(self, experts: str) -> LayerQuant:
        return Mapped(QuantScheme.mxfp4(), "mxfp4 (gpt-oss), 16-bit activations", method="GptOssMxfp4MoEMethod")


NOT_MODELLED = {  # vLLM config classes whose MoE method moe-fsm has no policy for, with why
    "mxfp4": "mxfp4 on a model that is not gpt_oss: vLLM's Mxfp4MoEMethod picks DeepSeek-V4's MXFP4 backend list "
             "(select_deepseek_v4_mxfp4_moe_backend), which moe-fsm does not model",
    "deepseek_v4_fp8": "DeepSeek-V4's FP8 config chooses its own MoE methods; not modelled",
    "inc": "INC / auto-round checkpoints: not modelled",
    "torchao": "torchao checkpoints: not modelled",
    "humming": "Humming's own quantization config: not modelled (ask for the Humming backend instead)",
    "experts_int8": "experts_int8 quantizes online: not modelled",
    "online": "online quantization: not modelled",
}

# vLLM's config class per resolved method name (get_quantization_config's method_to_config, the MoE-bearing ones).
CONFIG_READERS: dict[str, type[Reader]] = {
    "awq": _AutoAWQ, "awq_marlin": _AutoAWQ, "auto_awq": _AutoAWQ,
    "gptq": _AutoGPTQ, "gptq_marlin": _AutoGPTQ, "auto_gptq": _AutoGPTQ,
    "moe_wna16": _MoeWNA16,
    "fp8": _Fp8,
    "modelopt": ModelOptReader, "modelopt_fp4": ModelOptReader, "modelopt_mxfp8": ModelOptReader,
    "modelopt_mixed": ModelOptReader, "mxfp8": ModelOptReader,
    "compressed-tensors": CompressedTensorsReader,
    "quark": QuarkReader,
    "gpt_oss_mxfp4": _GptOssMxfp4,
}




VLLM_CONFIG_RULES = ConfigRules("vLLM", _resolve, MappingProxyType(CONFIG_READERS), MappingProxyType(NOT_MODELLED))


class QuantReader:
    """A checkpoint's quantization_config, read (and its name lists indexed) once; ``layer(experts)`` per layer.

    InputError (naming the field) when a field the reader needs has the wrong type; what the engine refuses for
    the whole checkpoint makes every layer that ``Refused``. The engine's rules are the context's
    ``config_rules`` (vLLM's unless a profile names others).
    """

    def __init__(self, quantization: Optional[dict], context: Optional[LayerContext] = None) -> None:
        self.ctx = context or LayerContext()
        self.config_rules = self.ctx.config_rules or VLLM_CONFIG_RULES
        self.reader: Optional[Reader] = None
        self.whole: Optional[LayerQuant] = None
        self.method: Optional[str] = None
        if not quantization:
            return
        quantization = read_object(quantization, "quantization_config")
        quantization = dict(quantization)
        rules = self.config_rules
        try:
            method = rules.resolve(quantization, self.ctx)
            if isinstance(method, Refused):
                self.whole = replace(method, by=rules.engine)
                return
            self.method = method
            if method is None:
                return
            if method in rules.not_modelled:
                self.whole = not_modelled(rules.not_modelled[method])
                return
            if method not in rules.readers:
                self.whole = not_modelled(rules.unknown_reader.format(method=method))
                return
            self.reader = rules.readers[method](quantization, self.ctx, method)
            cap, minimum = self.ctx.capability, rules.min_capability(self.reader, method)
            if cap is not None and cap < minimum:
                self.whole = Refused(rules.capability_message.format(method=method, minimum=minimum, current=cap),
                                     by=rules.engine)
        except Refusal as refusal:
            self.whole = replace(refusal.refused, by=rules.engine)

    def layer(self, experts: str) -> LayerQuant:
        if self.whole is not None:
            return self.whole
        if self.reader is None:
            return unquantized("unquantized")
        try:
            found = self.reader.layer(experts)
        except Refusal as refusal:
            found = refusal.refused
        return replace(found, by=self.config_rules.engine) if isinstance(found, Refused) else found


def layer_quant(quantization: Optional[dict], experts: str, context: Optional[LayerContext] = None) -> LayerQuant:
    """The scheme of the experts module ``experts`` under a checkpoint's quantization_config."""
    return QuantReader(quantization, context).layer(experts)
