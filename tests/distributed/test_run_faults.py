"""Fault test for ``moe-fsm run --nproc 2`` (issue 12): stop signals to the launcher and to one rank.

Each case starts the real command (launcher -> torchrun agent -> two ranks) in
its own session, with its output going into a pipe the test holds. Once rank 0
has reported its first layer (so both ranks have written their traces and are
running), the test fills the pipe: rank 0's next line then blocks, rank 1 waits
for rank 0 in a collective, and the run cannot end, however fast the machine,
until it is stopped (rank 0 prints the table last). The test sends one signal to
one process, drains the pipe again, and asserts that every process of the
launch has ended within 10 s and that every visible trace file parses. Before
the fix, SIGTERM to the launcher left the agent and both ranks running,
re-parented to PID 1. Before the pipe held the run (issue 39), a fast machine
finished it before the signal came.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import threading
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


def _held_pipe() -> tuple[int, int, int]:
    """(read end, write end for the launch, a non-blocking write end of its own for the test to fill the pipe with).

    The pipe holds one page, less than rank 0's table, so the run cannot end while the test does not read. The
    test's own write end is a separate open of the pipe: making it non-blocking leaves the launch's writes blocking.
    """
    read, write = os.pipe()
    fcntl.fcntl(write, fcntl.F_SETPIPE_SZ, 4096)
    return read, write, os.open(f"/proc/self/fd/{write}", os.O_WRONLY | os.O_NONBLOCK)


def _fill(fd: int) -> None:
    try:
        while True:
            os.write(fd, b"\n" * 4096)
    except BlockingIOError:
        return


@pytest.mark.parametrize("target", ["launcher", "rank"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=lambda s: s.name)
def test_run_nproc_2_ends_every_process_on_a_signal(tmp_path: Path, target: str, sig: signal.Signals) -> None:
    trace_dir = tmp_path / "traces"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MOE_FSM_DIST_TIMEOUT": "60"}
    command = [sys.executable, "-m", "moe_fsm", "run", "--nproc", "2", "--tokens", "16", "--repeats", "1",
               "--trace-dir", str(trace_dir)]
    read, write, fill = _held_pipe()
    launcher = subprocess.Popen(command, env=env, stdout=write, stderr=subprocess.STDOUT, start_new_session=True,
                                cwd=tmp_path)
    os.close(write)
    seen: set[int] = set()
    output = bytearray()
    drain = threading.Thread(target=lambda: [output.extend(chunk) for chunk in iter(lambda: os.read(read, 65536), b"")],
                             daemon=True)
    try:
        deadline = time.monotonic() + START_DEADLINE_S
        os.set_blocking(read, False)
        while time.monotonic() < deadline and launcher.poll() is None and b"[1/48]" not in output:
            try:
                output.extend(os.read(read, 65536))  # the header, then rank 0's line for its first layer
            except BlockingIOError:
                time.sleep(0.05)
        _fill(fill)  # from here on the run waits for the test: rank 0's next line blocks
        os.close(fill)
        fill = -1
        family = _descendants(launcher.pid)
        seen.update(family)
        ranks = [p for p in family if "__main__.py run" in _cmdline(p)]
        assert launcher.poll() is None and len(ranks) == 2 and b"[1/48]" in output, \
            f"the launch did not get going: {launcher.poll()}, {bytes(output)[-2000:]!r}"
        assert list(trace_dir.glob("*.rank0.json")) and list(trace_dir.glob("*.rank1.json"))
        victim = launcher.pid if target == "launcher" else max(ranks)
        os.kill(victim, sig)
        sent = time.monotonic()
        os.set_blocking(read, True)
        drain.start()  # the processes' last lines must not block on the full pipe
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
        if fill >= 0:
            os.close(fill)
        for pid in seen | {launcher.pid}:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if not drain.is_alive():
            os.set_blocking(read, False)  # a launch stopped above: nothing may block the clean-up
        launcher.wait(timeout=30)
        drain.join(timeout=30)
        os.close(read)
    visible = [p for p in trace_dir.iterdir() if not p.name.startswith(".")]
    assert len(visible) >= 2  # each rank's one trace (the 48 layers decide alike), whole JSON
    for path in visible:
        json.loads(path.read_text())
