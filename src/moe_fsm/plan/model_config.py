"""A model's MoE geometry from its ``config.json``: which layers are MoE, and their shapes.

Checkpoints spell the same facts differently (``n_routed_experts`` /
``num_local_experts`` / ``num_experts``; ``moe_intermediate_size`` or the plain
``intermediate_size`` for models whose every MLP is MoE; dense first layers as
``first_k_dense_replace``, ``decoder_sparse_step`` + ``mlp_only_layers`` or
``interleave_moe_layer_step``). The spellings are tables here, so a new
architecture is a new row. No torch, no network: a ``config.json`` on disk.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from moe_fsm.errors import InputError
from moe_fsm.inputs.layer import Activation

EXPERTS_KEYS = ("n_routed_experts", "num_local_experts", "num_experts", "moe_num_experts")
TOP_K_KEYS = ("num_experts_per_tok", "experts_per_token", "moe_topk", "top_k")
MOE_INTERMEDIATE_KEYS = ("moe_intermediate_size", "expert_intermediate_size", "intermediate_size")
DTYPE_KEYS = ("torch_dtype", "dtype")
SHARED_EXPERTS_KEYS = ("n_shared_experts", "num_shared_experts")

# Where the routed experts live under each decoder layer, by architecture (the module prefix quantization
# configs name): most checkpoints use ``mlp``; Mixtral keeps its experts under ``block_sparse_moe``.
MOE_BLOCK = {"MixtralForCausalLM": "block_sparse_moe", "PhimoeForCausalLM": "block_sparse_moe"}

# transformers' ``hidden_act`` names that moe-fsm's gated activations compute exactly (the config reader and the
# transformers integration share it); architectures with their own gated activation override it.
ACTIVATIONS = {"silu": Activation.SILU, "swish": Activation.SILU, "gelu": Activation.GELU}
ARCH_ACTIVATION = {"GptOssForCausalLM": Activation.SWIGLUOAI}


@dataclass(frozen=True)
class MoEGeometry:
    """One MoE layer's shapes as the config states them (global: before any tensor/expert parallel split)."""

    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    activation: Activation
    swiglu_limit: Optional[float]
    dtype: str
    shared_experts: int


@dataclass(frozen=True)
class ModelConfig:
    path: Path
    architecture: str
    model_type: str
    num_layers: int
    moe_layers: tuple[int, ...]
    geometry: MoEGeometry
    quantization: Optional[dict]

    def experts_module(self, index: int) -> str:
        return f"model.layers.{index}.{MOE_BLOCK.get(self.architecture, 'mlp')}.experts"


def load_config(path) -> dict:
    """Read ``config.json`` (a path, or a directory holding one); InputError when it is missing or malformed."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise InputError(f"model config {path} does not exist (give a config.json or the directory holding it)") from None
    except json.JSONDecodeError as err:
        raise InputError(f"model config {path} is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise InputError(f"model config {path} must hold a JSON object")
    return data


def _first(config: dict, keys: tuple[str, ...], what: str, path: Path):
    for key in keys:
        value = config.get(key)
        if value is not None:
            return value
    raise InputError(f"model config {path} names no {what} (looked for {', '.join(keys)})")


def _moe_layers(config: dict, num_layers: int) -> tuple[int, ...]:
    """The decoder layers whose MLP is MoE, by whichever convention the config uses."""
    first_dense = config.get("first_k_dense_replace", 0) or 0
    freq = config.get("moe_layer_freq", 1) or 1
    step = config.get("decoder_sparse_step", 1) or 1
    interleave = config.get("interleave_moe_layer_step", 1) or 1
    dense_only = set(config.get("mlp_only_layers") or ())
    return tuple(
        i for i in range(num_layers)
        if i >= first_dense and i % freq == 0 and (i + 1) % step == 0
        and (i + 1) % interleave == 0 and i not in dense_only
    )


def read_model_config(path) -> ModelConfig:
    """The MoE facts of a checkpoint's config.json (its text config, for multimodal wrappers)."""
    path = Path(path)
    raw = load_config(path)
    config = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    architecture = (raw.get("architectures") or ["unknown"])[0]
    num_experts = _first(config, EXPERTS_KEYS, "expert count", path)
    activation = ARCH_ACTIVATION.get(architecture)
    if activation is None:
        act = config.get("hidden_act", "silu")
        if act not in ACTIVATIONS:
            raise InputError(f"model config {path}: hidden_act {act!r} is not one of {sorted(ACTIVATIONS)}")
        activation = ACTIVATIONS[act]
    dtype = next((config.get(k) or raw.get(k) for k in DTYPE_KEYS if config.get(k) or raw.get(k)), "bfloat16")
    geometry = MoEGeometry(
        num_experts=num_experts,
        top_k=_first(config, TOP_K_KEYS, "top-k (experts per token)", path),
        hidden_size=_first(config, ("hidden_size",), "hidden size", path),
        intermediate_size=_first(config, MOE_INTERMEDIATE_KEYS, "expert intermediate size", path),
        activation=activation,
        swiglu_limit=config.get("swiglu_limit"),
        dtype=dtype,
        shared_experts=next((config[k] for k in SHARED_EXPERTS_KEYS if config.get(k)), 0)
        or (1 if config.get("shared_expert_intermediate_size") else 0),
    )
    num_layers = _first(config, ("num_hidden_layers",), "layer count", path)
    quantization = raw.get("quantization_config") or config.get("quantization_config")
    return ModelConfig(path, architecture, config.get("model_type", raw.get("model_type", "?")), num_layers,
                       _moe_layers(config, num_layers), geometry, quantization)
