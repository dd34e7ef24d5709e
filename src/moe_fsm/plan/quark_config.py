"""AMD Quark's quantization config to each MoE layer's scheme, as vLLM 0.31-0.33's ``QuarkConfig`` reads it.

``exclude`` first (a child of the experts excluded excludes them all), then ``layer_quant_config`` (fnmatch, or the
name inside the pattern), else ``global_quant_config``; the weight/input pair picks vLLM's MoE method
(``QuarkW8A8Fp8MoEMethod``, ``QuarkOCP_MX_MoEMethod``, ``QuarkW8A8Mxfp8MoEMethod``) and the scheme it hands its
oracle. Torch-free, core.
"""

from __future__ import annotations

from fnmatch import fnmatch
from typing import Optional

from moe_fsm.inputs.quant import QuantScheme
from moe_fsm.plan.name_matching import VllmRegex, capped
from moe_fsm.plan.quant_fields import (
    LayerContext, LayerQuant, Mapped, Reader, Refusal, Refused, bad_field, not_modelled, read_names, read_object,
    short_text, unquantized,
)



def _quark_tensor(value):
    """_unwrap_single_quant_config: a one-entry list is its entry; a longer list stays a list."""
    if isinstance(value, list):
        return value[0] if len(value) == 1 else value
    return value


class QuarkReader(Reader):
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
