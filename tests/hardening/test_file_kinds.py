"""Issue 39, item 2: what stands at a path moe-fsm writes.

A trace, manifest, golden file, ``diagram --update`` or tuned table is written only into a new path or a regular
file: a device, FIFO or socket there is refused with one line (exit 4) and stays what it was, and a symlink is
written through to its target.
"""

from __future__ import annotations

import json
import os
import socket
import stat
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
