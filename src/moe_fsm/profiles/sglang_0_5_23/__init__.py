"""The ``sglang-0.5.23`` profile: SGLang 0.5.23's MoE runner selection, read from its source.

SGLang resolves one ``--moe-runner-backend`` for the whole server in its server-argument pipeline
(``srt/arg_groups/pipeline.py``: alias, per-architecture model overrides, quantization constraints, the
all-to-all constraints, the speculative default; ``pipeline.py`` here), and each layer's quantization method
turns what is left into the runner it builds (``create_moe_runner``; ``layer.py`` and one module per family).
The same machine decides: each stage is a state whose guard and rules are data. docs/profiles.md maps the
stages onto the machine; tools/sglang_parity.py runs SGLang's own code against this profile.
"""

from __future__ import annotations

from types import MappingProxyType

from moe_fsm.profiles.profile import Profile, family_policies
from moe_fsm.profiles.sglang_0_5_23.env import ENV
from moe_fsm.profiles.sglang_0_5_23.kernels import KERNELS

PROFILE = Profile(
    name="sglang-0.5.23",
    about="SGLang 0.5.23's MoE runner resolution (srt/arg_groups/ server-argument pipeline and the quantization "
          "methods' create_moe_runner)",
    vllm_version=None,
    policies=family_policies(__name__),
    kernels=MappingProxyType(KERNELS),
    env=ENV,
    reads_model_facts=True,
    config_rules="sglang-0.5.23",  # plan reads checkpoints by SGLang's rules (plan/sglang_quant_config.py)
    redirect_hint="an earlier stage decides first: a model override, the all-to-all constraint, or the layer's "
                  "quantization method in create_moe_runner",
)
