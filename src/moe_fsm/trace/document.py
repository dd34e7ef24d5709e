"""The decision trace as one JSON document.

Everything that decides the outcome is in ``inputs``, so the document alone
replays the decision on another machine. Fields that change from run to run
(time, duration, host, versions) live under ``volatile`` and are left out of
the canonical form, so two runs of the same inputs give byte-identical traces.
"""

from __future__ import annotations

import json
import os
import platform as host_platform
import tempfile
import time
from functools import lru_cache
from pathlib import Path

SCHEMA_ID = "moe-fsm/decision-trace"
DEFAULT_TRACE_DIR = "moe-fsm-traces"  # where select and run write traces unless told otherwise
SCHEMA_VERSION = 1


def build_document(*, inputs: dict, family: str, path: list[str], events: list[dict], outcome: dict,
                   build: dict | None, layer_name: str | None, started_at: float, duration_us: float) -> dict:
    """``outcome`` is the decision (vLLM's, for the profile); ``build`` what moe-fsm can run of it here."""
    from moe_fsm import __version__

    return {
        "schema": SCHEMA_ID,
        "schema_version": SCHEMA_VERSION,
        "layer_name": layer_name,
        "family": family,
        "inputs": inputs,
        "path": path,
        "events": events,
        "outcome": outcome,
        "build": build,
        "volatile": {
            "started_at": round(started_at, 6),
            "duration_us": round(duration_us, 1),
            "pid": os.getpid(),
            **_process_facts(__version__),
        },
    }


@lru_cache(maxsize=1)
def _process_facts(version: str) -> dict:
    """host and versions: the same for every decision of a process, looked up once."""
    return {"host": host_platform.node(), "moe_fsm_version": version,
            "python": host_platform.python_version()}


def canonical(document: dict) -> dict:
    """The document without its volatile part: what golden traces and replays compare."""
    return {k: v for k, v in document.items() if k != "volatile"}


def dumps(document: dict, *, include_volatile: bool = True) -> str:
    doc = document if include_volatile else canonical(document)
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"


def write_atomic(path: Path, text: str) -> Path:
    """Write through a temporary file and rename, so a reader never sees half a trace."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def load(path: str | os.PathLike) -> dict:
    from moe_fsm.errors import InputError

    try:
        with open(path) as handle:
            document = json.load(handle)
    except FileNotFoundError:
        raise InputError(f"trace file {path} does not exist") from None
    except json.JSONDecodeError as err:
        raise InputError(f"trace file {path} is not JSON: {err}") from None
    if not isinstance(document, dict) or document.get("schema") != SCHEMA_ID:
        raise InputError(f"{path} is not a moe-fsm decision trace (schema {SCHEMA_ID!r} expected)")
    if document.get("schema_version") != SCHEMA_VERSION:
        raise InputError(
            f"{path} has trace schema version {document.get('schema_version')!r}; this moe-fsm reads version {SCHEMA_VERSION}"
        )
    return document


def now() -> float:
    return time.time()
