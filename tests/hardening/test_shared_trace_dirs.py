"""Issue 39, items 4 and 5: processes writing into one trace directory at once, and what `run` may clean up there.

Concurrent ``select``s each claim their own ``decision-<family>[-N].json`` (``O_EXCL``); a ``run`` or ``plan`` holds
the directory's lock from its first trace to its manifest, so a second one meanwhile is refused (exit 4, naming the
first) and every trace a manifest names holds that run's decision. ``run`` removes only the temporary files moe-fsm
makes (``.moe-fsm-tmp.PID.…`` of a writer no longer running), nothing of the user's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moe_fsm.cli.main import main
from moe_fsm.errors import TraceWriteError
from moe_fsm.inputs.platform import preset
from moe_fsm.plan.plan import plan_model
from moe_fsm.trace import document
from moe_fsm.trace.dir_lock import LOCK_NAME

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "tests" / "data" / "configs" / "qwen3-30b-a3b" / "config.json"
RUN = ["run", "--layers", "1", "--tokens", "2", "--repeats", "1"]
HOLD = """
import sys
from moe_fsm.trace.dir_lock import trace_dir_lock
with trace_dir_lock(sys.argv[1]):
    print("held", flush=True)
    sys.stdin.read()
"""


def moe_fsm(*argv, cwd) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "moe_fsm", *argv], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


# -- item 4: concurrent writers ------------------------------------------------------------------------------------------


def test_selects_at_once_each_write_their_own_trace(tmp_path):
    names = [f"proc{i}" for i in range(8)]
    processes = [moe_fsm("select", "--no-env", "--platform", "cpu", "--layer-name", name, cwd=tmp_path) for name in names]
    for process in processes:
        _, err = process.communicate(timeout=300)
        assert process.returncode == 0, err
    files = sorted((tmp_path / "moe-fsm-traces").iterdir())
    assert len(files) == len(names)
    assert sorted(json.loads(f.read_text())["layer_name"] for f in files) == names


@pytest.fixture
def held(tmp_path):
    """Another process holding ``tmp_path/traces``'s lock, until the test lets it go (``held.stdin.close()``)."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "traces")], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\n"
    yield holder
    holder.kill()
    holder.wait()


def test_a_run_into_a_directory_another_run_holds_is_refused_before_it_writes(tmp_path, capsys, held):
    traces = tmp_path / "traces"
    code = main([*RUN, "--trace-dir", str(traces)])
    out, err = capsys.readouterr()
    assert code == 4 and f"trace directory {traces} is in use by another moe-fsm run (pid {held.pid}: " in err, err
    assert "give this one another --trace-dir" in err and err.count("\n") == 1 and "model.layers.0" not in out
    assert sorted(p.name for p in traces.iterdir()) == [LOCK_NAME]
    held.stdin.close()
    held.wait(timeout=60)
    assert main([*RUN, "--trace-dir", str(traces)]) == 0  # the lock went with its holder
    assert not (traces / LOCK_NAME).exists() and (traces / "run.manifest").exists()


def test_a_plan_into_a_directory_another_run_holds_is_refused(tmp_path, held):
    with pytest.raises(TraceWriteError, match=f"is in use by another moe-fsm run \\(pid {held.pid}: "):
        plan_model(CONFIG, platform=preset("sm90"), env={}, trace_dir=tmp_path / "traces", policy="seeds")
    assert not list((tmp_path / "traces").glob("*.json"))


def test_a_killed_holder_leaves_no_lock_behind(tmp_path, capsys, held):
    held.kill()
    held.wait(timeout=60)
    assert (tmp_path / "traces" / LOCK_NAME).exists()  # the file of a killed holder stays; its lock does not
    assert main([*RUN, "--trace-dir", str(tmp_path / "traces")]) == 0


def test_two_runs_at_once_never_mix_their_traces(tmp_path):
    """The issue's repro: a CPU run and an H100 what-if into one directory, the second started while the first runs.

    Unlocked, the what-if overwrote the trace the CPU run's manifest names; now it is refused, naming the first.
    """
    first = moe_fsm("run", "--trace-dir", "C", "--layers", "4", "--repeats", "8", "--tokens", "2048", "--platform", "cpu",
                    cwd=tmp_path)
    assert first.stdout.readline().startswith("moe-fsm run:")  # its header: the directory is its own from here on
    second = moe_fsm("run", "--trace-dir", "C", "--layers", "4", "--repeats", "1", "--tokens", "8", "--platform", "sm90",
                     cwd=tmp_path)
    _, second_err = second.communicate(timeout=600)
    _, first_err = first.communicate(timeout=600)
    assert first.returncode == 0, first_err
    assert second.returncode == 4 and "is in use by another moe-fsm run" in second_err, second_err
    manifest = json.loads((tmp_path / "C" / "run.manifest").read_text())
    assert "cpu" in manifest["command"]
    for layer in manifest["layers"]:
        trace = json.loads((tmp_path / "C" / layer["trace_files"][0]).read_text())
        assert trace["inputs"]["platform"]["vendor"] == "cpu", layer["trace_files"][0]


# -- item 5: run's clean-up removes only moe-fsm's own temporary files ---------------------------------------------------


def test_run_removes_only_the_temporary_files_moe_fsm_makes(tmp_path, capsys):
    users = [".notes.tmp99999.txt", ".x.tmp99999999999999999999.y", ".layer000-x.json.tmp999999999.ab12cd",
             ".moe-fsm-tmp.99999999999999999999.y"]  # the last: a pid no writer has, so not a name moe-fsm made
    for name in users:
        (tmp_path / name).write_text("the user's")
    (tmp_path / ".moe-fsm-tmp.999999999.linked.json.x").symlink_to(".notes.tmp99999.txt")  # not a regular file
    dead_writer = tmp_path / ".moe-fsm-tmp.999999999.layer000-x.json.ab12cd"
    dead_writer.write_text("{")
    code = main([*RUN, "--trace-dir", str(tmp_path)])
    assert code == 0, capsys.readouterr().err
    assert all((tmp_path / name).read_text() == "the user's" for name in users)
    assert (tmp_path / ".moe-fsm-tmp.999999999.linked.json.x").is_symlink()
    assert not dead_writer.exists()


def test_the_writer_names_its_temporary_files_as_the_clean_up_expects(tmp_path, monkeypatch):
    seen = []
    real_replace = os.replace

    def replace(source, destination):
        seen.append(Path(source).name)
        real_replace(source, destination)

    monkeypatch.setattr(document.os, "replace", replace)
    document.write_atomic(tmp_path / "t.json", "{}")
    assert len(seen) == 1 and seen[0].startswith(f"{document.TEMP_PREFIX}{os.getpid()}.t.json.")
    assert document._TEMP_NAME.match(seen[0]).group(1) == str(os.getpid())
