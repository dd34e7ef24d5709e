"""``bench/gpu.sh step``: a hung multi-process step ends at its limit with every rank, and says where it hung.

The ranks run under ``moe_fsm.distributed.launch``, whose agent starts a session of
its own (as the ranks of the suite and the benchmark do), so a plain ``timeout`` on
the step's command would leave them running. Here rank 1 sleeps and rank 0 waits
in a gloo barrier with a process-group timeout far past the step's limit: only the
step's limit can end them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu.sh"
# Room for torchrun and two ranks importing torch: a minute on a loaded two-core machine, less where cores abound.
LIMIT_S = 60 if (os.cpu_count() or 1) < 8 else 25

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(shutil.which("bash") is None or shutil.which("setsid") is None, reason="bench/gpu.sh step needs bash and setsid"),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the step finds its processes in /proc"),
]

# Rank 0's stderr goes nowhere (as a rank's pipe into a pytest that is killed with it): its stacks reach the step's
# output only through the files the step asks for (MOE_FSM_STACKS_DIR).
HANGING_RANK = """
import os, sys, time
from pathlib import Path
import torch.distributed as dist
from moe_fsm.distributed import init_from_env
if os.environ.get("RANK") == "0":
    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
ctx = init_from_env("gloo")
Path(sys.argv[1], f"rank{ctx.rank}.ready").write_text(str(os.getpid()))
if ctx.rank == 1:
    while True:
        time.sleep(1)
dist.barrier()
"""

LAUNCHER = """
import sys
from moe_fsm.distributed import launch
sys.exit(launch(2, [sys.argv[1], sys.argv[2]], env={"OMP_NUM_THREADS": "1"}))
"""


def _marked(marker: str) -> list[int]:
    """Live processes whose environment carries the test's marker."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if f"H42_STEP_TEST={marker}".encode() in environ and state != "Z":
            found.append(int(entry.name))
    return found


def test_a_hung_step_ends_at_its_limit_with_every_rank_and_names_them(tmp_path: Path) -> None:
    rank_script, launcher = tmp_path / "hang.py", tmp_path / "launch.py"
    rank_script.write_text(HANGING_RANK)
    launcher.write_text(LAUNCHER)
    marker = uuid.uuid4().hex
    env = {**os.environ, "H42_STEP_TEST": marker, "MOE_FSM_DIST_TIMEOUT": "3600",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    started = time.monotonic()
    try:
        done = subprocess.run(["bash", str(SCRIPT), "step", "hang", str(LIMIT_S), "--", sys.executable, str(launcher),
                               str(rank_script), str(tmp_path)],
                              capture_output=True, text=True, env=env, timeout=LIMIT_S + 60)
        elapsed = time.monotonic() - started
        left = _marked(marker)
        out = done.stdout + done.stderr
        assert done.returncode == 124, out[-3000:]
        assert (tmp_path / "rank0.ready").exists() and (tmp_path / "rank1.ready").exists(), \
            f"the ranks never got going within {LIMIT_S} s, so nothing was tested:\n{out[-3000:]}"
        assert not left, f"processes outlived the step: {left}"
        assert elapsed < LIMIT_S + 30, f"the step took {elapsed:.0f} s to end"
        assert f"step 'hang' still running after {LIMIT_S} s" in out
        assert "RANK=0" in out and "RANK=1" in out, out[-3000:]
        assert "RANK=0 (pid" in out and "its Python stacks" in out, out[-3000:]
        assert "in barrier" in out, f"rank 0's stack (faulthandler on SIGUSR1) should show where it waited:\n{out[-3000:]}"
        assert not list(Path(os.environ.get("TMPDIR", "/tmp")).glob(f"moe-fsm-stacks.*/rank*-pid{ready_pid(tmp_path, 0)}.txt")), \
            "the step removes the stacks it asked for"
    finally:
        for pid in _marked(marker):
            os.kill(pid, 9)


def ready_pid(tmp_path: Path, rank: int) -> int:
    """The pid a rank of HANGING_RANK wrote when it got going."""
    return int((tmp_path / f"rank{rank}.ready").read_text())


def test_step_refuses_a_limit_that_is_not_seconds() -> None:
    done = subprocess.run(["bash", str(SCRIPT), "step", "x", "soon", "--", "true"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "LIMIT_S is 'soon'" in done.stderr


def test_a_step_that_ends_by_itself_keeps_its_status(tmp_path: Path) -> None:
    done = subprocess.run(["bash", str(SCRIPT), "step", "quick", "30", "--", "sh", "-c", "echo hi; exit 7"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 7 and done.stdout == "hi\n"


ASK_FOR_STACKS = """
import os, signal, time
from moe_fsm.distributed.group import _stacks_on_request
_stacks_on_request()
os.kill(os.getpid(), signal.SIGUSR1)
time.sleep(0.5)
print("still running")
"""


@pytest.mark.parametrize("folder", ["made", "missing"])
def test_a_rank_writes_its_stacks_where_the_step_asks_or_to_stderr(tmp_path: Path, folder: str) -> None:
    stacks = tmp_path / "stacks"
    if folder == "made":
        stacks.mkdir()
    env = {**os.environ, "MOE_FSM_STACKS_DIR": str(stacks), "RANK": "3",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", ASK_FOR_STACKS], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0 and "still running" in done.stdout, done.stdout + done.stderr
    if folder == "made":
        files = list(stacks.glob("rank3-pid*.txt"))
        assert len(files) == 1 and "<string>" in files[0].read_text(), (files, done.stderr)
        assert "<string>" not in done.stderr
    else:  # a folder that is not there: the rank runs on and its stacks go to stderr
        assert not stacks.exists() and "<string>" in done.stderr, done.stderr
