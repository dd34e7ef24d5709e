"""The decision trace as one JSON document.

Everything that decides the outcome is in ``inputs``, so the document alone
replays the decision on another machine. Fields that change from run to run
(time, duration, host, versions) live under ``volatile`` and are left out of
the canonical form, so two runs of the same inputs give byte-identical traces.
"""

from __future__ import annotations

import errno
import json
import math
import os
import platform as host_platform
import re
import stat
import sys
import tempfile
import time
from functools import lru_cache
from pathlib import Path

from moe_fsm.errors import TraceWriteError

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
    return json.dumps(doc, indent=2, sort_keys=True, allow_nan=False) + "\n"  # strict JSON: no NaN/Infinity


def write_atomic(path: Path, text: str) -> Path:
    """Write through a temporary file and rename, so a reader never sees half a trace.

    Every file moe-fsm writes where a user says (traces, manifests, golden files,
    ``diagram --update``, tuned config tables) goes through here, and only into a
    new path or a regular file: a device, FIFO, socket or directory standing at
    ``path`` is refused (TraceWriteError) rather than replaced by a regular file.
    A symlink is written through: its target gets the text, the link stays.

    The file gets the mode an ordinary ``open(path, "w")`` would (0666 less the
    umask), not the temporary file's 0600. The temporary file is named
    ``.moe-fsm-tmp.PID.NAME.XXXX``: a prefix only moe-fsm uses, so
    :func:`remove_stale_temp_files` never takes a user's file for one, and the
    writer's pid, so it can tell a killed writer's leftovers from a live writer's.
    """
    path = target = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)  # the user's path; never the missing folders of a link's target
        target = _write_target(path)
        fd, tmp = tempfile.mkstemp(prefix=f"{TEMP_PREFIX}{os.getpid()}.{target.name[:NAME_MAX_KEPT]}.", dir=target.parent)
    except TraceWriteError:
        raise
    except OSError as err:
        raise write_error(path, err, target) from None
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.replace(tmp, target)
    except BaseException as err:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(err, OSError):
            raise write_error(path, err, target) from None
        raise
    return path


def _write_target(path: Path) -> Path:
    """The file a write to ``path`` replaces: ``path`` itself, or the file its symlink names (the link stays).

    TraceWriteError when something other than a regular file stands there.
    """
    target = Path(os.path.realpath(path)) if path.is_symlink() else path
    try:
        mode = os.stat(target).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return target  # a new file (a parent that is a file is named when the write fails)
    if not stat.S_ISREG(mode):
        via = f" (the target of symlink {path})" if target != path else ""
        raise TraceWriteError(f"cannot write {target}{via}: it is {file_kind(mode)}, not a regular file; "
                              f"moe-fsm writes only to a regular file or a new path")
    return target


def file_kind(mode: int) -> str:
    """What a file of this ``st_mode`` is, in words (for errors about files that are not regular)."""
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
             (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link"))
    return next((words for test, words in kinds if test(mode)), "not a regular file")


NAME_MAX_KEPT = 200  # of a file name, in its temporary name (which adds about 30 characters)


def write_error(path: Path, err: OSError, link_target: Path | None = None) -> TraceWriteError:
    """The TraceWriteError for an OSError met while writing ``path`` (through a symlink to ``link_target``):
    its reason, in words that name the culprit."""
    reason = err.strerror or str(err)
    if err.errno == errno.ENAMETOOLONG:
        longest = max(Path(path).parts, key=len)
        what = "the file name" if longest == Path(path).name else "a directory name in it"
        reason += f" ({what} has {len(longest)} characters)"
    elif err.errno == errno.ENOTDIR or (err.errno == errno.EEXIST and not path.parent.is_dir()):
        reason = f"{_first_file_ancestor(path)} is a file, not a directory"
    if link_target is not None and link_target != path:
        reason += f" (writing through the symlink to {link_target})"
    error = TraceWriteError(f"cannot write {path}: {reason}")
    error.errno = err.errno
    return error


def _first_file_ancestor(path: Path) -> Path:
    for parent in reversed(path.parents):
        if parent.exists() and not parent.is_dir():
            return parent
    return path.parent


TEMP_PREFIX = ".moe-fsm-tmp."  # only moe-fsm's temporary files start so
_TEMP_NAME = re.compile(r"^\.moe-fsm-tmp\.(\d{1,9})\.")  # the pid: 9 digits at most, so it is a valid pid_t


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def remove_stale_temp_files(directory: str | os.PathLike) -> list[Path]:
    """Remove the temporary files of moe-fsm writers that died mid-write (SIGKILL); returns what was removed.

    Only regular files named with moe-fsm's own prefix (``.moe-fsm-tmp.PID.``) are
    candidates; any other name is the user's and stays. One is stale when its pid is
    no longer running here, or when it is older than an hour (a pid reused since, or
    another host).
    """
    directory = Path(directory)
    try:
        entries = list(directory.iterdir())
    except OSError:
        return []  # no directory yet (or none that can be listed): nothing of ours to clean
    removed = []
    for entry in entries:
        match = _TEMP_NAME.match(entry.name)
        if match is None:
            continue
        try:
            facts = entry.lstat()
            if not stat.S_ISREG(facts.st_mode):
                continue
            if not _running(int(match.group(1))) or time.time() - facts.st_mtime > 3600:
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


MAX_FILE_BYTES = 4 << 20  # traces are tens of kB; validating one takes about 4 s per MB


def read_text(path: str | os.PathLike, what: str, max_bytes: int = MAX_FILE_BYTES) -> str:
    """The UTF-8 text of a file the user named; InputError for anything else (a directory, a device, binary, too big).

    Only a regular file is opened: a FIFO would block the read until a writer
    came, and opening a device can act on it, so either is refused from its
    ``stat`` (and, should one be swapped in meanwhile, from the opened file's,
    opened without blocking).
    """
    from moe_fsm.errors import InputError

    path = Path(path)
    if "\0" in str(path):
        raise InputError(f"{what} {str(path)!r} is not a file name (it holds a NUL character)")
    try:
        _require_regular(os.stat(path).st_mode, path, what)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as handle:
            _require_regular(os.fstat(fd).st_mode, path, what)
            data = handle.read(max_bytes + 1)
    except FileNotFoundError:
        raise InputError(f"{what} {path} does not exist") from None
    except OSError as err:
        raise InputError(f"cannot read {what} {path}: {err.strerror or err}") from None
    if len(data) > max_bytes:
        raise InputError(f"{what} {path} is larger than {max_bytes >> 20} MiB, the most moe-fsm reads")
    if data[:2] in (b"\xff\xfe", b"\xfe\xff"):
        raise InputError(f"{what} {path} is UTF-16 text (it starts with a UTF-16 byte-order mark); moe-fsm reads UTF-8: "
                         f"convert it, e.g. iconv -f UTF-16 -t UTF-8")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise InputError(f"{what} {path} is not UTF-8 text (byte {err.start}): a binary file?") from None


def _require_regular(mode: int, path: Path, what: str) -> None:
    from moe_fsm.errors import InputError

    if stat.S_ISDIR(mode):
        raise InputError(f"{what} {path} is a directory, not a file")
    if not stat.S_ISREG(mode):
        raise InputError(f"{what} {path} is {file_kind(mode)}, not a regular file; moe-fsm reads only regular files")


def parse_json(text: str, what: str, *, non_finite: bool = False, not_json_hint: str = ""):
    """The JSON value of ``text`` (read from ``what``); InputError when it is not JSON moe-fsm can read.

    Every JSON file a user hands moe-fsm (traces, manifests, --input specs, model configs) is parsed
    here. ``non_finite``: accept NaN and Infinity as Python's json writes them (model configs may hold
    them; moe-fsm's own files never do). ``not_json_hint`` is added to the not-valid-JSON message.
    """
    from moe_fsm.errors import InputError

    try:
        data = json.loads(text, parse_constant=None if non_finite else _not_json,
                          parse_float=None if non_finite else _finite_float)
    except json.JSONDecodeError as err:
        raise InputError(f"{what} is not valid JSON: {err}{not_json_hint}") from None
    except RecursionError:
        raise InputError(f"{what} nests arrays or objects too deeply to be a moe-fsm file") from None
    except ValueError:  # json's only other error: an integer past Python's int max str digits (4300)
        raise _huge_integer(what, f" of more than {_int_digit_limit()} digits") from None
    _refuse_huge_integers(data, what)
    return data


def parse_toml(text: str, what: str) -> dict:
    """The tables of TOML ``text`` (read from ``what``); InputError when it is not TOML moe-fsm can read.

    Every TOML file a user hands moe-fsm (--input specs, golden scenarios) is parsed here.
    """
    import tomllib

    from moe_fsm.errors import InputError

    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise InputError(f"{what} is not valid TOML: {err}") from None
    except RecursionError:
        raise InputError(f"{what} nests tables or arrays too deeply") from None
    except ValueError:  # tomllib's only other error: a decimal integer past Python's int max str digits (4300)
        raise _huge_integer(what, f" of more than {_int_digit_limit()} digits") from None
    _refuse_huge_integers(data, what)
    return data


def _int_digit_limit() -> int:
    return sys.get_int_max_str_digits() or sys.int_info.default_max_str_digits


def _huge_integer(what: str, which: str):
    from moe_fsm.errors import InputError

    return InputError(f"{what} holds an integer{which}, past the range of a float (about 1.8e308); no moe-fsm input has one")


def _refuse_huge_integers(data, what: str) -> None:
    """Refuse an integer no float can hold, wherever it stands in ``data``.

    Such a number would fail later, where a size or a limit is compared as a float (OverflowError), or
    named in a message (one past 4300 digits cannot be printed; TOML's 0x/0o/0b integers are read
    whatever their length). The walks keep explicit stacks: a document nested as deep as the parser
    allows must not exhaust Python's. The first is bare (a model config can hold 10^6 values: 0.2 s);
    the second, run only for a refusal, finds where the integer stands.
    """
    if not _holds_huge_integer(data):
        return
    pending = [("", data)]
    while pending:
        where, value = pending.pop()
        if type(value) is dict:
            pending.extend((_key_path(where, key), item) for key, item in value.items())
        elif type(value) is list:
            pending.extend((f"{where}[{index}]", item) for index, item in enumerate(value))
        elif _holds_huge_integer(value):
            raise _huge_integer(what, where and f" at {where if len(where) <= 80 else where[:77] + '...'}")


_PLAIN_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")


def _key_path(where: str, key: str) -> str:
    """``layer.experts``; a key that is not a plain name as ``[repr]``, so no character of it acts or starts a line."""
    if _PLAIN_KEY.fullmatch(key):
        return f"{where}.{key}" if where else key
    return f"{where}[{key!r}]"


def _holds_huge_integer(data) -> bool:
    limit = sys.float_info.max
    pending = [data]
    while pending:
        value = pending.pop()
        kind = type(value)  # json and tomllib make plain dicts, lists and ints (and bools, which are no integers here)
        if kind is dict:
            pending.extend(value.values())
        elif kind is list:
            pending.extend(value)
        elif kind is int and not -limit <= value <= limit:
            return True
    return False


def _not_json(constant: str):
    raise json.JSONDecodeError(f"{constant} is not a JSON value (strict JSON has no NaN or Infinity)", constant, 0)


def _finite_float(literal: str) -> float:
    """A JSON number past a float's range (``1e999``) would read as infinity, which moe-fsm's files never hold."""
    value = float(literal)
    if value in (math.inf, -math.inf):
        raise json.JSONDecodeError(f"{literal} is past a float's range (it would read as infinity; moe-fsm's files "
                                   "hold finite numbers)", literal, 0)
    return value


def load(path: str | os.PathLike) -> dict:
    from moe_fsm.errors import InputError

    document = parse_json(read_text(path, "trace file"), f"trace file {path}")
    if not isinstance(document, dict) or document.get("schema") != SCHEMA_ID:
        raise InputError(f"{path} is not a moe-fsm decision trace (schema {SCHEMA_ID!r} expected)")
    if document.get("schema_version") != SCHEMA_VERSION:
        raise InputError(
            f"{path} has trace schema version {document.get('schema_version')!r}; this moe-fsm reads version {SCHEMA_VERSION}"
        )
    return document


def now() -> float:
    return time.time()
