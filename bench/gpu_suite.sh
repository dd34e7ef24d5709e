#!/usr/bin/env bash
# The GPU suite in one command: `pytest -m gpu` on a CUDA machine that has torch, Triton, pytest and
# pytest-timeout but not moe-fsm's pure-Python dependencies, which travel as wheels.
#
#   bench/gpu_suite.sh [WHEEL_DIR] [-- PYTEST_ARGS...]
#
# Run from the repository root (or a worktree's root). WHEEL_DIR holds the carried wheels (transitions,
# structlog, jsonschema and its dependencies, and hypothesis / sortedcontainers / six where the machine
# lacks them); without it: $MOE_FSM_WHEELS, else the first of ./.whl, ../../.whl (a worktree under .wt/),
# <main checkout>/.whl that holds wheels. Only the wheels whose distribution is not installed are
# installed, into $SITE (default /tmp/moe-fsm-site), which goes on PYTHONPATH with ./src.
# PYTEST_ARGS replace the default selection (`tests`): e.g. `-- tests/kernels/test_torch_experts_cuda.py
# tests/gpu/test_triton_moe.py`. (pytest runs a file named beside its directory in directory order, not first.)
#
# Limits: every test gets TEST_TIMEOUT_S seconds (pytest-timeout, default 300); the whole suite SUITE_S
# seconds (default 1500), after which pytest is interrupted (SIGINT) and still writes its reports.
# Writes under $OUT (default ./gpu-suite-out): gpu-suite.xml (junit), gpu-suite.log, summary.txt.
# Exit status: pytest's (0 all passed, 1 some failed, 2 interrupted, 5 nothing collected), or 3 when the
# machine is not fit to run the suite (no CUDA device, a wheel missing, a dependency not importable).
set -o pipefail
cd "$(dirname "$0")/.." || exit 3
ROOT=$PWD
OUT=${OUT:-$ROOT/gpu-suite-out}
SITE=${SITE:-/tmp/moe-fsm-site}
PY=${PYTHON:-python3}
mkdir -p "$OUT" "$SITE"
LOG=$OUT/gpu-suite.log
say() { echo "gpu_suite: $*" | tee -a "$LOG"; }
: > "$LOG"

WHEELS=""
if [ $# -gt 0 ] && [ "$1" != "--" ]; then WHEELS=$1; shift; fi
[ "${1:-}" = "--" ] && shift
if [ -z "$WHEELS" ]; then
    main_checkout=$(git rev-parse --path-format=absolute --git-common-dir 2>/dev/null | sed 's#/\.git$##')
    for candidate in "${MOE_FSM_WHEELS:-}" "$ROOT/.whl" "$ROOT/../../.whl" "${main_checkout:+$main_checkout/.whl}"; do
        if [ -n "$candidate" ] && compgen -G "$candidate/*.whl" > /dev/null; then WHEELS=$candidate; break; fi
    done
fi

# Which wheels the machine lacks: a wheel's distribution name is its file name up to the first '-'.
if [ -n "$WHEELS" ]; then
    [ -d "$WHEELS" ] || { say "wheel folder $WHEELS does not exist"; exit 3; }
    mapfile -t missing < <("$PY" - "$WHEELS" <<'EOF'
import pathlib, re, sys
from importlib import metadata
for wheel in sorted(pathlib.Path(sys.argv[1]).glob("*.whl")):
    name = re.sub(r"[-_.]+", "-", wheel.name.split("-")[0]).lower()
    try:
        metadata.version(name)
    except metadata.PackageNotFoundError:
        print(wheel)
EOF
)
    if [ ${#missing[@]} -gt 0 ]; then
        say "installing ${#missing[@]} wheel(s) into $SITE: $(for w in "${missing[@]}"; do basename "$w"; done | tr '\n' ' ')"
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${missing[@]}" 2>&1 | tee -a "$LOG" || { say "pip could not install the wheels"; exit 3; }
    else
        say "every wheel in $WHEELS is installed already"
    fi
else
    say "no wheel folder given or found (argument, \$MOE_FSM_WHEELS, .whl): using what is installed"
fi
export PYTHONPATH=$SITE:$ROOT/src${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1

"$PY" - <<'EOF' 2>&1 | tee -a "$LOG"
import importlib, sys
missing = []
for module in ("torch", "triton", "transitions", "structlog", "jsonschema", "hypothesis", "pytest", "pytest_timeout"):
    try:
        importlib.import_module(module)
    except Exception as err:  # noqa: BLE001 - report every missing piece at once
        missing.append(f"{module} ({type(err).__name__}: {err})")
import torch
if missing:
    sys.exit("gpu_suite: not importable: " + "; ".join(missing) + " (add its wheel to the wheel folder)")
if not torch.cuda.is_available():
    sys.exit("gpu_suite: torch sees no CUDA device: the GPU suite would only be skipped")
import triton
print(f"gpu_suite: {torch.cuda.get_device_name()} (capability {torch.cuda.get_device_capability()}), "
      f"torch {torch.__version__}, triton {triton.__version__}, python {sys.version.split()[0]}")
EOF
[ "${PIPESTATUS[0]}" -eq 0 ] || exit 3

[ $# -gt 0 ] || set -- tests
say "pytest -m gpu $* (per test ${TEST_TIMEOUT_S:-300} s, suite ${SUITE_S:-1500} s)"
timeout -s INT -k 30 "${SUITE_S:-1500}" "$PY" -m pytest -m gpu -q -p no:cacheprovider -rfE --durations=10 \
    --timeout "${TEST_TIMEOUT_S:-300}" --junitxml "$OUT/gpu-suite.xml" -o junit_family=xunit2 "$@" 2>&1 | tee -a "$LOG"
status=${PIPESTATUS[0]}
[ "$status" -eq 124 ] && status=2

"$PY" - "$OUT/gpu-suite.xml" "$status" <<'EOF' 2>&1 | tee "$OUT/summary.txt"
import sys
import xml.etree.ElementTree as ET
path, status = sys.argv[1], sys.argv[2]
try:
    root = ET.parse(path).getroot()
except (OSError, ET.ParseError) as err:
    sys.exit(f"gpu_suite: no junit report ({err}); pytest exit status {status}")
suites = [root] if root.tag == "testsuite" else list(root)
count = lambda key: sum(int(s.get(key, 0)) for s in suites)  # noqa: E731
failed = [f"{c.get('classname')}::{c.get('name')}" for s in suites for c in s.iter("testcase")
          if c.find("failure") is not None or c.find("error") is not None]
print(f"gpu_suite: {count('tests')} tests: {count('tests') - count('failures') - count('errors') - count('skipped')} passed, "
      f"{count('failures')} failed, {count('errors')} errors, {count('skipped')} skipped in {float(root.get('time') or suites[0].get('time') or 0):.0f} s; "
      f"pytest exit status {status}")
for name in failed:
    print(f"  FAILED {name}")
EOF
exit "$status"
