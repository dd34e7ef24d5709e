"""The run manifest: which run wrote which trace files of a trace directory, and what it found.

Several runs may share one trace directory (the default is ``moe-fsm-traces/``),
one at a time (``trace.dir_lock``: a second run while one writes is refused).
A run writes one trace per distinct decision, named after the first layer that
got it, so a later run overwrites some of an earlier run's files and leaves
others; ``run.manifest`` says which files the last run wrote, maps each layer
to its trace (``layers[i].trace_files``, one per rank; ``traces``: each file's
layers), with its command, settings and each layer's result, and lists the
trace files it found there from earlier runs (``moe_fsm.trace.manifest`` reads it
for ``explain`` / ``replay DIR/run.manifest --layer N``). Its content is JSON; its name
is not *.json, so `moe-fsm explain DIR/*.json` still reads only traces.
"""

from __future__ import annotations

import math
import os
import stat
import time
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Iterable, Sequence

from moe_fsm.trace.manifest import RUN_MANIFEST_NAME as MANIFEST_NAME  # JSON, not *.json: `explain DIR/*.json` takes traces
from moe_fsm.trace.manifest import RUN_MANIFEST_SCHEMA as MANIFEST_SCHEMA
from moe_fsm.trace.manifest import trace_groups


def write_manifest(
    trace_dir: Path,
    *,
    argv: Sequence[str],
    preset: str,
    tokens: int,
    seed: int,
    check_rows,
    repeats: int,
    world_size: int,
    started_at: float,
    results: Iterable,
    trace_files: Sequence[Sequence[Path]],
) -> Path:
    """Write ``trace_dir/run.manifest``; ``trace_files[i]`` are layer i's files (one per rank), shared by layers
    that decided alike."""
    import json

    from moe_fsm.trace.document import write_atomic

    trace_dir = Path(trace_dir)
    results = list(results)
    ours = {Path(p).name for files in trace_files for p in files}
    earlier = _earlier_traces(trace_dir, ours, started_at)
    document = {
        "schema": MANIFEST_SCHEMA,
        "schema_version": 1,
        "run_id": uuid.uuid4().hex,
        "started_at": round(started_at, 3),
        "finished_at": round(time.time(), 3),
        "pid": os.getpid(),
        "command": list(argv),
        "preset": preset,
        "tokens": tokens,
        "seed": seed,
        "check_rows": check_rows,
        "repeats": repeats,
        "world_size": world_size,
        "ok": all(r.ok for r in results),
        "layers": [
            {**_finite(asdict(r)), "ok": r.ok, "trace_files": [Path(p).name for p in files]}
            for r, files in zip(results, trace_files)
        ],
        "traces": trace_groups((r.name, Path(files[0]).name if files else None) for r, files in zip(results, trace_files)),
        "earlier_files": earlier,
    }
    return write_atomic(trace_dir / MANIFEST_NAME, json.dumps(document, indent=2, sort_keys=True, allow_nan=False) + "\n")


def _earlier_traces(trace_dir: Path, ours: set[str], started_at: float) -> list[str]:
    """The trace files (regular ``*.json``) an earlier run left in ``trace_dir``; anything else there is not one."""
    earlier = []
    for path in trace_dir.glob("*.json"):
        try:
            facts = path.stat()
        except OSError:
            continue  # a dangling symlink, or removed meanwhile
        if path.name not in ours and stat.S_ISREG(facts.st_mode) and facts.st_mtime < started_at:
            earlier.append(path.name)
    return sorted(earlier)


def _finite(row: dict) -> dict:
    """Strict JSON has no NaN or Infinity: such a figure is recorded as null."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
