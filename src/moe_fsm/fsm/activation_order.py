"""Backend lists narrowed and ordered by the checkpoint's activation key (vLLM 0.33's newer oracles).

Shared by the auto scan (``steps.py``) and the named alternatives of
``candidate_steps.py``, so it sits below both.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_fsm.backends.specs import LAYER_ACTIVATION


def activation_key_text(key) -> str:
    """An activation key in messages: None stands for 16-bit activations."""
    return "none (16-bit)" if key is None else str(key)


@dataclass(frozen=True)
class ActivationOrder:
    """vLLM's ``_filter_by_activation``: which backends a checkpoint's activation key may use, in what order.

    With a requested key: the backends whose activation key equals it (and those
    that take the layer's own key), then the 16-bit ones; without one: the 16-bit
    ones if there are any, else the list unchanged. ``sixteen_bit_fallback=False``
    (vLLM 0.31): with a requested key, only the matching backends (no 16-bit ones after them).
    """

    sixteen_bit_fallback: bool = True

    def apply(self, run, backends: list[str]) -> list[str]:
        wanted = run.ctx.layer.quant.activation
        keys = {b: run.registry.spec(run.policy.family, b).activation_key for b in backends}
        # a backend that takes the layer's key counts as 16-bit too (vLLM's _backend_activation_key says None)
        sixteen_bit = [b for b in backends if keys[b] is None or keys[b] is LAYER_ACTIVATION]
        if wanted is not None:
            matching = [b for b in backends if keys[b] == wanted or keys[b] is LAYER_ACTIVATION]
            ordered = matching + ([b for b in sixteen_bit if b not in matching] if self.sixteen_bit_fallback else [])
        else:
            ordered = sixteen_bit or list(backends)
        if ordered != list(backends) and run.rec.enabled:
            dropped = [b for b in backends if b not in ordered]
            text = (f"activations {activation_key_text(wanted)} requested: " if wanted is not None else "no activation quantization "
                    "requested: ") + (("matching variants first, then 16-bit ones" if self.sixteen_bit_fallback else "matching variants only")
                                                                     if wanted is not None else "16-bit variants only")
            run.rec.emit("note", text=text + (f"; left out: {', '.join(dropped)}" if dropped else ""))
        return ordered
