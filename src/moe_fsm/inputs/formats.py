"""The activation formats experts take: a fact the decision core and the runtime share.

It lives with the inputs (not in ``modular``) so that deciding needs no torch.
"""

from __future__ import annotations

from enum import Enum


class ActivationFormat(str, Enum):
    """Standard: tokens as rows [M, K]. Batched: per local expert [E_local, max_tokens, K]."""

    STANDARD = "standard"
    BATCHED = "batched"
