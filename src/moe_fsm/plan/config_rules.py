"""Each engine's rules for reading a checkpoint's quantization_config, by the name a profile gives them.

``Profile.config_rules`` names one (vLLM's profiles: ``vllm``; ``sglang-0.5.23``: SGLang 0.5.23's), so which
engine's config path ``plan`` follows is data of the profile, and the reader (``quant_config.QuantReader``) is one.
"""

from __future__ import annotations

from types import MappingProxyType

from moe_fsm.errors import InputError
from moe_fsm.plan.quant_config import VLLM_CONFIG_RULES
from moe_fsm.plan.quant_fields import ConfigRules
from moe_fsm.plan.sglang_quant_config import SGLANG_0_5_23_CONFIG_RULES

CONFIG_RULES = MappingProxyType({"vllm": VLLM_CONFIG_RULES, "sglang-0.5.23": SGLANG_0_5_23_CONFIG_RULES})


def config_rules(name: str) -> ConfigRules:
    try:
        return CONFIG_RULES[name]
    except KeyError:
        raise InputError(f"no config-reading rules named {name!r}; known: {sorted(CONFIG_RULES)}") from None
