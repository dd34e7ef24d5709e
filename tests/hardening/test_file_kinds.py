"""Issue 39, items 2 and 8 (the file parts): what stands at a path moe-fsm writes or reads.

A trace, manifest, golden file, ``diagram --update`` or tuned table is written only into a new path or a regular
file: a device, FIFO or socket there is refused with one line (exit 4) and stays what it was, and a symlink is
written through to its target. A file moe-fsm reads is opened only when it is a regular file (a FIFO would block
the read forever). Odd files in a trace or golden directory, a 300-character trace directory and a standard
output that cannot be written end in one line, never a traceback.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from moe_fsm.cli.main import main
from moe_fsm.errors import TraceWriteError

ROOT = Path(__file__).resolve().parents[2]
SELECT = ["select", "--platform", "cpu", "--no-env"]
RUN = ["run", "--layers", "1", "--tokens", "2", "--repeats", "1"]
CONFIG = ROOT / "tests" / "data" / "configs" / "qwen3-30b-a3b" / "config.json"
LAYER0_TRACE = "layer000-model.layers.0.mlp.experts.json"


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative names keep a socket's path under the 108 bytes bind() takes


def make_special(path: Path, kind: str) -> str:
    """Make a file of ``kind`` at ``path``; returns how moe-fsm's errors name that kind."""
    if kind == "fifo":
        os.mkfifo(path)
        return "is a FIFO (named pipe), not a regular file"
    if kind == "socket":
        server = socket.socket(socket.AF_UNIX)
        server.bind(os.path.relpath(path))
        server.close()  # the socket file stays
        return "is a socket, not a regular file"
    if kind == "chardev":
        if os.geteuid() != 0:
            pytest.skip("only root makes device files")
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))  # a second /dev/null
        return "is a character device, not a regular file"
    if kind == "link-to-fifo":
        os.mkfifo(path.with_name(path.name + ".target"))
        path.symlink_to(path.name + ".target")
        return "is a FIFO (named pipe), not a regular file"
    raise AssertionError(kind)


def kind_of(path: Path) -> str:
    mode = os.stat(path).st_mode
    return next(name for name, test in (("fifo", stat.S_ISFIFO), ("socket", stat.S_ISSOCK), ("chardev", stat.S_ISCHR),
                                        ("regular", stat.S_ISREG)) if test(mode))


# -- item 2: a write never replaces what is not a regular file --------------------------------------------------------


@pytest.mark.parametrize("kind", ["fifo", "socket", "chardev", "link-to-fifo"])
def test_a_trace_is_not_written_over_a_device_fifo_or_socket(tmp_path, capsys, kind):
    target = tmp_path / "out"
    message = make_special(target, kind)
    before = kind_of(target)
    code, _, err = run(capsys, *SELECT, "--trace-out", str(target))
    assert code == 4 and message in err and "writes only to a regular file or a new path" in err, err
    assert err.count("\n") == 1 and kind_of(target) == before
    assert target.is_symlink() == (kind == "link-to-fifo")


def _fifo_at(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(path)
    return path


@pytest.mark.parametrize("writer", ["run trace", "run manifest", "plan manifest"])
def test_every_command_that_writes_refuses_a_fifo_in_its_place(tmp_path, capsys, writer):
    directory = tmp_path / "traces"
    if writer == "run trace":
        fifo = _fifo_at(directory / LAYER0_TRACE)
        argv = [*RUN, "--trace-dir", str(directory)]
    elif writer == "run manifest":
        fifo = _fifo_at(directory / "run.manifest")
        argv = [*RUN, "--trace-dir", str(directory)]
    else:
        fifo = _fifo_at(directory / "plan.manifest")
        argv = ["plan", str(CONFIG), "--platform", "sm90", "--no-env", "--trace-dir", str(directory)]
    code, _, err = run(capsys, *argv)
    assert code == 4 and f"{fifo}: it is a FIFO (named pipe), not a regular file" in err, err
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_the_tuned_table_writer_refuses_a_fifo(tmp_path):
    from moe_fsm.kernels.triton_moe.config import config_file_name, write_user_table

    fifo = _fifo_at(tmp_path / config_file_name("NVIDIA_H100"))
    with pytest.raises(TraceWriteError, match="is a FIFO"):
        write_user_table("NVIDIA_H100", "E=8,N=64,K=32", {}, {}, directory=tmp_path)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_diagram_update_writes_through_a_symlink_to_its_target(tmp_path, capsys):
    from moe_fsm.cli.diagram import BEGIN, END

    real = tmp_path / "docs" / "state.md"
    real.parent.mkdir()
    real.write_text(f"# States\n{BEGIN}\n{END}\nafter\n")
    link = tmp_path / "link.md"
    link.symlink_to(real)
    code, out, _ = run(capsys, "diagram", "--update", str(link))
    assert code == 0 and "state diagrams updated" in out
    assert link.is_symlink() and os.readlink(link) == str(real)  # the user's link stays
    assert "stateDiagram-v2" in real.read_text() and real.read_text().endswith("after\n")
    assert run(capsys, "diagram", "--check", str(real))[0] == 0


def test_a_trace_written_through_a_symlink_keeps_the_link_and_makes_no_folders(tmp_path, capsys):
    (tmp_path / "kept.json").write_text("{}")
    Path("link.json").symlink_to("kept.json")
    assert run(capsys, *SELECT, "--trace-out", "link.json")[0] == 0
    assert Path("link.json").is_symlink() and json.loads((tmp_path / "kept.json").read_text())["family"] == "unquantized"
    Path("dangling.json").symlink_to("missing/t.json")
    code, _, err = run(capsys, *SELECT, "--trace-out", "dangling.json")
    assert code == 4 and "writing through the symlink to" in err and not (tmp_path / "missing").exists()


# -- item 8: files that are not regular, given to a reader ---------------------------------------------------------------


def _unblock_after(fifo: Path, seconds: float) -> threading.Thread:
    """Should a reader block on ``fifo`` (the bug), open it for writing after ``seconds`` so the test ends and fails."""
    def unblock():
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            time.sleep(0.1)
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass  # nobody is reading it: nothing blocked

    thread = threading.Thread(target=unblock, daemon=True)
    thread.start()
    return thread


READERS = {
    "explain": lambda f: ["explain", str(f)],
    "replay": lambda f: ["replay", str(f)],
    "select --input": lambda f: ["select", "--input", str(f)],
    "diff --input": lambda f: ["diff", "--input", str(f)],
    "plan": lambda f: ["plan", str(f), "--platform", "sm90", "--no-env", "--trace-dir", "traces"],
    "diagram --check": lambda f: ["diagram", "--check", str(f)],
}


@pytest.mark.parametrize("reader", sorted(READERS))
@pytest.mark.parametrize("kind", ["fifo", "socket", "chardev"])
def test_readers_refuse_a_file_that_is_not_regular_without_blocking(tmp_path, capsys, reader, kind):
    special = tmp_path / "in.json"
    message = make_special(special, kind)
    if kind == "fifo":
        _unblock_after(special, 5)
    started = time.monotonic()
    code, _, err = run(capsys, *READERS[reader](special))
    assert code == 2 and message in err and err.count("\n") == 1, err
    assert time.monotonic() - started < 5


def test_a_manifest_naming_a_fifo_for_its_trace_is_refused(tmp_path, capsys):
    assert run(capsys, *RUN, "--trace-dir", "traces")[0] == 0
    trace = tmp_path / "traces" / LAYER0_TRACE
    trace.unlink()
    os.mkfifo(trace)
    _unblock_after(trace, 5)
    code, _, err = run(capsys, "explain", "traces/run.manifest", "--layer", "0")
    assert code == 2 and "is a FIFO (named pipe), not a regular file" in err, err


def _scenarios(directory: Path) -> Path:
    folder = directory / "seeds" / "scenarios"
    folder.mkdir(parents=True)
    (folder / "one.toml").write_text('[[scenario]]\nname = "one"\nplatform = "cpu"\nlayer = { quant = "unquantized" }\n')
    return folder


@pytest.mark.parametrize("odd", ["not-utf8", "directory", "fifo"])
def test_golden_refuses_an_odd_scenario_file_in_one_line(tmp_path, capsys, odd):
    folder = _scenarios(tmp_path / "g")
    path = folder / "odd.toml"
    if odd == "not-utf8":
        path.write_bytes(b"name = \"\x80\x81\"\n")
        message = "is not UTF-8 text"
    elif odd == "directory":
        path.mkdir()
        message = "is a directory, not a file"
    else:
        os.mkfifo(path)
        _unblock_after(path, 5)
        message = "is a FIFO (named pipe), not a regular file"
    for verb in ("--check", "--update"):
        code, _, err = run(capsys, "golden", verb, "--dir", "g")
        assert code == 2 and f"scenario file {path.relative_to(tmp_path)} {message}" in err and err.count("\n") == 1, err


def test_golden_leaves_a_directory_named_like_a_golden_trace_alone(tmp_path, capsys):
    _scenarios(tmp_path / "g")
    stray = tmp_path / "g" / "seeds" / "golden" / "notes.json"
    stray.mkdir(parents=True)
    (stray / "mine.txt").write_text("the user's")
    code, out, err = run(capsys, "golden", "--update", "--dir", "g")
    assert code == 0, err
    assert (stray / "mine.txt").read_text() == "the user's"
    assert run(capsys, "golden", "--check", "--dir", "g")[0] == 0
    (tmp_path / "g" / "seeds" / "golden" / "one.json").unlink()
    (tmp_path / "g" / "seeds" / "golden" / "one.json").mkdir()
    code, _, err = run(capsys, "golden", "--check", "--dir", "g")
    assert code == 2 and "golden trace g/seeds/golden/one.json is a directory, not a file" in err


# -- item 8: a trace directory with a long name or a dangling symlink; standard output that cannot be written ----------


def test_run_with_a_300_character_trace_dir_is_one_line(capsys):
    code, out, err = run(capsys, *RUN, "--trace-dir", "d" * 300)
    assert code == 4 and "File name too long (a directory name in it has 300 characters)" in err
    assert err.count("\n") == 1 and "model.layers.0" not in out


def test_a_dangling_symlink_in_the_trace_directory_does_not_cost_the_manifest(tmp_path, capsys):
    directory = tmp_path / "traces"
    directory.mkdir()
    (directory / "gone.json").symlink_to("nowhere.json")
    code, _, err = run(capsys, *RUN, "--trace-dir", str(directory))
    assert code == 0, err
    manifest = json.loads((directory / "run.manifest").read_text())
    assert manifest["earlier_files"] == [] and manifest["layers"][0]["trace_files"] == [LAYER0_TRACE]
    assert (directory / "gone.json").is_symlink()


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full")
@pytest.mark.parametrize("extra", [[], ["--json"]])
def test_output_to_a_full_device_is_one_line_and_exit_4(tmp_path, extra):
    """A real process: the interpreter's own flush at exit must not add a second traceback."""
    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-m", "moe_fsm", *SELECT, *extra, "--trace-out", str(tmp_path / "t.json")],
                              stdout=full, stderr=subprocess.PIPE, text=True, timeout=120)
    assert done.returncode == 4, done.stderr
    assert done.stderr == "moe-fsm select: error: cannot write to standard output: No space left on device\n"
    assert json.loads((tmp_path / "t.json").read_text())["family"] == "unquantized"  # the trace itself was written

