"""The tuned tile tables of the weight-quantized Triton MoE: the shipped ones and the one ``moe-fsm tune`` writes.

A table is one JSON object per device: ``fused.table_key`` (``"int4,g=128,zp=0,E=..,N=..,K=..,top_k=.."``, plus
``",scaled_dot"`` for MXFP4 through ``tl.dot_scaled``) -> {token count -> ``WqConfig`` JSON}. Two places hold them:

1. the user's table, ``wq_<device>.json`` in the directory of the user's 16-bit/FP8 Triton tables
   (``triton_moe.config.user_config_dir``: ``$MOE_FSM_TRITON_CONFIG_DIR``, else ``$XDG_CACHE_HOME/moe_fsm/triton_moe``
   or ``~/.cache/moe_fsm/triton_moe``), written by ``moe-fsm tune`` on this machine;
2. the tables shipped in the package (``configs/wq_<device>.json``, ``bench/bench_weight_quantized.py run
   --write-table``).

A lookup (``fused.get_wq_config``) reads a shape's token counts from both, the user's over the shipped ones at the
same count, and takes the count nearest on a log scale. The user's file has the shipped format, so a tuned table
can be shipped as it is. Torch-free, so the tables can be read, written and checked anywhere.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Optional

from moe_fsm.errors import InputError, KernelInputError
from moe_fsm.kernels.triton_moe.config import read_table_text, user_config_dir
from moe_fsm.trace.document import parse_json, write_atomic


def table_file_name(device: str) -> str:
    """``NVIDIA H100 80GB HBM3`` -> ``wq_NVIDIA_H100_80GB_HBM3.json`` (the shipped tables' names)."""
    return "wq_" + device.replace(" ", "_") + ".json"


def _is_table(data) -> bool:
    """A JSON object of shape keys -> {token count -> {field -> integer or flag}}."""
    if not isinstance(data, dict):
        return False
    for entries in data.values():
        if not isinstance(entries, dict):
            return False
        for count, config in entries.items():
            if not count.isdigit() or not isinstance(config, dict):
                return False
            if not all(isinstance(v, (int, bool)) for v in config.values()):
                return False
    return True


def read_table(text: str, where: str) -> dict:
    """A table's JSON; KernelInputError naming ``where`` when it is not JSON moe-fsm reads or not such a table."""
    try:
        data = parse_json(text, f"the weight-quantized MoE tile table {where}")
    except InputError as exc:
        raise KernelInputError(str(exc)) from None
    if not _is_table(data):
        raise KernelInputError(f"the weight-quantized MoE tile table {where} is not a JSON object of shape keys -> "
                               "{token count -> tile fields (integers or flags)}")
    return data


@functools.lru_cache(maxsize=None)
def load_user_table(directory: str, device: str) -> dict:
    """The table ``moe-fsm tune`` wrote into ``directory`` for a device, or an empty one."""
    path = Path(directory) / table_file_name(device)
    if not path.is_file():
        return {}
    return read_table(read_table_text(path, "the weight-quantized MoE tile table"), str(path))


def user_table(device: str) -> dict:
    """The user's table for a device, from the user's config directory as it is now."""
    return load_user_table(str(user_config_dir()), device)


def write_user_table(device: str, key: str, entries: dict[int, dict], directory: Optional[Path] = None) -> Path:
    """Merge tuned ``entries`` (token count -> ``WqConfig.to_json()``) for one shape key into the user's table.

    Other shapes, and this shape's other token counts, are kept; the counts tuned now are replaced. A file at the
    path that is not such a table is not moe-fsm's: it is refused, never replaced.
    """
    directory = Path(directory) if directory is not None else user_config_dir()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / table_file_name(device)
    data = {}
    if path.is_file():
        try:
            data = read_table(read_table_text(path, "the weight-quantized MoE tile table"), str(path))
        except KernelInputError as exc:
            raise KernelInputError(f"{exc}, so moe-fsm does not replace it: move it away or tune into another "
                                   "--config-dir") from None
    merged = {**data.get(key, {}), **{str(t): dict(c) for t, c in entries.items()}}
    data[key] = dict(sorted(merged.items(), key=lambda item: int(item[0])))
    write_atomic(path, json.dumps(data, indent=1) + "\n")
    load_user_table.cache_clear()
    return path
