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
import re
import tempfile
import time
from pathlib import Path

SCHEMA_ID = "moe-fsm/decision-trace"
SCHEMA_VERSION = 1


def build_document(*, inputs: dict, family: str, path: list[str], events: list[dict], outcome: dict,
                   layer_name: str | None, started_at: float, duration_us: float) -> dict:
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
        "volatile": {
            "started_at": round(started_at, 6),
            "duration_us": round(duration_us, 1),
            "host": host_platform.node(),
            "pid": os.getpid(),
            "moe_fsm_version": __version__,
            "python": host_platform.python_version(),
        },
    }


def canonical(document: dict) -> dict:
    """The document without its volatile part: what golden traces and replays compare."""
    return {k: v for k, v in document.items() if k != "volatile"}


def dumps(document: dict, *, include_volatile: bool = True) -> str:
    doc = document if include_volatile else canonical(document)
    return json.dumps(doc, indent=2, sort_keys=True, allow_nan=False) + "\n"  # strict JSON: no NaN/Infinity


def write_atomic(path: Path, text: str) -> Path:
    """Write through a temporary file and rename, so a reader never sees half a trace.

    The file gets the mode an ordinary ``open(path, "w")`` would (0666 less the
    umask), not the temporary file's 0600. The temporary name carries the
    writer's pid (``.NAME.tmpPID.XXXX``), so :func:`remove_stale_temp_files` can
    tell a killed writer's leftovers from a live writer's file.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}{_TEMP_MARK}{os.getpid()}.", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


_TEMP_MARK = ".tmp"
_TEMP_NAME = re.compile(r"^\..+\.tmp(\d+)\.[^.]+$")


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def remove_stale_temp_files(directory: str | os.PathLike) -> list[Path]:
    """Remove the temporary files of writers that died mid-write (SIGKILL); returns what was removed.

    A temporary file is stale when the pid in its name is no longer running
    here, or when it is older than an hour (a pid reused since, or another host).
    """
    directory = Path(directory)
    if not directory.is_dir():
        return []
    removed = []
    for entry in directory.iterdir():
        match = _TEMP_NAME.match(entry.name)
        if match is None or not entry.is_file():
            continue
        try:
            stale = not _running(int(match.group(1))) or time.time() - entry.stat().st_mtime > 3600
            if stale:
                entry.unlink()
                removed.append(entry)
        except OSError:
            continue  # gone meanwhile, or not ours to remove
    return removed


def _running(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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
