"""Kernel configs for the Triton fused-MoE GEMMs: a tuned table plus a default.

A config is the tile shape and launch shape of the two grouped GEMMs. The
alignment step pads every expert's rows to ``block_m``, so both GEMMs share
``block_m``; everything else (BLOCK_N, BLOCK_K, GROUP_M, warps, stages) is
chosen per GEMM, because the w1 GEMM (K -> 2N, fused activation) and the w2 GEMM
(N -> K) have different shapes.

The table is JSON produced by ``bench/tune_triton.py`` on a GPU, one file per
device name under ``configs/``, keyed by ``"E=..,N=..,K=..,dtype=.."`` and then by
the token count it was tuned at. A lookup takes the tuned token count nearest to
the actual one on a log scale (a 600-token batch uses the 512 entry), because the
best tile mostly depends on the rows per expert, which scales with tokens. Shapes
not in the table get ``default_config``: small tiles while experts see few rows
(the GEMMs are bound by reading weights), wide tiles once they see many (bound by
the tensor cores).

This module imports neither Triton nor CUDA so the table can be read and checked
anywhere.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import asdict, dataclass
from importlib import resources
from typing import Optional

from moe_fsm.errors import KernelInputError

FP8_GROUP = 128  # DeepSeek-V3 block size: 128x128 weight blocks, 1x128 activation groups


@dataclass(frozen=True)
class GemmConfig:
    """Launch parameters of one grouped GEMM (``block_n`` is the output tile width)."""

    block_n: int
    block_k: int
    group_m: int = 1
    num_warps: int = 4
    num_stages: int = 3

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class MoEConfig:
    """Both GEMMs' configs and the row block they share."""

    block_m: int
    w1: GemmConfig
    w2: GemmConfig

    def to_json(self) -> dict:
        return {"block_m": self.block_m, "w1": self.w1.to_json(), "w2": self.w2.to_json()}

    @classmethod
    def from_json(cls, data: dict) -> "MoEConfig":
        try:
            return cls(int(data["block_m"]), GemmConfig(**data["w1"]), GemmConfig(**data["w2"]))
        except (KeyError, TypeError) as exc:
            raise KernelInputError(
                f"a Triton MoE config needs block_m plus w1/w2 objects with block_n, block_k, "
                f"group_m, num_warps, num_stages; got {data!r} ({exc})"
            ) from None


def dtype_key(compute_dtype: str, fp8: Optional[str]) -> str:
    """The table's dtype field: ``bf16``/``fp16`` for unquantized, ``fp8_block``/``fp8`` for w8a8."""
    if fp8 is None:
        return {"bfloat16": "bf16", "float16": "fp16"}.get(compute_dtype, compute_dtype)
    return "fp8_block" if fp8 == "block" else "fp8"


def shape_key(num_experts: int, n: int, k: int, dtype: str) -> str:
    return f"E={num_experts},N={n},K={k},dtype={dtype}"


def validate_config(config: MoEConfig, *, block_fp8: bool) -> None:
    """Reject configs the kernels cannot run, naming the field and what is accepted."""

    def pow2(x: int) -> bool:
        return x >= 1 and (x & (x - 1)) == 0

    if not pow2(config.block_m) or config.block_m < 16:
        raise KernelInputError(f"block_m={config.block_m}: accepted are powers of two >= 16")
    for name, g in (("w1", config.w1), ("w2", config.w2)):
        for field_name in ("block_n", "block_k"):
            value = getattr(g, field_name)
            if not pow2(value) or value < 16:
                raise KernelInputError(f"{name}.{field_name}={value}: accepted are powers of two >= 16")
        if g.group_m < 1 or g.num_warps not in (1, 2, 4, 8, 16) or g.num_stages < 1:
            raise KernelInputError(
                f"{name}: group_m >= 1, num_warps in 1/2/4/8/16 and num_stages >= 1 are accepted; got {g}"
            )
        if block_fp8 and FP8_GROUP % g.block_k:
            raise KernelInputError(
                f"{name}.block_k={g.block_k}: block FP8 needs block_k dividing {FP8_GROUP} "
                "(one weight-scale block per K step)"
            )
    if block_fp8 and config.w1.block_n % FP8_GROUP:
        raise KernelInputError(
            f"w1.block_n={config.w1.block_n}: block FP8 needs a multiple of {FP8_GROUP}, because the w1 "
            "GEMM quantizes its output in 1x128 groups in its epilogue"
        )


def default_config(num_experts: int, n: int, k: int, top_k: int, num_tokens: int, *, block_fp8: bool) -> MoEConfig:
    """A reasonable config for an untuned shape, from the mean rows per expert."""
    rows_per_expert = num_tokens * top_k / num_experts
    if rows_per_expert <= 16:
        block_m, w1, w2 = 16, GemmConfig(64, 128, 1, 4, 4), GemmConfig(64, 128, 1, 4, 4)
    elif rows_per_expert <= 96:
        block_m, w1, w2 = 64, GemmConfig(64, 64, 8, 4, 4), GemmConfig(128, 64, 8, 4, 4)
    else:
        block_m, w1, w2 = 128, GemmConfig(64, 64, 8, 8, 4), GemmConfig(128, 64, 8, 8, 4)
    if block_fp8:
        w1 = GemmConfig(FP8_GROUP, min(w1.block_k, FP8_GROUP), w1.group_m, w1.num_warps, 3)
        w2 = GemmConfig(w2.block_n, FP8_GROUP, w2.group_m, w2.num_warps, 3)
    return MoEConfig(block_m, w1, w2)


def config_file_name(device_name: str) -> str:
    """``NVIDIA H100 80GB HBM3`` -> ``NVIDIA_H100_80GB_HBM3.json``."""
    return "".join(c if c.isalnum() else "_" for c in device_name) + ".json"


@functools.lru_cache(maxsize=None)
def load_table(device_name: str) -> dict:
    """The tuned table for a device, or an empty one if none was committed for it."""
    resource = resources.files("moe_fsm.kernels.triton_moe").joinpath("configs", config_file_name(device_name))
    if not resource.is_file():
        return {}
    data = json.loads(resource.read_text())
    return data.get("configs", {})


@functools.lru_cache(maxsize=4096)
def get_config(
    device_name: str,
    num_experts: int,
    n: int,
    k: int,
    top_k: int,
    num_tokens: int,
    compute_dtype: str,
    fp8: Optional[str],
) -> MoEConfig:
    """The tuned config nearest in token count for this shape, else ``default_config``."""
    block_fp8 = fp8 == "block"
    entries = load_table(device_name).get(shape_key(num_experts, n, k, dtype_key(compute_dtype, fp8)))
    if not entries:
        return default_config(num_experts, n, k, top_k, num_tokens, block_fp8=block_fp8)
    target = math.log2(max(num_tokens, 1))
    nearest = min(entries, key=lambda m: (abs(math.log2(int(m)) - target), int(m)))
    config = MoEConfig.from_json(entries[nearest])
    validate_config(config, block_fp8=block_fp8)
    return config
