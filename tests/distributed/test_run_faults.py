"""Fault test for ``moe-fsm run --nproc 2`` (issue 12): stop signals to the launcher and to one rank.

Each case starts the real command (launcher -> torchrun agent -> two ranks) in
its own session, waits until the ranks have written their traces and are
computing, sends one signal to one process, and then asserts that every process
of the launch has ended within 10 s and that every visible trace file parses.
Before the fix, SIGTERM to the launcher left the agent and both ranks running,
re-parented to PID 1.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")]

END_WITHIN_S = 10.0
START_DEADLINE_S = 120.0


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[0] == "Z":
            continue
        tree.setdefault(int(fields[1]), []).append(int(entry.name))
    return tree


def _descendants(pid: int) -> list[int]:
    tree, out, todo = _children(), [], [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return state[state.rindex(")") + 2] != "Z"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


@pytest.mark.parametrize("target", ["launcher", "rank"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=lambda s: s.name)
def test_run_nproc_2_ends_every_process_on_a_signal(tmp_path: Path, target: str, sig: signal.Signals) -> None:
    trace_dir = tmp_path / "traces"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MOE_FSM_DIST_TIMEOUT": "60"}
    command = [sys.executable, "-m", "moe_fsm", "run", "--nproc", "2", "--tokens", "512", "--full-check",
               "--repeats", "50", "--trace-dir", str(trace_dir)]
    launcher = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True, cwd=tmp_path)
    seen: set[int] = set()
    try:
        deadline = time.monotonic() + START_DEADLINE_S
        ranks: list[int] = []
        while time.monotonic() < deadline and launcher.poll() is None:
            family = _descendants(launcher.pid)
            seen.update(family)
            ranks = [p for p in family if "__main__.py run" in _cmdline(p)]
            # each rank writes its one trace (48 identical layers: one distinct decision) before it computes
            if len(ranks) == 2 and list(trace_dir.glob("*.rank1.json")) and list(trace_dir.glob("*.rank0.json")):
                break
            time.sleep(0.2)
        assert launcher.poll() is None and len(ranks) == 2, f"the launch did not get going: {launcher.poll()}"
        time.sleep(1.0)  # the ranks are computing now
        seen.update(_descendants(launcher.pid))
        victim = launcher.pid if target == "launcher" else max(ranks)
        os.kill(victim, sig)
        sent = time.monotonic()
        everyone = seen | {launcher.pid}
        while time.monotonic() - sent < END_WITHIN_S + 5:
            launcher.poll()
            if not any(_alive(p) for p in everyone):
                break
            time.sleep(0.1)
        elapsed = time.monotonic() - sent
        still = {p: _cmdline(p) for p in everyone if _alive(p)}
        assert not still, f"{len(still)} process(es) still running {elapsed:.1f} s after {sig.name} to the {target}: {still}"
        assert elapsed <= END_WITHIN_S, f"the processes took {elapsed:.1f} s to end"
        if target == "rank":
            assert launcher.wait(timeout=1) != 0
    finally:
        for pid in seen | {launcher.pid}:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        launcher.wait(timeout=30)
    visible = [p for p in trace_dir.iterdir() if not p.name.startswith(".")]
    assert len(visible) >= 2  # each rank's one trace (the 48 layers decide alike), whole JSON
    for path in visible:
        json.loads(path.read_text())
