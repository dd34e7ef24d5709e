"""The environment variables SGLang 0.5.23's MoE runner resolution reads (``srt/environ.py`` and the quantization
modules' ``get_bool_env_var`` reads).

SGLang reads booleans two ways: ``envs.X.get()`` (``EnvBool``: true/1/yes/y and false/0/no/n in any case;
anything else warns and falls back to the default) and ``get_bool_env_var`` (true/1 on, false/0 off; anything
else warns and reads off). ``SGLANG_USE_AITER`` is read both ways (the GPT-OSS override and the FP8 method with
``EnvBool``, the unquantized and MXFP4 methods with ``get_bool_env_var``), so ``yes`` would switch one reader on
and leave the other off. moe-fsm accepts the values both readers agree on for the variables read both ways,
each reader's own words for the others, and refuses the rest by name, where SGLang would warn and carry on.

``SGLANG_FORCE_FP8_MARLIN`` is not here: 0.5.23 reads it only in the dense FP8 linear methods
(``Fp8LinearMethod``, ``ModelOptFp8LinearMethod``), never in an MoE runner choice.
"""

from __future__ import annotations

from typing import Callable

from moe_fsm.errors import EnvVarError
from moe_fsm.inputs.env import EnvRegistry, EnvVar

ENV_BOOL = "true, 1, yes or y (on); false, 0, no or n (off); any case"
BOTH_READERS = "true or 1 (on); false or 0 (off); any case"


def env_bool(name: str) -> Callable[[str], bool]:
    """SGLang's ``EnvBool.parse``; a value it would warn about and replace by the default is refused."""

    def parse(raw: str) -> bool:
        value = raw.lower()
        if value in ("true", "1", "yes", "y"):
            return True
        if value in ("false", "0", "no", "n"):
            return False
        raise EnvVarError(name, raw, ENV_BOOL)

    return parse


def both_readers(name: str) -> Callable[[str], bool]:
    """A variable SGLang reads with ``EnvBool`` in one place and ``get_bool_env_var`` in another (or only with
    ``get_bool_env_var``): the words on which they agree."""

    def parse(raw: str) -> bool:
        value = raw.lower()
        if value in ("true", "1"):
            return True
        if value in ("false", "0"):
            return False
        raise EnvVarError(name, raw, BOTH_READERS)

    return parse


ENV = EnvRegistry.of(
    EnvVar("SGLANG_ENABLE_JIT_DEEPGEMM", True, env_bool("SGLANG_ENABLE_JIT_DEEPGEMM"), ENV_BOOL,
           "DeepGEMM's JIT kernels (deep_gemm_wrapper.ENABLE_JIT_DEEPGEMM, with CUDA SM90+ and deep_gemm importable); "
           "FP8 MoE picks deep_gemm under DeepEP-style all-to-all only when it is on."),
    EnvVar("SGLANG_USE_AITER", False, both_readers("SGLANG_USE_AITER"), BOTH_READERS,
           "AITER kernels on ROCm: the unquantized, FP8 and MXFP4 methods take the aiter runner for auto, and "
           "GPT-OSS on ROCm picks triton (BF16) or keeps auto (MXFP4)."),
    EnvVar("SGLANG_INT4_WEIGHT", False, both_readers("SGLANG_INT4_WEIGHT"), BOTH_READERS,
           "INT4 weights in the FP8 method on ROCm (_use_hip_int4): auto picks the aiter runner."),
    EnvVar("SGLANG_FLASHINFER_CUTEDSL_NVFP4_W4A16", False, env_bool("SGLANG_FLASHINFER_CUTEDSL_NVFP4_W4A16"),
           ENV_BOOL, "FlashInfer CuteDSL NVFP4 W4A16: nvfp4_online under flashinfer_megamoe resolves auto to it."),
    EnvVar("SGLANG_FLASHINFER_NVFP4_PER_TOKEN_ACTIVATION", False,
           env_bool("SGLANG_FLASHINFER_NVFP4_PER_TOKEN_ACTIVATION"), ENV_BOOL,
           "Per-token NVFP4 activations; flashinfer_cutedsl refuses them under --moe-a2a-backend deepep."),
)
