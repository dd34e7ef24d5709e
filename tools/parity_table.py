"""One row of the vLLM parity harness: how to ask vLLM's oracle function for one quantization family.

Its own module so that the harness (``tools/vllm_parity.py``) and the families kept apart from it
(``tools/parity_families/``) both import it, and neither imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class FamilyTable:
    """How to ask vLLM's oracle for one family.

    ``module``/``function``: the oracle function; ``arguments(vllm, inputs, config)``
    returns its positional arguments after the FusedMoEConfig (quant keys,
    flags), built from moe-fsm's DecisionInputs; ``result(value)`` maps the
    oracle's return value to (backend name, experts class name).
    """

    family: str
    module: str
    function: str
    arguments: Callable[[Any, Any, Any], tuple]
    result: Callable[[Any], tuple[str, str | None]] = lambda value: (value[0].name, value[1].__name__ if value[1] else None)
