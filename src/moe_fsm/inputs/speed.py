"""A measured speed table: how fast each candidate experts kernel ran, per layer shape and token count, on one device.

The ``fastest-*`` profiles order the candidates their base profile would accept by these figures
(``fsm/measured_steps.py``). The table is an input like the platform facts: read once at the edge (a JSON file
given by ``--speed-table PATH``, or the one ``moe-fsm measure`` wrote for this device in the user's config
directory), validated into this immutable object, and recorded whole in the trace (with its SHA-256), so a trace
replays the same choice on any machine. Nothing here imports torch or measures anything.

The file::

    {"format": "moe-fsm speed table 1",
     "device": "NVIDIA H100 80GB HBM3",
     "measured": {"date": "2026-11-27", "moe_fsm_version": "0.1.0", "command": "moe-fsm measure ...",
                  "method": "CUDA graphs, median of 50 replays"},
     "shapes": {"E=128,N=768,K=2048,topk=8,dtype=bfloat16,quant=unquantized":
                  {"tokens": {"1": {"TRITON": 21.4, "TORCH_GROUPED_MM": 35.0}, "128": {...}},
                   "ran": {"TRITON": "moe_fsm.experts.triton_experts:TritonExperts", ...}}}}

A shape key (``shape_key``) names the layer shard one GPU runs: experts, intermediate size N, hidden size K,
top-k, activation dtype and quantization scheme. Figures are median microseconds of one experts call at that
token count; candidates are the profile's backend names (``TRITON``, ``FLASHINFER_CUTLASS``, ``TORCH_GROUPED_MM``,
...); ``ran`` says which implementation ran under each (the decided kernel, or its stand-in).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from moe_fsm.errors import InputError
from moe_fsm.inputs.hashing import computed_once, hashed_once

FORMAT = "moe-fsm speed table 1"
TABLE_DIR_VAR = "MOE_FSM_SPEED_TABLE_DIR"
_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")
_CANDIDATE = re.compile(r"^[A-Z][A-Z0-9_]*$")
_MEASURED_FIELDS = ("date", "moe_fsm_version", "command", "method")
_TOP_FIELDS = ("format", "device", "measured", "shapes", "source", "sha256")


def shape_key(layer, parallel) -> str:
    """The table key of the shard of ``layer`` one GPU runs under ``parallel`` (vLLM's split: whole experts per
    rank with expert parallelism, else every expert with N cut over the tp x dp ranks)."""
    experts, n = layer.num_experts, layer.intermediate_size
    if parallel.use_ep:
        experts = math.ceil(experts / parallel.ep_size)
    else:
        n //= parallel.tp_size * parallel.dp_size
    return (f"E={experts},N={n},K={layer.hidden_size},topk={layer.top_k},dtype={layer.dtype},"
            f"quant={layer.quant.describe()}")


@dataclass(frozen=True)
class Measurement:
    """How the table was measured: when, with which moe-fsm, by which command and method."""

    date: str
    moe_fsm_version: str
    command: str
    method: str

    def to_json(self) -> dict:
        return {"date": self.date, "moe_fsm_version": self.moe_fsm_version, "command": self.command,
                "method": self.method}


@hashed_once
@dataclass(frozen=True)
class SpeedTable:
    """One device's measured figures. ``shapes``: (shape key, ((tokens, ((candidate, µs), ...)), ...), ran)
    tuples, sorted, so equal tables compare and hash equal; ``source``: the file it was read from."""

    device: str
    measured: Measurement
    shapes: tuple[tuple[str, tuple[tuple[int, tuple[tuple[str, float], ...]], ...], tuple[tuple[str, str], ...]], ...]
    source: str

    def figures(self, key: str) -> dict[int, dict[str, float]] | None:
        """Token count -> candidate -> median µs for a shape key; None when the table has no entry for it."""
        for shape, points, _ in self.shapes:
            if shape == key:
                return {tokens: dict(row) for tokens, row in points}
        return None

    def ran(self, key: str) -> dict[str, str]:
        for shape, _, ran in self.shapes:
            if shape == key:
                return dict(ran)
        return {}

    @property
    def shape_keys(self) -> tuple[str, ...]:
        return tuple(shape for shape, _, _ in self.shapes)

    @computed_once
    def sha256(self) -> str:
        """The digest of the table's content (not of where it was read from)."""
        body = json.dumps(self._content(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(body.encode()).hexdigest()

    def _content(self) -> dict:
        return {
            "format": FORMAT,
            "device": self.device,
            "measured": self.measured.to_json(),
            "shapes": {shape: {"tokens": {str(t): dict(row) for t, row in points},
                               **({"ran": dict(ran)} if ran else {})}
                       for shape, points, ran in self.shapes},
        }

    @computed_once
    def to_json(self) -> dict:
        """The trace's ``inputs.speed_table``: the whole table, where it came from and its digest."""
        return {**self._content(), "source": self.source, "sha256": self.sha256()}

    @classmethod
    def from_json(cls, data, source: str | None = None) -> "SpeedTable":
        """A table from its JSON form (a file's, or a trace's with ``source`` and ``sha256``); InputError naming the
        first field that is wrong and what is accepted."""
        where = f"speed table {source}" if source else "speed table"
        if not isinstance(data, dict):
            raise InputError(f"{where} must be a JSON object with {list(_TOP_FIELDS[:4])}, got {type(data).__name__}")
        unknown = sorted(set(data) - set(_TOP_FIELDS))
        if unknown:
            raise InputError(f"{where}: unknown field(s) {unknown}; accepted: {list(_TOP_FIELDS)}")
        if data.get("format") != FORMAT:
            raise InputError(f"{where}: 'format' must be {FORMAT!r}, got {data.get('format')!r}")
        device = data.get("device")
        if not isinstance(device, str) or not device.strip():
            raise InputError(f"{where}: 'device' must name the device it was measured on (as torch names it, "
                             f"e.g. 'NVIDIA H100 80GB HBM3'), got {device!r}")
        measured = _measurement(data.get("measured"), where)
        shapes = data.get("shapes")
        if not isinstance(shapes, dict) or not shapes:
            raise InputError(f"{where}: 'shapes' must be a non-empty object of shape key -> figures, got {shapes!r:.80}")
        parsed = tuple(sorted(_shape(key, value, where) for key, value in shapes.items()))
        recorded_source = data.get("source")
        if recorded_source is not None and not isinstance(recorded_source, str):
            raise InputError(f"{where}: 'source' must be the path it was read from, got {recorded_source!r}")
        table = cls(device, measured, parsed, source if source is not None else (recorded_source or "(inline)"))
        digest = data.get("sha256")
        if digest is not None and digest != table.sha256():
            raise InputError(f"{where}: 'sha256' {digest!r} does not match its content ({table.sha256()}); "
                             "the figures were edited after it was recorded")
        return table


def _measurement(data, where: str) -> Measurement:
    if not isinstance(data, dict):
        raise InputError(f"{where}: 'measured' must be an object with {list(_MEASURED_FIELDS)}, got {data!r:.80}")
    unknown = sorted(set(data) - set(_MEASURED_FIELDS))
    if unknown:
        raise InputError(f"{where}: unknown field(s) {unknown} in 'measured'; accepted: {list(_MEASURED_FIELDS)}")
    for name in _MEASURED_FIELDS:
        if not isinstance(data.get(name), str) or not data[name].strip():
            raise InputError(f"{where}: 'measured.{name}' must be a non-empty string, got {data.get(name)!r}")
    if not _DATE.match(data["date"]):
        raise InputError(f"{where}: 'measured.date' must be YYYY-MM-DD, got {data['date']!r}")
    return Measurement(*(data[name] for name in _MEASURED_FIELDS))


def _shape(key, value, where: str):
    if not isinstance(key, str) or not key.startswith("E="):
        raise InputError(f"{where}: shape key {key!r} must look like 'E=128,N=768,K=2048,topk=8,dtype=bfloat16,"
                         "quant=unquantized' (moe-fsm measure writes them)")
    at = f"{where}: shapes[{key!r}]"
    if not isinstance(value, dict) or set(value) - {"tokens", "ran"} or not isinstance(value.get("tokens"), dict):
        raise InputError(f"{at} must be an object with 'tokens' (token count -> candidate -> µs) and optionally "
                         f"'ran', got {value!r:.80}")
    points = []
    for tokens_text, row in value["tokens"].items():
        if not (isinstance(tokens_text, str) and tokens_text.isdigit() and int(tokens_text) > 0):
            raise InputError(f"{at}.tokens: {tokens_text!r} is not a positive token count")
        if not isinstance(row, dict) or not row:
            raise InputError(f"{at}.tokens[{tokens_text!r}] must be a non-empty object of candidate -> µs")
        figures = []
        for candidate, us in row.items():
            if not _CANDIDATE.match(candidate):
                raise InputError(f"{at}.tokens[{tokens_text!r}]: {candidate!r} is not a backend name "
                                 "(upper case, as the profile names it: TRITON, TORCH_GROUPED_MM, ...)")
            if isinstance(us, bool) or not isinstance(us, (int, float)) or not (math.isfinite(us) and us > 0):
                raise InputError(f"{at}.tokens[{tokens_text!r}].{candidate} must be a positive number of "
                                 f"microseconds, got {us!r}")
            figures.append((candidate, float(us)))
        points.append((int(tokens_text), tuple(sorted(figures))))
    if not points:
        raise InputError(f"{at}.tokens is empty: measure at least one token count")
    ran = value.get("ran", {})
    if not isinstance(ran, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in ran.items()):
        raise InputError(f"{at}.ran must map candidate -> the implementation that ran, got {ran!r:.80}")
    return key, tuple(sorted(points)), tuple(sorted(ran.items()))


def read_speed_table(path: str | os.PathLike, source: str | None = None) -> SpeedTable:
    """Read and validate a table file; InputError naming the file and what is wrong. ``source``: how the trace
    names the file (default: the path as given; golden scenarios name it relative to the repository)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise InputError(f"speed table {path}: cannot be read ({err.strerror or err})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise InputError(f"speed table {path}: not JSON (line {err.lineno}: {err.msg})") from None
    return SpeedTable.from_json(data, source=source or str(path))


def table_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """Where ``moe-fsm measure`` writes and the ``fastest`` profiles look: ``$MOE_FSM_SPEED_TABLE_DIR``, else
    ``$XDG_CONFIG_HOME/moe_fsm/speed``, else ``~/.config/moe_fsm/speed``."""
    if environ.get(TABLE_DIR_VAR):
        return Path(environ[TABLE_DIR_VAR])
    base = environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "moe_fsm" / "speed"


def table_file_name(device_name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia_h100_80gb_hbm3.json'."""
    return re.sub(r"[^a-z0-9]+", "_", device_name.lower()).strip("_") + ".json"


def table_for_device(device_name: str, environ: Mapping[str, str] = os.environ) -> SpeedTable | None:
    """The table measured for this device in the user's config directory, or None when there is none."""
    path = table_dir(environ) / table_file_name(device_name)
    return read_speed_table(path) if path.is_file() else None


def speed_table_from_spec(value) -> SpeedTable | None:
    """The spec language's ``speed_table``: a path to a table file, a table (a trace's record), or None / false
    (none given)."""
    if value is None or value is False or isinstance(value, SpeedTable):
        return value or None
    if isinstance(value, (str, os.PathLike)):
        return read_speed_table(value)
    if isinstance(value, dict):
        return SpeedTable.from_json(value)
    raise InputError(f"speed_table must be a path to a table file or a table object, got {type(value).__name__}")
