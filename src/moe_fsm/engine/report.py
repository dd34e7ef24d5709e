"""The main job's printed report: what ran, where, how well, and where the traces are."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

from moe_fsm.engine.manifest import MANIFEST_NAME
from moe_fsm.engine.presets import ModelPreset


def render_header(model: ModelPreset, tokens: int, layers: Optional[int], device: str, platform, request, env,
                  extra: tuple[str, ...] = ()) -> str:
    set_vars = ", ".join(f"{k}={v}" for k, v in env.raw) or "none"
    count = min(layers or len(model.layers), len(model.layers))
    return "\n".join([
        f"moe-fsm run: {model.describe()}",
        f"  running {count} layer(s) on {tokens} tokens, device {device}",
        f"  platform: {platform.describe()}; libraries: {', '.join(sorted(l.value for l in platform.libraries)) or 'none'}"
        + (f" [not probed: MOE_FSM_PLATFORM={platform.probe_override}]" if platform.probe_override else ""),
        f"  backend request: {request.to_json()}; VLLM_* env set: {set_vars}",
        *extra,
        "",
    ])


def check_text(result) -> str:
    if result.nonfinite_rows:
        return f"FAIL ({result.nonfinite_rows} of {result.checked_rows} checked rows non-finite)"
    return "ok" if result.ok else f"FAIL (> {result.tolerance:.0e})"


def render_check_mode(options) -> str:
    rows = "every row" if options.check_rows is None else f"{options.check_rows} sampled rows per layer (--full-check: every row)"
    return (f"  float64 check: {rows}; time: median of {options.repeats} call(s); "
            "weights: one random draw per layer configuration")


def progress_line(done: int, total: int, name: str, result) -> str:
    """One line per finished layer, for logs (stderr is not a terminal)."""
    return (f"[{done}/{total}] {name}: {result.backend} ({result.kernel}) {result.time_ms:.2f} ms, "
            f"rel err {result.rel_error:.2e} {check_text(result)}")


def render_results(results, engine, trace_dir: Path) -> str:
    header = ("layer", "name", "family", "backend", "kernel", "prepare/finalize", "time ms", "rel err", "check")
    rows = [
        (
            str(r.index), r.name, r.family, r.backend, r.kernel, r.prepare_finalize,
            f"{r.time_ms:.2f}", f"{r.rel_error:.2e}", check_text(r),
        )
        for r in results
    ]
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
    failed = [r for r in results if not r.ok]
    by_backend: dict[str, int] = {}
    for r in results:
        key = f"{r.family}: {r.backend} ({r.kernel})"
        by_backend[key] = by_backend.get(key, 0) + 1
    lines.append("")
    lines.append(
        f"{len(results) - len(failed)}/{len(results)} layers within tolerance of the float64 reference; "
        f"{engine.distinct_decisions} distinct decision(s) for {len(results)} layers"
    )
    nonfinite = [r for r in results if r.nonfinite_rows]
    if nonfinite:
        lines.append(
            f"NON-FINITE OUTPUTS in {len(nonfinite)} layer(s) (NaN/Inf where the float64 reference is finite), first: "
            f"layer {nonfinite[0].index} ({nonfinite[0].name}), {nonfinite[0].nonfinite_rows} row(s)"
        )
    for key, count in sorted(by_backend.items()):
        lines.append(f"  {count:3d} x {key}")
    lines.append(f"traces: {trace_dir}/ (one JSON per distinct decision; {MANIFEST_NAME} maps each layer to its file, "
                 f"with this run's results: `moe-fsm explain {trace_dir}/{MANIFEST_NAME} --layer N` tells layer N's story)")
    return "\n".join(lines)


def make_progress():
    """A bar on a terminal; otherwise one line per layer on stderr (what a log file needs)."""
    return ProgressBar() if sys.stderr.isatty() else ProgressLines()


class ProgressBar:
    """A one-line progress bar on stderr, for terminals."""

    def __init__(self, width: int = 30) -> None:
        self.width = width

    def __call__(self, done: int, total: int, label: str, result=None) -> None:
        filled = self.width * done // max(total, 1)
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (self.width - filled)}] {done}/{total} {label[:48]:<48}")
        sys.stderr.flush()

    def done(self) -> None:
        sys.stderr.write("\r" + " " * (self.width + 60) + "\r")
        sys.stderr.flush()


class ProgressLines:
    """One line per finished layer on stderr: redirected output still shows the job moving."""

    def __call__(self, done: int, total: int, label: str, result=None) -> None:
        print(progress_line(done, total, label, result), file=sys.stderr, flush=True)

    def done(self) -> None:
        pass
