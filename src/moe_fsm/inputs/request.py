"""What the user asked for: ``auto``, one backend name, or one per quantization family.

vLLM's ``--moe-backend`` is one string that every oracle must accept, so a
mixed NVFP4+FP8 checkpoint with ``flashinfer_b12x`` dies in the FP8 oracle
(PR #43334). A per-family mapping gives each family its own choice and
``auto`` to the families it does not name, with no new env var.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Union

from moe_fsm.inputs.hashing import hashed_once
from moe_fsm.errors import InputError
from moe_fsm.inputs.quant import QuantFamily

AUTO = "auto"


def normalize_backend_name(name: str) -> str:
    """vLLM's normalization: lower case, '-' becomes '_'."""
    if not isinstance(name, str) or not name.strip():
        raise InputError(f"a backend name must be a non-empty string, got {name!r}")
    return name.strip().lower().replace("-", "_")


@hashed_once
@dataclass(frozen=True)
class BackendRequest:
    """``default`` applies to every family not listed in ``per_family``."""

    default: str = AUTO
    per_family: tuple[tuple[QuantFamily, str], ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.default, str) or not self.default.strip():
            raise InputError(f"a backend request's default must be a backend name or 'auto', got {self.default!r}")
        if not isinstance(self.per_family, tuple) or not all(
            isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], QuantFamily) and isinstance(p[1], str)
            for p in self.per_family
        ):
            raise InputError(
                "per_family must be a tuple of (QuantFamily, name) pairs; use BackendRequest.parse({'fp8': 'triton'})"
            )

    @classmethod
    def parse(cls, spec: Union[str, Mapping[str, str], "BackendRequest", None]) -> "BackendRequest":
        """Accept "auto", "triton", {"nvfp4": "flashinfer_b12x", "fp8": "flashinfer_cutlass"},
        or the CLI form "nvfp4=flashinfer_b12x,fp8=flashinfer_cutlass"."""
        if spec is None:
            return cls()
        if isinstance(spec, BackendRequest):
            return spec
        if isinstance(spec, str) and "=" in spec:
            pairs = [part.split("=", 1) for part in spec.split(",") if part.strip()]
            if any(len(p) != 2 for p in pairs):
                raise InputError(f"backend mapping {spec!r} must look like 'nvfp4=flashinfer_b12x,fp8=triton'")
            keys = [k.strip().lower() for k, _ in pairs]
            if len(set(keys)) != len(keys):
                raise InputError(f"backend mapping {spec!r} names a family twice; give each family one backend")
            spec = {k.strip(): v.strip() for k, v in pairs}
        if isinstance(spec, str):
            return cls(normalize_backend_name(spec))
        if isinstance(spec, Mapping):
            families = {f.value: f for f in QuantFamily}
            per_family = []
            default = AUTO
            for key, name in spec.items():
                key_n = str(key).strip().lower()
                if key_n in ("default", "*"):
                    default = normalize_backend_name(name)
                    continue
                if key_n not in families:
                    raise InputError(
                        f"backend mapping key {key!r} is not a quantization family; "
                        f"accepted: {sorted(families)} or 'default'"
                    )
                if any(fam is families[key_n] for fam, _ in per_family):
                    raise InputError(f"backend mapping names family {key_n!r} twice; give each family one backend")
                per_family.append((families[key_n], normalize_backend_name(name)))
            return cls(default, tuple(sorted(per_family, key=lambda p: p[0].value)))
        raise InputError(f"backend request must be a string or a mapping of family to name, got {type(spec).__name__}")

    def for_family(self, family: QuantFamily) -> str:
        for fam, name in self.per_family:
            if fam is family:
                return name
        return self.default

    def source_for(self, family: QuantFamily) -> str:
        """Where the family's choice came from, for error messages and traces."""
        if any(fam is family for fam, _ in self.per_family):
            return f"backend[{family.value}]"
        return "backend"

    def to_json(self) -> Union[str, dict]:
        if not self.per_family:
            return self.default
        data = {fam.value: name for fam, name in self.per_family}
        if self.default != AUTO:
            data["default"] = self.default
        return data

    @classmethod
    def from_json(cls, data: Union[str, dict]) -> "BackendRequest":
        return cls.parse(data)
