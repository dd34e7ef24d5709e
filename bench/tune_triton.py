"""Maintainers: tune the named full-size shapes on this GPU and merge them into the table shipped in the package.

The tuning itself is ``moe_fsm.kernels.triton_moe.tuning`` (what ``moe-fsm tune``
runs: whole-layer CUDA-graph replays per candidate). This script tunes into a
scratch user directory, then merges that table's shapes into
``src/moe_fsm/kernels/triton_moe/configs/<device>.json`` (other shapes there are
kept), which is what a release ships.

    python bench/tune_triton.py                      # every named shape, every token count
    python bench/tune_triton.py --shapes qwen3-30b-a3b --tokens 1 8 32
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from moe_fsm.kernels.triton_moe.config import config_file_name  # noqa: E402
from moe_fsm.kernels.triton_moe.tuning import NAMED_SHAPES, TOKENS, tune_and_write  # noqa: E402

SHIPPED = ROOT / "src" / "moe_fsm" / "kernels" / "triton_moe" / "configs"


def merge_into_shipped(tuned: Path, shipped_dir: Path = SHIPPED) -> Path:
    """Merge a tuned table's entries into the shipped table of the same device; returns its path.

    Per shape and token count: a run that tuned some token counts of a shape keeps the shipped entries of the
    others.
    """
    new = json.loads(tuned.read_text())
    path = shipped_dir / tuned.name
    table = json.loads(path.read_text()) if path.is_file() else {"configs": {}}
    for key, entries in new["configs"].items():
        merged = {**table["configs"].get(key, {}), **entries}
        table["configs"][key] = dict(sorted(merged.items(), key=lambda item: int(item[0])))
    table.pop("best_us", None)
    table.update({k: v for k, v in new.items() if k != "configs"})
    table["generated_by"] = "bench/tune_triton.py (moe_fsm.kernels.triton_moe.tuning)"
    table["date"] = time.strftime("%Y-%m-%d")
    path.write_text(json.dumps(table, indent=1) + "\n")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="*", default=list(NAMED_SHAPES), choices=list(NAMED_SHAPES))
    parser.add_argument("--tokens", nargs="*", type=int, default=list(TOKENS))
    parser.add_argument("--workers", type=int, default=12)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("tune_triton.py needs a CUDA device")
    with tempfile.TemporaryDirectory() as scratch:
        tuned = tune_and_write([NAMED_SHAPES[s] for s in args.shapes], args.tokens, workers=args.workers, directory=Path(scratch)).path
        assert tuned.name == config_file_name(torch.cuda.get_device_name())
        print(f"merged into {merge_into_shipped(tuned)}")


if __name__ == "__main__":
    main()
