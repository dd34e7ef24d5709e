"""What an engine reads about the model and its server flags beyond one layer's shapes and quantization.

vLLM's oracles decide from the layer alone; SGLang's server-argument pipeline
also reads the checkpoint's architecture (its per-architecture overrides: GPT-OSS on
Hopper picks ``triton_kernel``, DeepSeek/Qwen3/GLM4-MoE on Blackwell pick
``flashinfer_trtllm``), the quantization method config.json declares, the server's
``--quantization`` flag, and whether the layer belongs to a speculative draft model
(a draft's layers take the speculative runner). A layer carries these facts as
``MoELayer.model``; profiles that read none of them (every vLLM one) ignore them,
and a trace records them only when given.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from moe_fsm.errors import InputError
from moe_fsm.inputs.hashing import field_dict, hashed_once

MAX_NAME = 256


@hashed_once
@dataclass(frozen=True)
class ModelFacts:
    """``architecture``: config.json's ``architectures[0]`` (e.g. ``GptOssForCausalLM``; None: not known).
    ``quant_method``: ``quantization_config.quant_method`` as the checkpoint declares it (``fp8``,
    ``modelopt_fp4``, ``mxfp4``, ``compressed-tensors``, ``gptq``, ``awq``, ...; None: the layer's scheme says it).
    ``quantization``: the server's ``--quantization`` flag (None: not given).
    ``draft``: the layer belongs to the speculative draft model (SGLang decides it with the speculative runner).
    ``layer_method``: the quantization method the engine builds this layer with, as ``plan`` read it from the
    checkpoint by that engine's rules (SGLang's ``fp8``, ``modelopt_fp4``, ``gptq_marlin``, ``moe_wna16``, ...; None:
    the profile derives it from ``quant_method``). Left out of the JSON form when None.
    """

    architecture: str | None = None
    quant_method: str | None = None
    quantization: str | None = None
    draft: bool = False
    layer_method: str | None = None

    def __post_init__(self) -> None:
        for name in ("architecture", "quant_method", "quantization", "layer_method"):
            value = getattr(self, name)  # as a config.json spells it, control characters and all (JSON escapes them)
            if value is not None and (not isinstance(value, str) or not 0 < len(value) <= MAX_NAME):
                raise InputError(f"model {name} must be a non-empty string of at most {MAX_NAME} characters, or None; "
                                 f"got {value!r:.80}")
        if not isinstance(self.draft, bool):
            raise InputError(f"model draft must be True or False, got {self.draft!r}")

    @property
    def given(self) -> bool:
        """Any fact differs from "not known" (only then does a trace record them)."""
        return self != ModelFacts()

    def to_json(self) -> dict:
        data = field_dict(self)
        if data["layer_method"] is None:  # traces from before the field, and every select, read the same
            del data["layer_method"]
        return data

    @classmethod
    def from_json(cls, data) -> "ModelFacts":
        if not isinstance(data, dict):
            raise InputError(f"a layer's model facts must be an object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise InputError(f"unknown model field(s) {unknown}; accepted: {sorted(known)}")
        return cls(**data)
