"""Selection by measured speed: a step that orders the candidates a profile accepts by a measured table.

An engine's oracle picks the first backend of a fixed priority list that supports the layer. A ``fastest``
profile (``profiles/fastest_vllm_0_33``) keeps every rule of its base profile — the earlier steps (LoRA,
an explicit backend, env overrides) and each backend's support checks — and puts ``MeasuredScan`` just before
the base's auto scan. Its guard holds when the decision's speed table (``inputs/speed.py``) was measured on this
device and has figures for this layer's shape; otherwise the machine goes on to the base's auto scan, which
decides exactly as the base profile, and the guard's record says why.

Entered, the step asks every candidate of the base's scan (plus ``measured_extras``: backends the base never
scans on its own, such as moe-fsm's TORCH_GROUPED_MM) for its verdict, takes the base's choice (the first
supported in the base's order) as the reference, and selects the supported candidate with the lowest geometric
mean over the token counts measured for the base's choice, among those no slower than it at any of them. So the
choice is never slower than the base's at a measured point, and the base's choice wins ties (then the scan
order decides). When the base's choice has no figure, the step selects it and says so. The ``measured`` event
records every figure used, the table's file, digest, device and date.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moe_fsm.fsm.steps import Step
from moe_fsm.inputs.speed import shape_key


@dataclass(frozen=True, eq=False)
class MeasuredScan(Step):
    """The base policy's auto scan (``base_step``), ordered by the measured table where it has this layer."""

    base_step: str = "auto_scan"
    measured_extras: tuple[str, ...] = ()

    def guard(self, run) -> bool:
        table = run.speed_table
        device = run.ctx.platform.device_name
        key = shape_key(run.ctx.layer, run.ctx.parallel)
        inputs = {"device": device, "shape": key}
        if table is None:
            result, why = False, "no speed table was given (--speed-table PATH, or moe-fsm measure's table for this device)"
        elif table.device != device:
            result, why = False, f"the speed table was measured on {table.device!r}, not on this device"
        elif table.figures(key) is None:
            result, why = False, "the speed table has no entry for this shape"
        else:
            result, why = True, "the speed table has figures for this device and shape"
        if run.rec.enabled:
            if table is not None:
                inputs["table"] = table.source
            run.record_guard(self, "speed_table", {**inputs, "reason": why}, result)
        return result

    def act(self, run) -> None:
        base = run.policy.step(self.base_step)
        order = base.scan_order(run)
        known = set(run.policy.backends) | {spec.name for spec in run.registry.extensions(run.policy.family)}
        extras = [b for b in self.measured_extras if b in known and b not in order and b not in run.pruned]
        verdicts = {backend: run.verdict(backend) for backend in (*order, *extras)}
        base_choice = next((b for b in order if verdicts[b].supported), None)
        if base_choice is None:
            base.conclude_unselected(run, [verdicts[b] for b in order])
            return
        table, key = run.speed_table, shape_key(run.ctx.layer, run.ctx.parallel)
        figures = table.figures(key)
        points = sorted(t for t, row in figures.items() if base_choice in row)
        rows, chosen, best = [], base_choice, None
        for position, backend in enumerate((*order, *extras)):
            row = self._row(backend, verdicts[backend].supported, figures, points, base_choice)
            rows.append(row)
            if row["eligible"] and (best is None or (row["geomean_us"], position) < best):
                chosen, best = backend, (row["geomean_us"], position)
        if not points:
            because = (f"the base profile's choice {base_choice} has no figure for this shape: "
                       "decided as the base profile")
        elif chosen == base_choice:
            because = f"no supported candidate is faster than the base profile's choice {base_choice} at every measured token count"
        else:
            because = (f"{chosen} is no slower than the base profile's choice {base_choice} at every measured token "
                       f"count and fastest on their geometric mean")
        run.rec.emit("measured", table=table.source, sha256=table.sha256(), device=table.device,
                     date=table.measured.date, shape=key, tokens=points, base=base_choice, chosen=chosen,
                     figures=rows, because=because)
        run.select(verdicts[chosen])

    @staticmethod
    def _row(backend: str, supported: bool, figures, points, base_choice) -> dict:
        us = {str(t): figures[t][backend] for t in points if backend in figures[t]}
        if not supported:
            reason, eligible = "not supported here (the base profile's rules)", False
        elif not points:
            reason, eligible = ("the base profile's choice" if backend == base_choice else "not compared"), backend == base_choice
        elif len(us) < len(points):
            missing = [t for t in points if str(t) not in us]
            reason, eligible = f"no figure at {_counts(missing)}", False
        else:
            slower = [t for t in points if figures[t][backend] > figures[t][base_choice]]
            eligible = not slower
            reason = (f"slower than {base_choice} at {_counts(slower)}" if slower
                      else "the base profile's choice" if backend == base_choice else f"no slower than {base_choice}")
        complete = bool(points) and len(us) == len(points)
        mean = math.exp(sum(math.log(figures[t][backend]) for t in points) / len(points)) if complete else None
        return {"backend": backend, "supported": supported, "us": us,
                "geomean_us": None if mean is None else round(mean, 3), "eligible": eligible, "reason": reason}

    def guard_text(self) -> str:
        return "the speed table has figures for this device and layer shape"


def _counts(tokens: list[int]) -> str:
    """[1] -> '1 token'; [1, 128] -> '1 and 128 tokens'."""
    if tokens == [1]:
        return "1 token"
    *rest, last = map(str, tokens)
    return (", ".join(rest) + " and " + last if rest else last) + " tokens"
