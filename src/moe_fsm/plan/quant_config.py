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
   (``CONFIG_READERS``).
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

import math
from dataclasses import replace
from fnmatch import fnmatch
from types import MappingProxyType
from typing import Callable, Optional, Union

from moe_fsm.errors import InputError
from moe_fsm.inputs.platform import Vendor
from moe_fsm.inputs.quant import NVFP4_STATIC, QuantFamily, QuantScheme
from moe_fsm.plan.compressed_tensors_config import CompressedTensorsReader
from moe_fsm.plan.name_matching import PrefixIndex, SubstringOrGlob, VllmRegex, capped
from moe_fsm.plan.quant_fields import (
    ConfigRules, LayerContext, LayerQuant, Mapped, Reader, Refusal, Refused, bad_field,
    first_key, not_modelled, read_flag, read_int, read_names, read_object, short_repr, short_text, unquantized,
)


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


def _fp8_block_scheme(ctx: LayerContext, block: list, source: str, method: str) -> LayerQuant:
    """Fp8MoEMethod with weight blocks: vLLM fits the blocks to the TP shard (refine_fp8_moe_block_shape) and keys
    the weights by the fitted shape; moe-fsm's FP8 block scheme is 128x128."""
    bn, bk = block
    ispp = ctx.intermediate_per_partition
    shape = list(block)
    if not (ispp % bn == 0 and (ctx.tp_size == 1 or ispp % bk == 0)):
        refine = math.gcd(int(bn), int(bk), ispp, ctx.hidden_size)
        if refine >= 32:
            shape = [refine, refine]
    if shape != [128, 128]:
        fitted = "" if shape == list(block) else f" (refined from {short_repr(block)} to fit the per-rank intermediate size {ispp})"
        return not_modelled(f"{source}: weight blocks {short_repr(shape)}{fitted}; moe-fsm's FP8 schemes take 128x128 "
                             "blocks only")
    return Mapped(QuantScheme.fp8("block", "group"), f"{source} block 128x128, dynamic 1x128 activations",
                  method=method)


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
            return _fp8_block_scheme(self.ctx, self.block, "fp8", "Fp8MoEMethod")
        if not self.dynamic:
            return Mapped(QuantScheme.fp8("tensor", "tensor", static_activation=True),
                          "fp8 per-tensor, static activations", method="Fp8MoEMethod")
        if self.ctx.rules.fp8_batch_invariant_token and self.ctx.batch_invariant:
            return Mapped(QuantScheme.fp8("tensor", "token"), "fp8 per-tensor, dynamic per-token activations "
                          "(VLLM_BATCH_INVARIANT)", method="Fp8MoEMethod")
        return Mapped(QuantScheme.fp8("tensor", "tensor"), "fp8 per-tensor, dynamic activations", method="Fp8MoEMethod")


# modelopt --------------------------------------------------------------------------------------------------------

MODELOPT_ALGOS = ("FP8", "FP8_PER_CHANNEL_PER_TOKEN", "FP8_PB_WO", "NVFP4", "W4A16_NVFP4", "MXFP8", "MIXED_PRECISION")
MODELOPT_OWNED = {  # the quant_algos each ModelOpt config class accepts (algos_owned_by)
    "modelopt": ("FP8", "FP8_PER_CHANNEL_PER_TOKEN", "FP8_PB_WO"),
    "modelopt_fp4": ("NVFP4", "W4A16_NVFP4"),
    "modelopt_mxfp8": ("MXFP8",),
}
BLOCK_FP8_MOE_ALGOS = ("FP8_PB_WO", "FP8_BLOCK_SCALES")
B12X_BLOCK_CODECS = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0")  # vllm.utils.b12x, MIXED_PRECISION entries (0.32+)
VISION_MODULES = ("vision_tower", "vision_model", "vit_large_projector")


def _modelopt_fixed(algo: str) -> tuple[QuantScheme, str]:
    """The scheme and method of the non-mixed ModelOpt MoE methods."""
    if algo in MODELOPT_OWNED["modelopt"]:  # ModelOptFp8MoEMethod keys every FP8 algo static per-tensor
        return QuantScheme.fp8("tensor", "tensor", static_activation=True), "ModelOptFp8MoEMethod"
    if algo == "NVFP4":
        return QuantScheme.nvfp4(), "ModelOptNvFp4FusedMoE"
    if algo == "W4A16_NVFP4":
        return QuantScheme(QuantFamily.NVFP4, NVFP4_STATIC, None), "ModelOptNvFp4FusedMoE"
    return QuantScheme.mxfp8(), "ModelOptMxFp8FusedMoE"


class _ModelOpt(Reader):
    """ModelOptFp8Config / ModelOptNvFp4Config / ModelOptMxFp8Config / ModelOptMixedPrecisionConfig."""

    MIN_CAPABILITIES = {"modelopt": 80, "modelopt_fp4": 75, "modelopt_mxfp8": 80, "mxfp8": 80, "modelopt_mixed": 75}

    def __init__(self, config: dict, ctx: LayerContext, method: str) -> None:
        super().__init__(config, ctx, method)
        self.MIN_CAPABILITY = self.MIN_CAPABILITIES[method]
        if method == "mxfp8":  # the MiniMax-style quant_method: the same class as modelopt_mxfp8
            method = "modelopt_mxfp8"
        if method == "modelopt_mxfp8" and "quantization" not in config and not config.get("quant_algo"):
            # ModelOptMxFp8Config.from_config reads a config without quant_algo as the ModelOpt MXFP8 schema
            config = {"quantization": {"quant_algo": "MXFP8", "exclude_modules": read_names(
                config.get("ignored_layers"), "ignored_layers")}}
        nested = "quantization" in config
        if nested:
            body = config["quantization"]
            if not isinstance(body, dict):
                raise Refusal("Expected 'quantization' to be a dictionary in config")
            algo = body.get("quant_algo")
            excluded = body.get("exclude_modules", [])
        else:
            body = config
            algo = config.get("quant_algo")
            excluded = config.get("ignore", config.get("exclude_modules", []) if ctx.rules.modelopt_flat_exclude_modules
                                  else [])
        if not algo:
            raise Refusal("Missing 'quant_algo' in quantization config")
        if not isinstance(algo, str):
            raise bad_field("quant_algo", "a quant_algo name (a string)", algo)
        algo = algo.upper()
        if not isinstance(excluded, list):
            raise Refusal(f"exclude_modules must be a list, got {type(excluded)}")
        if algo not in MODELOPT_ALGOS:
            raise Refusal(f"ModelOpt currently only supports: {list(MODELOPT_ALGOS)} quantizations in vLLM. Please "
                           "check the `hf_quant_config.json` file for your model's quant configuration.")
        owned = MODELOPT_OWNED.get(method)
        if owned is not None and algo not in owned:
            label = {"modelopt": "ModelOpt FP8 quant_algo for vLLM", "modelopt_fp4": "ModelOpt NVFP4 quant_algo",
                     "modelopt_mxfp8": "ModelOpt MXFP8 quant_algo"}[method]
            raise Refusal(f"Unsupported {label}: {algo}. Supported: {' / '.join(owned)}.")
        if method == "modelopt_fp4":
            groups = config.get("config_groups")
            if algo == "NVFP4" and isinstance(groups, dict) and groups and all(
                    isinstance(g, dict) and g.get("input_activations") is None for g in groups.values()):
                algo = "W4A16_NVFP4"  # weight-only despite the name: vLLM routes it through W4A16
            if "NVFP4" in algo and nested:
                missing = [f for f in ("group_size", "kv_cache_quant_algo", "exclude_modules") if f not in body]
                if missing:
                    raise Refusal(f"NVFP4 quantization requires the following fields in hf_quant_config.json: {missing}")
        self.algo = algo
        self.excluded = SubstringOrGlob(read_names(excluded, "exclude_modules"), "exclude_modules", glob=True)
        self.layers: dict = {}
        if method == "modelopt_mixed":
            self._read_mixed(body)
        self.method = method

    def _read_mixed(self, body: dict) -> None:
        layers = read_object(body.get("quantized_layers", {}), "quantized_layers", {})
        if not layers:
            raise Refusal("MIXED_PRECISION quant_algo requires a non-empty 'quantized_layers' mapping in the "
                           "quantization config.")
        blocks = set()
        for key, entry in layers.items():  # every entry checked up front: no layer is decided from a malformed config
            entry = read_object(entry, f"quantized_layers[{key!r}]")
            algo = entry.get("quant_algo", "")
            if not isinstance(algo, str):
                raise bad_field(f"quantized_layers[{key!r}].quant_algo", "a quant_algo name (a string)", algo)
            if self.ctx.rules.modelopt_b12x_codecs and algo.lower() in B12X_BLOCK_CODECS:
                continue  # (the codec's block contract is b12x's; its MoE method is not modelled)
            if algo.upper() in BLOCK_FP8_MOE_ALGOS:
                blocks.add(read_int(entry.get("group_size", 128), f"quantized_layers[{key!r}].group_size"))
        if len(blocks) > 1:
            raise Refusal(f"MIXED_PRECISION currently requires all block-FP8 MoE layers to use one group_size, got "
                           f"{sorted(blocks)}.")
        self.block = next(iter(blocks), 128)
        self.layers = layers
        self.index = PrefixIndex(layers)

    def _candidates(self, prefix: str) -> tuple[str, ...]:
        candidates = [prefix]
        if prefix.startswith("language_model.model."):
            candidates.append("model.language_model." + prefix[len("language_model.model."):])
        elif prefix.startswith("model.language_model."):
            candidates.append("language_model.model." + prefix[len("model.language_model."):])
        return tuple(dict.fromkeys(candidates))

    def _mixed_algo(self, experts: str) -> tuple[Optional[str], Optional[str]]:
        """_resolve_quant_algo for an experts module: the key itself, a key under it, a key under its parent."""
        for candidate in self._candidates(experts):
            if candidate in self.layers:
                return self.layers[candidate].get("quant_algo", "").upper(), candidate
        for candidate in self._candidates(experts):
            key = self.index.first(candidate + ".")
            if key is not None:
                return self.layers[key].get("quant_algo", "").upper(), key
        if experts.endswith(".experts"):
            key = self.index.first(experts.rsplit(".experts", 1)[0] + ".")
            if key is not None:
                return self.layers[key].get("quant_algo", "").upper(), key
        return None, None

    def layer(self, experts: str) -> LayerQuant:
        excluded = self.excluded.first(experts)
        if excluded:
            return unquantized(f"modelopt: excluded by {excluded!r}")
        if self.method != "modelopt_mixed":
            if any(v in experts for v in VISION_MODULES):
                return Refused("a vision module's MoE layer gets UnquantizedLinearMethod from ModelOpt, which "
                               "RoutedExperts asserts is a FusedMoEMethodBase", "AssertionError")
            scheme, method = _modelopt_fixed(self.algo)
            return Mapped(scheme, f"modelopt {self.algo}", method=method)
        algo, key = self._mixed_algo(experts)
        if algo is None:
            return unquantized("modelopt MIXED_PRECISION: not in quantized_layers")
        where = f"modelopt MIXED_PRECISION: {algo} ({key})"
        if self.ctx.rules.modelopt_b12x_codecs and algo.lower() in B12X_BLOCK_CODECS:
            return not_modelled(f"{where}: vLLM's ModelOptBlockQuantMoEMethod (b12x GGML blocks) is not modelled")
        if algo in BLOCK_FP8_MOE_ALGOS:
            return _fp8_block_scheme(self.ctx, [self.block, self.block], where, "Fp8MoEMethod")
        if algo in ("FP8", "NVFP4", "W4A16_NVFP4", "MXFP8"):
            scheme, method = _modelopt_fixed(algo)
            return Mapped(scheme, where, method=method)
        return unquantized(f"{where}: no MoE method for it (vLLM leaves the experts unquantized)")


# quark ------------------------------------------------------------------------------------------------------------


def _quark_tensor(value):
    """_unwrap_single_quant_config: a one-entry list is its entry; a longer list stays a list."""
    if isinstance(value, list):
        return value[0] if len(value) == 1 else value
    return value


class _Quark(Reader):
    """QuarkConfig: ``exclude`` (a child of the experts excluded excludes them all), then ``layer_quant_config``
    (fnmatch, or the name inside the pattern), else ``global_quant_config``; the weight/input pair picks the method."""

    MIN_CAPABILITY = 70

    def __init__(self, config: dict, ctx: LayerContext, method: str) -> None:
        super().__init__(config, ctx, method)
        if config.get("export") is None:
            raise Refusal("The export key should be included in the configurations of Quark quantized model")
        read_object(config["export"], "export")
        self.exclude = read_names(config.get("exclude"), "exclude")
        self.exclude_regex = VllmRegex(self.exclude, "exclude")
        self.layer_configs = read_object(config.get("layer_quant_config") or {}, "layer_quant_config", {})
        if config.get("layer_type_quant_config") is None:
            raise Refusal("QuarkConfig reads layer_type_quant_config with .get(), and the config has none "
                           "('NoneType' object has no attribute 'get')", "AttributeError")
        self.global_config = read_object(config.get("global_quant_config"), "global_quant_config", {})
        capped([p for p in self.layer_configs if "*" in p], "layer_quant_config", "wildcard")

    def _excluded(self, experts: str) -> Optional[str]:
        for target in self.exclude:
            if not target.startswith("re:") and (target == experts or target.startswith(experts + ".")):
                return target
        return self.exclude_regex.first(experts)

    def _config_for(self, experts: str) -> dict:
        for pattern, entry in self.layer_configs.items():
            if (fnmatch(experts, pattern) if "*" in pattern else experts in pattern):
                return read_object(entry, f"layer_quant_config[{pattern!r}]")
        return self.global_config

    def layer(self, experts: str) -> LayerQuant:
        hit = self._excluded(experts)
        if hit:
            return unquantized(f"quark: excluded by {hit!r}")
        chosen = self._config_for(experts)
        if chosen.get("output_tensors") or chosen.get("bias"):
            return Refused("Currently, Quark models with output_tensors and bias quantized are not supported",
                           "NotImplementedError")
        weight, inputs = _quark_tensor(chosen.get("weight")), _quark_tensor(chosen.get("input_tensors"))
        if isinstance(weight, list) or isinstance(inputs, list):
            return not_modelled("quark with several weight or input specs (W4A8 FP8, NVFP4): not modelled")
        if weight is not None and not isinstance(weight, dict) or inputs is not None and not isinstance(inputs, dict):
            raise bad_field("weight / input_tensors", "objects", (weight, inputs))
        fp8 = self._fp8(weight, inputs)
        if fp8 is not None:
            return fp8
        if isinstance(weight, dict) and weight.get("dtype") in ("int4", "uint4", "int8", "uint8"):
            return not_modelled(f"quark {short_text(weight['dtype']).upper()} weights (QuarkW4A16Int4MoEMethod / "
                                 "QuarkW8A8Int8MoEMethod): not modelled")
        mx = self._ocp_mx(weight, inputs)
        if mx is not None:
            return mx
        return Refused("Unsupported FusedMoe scheme", "RuntimeError")

    @staticmethod
    def _fp8(w: Optional[dict], a: Optional[dict]) -> Optional[LayerQuant]:
        """QuarkConfig._is_fp8_w8a8 -> QuarkW8A8Fp8MoEMethod."""
        if not isinstance(w, dict) or not isinstance(a, dict):
            return None
        if not (w.get("dtype") == "fp8_e4m3" and a.get("dtype") == "fp8_e4m3") or w.get("is_dynamic"):
            return None
        if w.get("qscheme") == "per_block" and list(w.get("block_size") or []) == [128, 128] and w.get("symmetric") is True:
            if not (a.get("is_dynamic") and a.get("qscheme") == "per_group" and a.get("group_size") == 128
                    and a.get("symmetric") is True):
                return None
            if w.get("scale_type") == "float8_e8m0fnu":
                return not_modelled("quark FP8 128x128 blocks with E8M0 scales: no such FP8 scheme in moe-fsm")
            return Mapped(QuantScheme.fp8("block", "group"), "quark FP8 128x128 blocks", method="QuarkW8A8Fp8MoEMethod")
        if w.get("qscheme") not in ("per_tensor", "per_channel"):
            return None
        weight = "channel" if w.get("qscheme") == "per_channel" else "tensor"
        if a.get("is_dynamic"):
            act = "token" if a.get("qscheme") == "per_channel" else "tensor"
            static = False
        elif a.get("qscheme") == "per_tensor":
            act, static = "tensor", True
        else:
            return None
        if (weight, act) not in (("tensor", "tensor"), ("channel", "token")):
            return Refused("For FP8 Fused MoE layers, only per-tensor, per-channel and per-block scales for weights and "
                           f"activations are supported. Found per_{weight}, "
                           f"{'per_channel' if act == 'token' else 'per_tensor'}")
        return Mapped(QuantScheme.fp8(weight, act, static_activation=static),
                      f"quark FP8 {weight} weights, {'static' if static else 'dynamic'} {act} activations",
                      method="QuarkW8A8Fp8MoEMethod")

    def _ocp_mx(self, w: Optional[dict], a: Optional[dict]) -> Optional[LayerQuant]:
        """QuarkConfig._is_w_ocp_mx_a_x -> QuarkOCP_MX_MoEMethod (MXFP4; MXFP6 is not modelled)."""
        if not isinstance(w, dict) or not isinstance(w.get("dtype"), str):
            return None
        dtype = w["dtype"].replace("fp", "mxfp")
        if dtype not in ("mxfp4", "mxfp6_e3m2", "mxfp6_e2m3", "mxfp8_e4m3"):
            return None
        if w.get("qscheme") == "per_group":
            if w.get("group_size") != 32 or w.get("scale_format") != "e8m0":
                return None
        elif w.get("qscheme") == "per_block":
            if dtype != "mxfp8_e4m3" or len(list(w.get("block_size") or [])) != 2 or list(w["block_size"])[1] != 32:
                return None
        else:
            return None
        if a is None:
            act = None
        elif not a.get("is_dynamic"):
            if a.get("dtype") == "fp8_e4m3" and a.get("qscheme") == "per_tensor" and a.get("symmetric") is True:
                act = "fp8-static"
            else:
                return None
        elif a.get("dtype") == "fp8_e4m3" and a.get("qscheme") == "per_group" and a.get("group_size") == 32:
            act = "mxfp8"
        elif a.get("dtype") == "fp8_e4m3":
            act = "fp8-dynamic"
        elif isinstance(a.get("dtype"), str) and a["dtype"].replace("fp", "mxfp") in ("mxfp4", "mxfp6_e3m2", "mxfp6_e2m3"):
            act = a["dtype"].replace("fp", "mxfp")
        else:
            return Refused(f"Unsupported input_dtype={short_text(a.get('dtype'))} in Quark's vLLM integration. Supported "
                           "activation dtypes are mxfp4, mxfp6_e3m2, mxfp6_e2m3, mxfp8_e4m3, or None for weight-only "
                           "quantization.")
        if dtype == "mxfp8_e4m3":
            if not self.ctx.rules.quark_mxfp8_moe:
                return Refused("Unsupported OCP MX dtype combination for MoE: MXFP8 experts are not supported through "
                               "the MoE path; only the linear path handles MXFP8.")
            if w.get("qscheme") != "per_group":
                return Refused("Quark MXFP8 MoE experts support only the 1-D per_group (group_size=32, e8m0) weight "
                               "spelling", "NotImplementedError")
            return Mapped(QuantScheme.mxfp8(), "quark MXFP8", method="QuarkW8A8Mxfp8MoEMethod")
        if dtype != "mxfp4":
            return not_modelled(f"quark {dtype.upper()} weights: MXFP6 has no scheme in moe-fsm")
        if act in ("mxfp6_e3m2", "mxfp6_e2m3"):
            return not_modelled(f"quark MXFP4 weights with {act.upper()} activations: no such scheme in moe-fsm")
        if act == "fp8-dynamic":
            return Refused("QuarkOCP_MX_MoEMethod with dynamic input scales is currently not implemented for OCP MX "
                           "scheme w_mxfp4_a_fp8. Please open an issue.", "NotImplementedError")
        if act == "mxfp8":
            return not_modelled("quark MXFP4 weights with MXFP8 activations: vLLM's QuarkOCP_MX_MoEMethod asks no "
                                 "oracle for it and runs its emulation; not modelled")
        activation = {None: "none", "fp8-static": "fp8-tensor", "mxfp4": "mxfp4"}[act]
        return Mapped(QuantScheme.mxfp4(activation), f"quark MXFP4 weights, {'16-bit' if act is None else act} "
                      "activations", method="QuarkOCP_MX_MoEMethod")


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
    "modelopt": _ModelOpt, "modelopt_fp4": _ModelOpt, "modelopt_mxfp8": _ModelOpt, "modelopt_mixed": _ModelOpt,
    "mxfp8": _ModelOpt,
    "compressed-tensors": CompressedTensorsReader,
    "quark": _Quark,
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
