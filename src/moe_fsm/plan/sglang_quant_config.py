"""A checkpoint's quantization_config read by SGLang 0.5.23's rules: which config class, which MoE method per layer.

The ``sglang-0.5.23`` profile names this table (``Profile.config_rules``); ``QuantReader`` applies it as it applies
vLLM's. The facts, from SGLang 0.5.23's wheel (``pip download sglang==0.5.23 --no-deps``):

1. **Which method name** (``srt/configs/model_config.py``): ``_parse_quant_hf_config`` reads config.json's
   ``quantization_config`` (a ModelOpt one, or one without ``quant_method``, is renamed by its ``quant_algo``:
   ``_parse_modelopt_quant_config``), else ``compression_config``, else ``hf_quant_config.json`` beside it;
   ``_verify_quantization`` asks every class of ``QUANTIZATION_METHODS`` in its order for an
   ``override_quantization_method`` (GPTQ -> ``gptq_marlin`` and AWQ -> ``awq_marlin`` where Marlin takes the
   weights, ModelOpt's per-format names, ``petit_nvfp4`` on ROCm), then refuses a name the registry lacks and, on
   ROCm, one outside its ROCm list. The registry differs by platform (``layers/quantization/__init__.py``:
   ``mxfp4`` on CUDA, CPUs, gfx95x and XPU; ``gptq`` on CPUs and XPU), and on a CPU with AMX ``get_quantization_config``
   takes only ``CPU_QUANTIZATION_METHODS``. ``model_loader/loader.py`` refuses a GPU under the class's
   ``get_min_capability``.
2. **Which MoE method per layer**: each class's ``get_quant_method`` for a ``FusedMoE`` layer (a None is
   ``UnquantizedFusedMoEMethod``, ``fused_moe_triton/layer.py``). The result's ``engine_method`` is the method name
   the profile's ``create_moe_runner`` rules are keyed by, given to the layer as ``ModelFacts.layer_method``.

A refusal carries SGLang's message and exception type, with the file that raises it in a comment; a class whose
MoE method the profile has no rules for is ``Unmapped`` with what SGLang would build. tools/sglang_config_parity.py
runs SGLang's own config path on every tests/data/configs checkpoint against this table.
"""

from __future__ import annotations

import re
from types import MappingProxyType
from typing import Optional, Union

from moe_fsm.inputs.platform import Vendor
from moe_fsm.inputs.quant import NVFP4_STATIC, QuantFamily, QuantScheme
from moe_fsm.plan.compressed_tensors_config import CompressedTensorsReader, CtScheme
from moe_fsm.plan.quant_fields import (
    ConfigRules, LayerContext, LayerQuant, Mapped, Reader, Refusal, Refused, Unmapped, bad_field, first_key,
    read_flag, read_int, read_names, read_object, short_text,
)

ENGINE = "SGLang 0.5.23"

# -- step 1: the method name ----------------------------------------------------------------------------------------

# layers/quantization/__init__.py BASE_QUANTIZATION_METHODS, in its order (the order overrides are asked in, and the
# list an unknown name's message shows).
BASE_METHODS = (
    "fp8", "mxfp8", "minimax_m3_nvfp4", "blockwise_int8", "modelopt", "modelopt_fp8", "modelopt_fp4", "nvfp4_online",
    "modelopt_mixed", "w8a8_int8", "w8a8_fp8", "awq", "awq_marlin", "bitsandbytes", "gguf", "gptq_marlin",
    "moe_wna16", "compressed-tensors", "w4afp8", "petit_nvfp4", "quark", "quark_mxfp4", "auto-round",
    "auto-round-int8", "modelslim", "quark_int4fp8_moe", "humming", "mxfp_w4a8",
)
# ... then the platform's additions: "mxfp4" on CPUs, CUDA, gfx95x and XPU; "gptq" on CPUs and XPU.
# configs/model_config.py _verify_quantization: rocm_supported_quantization.
ROCM_METHODS = ("awq", "fp8", "compressed_tensors", "compressed-tensors", "w8a8_fp8", "petit_nvfp4", "quark", "mxfp4",
                "mxfp8", "auto-round", "auto-round-int8", "quark_int4fp8_moe", "quark_mxfp4")
# layers/quantization/__init__.py CPU_QUANTIZATION_METHODS (what get_quantization_config takes on a CPU with AMX).
CPU_METHODS = ("fp8", "w8a8_int8", "compressed-tensors", "awq", "gptq", "mxfp4", "auto-round")


def registered(ctx: LayerContext) -> tuple[str, ...]:
    """QUANTIZATION_METHODS on the context's platform, in the registry's order."""
    p = ctx.platform
    vendor = None if p is None else p.vendor
    names = list(BASE_METHODS)
    gfx95 = vendor is Vendor.ROCM and (p.gcn_arch or "").startswith("gfx95")
    if vendor in (Vendor.CPU, Vendor.CUDA, Vendor.XPU, None) or gfx95:
        names.append("mxfp4")
    if vendor in (Vendor.CPU, Vendor.XPU):
        names.append("gptq")
    return tuple(names)


def _marlin_capability(ctx: LayerContext) -> int:
    """marlin_utils: torch's device capability as an int, -1 without a GPU (a CPU); ROCm reports its gfx9 as 9.x."""
    p = ctx.platform
    if p is None:
        return 90  # a context without a platform (a library call) reads as a Hopper GPU, as registered() reads CUDA
    if p.vendor is Vendor.CUDA and p.capability is None:
        return -1
    if p.vendor is Vendor.CUDA:
        return p.capability[0] * 10 + p.capability[1]
    if p.vendor is Vendor.ROCM:
        match = re.match(r"gfx9(\d)", p.gcn_arch or "")
        return 90 + int(match.group(1)) if match else -1
    return -1


MARLIN_GROUPS = (-1, 32, 64, 128)  # marlin_utils.MARLIN_SUPPORTED_GROUP_SIZES


def _gptq_marlin(config: dict, ctx: LayerContext) -> bool:
    """GPTQMarlinConfig.override_quantization_method: not Marlin-format already, and is_gptq_marlin_compatible."""
    if config.get("checkpoint_format") == "marlin" or config.get("is_marlin_format", False):
        return False
    bits, group, sym, desc_act = (config.get(k) for k in ("bits", "group_size", "sym", "desc_act"))
    if config.get("quant_method", "").lower() != "gptq" or None in (bits, group, sym, desc_act):
        return False
    return (bits, sym) in ((4, True), (8, True)) and _marlin_capability(ctx) >= 80 and group in MARLIN_GROUPS


def _awq_marlin(config: dict, ctx: LayerContext) -> bool:
    """AWQMarlinConfig.is_awq_marlin_compatible: CUDA only; 4-bit with zero points in a Marlin group size."""
    if ctx.platform is not None and ctx.platform.vendor is not Vendor.CUDA:
        return False
    bits, group, zero_point = (config.get(k) for k in ("bits", "group_size", "zero_point"))
    if config.get("quant_method", "").lower() != "awq" or None in (bits, group, zero_point) or bits not in (4, 8):
        return False
    # check_marlin_supported: with zero points Marlin takes uint4 only, without them no AWQ type at all
    return _marlin_capability(ctx) >= 80 and bool(zero_point) and bits == 4 and group in MARLIN_GROUPS


def _modelopt_name(body: dict) -> Optional[dict]:
    """ModelConfig._parse_modelopt_quant_config: the method a ModelOpt quant_algo is served with."""
    inner = body.get("quantization", body)
    if not isinstance(inner, dict):
        return None
    nested = inner.get("quantization")
    inner = nested if isinstance(nested, dict) else inner
    algo = inner.get("quant_algo")
    if algo == "MIXED_PRECISION":
        layers = inner.get("quantized_layers") or {}
        nvfp4 = isinstance(layers, dict) and any(
            isinstance(info, dict) and str(info.get("quant_algo", "")).upper() in ("NVFP4", "W4A16_NVFP4")
            for info in layers.values())
        return {"quant_method": "modelopt_mixed" if nvfp4 else "w4afp8"}
    if isinstance(algo, str) and "FP4" in algo:
        return {"quant_method": "modelopt_fp4"}
    if algo == "FP8":
        return {"quant_method": "modelopt_fp8"}
    if algo == "MXFP8":
        return {"quant_method": "mxfp8"}
    return None


def resolve(config: dict, ctx: LayerContext) -> Union[str, Refused, None]:
    """SGLang's method name for the checkpoint (None: unquantized), or its refusal; ``config`` is normalised in
    place as ``_parse_quant_hf_config`` normalises it."""
    method = config.get("quant_method")
    if method is not None and not isinstance(method, str):
        raise bad_field("quant_method", "a string", method)
    if method is None and "producer" in config:  # hf_quant_config.json: parsed on its own
        parsed = _modelopt_name(config)
        config.update(parsed or {})
    elif method is None or method == "modelopt":
        config.update(_modelopt_name({"quantization": config}) or {})
    method = str(config.get("quant_method", "")).lower()
    config["quant_method"] = method
    names = registered(ctx)
    # _verify_quantization: each class's override_quantization_method, in the registry's order (no --quantization)
    for name in names:
        claimed = OVERRIDES.get(name, lambda c, x: None)(config, ctx)
        if claimed:
            method = claimed
            break
    if not method:
        return None
    if method not in names:  # configs/model_config.py _verify_quantization
        return Refused(f"Unknown quantization method: {short_text(method)}. Must be one of {list(names)}.")
    vendor = None if ctx.platform is None else ctx.platform.vendor
    if vendor is Vendor.ROCM and method not in ROCM_METHODS:  # configs/model_config.py _verify_quantization
        return Refused(f"{method} quantization is currently not supported in ROCm.")
    if vendor is Vendor.CPU and ctx.platform.cpu_amx and method not in CPU_METHODS:
        # layers/quantization/__init__.py get_quantization_config (it lists QUANTIZATION_METHODS, as here)
        return Refused(f"Invalid quantization method on CPU: {method}. Available methods on CPU: {list(names)}")
    return method


OVERRIDES = {  # the registry names whose class overrides a checkpoint's method (the others return None)
    "modelopt": lambda c, ctx: c["quant_method"] if c["quant_method"] in ("modelopt_fp8", "modelopt_fp4") else None,
    "modelopt_fp8": lambda c, ctx: c["quant_method"] if c["quant_method"] in ("modelopt_fp8", "modelopt_fp4") else None,
    "modelopt_fp4": lambda c, ctx: c["quant_method"] if c["quant_method"] in ("modelopt_fp8", "modelopt_fp4") else None,
    "modelopt_mixed": lambda c, ctx: "modelopt_mixed" if c["quant_method"] == "modelopt_mixed" else None,
    "awq_marlin": lambda c, ctx: "awq_marlin" if _awq_marlin(c, ctx) else None,
    "gptq_marlin": lambda c, ctx: "gptq_marlin" if _gptq_marlin(c, ctx) else None,
    "petit_nvfp4": lambda c, ctx: "petit_nvfp4" if ctx.vendor is Vendor.ROCM and c["quant_method"] == "modelopt"
    else None,
}

# Each class's get_min_capability (model_loader/loader.py refuses a GPU under it; CPUs report none).
MIN_CAPABILITY = {"fp8": 80, "mxfp8": 100, "modelopt_fp8": 89, "modelopt_fp4": 80, "modelopt_mixed": 80,
                  "compressed-tensors": 70, "gptq_marlin": 80, "awq_marlin": 80, "mxfp4": 80, "moe_wna16": 70,
                  "quark": 70, "w4afp8": 90, "w8a8_fp8": 89, "w8a8_int8": 75}


# -- step 2: each class's MoE method --------------------------------------------------------------------------------


def _unquantized(why: str) -> Mapped:
    return Mapped(QuantScheme.unquantized(), why, method="UnquantizedFusedMoEMethod", engine_method="unquantized")


def _module_path_match(ignored: str, prefix: str) -> bool:
    """layers/quantization/utils._module_path_match: equal, a parent module, or a dotted run inside the name."""
    ignored, prefix = ignored.rstrip("."), prefix.rstrip(".")
    return ignored == prefix or prefix.startswith(ignored + ".") or f".{ignored}." in f".{prefix}."


class _Fp8(Reader):
    """Fp8Config (``fp8``, ``mxfp8``): ``ignored_layers`` / ``modules_to_not_convert`` (each with and without
    ``model.``) skip the experts by module path (``is_layer_skipped``); else ``Fp8MoEMethod``."""

    def __init__(self, config: dict, ctx: LayerContext, method: str) -> None:
        super().__init__(config, ctx, method)
        self.mxfp8 = "mxfp8" in method
        scheme = first_key(config, ("activation_scheme",))
        if scheme not in ("static", "dynamic"):  # fp8.py Fp8Config.__init__
            raise Refusal(f"Unsupported activation scheme {short_text(scheme)}")
        ignored = config.get("ignored_layers", config.get("modules_to_not_convert"))
        ignored = read_names(ignored, "ignored_layers")
        self.ignored = [v for name in ignored for v in (name.removeprefix("model."), "model." + name.removeprefix("model."))]
        block = config.get("weight_block_size")
        if block is not None and (not isinstance(block, list) or not all(isinstance(b, int) and not isinstance(b, bool)
                                                                         for b in block)):
            raise bad_field("weight_block_size", "a list of integers such as [128, 128]", block)
        if self.mxfp8:
            block = [1, 32]  # Fp8Config.from_config: MXFP8 fixes the block
        elif block is not None:
            if len(block) != 2:  # fp8.py Fp8Config.__init__
                raise Refusal(f"The quantization block size of weight must have 2 dimensions, but got {len(block)} "
                               "dimensions.")
            if scheme != "dynamic":
                raise Refusal("The block-wise quantization only supports dynamic activation scheme for now, but got "
                               f"{scheme} activation scheme.")
        self.block, self.dynamic = block, scheme == "dynamic"

    def layer(self, experts: str) -> LayerQuant:
        hit = next((name for name in self.ignored if _module_path_match(name, experts)
                    or ("experts" in name and experts in name)), None)
        if hit:
            return _unquantized(f"fp8: ignored ({hit!r}): UnquantizedFusedMoEMethod")
        if self.mxfp8:
            return Mapped(QuantScheme.mxfp8(), "mxfp8: Fp8MoEMethod with 1x32 MXFP8 blocks", method="Fp8MoEMethod",
                          engine_method="mxfp8")
        if self.block is not None:
            if self.block != [128, 128]:
                return Unmapped(f"fp8 weight blocks {self.block}: SGLang's Fp8MoEMethod takes them; moe-fsm's FP8 "
                                "schemes are 128x128 blocks only")
            scheme, text = QuantScheme.fp8("block", "group"), "fp8 block 128x128, dynamic 1x128 activations"
        elif self.dynamic:
            scheme, text = QuantScheme.fp8("tensor", "tensor"), "fp8 per-tensor, dynamic activations"
        else:
            scheme, text = QuantScheme.fp8("tensor", "tensor", static_activation=True), "fp8 per-tensor, static activations"
        return Mapped(scheme, text, method="Fp8MoEMethod", engine_method="fp8")


def _exclusion(pattern: str) -> re.Pattern:
    """modelopt_quant._compile_exclusion_pattern: dots literal, ``*`` any run."""
    return re.compile(pattern.replace(".", r"\.").replace("*", r".*"))


class _ModelOpt(Reader):
    """ModelOptFp8Config / ModelOptFp4Config / ModelOptMixedPrecisionConfig: ``is_layer_excluded`` (a pattern
    matching the whole name or one dotted part, ``language_model.`` stripped too) gives the experts no method
    (unquantized); else the class's MoE method, or for MIXED_PRECISION the layer's ``quantized_layers`` entry."""

    def __init__(self, config: dict, ctx: LayerContext, method: str) -> None:
        super().__init__(config, ctx, method)
        body = config
        if "quant_algo" not in config:  # the nested hf_quant_config.json form
            body = config.get("quantization")
            if not isinstance(body, dict):  # ModelOptFp8Config.from_config / ModelOptFp4Config.from_config
                raise Refusal("Cannot find 'quant_algo' in the model's quantization config. Expected either flat "
                               "format (config.json) or nested format (hf_quant_config.json).")
        algo = body.get("quant_algo")
        if not isinstance(algo, str):
            raise bad_field("quant_algo", "a quant_algo name (a string)", algo)
        excluded = body.get("ignore", body.get("exclude_modules")) if "quant_algo" in config else body.get("exclude_modules")
        self.patterns = [(p, _exclusion(p)) for p in read_names(excluded, "exclude_modules")]
        self.algo = algo.upper()
        if method == "modelopt_fp8" and self.algo != "FP8":  # modelopt_quant.py ModelOptFp8Config.from_config
            raise Refusal(f"ModelOptFp8Config only supports regular FP8 quantization, but found {algo!r}. Use the "
                           "native 'mxfp8' quantization method for MXFP8 or ModelOptFp4Config for FP4.")
        self.layers = {}
        if method == "modelopt_mixed":
            layers = read_object(body.get("quantized_layers", {}), "quantized_layers", {})
            if not layers:  # modelopt_quant.py ModelOptMixedPrecisionConfig.from_config
                raise Refusal("MIXED_PRECISION quantization requires a non-empty quantized_layers map.")
            self.layers = {k: str(read_object(v, f"quantized_layers[{k!r}]").get("quant_algo", "")).upper()
                           for k, v in layers.items()}

    def _excluded(self, prefix: str) -> Optional[str]:
        names = [prefix] + ([prefix.removeprefix("language_model.")] if prefix.startswith("language_model.") else [])
        for pattern, compiled in self.patterns:
            if any(compiled.fullmatch(n) or any(compiled.fullmatch(part) for part in n.split(".")) for n in names):
                return pattern
        return None

    def _mixed_algo(self, prefix: str) -> Optional[str]:
        """ModelOptMixedPrecisionConfig._resolve_quant_algo for the experts module: the name, else a key under it."""
        candidates = [prefix]
        if prefix.startswith("language_model.model."):
            candidates.append("model.language_model." + prefix[len("language_model.model."):])
        elif prefix.startswith("model."):
            candidates.append("model.language_model." + prefix[len("model."):])
        for candidate in candidates:
            if candidate in self.layers:
                return self.layers[candidate]
        for candidate in candidates:
            key = next((k for k in self.layers if k.startswith(candidate + ".")), None)
            if key is not None:
                return self.layers[key]
        return None

    def layer(self, experts: str) -> LayerQuant:
        hit = self._excluded(experts)
        if hit:
            return _unquantized(f"modelopt: excluded by {hit!r} (no MoE method: UnquantizedFusedMoEMethod)")
        if self.method == "modelopt_fp8":
            return Mapped(QuantScheme.fp8("tensor", "tensor", static_activation=True), "modelopt FP8",
                          method="ModelOptFp8MoEMethod", engine_method="modelopt_fp8")
        if self.method == "modelopt_fp4":
            return Mapped(QuantScheme.nvfp4(), f"modelopt {self.algo}", method="ModelOptNvFp4FusedMoEMethod",
                          engine_method="modelopt_fp4")
        algo = self._mixed_algo(experts)
        where = f"modelopt MIXED_PRECISION: {algo}"
        if algo == "FP8":
            return Mapped(QuantScheme.fp8("tensor", "tensor", static_activation=True), where,
                          method="ModelOptFp8MoEMethod", engine_method="modelopt_fp8")
        if algo == "NVFP4":
            return Mapped(QuantScheme.nvfp4(), where, method="ModelOptNvFp4FusedMoEMethod", engine_method="modelopt_fp4")
        if algo == "MXFP8":
            return Mapped(QuantScheme.mxfp8(), where, method="Fp8MoEMethod", engine_method="mxfp8")
        if algo in ("FP8_PB_WO", "FP8_BLOCK_SCALES"):
            return Unmapped(f"{where}: SGLang's Fp8MoEMethod with the config's FP8 blocks; the block size of a "
                            "MIXED_PRECISION checkpoint is not read by moe-fsm")
        if algo == "W4A16_NVFP4":
            return Unmapped(f"{where}: SGLang's ModelOptNvFp4FusedMoEMethod without per-token activations (W4A16); "
                            "this profile does not model its runner choice")
        return _unquantized(f"{where or 'modelopt MIXED_PRECISION: not in quantized_layers'}: no MoE method "
                            "(UnquantizedFusedMoEMethod)")


class _Mxfp4(Reader):
    """Mxfp4Config: every FusedMoE layer of an MXFP4-serialized checkpoint gets ``Mxfp4MoEMethod`` (no exclusion
    list is read for the experts), 16-bit activations."""

    def layer(self, experts: str) -> LayerQuant:
        return Mapped(QuantScheme.mxfp4(), "mxfp4: Mxfp4MoEMethod, 16-bit activations", method="Mxfp4MoEMethod",
                      engine_method="mxfp4")


class _GptqMarlin(Reader):
    """GPTQMarlinConfig: every FusedMoE layer gets ``GPTQMarlinMoEMethod`` (no exclusion, no fallback)."""

    def __init__(self, config: dict, ctx: LayerContext, method: str) -> None:
        super().__init__(config, ctx, method)
        self.bits = read_int(first_key(config, ("bits",)), "bits")
        self.group = read_int(first_key(config, ("group_size",)), "group_size")
        self.desc_act = read_flag(first_key(config, ("desc_act",)), "desc_act")

    def layer(self, experts: str) -> LayerQuant:
        act_order = self.desc_act and self.group != -1
        return Mapped(QuantScheme.int_wna16(self.bits, self.group, False, "gptq", act_order),
                      f"gptq {self.bits}-bit group {self.group}{', act-order' if act_order else ''}",
                      method="GPTQMarlinMoEMethod", engine_method="gptq_marlin")


class _AwqMarlin(Reader):
    """AWQMarlinConfig: ``modules_to_not_convert`` (by substring) gives the experts no method; a layer Marlin's MoE
    check refuses falls back to ``MoeWNA16Config``'s method; else ``AWQMoEMethod`` (Marlin)."""

    def __init__(self, config: dict, ctx: LayerContext, method: str) -> None:
        super().__init__(config, ctx, method)
        self.group = read_int(first_key(config, ("group_size",)), "group_size")
        self.zero_point = read_flag(first_key(config, ("zero_point",)), "zero_point")
        self.skipped = read_names(config.get("modules_to_not_convert"), "modules_to_not_convert")

    def _marlin_takes(self) -> bool:
        """marlin_utils.check_moe_marlin_supports_layer (no tile padding)."""
        ctx = self.ctx
        ispp = ctx.intermediate_per_partition
        return (ctx.hidden_size % 128 == 0 and ispp % max(64, self.group) == 0 and self.group in MARLIN_GROUPS
                and not ctx.router_weight_on_input and ctx.gated_silu)

    def layer(self, experts: str) -> LayerQuant:
        hit = next((name for name in self.skipped if name in experts), None)  # is_layer_skipped_awq
        if hit:
            return _unquantized(f"awq: not converted ({hit!r}): no MoE method (UnquantizedFusedMoEMethod)")
        if not self._marlin_takes():
            return Mapped(QuantScheme.int_wna16(4, self.group, self.zero_point, "moe_wna16"),
                          f"awq 4-bit group {self.group} via MoeWNA16 (Marlin's MoE check fails)",
                          method="MoeWNA16Method", engine_method="moe_wna16")
        return Mapped(QuantScheme.int_wna16(4, self.group, self.zero_point, "awq"),
                      f"awq 4-bit group {self.group}{' zero-point' if self.zero_point else ''}",
                      method="AWQMoEMethod", engine_method="awq_marlin")


class _PlainAwq(Reader):
    """``awq`` where Marlin does not take it (off CUDA). On a CPU with AMX, ``AWQCPUConfig`` builds
    ``AWQMoEMethod`` (Intel AMX kernels), and on XPU ``AWQXPUConfig`` its own: neither is modelled. Elsewhere
    ``AWQConfig.get_quant_method`` gives a FusedMoE layer no method off NPUs, so SGLang builds
    ``UnquantizedFusedMoEMethod`` for the AWQ experts."""

    def layer(self, experts: str) -> LayerQuant:
        p = self.ctx.platform
        if p is not None and p.vendor is Vendor.CPU and p.cpu_amx:
            return Unmapped("awq on a CPU with AMX: SGLang's AWQCPUConfig builds AWQMoEMethod (Intel AMX kernels), "
                            "whose runner this profile does not model")
        if p is not None and p.vendor is Vendor.XPU:  # awq/awq.py AWQXPUConfig.get_quant_method
            return Refused("AWQ MoE is not yet supported on XPU (dense-only phase).", "NotImplementedError")
        return _unquantized("awq without Marlin: AWQConfig gives the experts no method; SGLang builds "
                            "UnquantizedFusedMoEMethod for the packed AWQ weights")


class _PlainGptq(Reader):
    """``gptq`` where Marlin does not take it (registered on CPUs and XPU only). XPU's ``GPTQXPUConfig`` refuses
    MoE layers; a CPU's ``CPUGPTQConfig`` builds ``GPTQMoEMethod`` (Intel AMX kernels), which is not modelled."""

    def layer(self, experts: str) -> LayerQuant:
        p = self.ctx.platform
        if p is not None and p.vendor is Vendor.XPU:  # gptq/gptq.py GPTQXPUConfig.get_quant_method
            return Refused("GPTQ MoE is not yet supported on XPU (dense-only phase).", "NotImplementedError")
        return Unmapped("gptq on a CPU: SGLang's CPUGPTQConfig builds GPTQMoEMethod (Intel AMX kernels), whose runner "
                        "this profile does not model")


def _is_nvfp4(q) -> bool:
    return q is not None and q.strategy == "tensor_group" and q.type == "float" and q.num_bits == 4 \
        and q.group_size == 16 and q.symmetric


class _CompressedTensorsSgl(CompressedTensorsReader):
    """SGLang's CompressedTensorsConfig: vLLM's group and target reading (SGLang's is adapted from it), group
    activation order accepted (Marlin takes it), the experts always matched as ``gate_proj``/``up_proj``/
    ``down_proj``, and ``get_moe_scheme``'s dispatch in its order."""

    REFUSE_GROUP_ACTORDER = False

    def projection_names(self) -> tuple[str, str, str]:
        return ("gate_proj", "up_proj", "down_proj")  # compressed_tensors.py get_moe_scheme's unfused names

    def method_of(self, s: CtScheme) -> LayerQuant:
        """compressed_tensors.py ``get_moe_scheme`` (CUDA, ROCm, CPU; NPU schemes are not modelled)."""
        w, a = s.weights, s.input_activations
        if "mxfp4" in (s.format or "") or (w.type == "float" and w.num_bits == 4 and w.group_size == 32):
            return Unmapped("compressed-tensors MXFP4 experts: SGLang builds Mxfp4MoEMethod for them (_is_mxfp4_moe); "
                            "this profile reads that method's runner choice under quant_method mxfp4 only")
        engine = "compressed-tensors"
        if w.strategy in ("channel", "group") and a is None and not w.dynamic and w.type == "int":
            if w.num_bits not in (4, 8):
                return Unmapped(f"compressed-tensors W{w.num_bits}A16: moe-fsm's WNA16 schemes are 4- or 8-bit")
            group = -1 if w.group_size is None else w.group_size
            order = w.actorder in ("group", "dynamic")
            # the scheme an auto runner gets: ROCm's and SM100's Triton WNA16 (4-bit symmetric groups of 32 or 128, no
            # activation order), else Marlin's; an explicit runner can pick a sibling, which create_moe_runner decides
            triton = w.num_bits == 4 and w.symmetric and group in (32, 128) and not w.actorder
            p = self.ctx.platform
            on_triton = p is not None and (p.vendor is Vendor.ROCM or triton and p.is_capability_family(10))
            return Mapped(QuantScheme.int_wna16(w.num_bits, group, not w.symmetric, "compressed-tensors", order),
                          f"compressed-tensors W{w.num_bits}A16 {w.strategy}" + (f" {group}" if group > 0 else "")
                          + ("" if w.symmetric else " asymmetric"),
                          method="CompressedTensorsWNA16TritonMoE" if on_triton else "CompressedTensorsWNA16MoE",
                          engine_method=engine)
        if _is_nvfp4(w) and a is None:
            return Mapped(QuantScheme(QuantFamily.NVFP4, NVFP4_STATIC, None), "compressed-tensors NVFP4 W4A16",
                          method="CompressedTensorsW4A16Nvfp4MoE", engine_method=engine)
        if _is_nvfp4(w) and _is_nvfp4(a):
            # W4A4 below capability 10.0 is served weight-only by FP4 Marlin (CompressedTensorsW4A16Nvfp4MoE)
            p = self.ctx.platform
            w4a4 = p is not None and p.vendor is Vendor.CUDA and p.has_capability(10, 0)
            return Mapped(QuantScheme.nvfp4(), "compressed-tensors NVFP4 W4A4" + ("" if w4a4 else ", served weight-only"),
                          method="CompressedTensorsW4A4Nvfp4MoE" if w4a4 else "CompressedTensorsW4A16Nvfp4MoE",
                          engine_method=engine)
        if a is not None and w.type == a.type == "float" and w.symmetric and not w.dynamic \
                and w.strategy in ("tensor", "channel", "block") and (a.dynamic or a.symmetric and a.strategy == "tensor"):
            if w.strategy == "block":
                if w.block_structure != (128, 128):
                    return Unmapped(f"compressed-tensors FP8 blocks {list(w.block_structure)}: moe-fsm's FP8 schemes "
                                    "are 128x128 blocks only")
                scheme, text = QuantScheme.fp8("block", "group"), "128x128 blocks, dynamic 1x128 activations"
            elif w.strategy == "channel" and a.strategy == "token":
                scheme, text = QuantScheme.fp8("channel", "token"), "channel weights, dynamic per-token activations"
            elif w.strategy == "tensor" and a.strategy == "tensor":
                scheme = QuantScheme.fp8("tensor", "tensor", static_activation=not a.dynamic)
                text = f"tensor weights, {'dynamic' if a.dynamic else 'static'} per-tensor activations"
            else:
                return Unmapped(f"compressed-tensors FP8 {w.strategy} weights with {a.strategy} activations: SGLang's "
                                "CompressedTensorsW8A8Fp8MoE takes them; moe-fsm has no FP8 scheme for the pair")
            return Mapped(scheme, f"compressed-tensors FP8 {text}", method="CompressedTensorsW8A8Fp8MoE",
                          engine_method=engine)
        if a is not None and w.num_bits == a.num_bits == 8 and w.strategy in ("tensor", "channel") \
                and a.strategy == "token" and w.symmetric and not w.dynamic and a.dynamic:
            raise Refusal("The W8A8Int8 Fused MoE scheme is implemented only for NPU for now.", "NotImplementedError")
        if a is not None and s.format == "pack-quantized" and w.num_bits == 4 and w.type == "int" and w.symmetric \
                and not w.dynamic and a.num_bits == 8 and a.dynamic:
            return Unmapped("compressed-tensors W4A8 (INT4 weights, dynamic 8-bit activations): SGLang's "
                            "CompressedTensorsW4AFP8MoE; this profile models W4AFP8 under quant_method w4afp8 only")
        if a is not None and w.num_bits == 4 and a.num_bits == 8 and w.strategy in ("group", "channel") \
                and a.strategy == "token" and w.symmetric and not w.dynamic and a.dynamic:
            raise Refusal("The W4A8Int8 Fused MoE scheme is implemented only for NPU for now.", "NotImplementedError")
        # compressed_tensors.py get_moe_scheme (it prints the two QuantizationArgs)
        raise Refusal(f"Unsupported FusedMoe scheme: {w.text()}, {a.text() if a else None}", "RuntimeError")


NOT_MODELLED = {  # SGLang classes (on this platform) whose MoE method the profile has no runner rules for
    "quark": "quark: SGLang's QuarkFusedMoEMethod delegates to the layer's Quark scheme (QuarkW4A4MXFp4MoE, "
             "QuarkW8A8FP8MoE, ...), whose runner choice this profile does not model",
    "quark_mxfp4": "quark_mxfp4: SGLang's Quark online MXFP4 requantization is not modelled",
    "w4afp8": "w4afp8 (a ModelOpt MIXED_PRECISION checkpoint without NVFP4 layers): SGLang's W4AFp8Config reads "
              "per-layer facts moe-fsm does not read",
    "w8a8_int8": "w8a8_int8: SGLang's W8A8Int8MoEMethod is not modelled",
    "w8a8_fp8": "w8a8_fp8: SGLang's W8A8FP8MoEMethod is not modelled",
    "petit_nvfp4": "petit_nvfp4 (a ModelOpt checkpoint on ROCm): SGLang's Petit NVFP4 MoE method is not modelled",
    "nvfp4_online": "nvfp4_online quantizes at load time: not modelled",
    "minimax_m3_nvfp4": "minimax_m3_nvfp4: MiniMax M3's own NVFP4 config is not modelled",
    "blockwise_int8": "blockwise_int8: SGLang's BlockInt8MoEMethod is not modelled",
    "bitsandbytes": "bitsandbytes: SGLang's BitsAndBytesMoEMethod is not modelled",
    "gguf": "gguf: SGLang's GGUFMoEMethod is not modelled",
    "auto-round": "auto-round: not modelled", "auto-round-int8": "auto-round-int8: not modelled",
    "modelslim": "modelslim (Ascend NPU): not modelled", "quark_int4fp8_moe": "quark_int4fp8_moe: not modelled",
    "humming": "humming: not modelled", "mxfp_w4a8": "mxfp_w4a8 (Ascend NPU): not modelled",
    "moe_wna16": "moe_wna16 is served only when --quantization moe_wna16 asks for it",
}

READERS = {
    "fp8": _Fp8, "mxfp8": _Fp8,
    "modelopt_fp8": _ModelOpt, "modelopt_fp4": _ModelOpt, "modelopt_mixed": _ModelOpt,
    "compressed-tensors": _CompressedTensorsSgl,
    "mxfp4": _Mxfp4,
    "gptq_marlin": _GptqMarlin, "awq_marlin": _AwqMarlin, "awq": _PlainAwq, "gptq": _PlainGptq,
}


def _min_capability(reader: Reader, method: str) -> int:
    return MIN_CAPABILITY.get(method, 0)


SGLANG_0_5_23_CONFIG_RULES = ConfigRules(
    ENGINE, resolve, MappingProxyType(READERS), MappingProxyType(NOT_MODELLED), min_capability=_min_capability,
    unknown_reader="quant_method {method!r}: SGLang's config class has no MoE method moe-fsm models",
    method_key="sglang_method",
)
