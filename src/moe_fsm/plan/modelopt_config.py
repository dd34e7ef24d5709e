"""NVIDIA ModelOpt's quantization config to each MoE layer's scheme, as vLLM 0.31-0.33's ModelOpt config classes read
it (``ModelOptFp8Config``, ``ModelOptNvFp4Config``, ``ModelOptMxFp8Config``, ``ModelOptMixedPrecisionConfig``).

The config comes flat (``config.json``'s ``quantization_config``) or nested (``hf_quant_config.json``'s
``quantization``); its ``quant_algo`` must be one the resolved class owns, ``exclude_modules`` are globs, and the
MIXED_PRECISION class picks each layer's algo from ``quantized_layers`` by the experts' own key, a key under it or one
under its parent (vLLM's ``_resolve_quant_algo``). Torch-free, core.
"""

from __future__ import annotations

from typing import Optional

from moe_fsm.inputs.quant import NVFP4_STATIC, QuantFamily, QuantScheme
from moe_fsm.plan.name_matching import PrefixIndex, SubstringOrGlob
from moe_fsm.plan.quant_fields import (
    LayerContext, LayerQuant, Mapped, Reader, Refusal, Refused, bad_field, fp8_block_scheme, not_modelled, read_int,
    read_names, read_object, unquantized,
)


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


class ModelOptReader(Reader):
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
            return fp8_block_scheme(self.ctx, [self.block, self.block], where, "Fp8MoEMethod")
        if algo in ("FP8", "NVFP4", "W4A16_NVFP4", "MXFP8"):
            scheme, method = _modelopt_fixed(algo)
            return Mapped(scheme, where, method=method)
        return unquantized(f"{where}: no MoE method for it (vLLM leaves the experts unquantized)")
