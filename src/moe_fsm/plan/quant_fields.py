"""What reading one MoE layer's quantization takes and gives, and the typed reads every engine's reader shares.

A reader (``quant_config`` for vLLM, ``sglang_quant_config`` for SGLang) gets a ``LayerContext`` (the facts an
engine's config classes read besides the layer's name) and gives one of three results: ``Mapped`` (the scheme the
engine's MoE method hands its oracle), ``Unmapped`` (the engine decides by a rule moe-fsm has no policy for) or
``Refused`` (the engine's own refusal, in its words). A field of the wrong type is an ``InputError`` naming the field
(``bad_field``); a refusal raised deep in a reader travels up as ``Refusal``. Torch-free, core.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Union

from moe_fsm.errors import InputError
from moe_fsm.inputs.parallel import ParallelConfig
from moe_fsm.inputs.platform import PlatformFacts, Vendor
from moe_fsm.inputs.quant import QuantScheme


@dataclass(frozen=True)
class Mapped:
    scheme: QuantScheme
    source: str  # how the config said it, for the table
    allow_vllm_cutlass: bool = False
    method: str = ""  # vLLM's FusedMoEMethodBase class for the layer
    # Backends the method goes on with once its oracle chose (empty: any); another one fails as vLLM's method
    # fails after the oracle returned, with ``only_reason`` (an AssertionError in vLLM).
    only_backends: tuple[str, ...] = ()
    only_reason: str = ""
    # The engine's own name for the method it builds the layer with, where its profile reads it as a fact of the
    # layer (SGLang's ``fp8``, ``modelopt_fp4``, ``gptq_marlin``, ``moe_wna16``, ...); empty for vLLM's readers.
    engine_method: str = ""

    def refusal_after(self, backend: str) -> Optional["Refused"]:
        """What vLLM's method raises after its oracle chose ``backend``, if it does."""
        if self.only_backends and backend not in self.only_backends:
            return Refused(self.only_reason, "AssertionError")
        return None


@dataclass(frozen=True)
class Unmapped:
    """vLLM decides this layer by a rule moe-fsm has no policy for."""

    reason: str


@dataclass(frozen=True)
class Refused:
    """vLLM refuses this checkpoint (or this layer of it) before or while choosing the layer's method."""

    reason: str  # the engine's message
    error: str = "ValueError"  # the exception the engine raises
    by: str = "vLLM"  # whose rules refuse (the engine of the profile's config rules)


LayerQuant = Union[Mapped, Unmapped, Refused]


# -- what vLLM's config readers look at besides a layer's name ------------------------------------------------------


@dataclass(frozen=True)
class ReleaseRules:
    """The config-path rules that differ between the vLLM releases moe-fsm has profiles for."""

    ct_checkpoint_projection_names: bool  # compressed-tensors matches the model's own expert names (Mixtral's w1/w3/w2)
    ct_mxfp4_w4a8: bool  # compressed-tensors' MXFP4 weights + dynamic FP8 activations method exists
    fp8_batch_invariant_token: bool  # Fp8MoEMethod: VLLM_BATCH_INVARIANT turns dynamic per-tensor into per-token
    modelopt_flat_exclude_modules: bool  # flat ModelOpt configs also read exclude_modules (not only ignore)
    modelopt_b12x_codecs: bool  # ModelOpt MIXED_PRECISION knows the b12x block codecs
    quark_mxfp8_moe: bool  # Quark MXFP8 experts have an MoE method


RELEASE_RULES = {
    (0, 31): ReleaseRules(False, False, False, False, False, False),
    (0, 32): ReleaseRules(True, True, False, False, True, False),
    (0, 33): ReleaseRules(True, True, True, True, True, True),
}
LATEST = max(RELEASE_RULES)

# The checkpoint names of the experts' gate, up and down projections (vLLM's ckpt_names), where a model differs
# from ("gate_proj", "up_proj", "down_proj"); compressed-tensors matches its targets against these.
DEFAULT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LayerContext:
    """The facts vLLM's quantization configs read besides the layer's module name.

    ``release``: the vLLM release whose rules apply ((0, 33); the ``seeds`` profile reads as the latest);
    ``batch_invariant``: VLLM_BATCH_INVARIANT, which FP8's per-tensor method reads. Platform and parallel
    layout matter where vLLM's choice of method does: Marlin's shape rule (ROCm, the per-rank intermediate
    size), AWQ on CPUs, a GPU's minimum capability, the platform's list of quantization methods.
    """

    model_type: str = "?"
    projections: tuple[str, str, str] = DEFAULT_PROJECTIONS
    hidden_size: int = 0
    intermediate_size: int = 0
    platform: Optional[PlatformFacts] = None
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    batch_invariant: bool = False
    release: tuple[int, int] = LATEST
    # Whose config-reading rules apply: the profile's ``config_rules`` table (None: vLLM's, ``VLLM_CONFIG_RULES``).
    config_rules: Optional["ConfigRules"] = None
    # What SGLang's MoE Marlin check reads of the layer (check_moe_marlin_supports_layer).
    router_weight_on_input: bool = False
    gated_silu: bool = True

    @property
    def rules(self) -> ReleaseRules:
        return RELEASE_RULES.get(self.release[:2], RELEASE_RULES[LATEST])

    @property
    def capability(self) -> Optional[int]:
        """vLLM's ``get_device_capability().to_int()`` (90 for 9.0); None where vLLM has none (CPU) or moe-fsm
        records none (ROCm, XPU)."""
        p = self.platform
        return None if p is None or p.capability is None else p.capability[0] * 10 + p.capability[1]

    @property
    def vendor(self) -> Optional[Vendor]:
        return None if self.platform is None else self.platform.vendor

    @property
    def tp_size(self) -> int:
        """FusedMoEParallelConfig's tp_size: TP flattened across DP; 1 with expert parallelism."""
        p = self.parallel
        return 1 if p.use_ep else p.tp_size * p.dp_size

    @property
    def intermediate_per_partition(self) -> int:
        return self.intermediate_size // self.tp_size


# -- typed reads ---------------------------------------------------------------------------------------------


def bad_field(where: str, wanted: str, value) -> InputError:
    shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return InputError(f"quantization_config: {where} must be {wanted}, got {shown}")


def read_object(value, where: str, default: Optional[dict] = None) -> dict:
    if value is None and default is not None:
        return default
    if not isinstance(value, dict):
        raise bad_field(where, "an object", value)
    return value


def read_names(value, where: str) -> list[str]:
    """A list of module names or patterns (None or absent: empty)."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise bad_field(where, "a list of module names (strings)", value)
    return value


def read_int(value, where: str, *, low: Optional[int] = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or (low is not None and value < low):
        raise bad_field(where, "an integer" + (f" >= {low}" if low is not None else ""), value)
    return value


def read_flag(value, where: str) -> bool:
    if not isinstance(value, bool):
        raise bad_field(where, "true or false", value)
    return value


def short_repr(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def short_text(value) -> str:
    text = str(value)
    return text if len(text) <= 40 else text[:37] + "..."


def first_key(config: dict, keys: tuple[str, ...]):
    """vLLM's ``get_from_keys``: the first key present, else its ValueError (raised as a Refused)."""
    for key in keys:
        if key in config:
            return config[key]
    raise Refusal(f"Cannot find any of {list(keys)} in the model's quantization config.")


class Refusal(Exception):
    """vLLM refuses: carried up to the layer (or the whole config) as a ``Refused``."""

    def __init__(self, message: str, error: str = "ValueError") -> None:
        super().__init__(message)
        self.refused = Refused(message, error)


def unquantized(why: str) -> Mapped:
    return Mapped(QuantScheme.unquantized(), why, method="UnquantizedFusedMoEMethod")


def not_modelled(why: str) -> Unmapped:
    return Unmapped(why)


# -- an engine's readers, as data -------------------------------------------------------------------------------

class Reader:
    """One vLLM config class: ``MIN_CAPABILITY`` is its get_min_capability (checked before any layer)."""

    MIN_CAPABILITY = 0

    def __init__(self, config: dict, ctx: LayerContext, method: str) -> None:
        self.config, self.ctx, self.method = config, ctx, method

    def layer(self, experts: str) -> LayerQuant:
        raise NotImplementedError


@dataclass(frozen=True)
class ConfigRules:
    """One engine's rules for reading a checkpoint's quantization_config, as data a profile names
    (``Profile.config_rules``): how the config's name resolves to a config class (``resolve``: the engine's
    registry, overrides and refusals), the reader of each class (``readers``), the classes moe-fsm does not
    model with why (``not_modelled``), and the engine's minimum-capability refusal. The machinery that applies
    them (``QuantReader``) is the same for every engine."""

    engine: str  # whose words a refusal is in ("vLLM", "SGLang 0.5.23")
    resolve: Callable[[dict, LayerContext], Union[str, Refused, None]]
    readers: Mapping[str, type]
    not_modelled: Mapping[str, str]
    min_capability: Callable[["Reader", str], int] = lambda reader, method: reader.MIN_CAPABILITY
    capability_message: str = ("The quantization method {method} is not supported for the current GPU. Minimum "
                               "capability: {minimum}. Current capability: {current}.")
    unknown_reader: str = "quant_method {method!r}: vLLM's config class has no MoE method moe-fsm models"
    method_key: str = "vllm_method"  # what a golden plan calls the engine's MoE method class of a layer


def fp8_block_scheme(ctx: LayerContext, block: list, source: str, method: str) -> LayerQuant:
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
