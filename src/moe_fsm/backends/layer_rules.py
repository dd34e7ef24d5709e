"""A support condition on anything a decision knows, worded as vLLM words its failure.

vLLM's newer oracles and experts classes refuse a configuration for reasons
that are not a device capability, a quantization key or a parallel layout:
the checkpoint's format (GPTQ, AWQ, compressed-tensors), zero points,
activation ordering, expert biases, a shape divisibility, the ROCm
architecture, the CPU architecture. ``Condition`` is that one idea: a
predicate over the ``SupportContext``, the words for what it asks, and vLLM's
own wording of why it fails.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from moe_fsm.backends.requirements import Requirement
from moe_fsm.backends.verdict import SupportContext


@dataclass(frozen=True)
class Condition(Requirement):
    """``holds(ctx)`` or the failure ``reason`` (a string, or a callable of the context for one naming a value)."""

    text: str
    holds: Callable[[SupportContext], bool]
    reason: str | Callable[[SupportContext], str]

    def describe(self) -> str:
        return self.text

    def failure(self, ctx: SupportContext) -> str | None:
        if self.holds(ctx):
            return None
        return self.reason(ctx) if callable(self.reason) else self.reason
