"""Issue 39, item 5: what `run` may clean up in a trace directory.

``run`` removes only the temporary files moe-fsm makes (``.moe-fsm-tmp.PID.…`` of a writer no longer running),
nothing of the user's.
"""

from __future__ import annotations

import os
from pathlib import Path

from moe_fsm.cli.main import main
from moe_fsm.trace import document

RUN = ["run", "--layers", "1", "--tokens", "2", "--repeats", "1"]


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
