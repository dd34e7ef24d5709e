"""Where FlashInfer's SM90 CUTLASS fused-MoE module comes from: a prebuilt copy, or nowhere.

On Hopper, ``flashinfer.fused_moe.cutlass_fused_moe`` JIT-compiles its whole module (248
objects, about 48 minutes on 16 cores) the first time it is called. An engine loading a model
must not stall for that, so moe-fsm's adapter never triggers it silently. It looks for the
trimmed module that ``moe-fsm flashinfer build`` builds (only the dtype pairs moe-fsm
calls; ``moe_fsm.experts.flashinfer_build``), checks that its manifest matches this FlashInfer and tvm-ffi, and hands it to
FlashInfer in place of the JIT build. Without one, building the kernel fails with what is
missing and the command that builds it; ``MOE_FSM_FLASHINFER_ALLOW_JIT=1`` lets FlashInfer
compile in place instead.

Looked for, in order: ``$MOE_FSM_FLASHINFER_PREBUILT`` (a directory holding
``manifest.json`` and the module), then ``$XDG_CACHE_HOME/moe-fsm/flashinfer/<version>/sm90``
(``~/.cache/...`` when unset).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from moe_fsm.errors import BackendUnavailableError

MODULE_NAME = "moe_fsm_fused_moe_90"
ARCH = "9.0a"
PREBUILT_ENV = "MOE_FSM_FLASHINFER_PREBUILT"
ALLOW_JIT_ENV = "MOE_FSM_FLASHINFER_ALLOW_JIT"
BUILD_COMMAND = "moe-fsm flashinfer build"


@dataclass(frozen=True)
class PrebuiltModule:
    """A built module and what its manifest says it holds."""

    so_path: Path
    dtype_sets: frozenset[str]
    flashinfer_version: str
    failed_smoke: frozenset[str] = frozenset()


def default_cache_dir(flashinfer_version: str) -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "moe-fsm" / "flashinfer" / flashinfer_version / "sm90"


def candidate_dirs(flashinfer_version: str) -> list[Path]:
    explicit = os.environ.get(PREBUILT_ENV)
    return [Path(explicit)] if explicit else [default_cache_dir(flashinfer_version)]


def read_prebuilt(directory: Path, flashinfer_version: str, tvm_ffi_version: str) -> PrebuiltModule:
    """The module in ``directory``, or a BackendUnavailableError saying what does not fit."""
    manifest_path = directory / "manifest.json"
    so_path = directory / f"{MODULE_NAME}.so"
    if not manifest_path.is_file() or not so_path.is_file():
        raise BackendUnavailableError(
            f"no prebuilt FlashInfer SM90 CUTLASS MoE module in {directory} (needs manifest.json and {so_path.name}); "
            f"build it with `{BUILD_COMMAND}` (into the user cache; `--out DIR` and {PREBUILT_ENV}=DIR for another "
            f"place), or set {ALLOW_JIT_ENV}=1 to let "
            "FlashInfer JIT-compile its full module (248 objects, about 48 minutes on 16 cores)"
        )
    manifest = json.loads(manifest_path.read_text())
    mismatches = [
        f"{key} {manifest.get(key)!r} (this process has {have!r})"
        for key, have in (("flashinfer", flashinfer_version), ("tvm_ffi", tvm_ffi_version), ("arch", ARCH))
        if manifest.get(key) != have
    ]
    if mismatches:
        raise BackendUnavailableError(
            f"the prebuilt FlashInfer module in {directory} was built for another setup: {', '.join(mismatches)}; "
            f"rebuild it with `{BUILD_COMMAND}`"
        )
    return PrebuiltModule(so_path, frozenset(manifest.get("dtype_sets", ())), flashinfer_version,
                          frozenset(manifest.get("dtype_sets_failed_smoke", ())))


def find_prebuilt(flashinfer_version: str, tvm_ffi_version: str) -> PrebuiltModule:
    problems = []
    for directory in candidate_dirs(flashinfer_version):
        try:
            return read_prebuilt(directory, flashinfer_version, tvm_ffi_version)
        except BackendUnavailableError as err:
            problems.append(str(err))
    raise BackendUnavailableError("; ".join(problems))


_installed: PrebuiltModule | None = None


def install_sm90_module() -> PrebuiltModule | None:
    """Make FlashInfer load the prebuilt SM90 module instead of JIT-compiling; once per process.

    Returns the module installed, or None when the caller allowed FlashInfer's own JIT.
    FlashInfer builds the module through ``gen_cutlass_fused_moe_sm90_module(...)
    .build_and_load()`` inside a cached getter, so replacing that one name in
    ``flashinfer.fused_moe.core`` before the first call is enough: the rest of FlashInfer's
    wrapping (runner, autotuner, workspace) is untouched.
    """
    global _installed
    if _installed is not None:
        return _installed
    import flashinfer
    import flashinfer.fused_moe.core as fused_moe_core
    import tvm_ffi

    try:
        prebuilt = find_prebuilt(flashinfer.__version__, tvm_ffi.__version__)
    except BackendUnavailableError:
        if os.environ.get(ALLOW_JIT_ENV) == "1":
            return None
        raise

    generate_full_spec = fused_moe_core.gen_cutlass_fused_moe_sm90_module

    class _PrebuiltSpec:
        def __init__(self, spec) -> None:
            self._spec = spec

        def build_and_load(self):
            return self._spec.load(prebuilt.so_path)

    fused_moe_core.gen_cutlass_fused_moe_sm90_module = lambda use_fast_build=False: _PrebuiltSpec(
        generate_full_spec(use_fast_build)
    )
    _installed = prebuilt
    return prebuilt
