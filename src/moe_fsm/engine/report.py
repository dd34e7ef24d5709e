"""The main job's printed report: what ran, where, how well, and where the traces are."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from moe_fsm.engine.presets import ModelPreset


def render_header(model: ModelPreset, tokens: int, layers: Optional[int], device: str, platform, request, env) -> str:
    set_vars = ", ".join(f"{k}={v}" for k, v in env.raw) or "none"
    count = min(layers or len(model.layers), len(model.layers))
    return "\n".join([
        f"moe-fsm run: {model.describe()}",
        f"  running {count} layer(s) on {tokens} tokens, device {device}",
        f"  platform: {platform.describe()}; libraries: {', '.join(sorted(l.value for l in platform.libraries)) or 'none'}",
        f"  backend request: {request.to_json()}; VLLM_* env set: {set_vars}",
        "",
    ])


def render_results(results, engine, trace_dir: Path) -> str:
    header = ("layer", "name", "family", "backend", "kernel", "prepare/finalize", "time ms", "rel err", "check")
    rows = [
        (
            str(r.index), r.name, r.family, r.backend, r.kernel, r.prepare_finalize,
            f"{r.time_ms:.2f}", f"{r.rel_error:.2e}", "ok" if r.ok else f"FAIL (> {r.tolerance:.0e})",
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
    for key, count in sorted(by_backend.items()):
        lines.append(f"  {count:3d} x {key}")
    lines.append(f"traces: {trace_dir}/ (one JSON per layer; `moe-fsm explain {trace_dir}/<file>` tells its story)")
    return "\n".join(lines)
