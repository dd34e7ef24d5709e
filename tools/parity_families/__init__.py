"""Parity of the MX and integer families (vLLM 0.33's mxfp4, mxfp8, int8, int_wna16, w4a8, w4a8_int8 oracles).

Kept apart from tools/vllm_parity.py (which owns the harness) so the two grow
without touching each other: ``tables()`` gives its ``FamilyTable`` rows,
``grid(families)`` the generated scenarios (grid.py), ``Faked`` the extra
machine facts these oracles' kernels ask for (fakes.py).
"""

from parity_families.fakes import Faked
from parity_families.grid import FAMILIES, grid, use_profile
from parity_families.tables import tables

__all__ = ["FAMILIES", "Faked", "grid", "tables", "use_profile"]
