"""A model's MoE geometry from its ``config.json``: which layers are MoE, and their shapes.

Checkpoints spell the same facts differently (``n_routed_experts`` /
``num_local_experts`` / ``num_experts``; ``moe_intermediate_size`` or the plain
``intermediate_size`` for models whose every MLP is MoE; dense first layers as
``first_k_dense_replace``, ``decoder_sparse_step`` + ``mlp_only_layers`` or
``interleave_moe_layer_step``). The spellings are tables here, so a new
architecture is a new row. No torch, no network: a ``config.json`` on disk.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from moe_fsm.errors import InputError
from moe_fsm.inputs.layer import Activation
from moe_fsm.inputs.quant import FLOAT_DTYPES

EXPERTS_KEYS = ("n_routed_experts", "num_local_experts", "num_experts", "moe_num_experts")
TOP_K_KEYS = ("num_experts_per_tok", "experts_per_token", "moe_topk", "top_k")
MOE_INTERMEDIATE_KEYS = ("moe_intermediate_size", "expert_intermediate_size", "intermediate_size")
DTYPE_KEYS = ("torch_dtype", "dtype")
SHARED_EXPERTS_KEYS = ("n_shared_experts", "num_shared_experts")

# Where the routed experts live under each decoder layer, by architecture (the module prefix quantization
# configs name): most checkpoints use ``mlp``; Mixtral keeps its experts under ``block_sparse_moe``, Llama 4
# under ``feed_forward``.
MOE_BLOCK = {"MixtralForCausalLM": "block_sparse_moe", "PhimoeForCausalLM": "block_sparse_moe",
             "Llama4ForCausalLM": "feed_forward", "Llama4ForConditionalGeneration": "feed_forward"}
# vLLM's module prefix of the language model's decoder layers, where a multimodal wrapper nests it (mllama4.py
# builds the text model under "language_model").
LAYERS_PREFIX = {"Llama4ForConditionalGeneration": "language_model.model.layers"}
# The experts' checkpoint names of the gate, up and down projections (vLLM's ckpt_names; compressed-tensors
# matches its targets against "<experts>.0.<name>"), where an architecture differs from gate_proj/up_proj/down_proj.
EXPERT_PROJECTIONS = {arch: ("w1", "w3", "w2") for arch in
                      ("MixtralForCausalLM", "PhimoeForCausalLM", "MiniMaxM2ForCausalLM", "Lfm2MoeForCausalLM")}
# What vLLM's model code passes its FusedMoE layer besides the shapes: gpt-oss's experts add biases (has_bias) and
# compute SwiGLU-OAI on interleaved gate/up rows (ARCH_ACTIVATION); Llama 4 applies the router weight to the input.
EXPERT_BIAS = frozenset({"GptOssForCausalLM"})
ROUTER_WEIGHT_ON_INPUT = frozenset({"Llama4ForCausalLM", "Llama4ForConditionalGeneration"})

# transformers' ``hidden_act`` names that moe-fsm's gated activations compute exactly (the config reader and the
# transformers integration share it); architectures with their own gated activation override it.
ACTIVATIONS = {"silu": Activation.SILU, "swish": Activation.SILU, "gelu": Activation.GELU}
ARCH_ACTIVATION = {"GptOssForCausalLM": Activation.SWIGLUOAI}


@dataclass(frozen=True)
class MoEGeometry:
    """One MoE layer's shapes as the config states them (global: before any tensor/expert parallel split), and
    what the architecture adds (expert biases, router weight applied to the input)."""

    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    activation: Activation
    swiglu_limit: Optional[float]
    dtype: str
    shared_experts: int
    bias: bool = False
    router_weight_on_input: bool = False


@dataclass(frozen=True)
class ModelConfig:
    path: Path
    architecture: str
    model_type: str
    num_layers: int
    moe_layers: tuple[int, ...]
    geometry: MoEGeometry
    quantization: Optional[dict]
    quantization_file: Optional[str] = None  # where the quantization config was read (hf_quant_config.json), if not config.json

    def experts_module(self, index: int) -> str:
        """vLLM's module name (prefix) of layer ``index``'s routed experts, the name quantization configs match."""
        return f"{LAYERS_PREFIX.get(self.architecture, 'model.layers')}.{index}.{MOE_BLOCK.get(self.architecture, 'mlp')}.experts"

    @property
    def projections(self) -> tuple[str, str, str]:
        return EXPERT_PROJECTIONS.get(self.architecture, ("gate_proj", "up_proj", "down_proj"))


# The sizes plan accepts: a config outside them is refused with the field and the range, before any layer is decided.
# Each bound is about 8x the largest value in a published checkpoint, rounded up to a power of two, so a new model
# that grows fits while a typo or a hostile file (num_hidden_layers: 1000000) cannot make plan write a million traces.
# (What published checkpoints have: Llama-3.1-405B 126 decoder layers, PaLM-540B 118; Qwen3-Next 512 routed experts,
# Kimi K2 384, DeepSeek-V3 256; top-k at most 10 (Qwen3-Next); hidden size at most 18432 (PaLM), 16384 (Llama-405B);
# expert intermediate size at most 32768 (Grok-1); at most 2 shared experts.)
LIMITS = {  # name: (low, high, what the range is of)
    "layers": (1, 1024, "decoder layer counts"),
    "experts": (1, 4096, "routed expert counts"),
    "top_k": (1, 128, "experts per token"),
    "hidden_size": (1, 262144, "hidden sizes"),
    "intermediate_size": (1, 262144, "expert intermediate sizes"),
    "shared_experts": (0, 64, "shared expert counts"),
}
MAX_CONFIG_BYTES = 16 << 20  # real config.json files are kB; a MIXED_PRECISION quantization_config can reach MBs


def load_config(path, what: str = "model config") -> dict:
    """Read ``config.json`` (a path, or a directory holding one); InputError when it is missing or malformed."""
    from moe_fsm.trace.document import parse_json, read_text

    path = Path(path)
    if "\0" not in str(path) and path.is_dir():
        path = path / "config.json"
    text = read_text(path, what, MAX_CONFIG_BYTES).removeprefix("\ufeff")  # a UTF-8 byte-order mark is harmless
    # NaN / Infinity as Python's json writes them are accepted; the sizes are checked below
    data = parse_json(text, f"{what} {path}", non_finite=True)
    if not isinstance(data, dict):
        raise InputError(f"{what} {path} must hold a JSON object, got {type(data).__name__}")
    return data


class _Fields:
    """Typed reads of one config object; every refusal names the file, the field and what is accepted."""

    def __init__(self, config: dict, path: Path, prefix: str = "") -> None:
        self.config, self.path, self.prefix = config, path, prefix

    def fail(self, key: str, wanted: str, value) -> InputError:
        shown = repr(value)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        return InputError(f"model config {self.path}: {self.prefix}{key} must be {wanted}, got {shown}")

    def first(self, keys: tuple[str, ...], what: str) -> tuple[str, object]:
        for key in keys:
            value = self.config.get(key)
            if value is not None:
                return key, value
        raise InputError(f"model config {self.path} names no {what} (looked for {', '.join(keys)})")

    def int_in(self, key: str, value, limit: str) -> int:
        low, high, what = LIMITS[limit]
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise self.fail(key, f"an integer in {low}..{high} (the range moe-fsm accepts for {what})", value)
        return value

    def sized(self, keys: tuple[str, ...], what: str, limit: str) -> int:
        key, value = self.first(keys, what)
        return self.int_in(key, value, limit)

    def optional_int(self, key: str, default: int, low: int, high: int) -> int:
        value = self.config.get(key)
        if value is None or value == 0 and not isinstance(value, bool) and default:
            return default  # unset, or 0 where 0 means "the default" (the `or 1` spelling of the layer-step keys)
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise self.fail(key, f"an integer in {low}..{high}", value)
        return value

    def text(self, key: str, default: Optional[str], accepted: str = "a string"):
        value = self.config.get(key)
        if value is None:
            return default
        if not isinstance(value, str):
            raise self.fail(key, accepted, value)
        return value


def _moe_layers(fields: _Fields, num_layers: int) -> tuple[int, ...]:
    """The decoder layers whose MLP is MoE, by whichever convention the config uses."""
    first_dense = fields.optional_int("first_k_dense_replace", 0, 0, num_layers)
    freq = fields.optional_int("moe_layer_freq", 1, 1, num_layers)
    step = fields.optional_int("decoder_sparse_step", 1, 1, num_layers)
    interleave = fields.optional_int("interleave_moe_layer_step", 1, 1, num_layers)
    listed = fields.config.get("mlp_only_layers")
    if listed is None:
        listed = []
    if not isinstance(listed, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in listed):
        raise fields.fail("mlp_only_layers", f"a list of layer indices (integers in 0..{num_layers - 1})", listed)
    dense_only = set(listed)
    return tuple(
        i for i in range(num_layers)
        if i >= first_dense and i % freq == 0 and (i + 1) % step == 0
        and (i + 1) % interleave == 0 and i not in dense_only
    )


def read_model_config(path) -> ModelConfig:
    """The MoE facts of a checkpoint's config.json (its text config, for multimodal wrappers).

    Every field plan reads is type- and range-checked here (``LIMITS``): a config that names an implausible
    size is an InputError naming the field and the accepted range, so the work plan does is bounded
    (at most ``LIMITS['layers']`` layers, each decided once per distinct input).
    """
    path = Path(path)
    raw = load_config(path)
    top = _Fields(raw, path)
    text_config = raw.get("text_config")
    if text_config is not None and not isinstance(text_config, dict):
        raise top.fail("text_config", "an object (a multimodal model's language-model config)", text_config)
    fields = _Fields(text_config, path, "text_config.") if text_config is not None else top
    config = fields.config
    architectures = raw.get("architectures")
    if architectures is None or architectures == []:
        architecture = "unknown"
    elif not isinstance(architectures, list) or not isinstance(architectures[0], str):
        raise top.fail("architectures", "a list of architecture names (strings)", architectures)
    else:
        architecture = architectures[0]
    num_experts = fields.sized(EXPERTS_KEYS, "expert count", "experts")
    activation = ARCH_ACTIVATION.get(architecture)
    if activation is None:
        act = fields.text("hidden_act", "silu", f"one of {sorted(ACTIVATIONS)}")
        if act not in ACTIVATIONS:
            raise InputError(f"model config {path}: hidden_act {act!r} is not one of {sorted(ACTIVATIONS)}")
        activation = ACTIVATIONS[act]
    dtype_key = next((k for k in DTYPE_KEYS if config.get(k)), None)
    dtype_fields = fields if dtype_key else top
    dtype_key = dtype_key or next((k for k in DTYPE_KEYS if raw.get(k)), None)
    dtype = dtype_fields.text(dtype_key, "bfloat16", f"one of {list(FLOAT_DTYPES)}") if dtype_key else "bfloat16"
    if dtype not in FLOAT_DTYPES:
        raise dtype_fields.fail(dtype_key, f"one of {list(FLOAT_DTYPES)}", dtype)
    top_k = fields.sized(TOP_K_KEYS, "top-k (experts per token)", "top_k")
    if top_k > num_experts:
        raise InputError(f"model config {path}: top-k {top_k} exceeds the expert count {num_experts}")
    limit = config.get("swiglu_limit")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, float))
                              or not math.isfinite(limit) or limit <= 0):
        raise fields.fail("swiglu_limit", "a positive finite number", limit)
    shared_key = next((k for k in SHARED_EXPERTS_KEYS if config.get(k)), None)
    shared = fields.int_in(shared_key, config[shared_key], "shared_experts") if shared_key else 0
    geometry = MoEGeometry(
        num_experts=num_experts,
        top_k=top_k,
        hidden_size=fields.sized(("hidden_size",), "hidden size", "hidden_size"),
        intermediate_size=fields.sized(MOE_INTERMEDIATE_KEYS, "expert intermediate size", "intermediate_size"),
        activation=activation,
        swiglu_limit=None if limit is None else float(limit),
        dtype=dtype,
        shared_experts=shared or (1 if config.get("shared_expert_intermediate_size") else 0),
        bias=architecture in EXPERT_BIAS,
        router_weight_on_input=architecture in ROUTER_WEIGHT_ON_INPUT,
    )
    num_layers = fields.sized(("num_hidden_layers",), "layer count", "layers")
    quantization, source = _quantization(raw, top, fields, path)
    model_type = fields.text("model_type", None) or top.text("model_type", "?")
    return ModelConfig(path, architecture, model_type, num_layers, _moe_layers(fields, num_layers), geometry,
                       quantization or None, source)


def _quantization(raw: dict, top: _Fields, fields: _Fields, path: Path) -> tuple[Optional[dict], Optional[str]]:
    """The checkpoint's quantization config where vLLM looks for it, in its order: config.json's
    ``quantization_config``; else ``hf_quant_config.json`` beside config.json (ModelOpt 0.29 and older);
    else ``compression_config`` (older compressed-tensors checkpoints); else the text config's."""
    value = top.config.get("quantization_config")
    if value is None:
        beside = (path if path.is_dir() else path.parent) / "hf_quant_config.json"
        if beside.is_file():
            return load_config(beside, "quantization config"), str(beside)
    for where, key in ((top, "quantization_config"), (top, "compression_config"), (fields, "quantization_config")):
        value = where.config.get(key)
        if value is not None:
            if not isinstance(value, dict):
                raise where.fail(key, "an object", value)
            return value, None
    return None, None
