#!/usr/bin/env bash
# The GPU machine's one entry point: the GPU test suite, each benchmark's device call, the FlashInfer build.
#
#   bench/gpu.sh SUBCOMMAND [ARGS...]      (from any directory: it runs from the repository root)
#
#   suite [WHEEL_DIR] [-- PYTEST_ARGS...]  `pytest -m gpu` with the carried wheels (below)
#   step NAME LIMIT_S -- COMMAND...        COMMAND under a hard limit that ends every process it started (ranks too)
#   distributed                            the multi-process tests and bench_distributed.py over NCCL, N GPUs
#   experts-vs-vllm                        GPU tests, `moe-fsm tune` of the named shapes, the host path, then
#                                          bench_experts_vs_vllm.py run with the fresh table
#   hopper-prefill                         the Hopper TMA kernels' GPU tests, then bench_hopper_prefill.py at 8192 tokens
#   transformers                           moe_fsm inside transformers: tests, host cost, profiles, forwards, generate()
#   weight-quantized [BUDGET_S] [EXTRACT] [-- BENCH_ARGS...]
#                                          the weight-quantized (MXFP4, INT4) MoE: tests, presets, bench_weight_quantized.py
#   flashinfer-build start|follow          build FlashInfer's SM90 module (it outlives a call), then its tests and bench
#
# Each subcommand keeps to the device tool's 10 minutes a call: every stage has its own time limit and writes
# under $OUT as it goes, so a cut call still returns what it measured. Exit status: the subcommand's (its comment in
# this file says which); 2 for an unknown subcommand.
set -u
cd "$(dirname "$0")/.." || exit 3
ROOT=$PWD

# missing_wheels PY DIR: the wheels in DIR whose distribution PY does not have (a wheel's distribution name is its
# file name up to the first '-').
missing_wheels() {
    "$1" - "$2" <<'EOF'
import pathlib, re, sys
from importlib import metadata
for wheel in sorted(pathlib.Path(sys.argv[1]).glob("*.whl")):
    name = re.sub(r"[-_.]+", "-", wheel.name.split("-")[0]).lower()
    try:
        metadata.version(name)
    except metadata.PackageNotFoundError:
        print(wheel)
EOF
}

# suite: the GPU suite in one command, on a CUDA machine that has torch, Triton, pytest and pytest-timeout but
# not moe-fsm's pure-Python dependencies, which travel as wheels.
#
# WHEEL_DIR holds the carried wheels (transitions, structlog, jsonschema and its dependencies, and hypothesis /
# sortedcontainers / six where the machine lacks them); without it: $MOE_FSM_WHEELS, else the first of ./.whl,
# ../../.whl (a worktree under .wt/), <main checkout>/.whl that holds wheels. Only the wheels whose distribution is
# not installed are installed, into $SITE (default /tmp/moe-fsm-site), which goes on PYTHONPATH with ./src.
# PYTEST_ARGS replace the default selection (`tests`): e.g. `-- tests/kernels/test_torch_experts_cuda.py
# tests/gpu/test_triton_moe.py`. (pytest runs a file named beside its directory in directory order, not first.)
#
# Limits: every test gets TEST_TIMEOUT_S seconds (pytest-timeout, default 300); the whole suite SUITE_S seconds
# (default 1500), after which pytest is interrupted (SIGINT) and still writes its reports.
# Writes under $OUT (default ./gpu-suite-out): gpu-suite.xml (junit), gpu-suite.log, summary.txt.
# Exit status: pytest's (0 all passed, 1 some failed, 2 interrupted, 5 nothing collected), or 3 when the machine
# is not fit to run the suite (no CUDA device, a wheel missing, a dependency not importable).
suite() (
    set -o pipefail
    OUT=${OUT:-$ROOT/gpu-suite-out}
    SITE=${SITE:-/tmp/moe-fsm-site}
    PY=${PYTHON:-python3}
    mkdir -p "$OUT" "$SITE"
    LOG=$OUT/gpu-suite.log
    say() { echo "gpu suite: $*" | tee -a "$LOG"; }
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

    # Which wheels the machine lacks
    if [ -n "$WHEELS" ]; then
        [ -d "$WHEELS" ] || { say "wheel folder $WHEELS does not exist"; exit 3; }
        mapfile -t missing < <(missing_wheels "$PY" "$WHEELS")
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
if missing:
    sys.exit("gpu suite: not importable: " + "; ".join(missing) + " (add its wheel to the wheel folder)")
import torch
if not torch.cuda.is_available():
    sys.exit("gpu suite: torch sees no CUDA device: the GPU suite would only be skipped")
import triton
print(f"gpu suite: {torch.cuda.get_device_name()} (capability {torch.cuda.get_device_capability()}), "
      f"torch {torch.__version__}, triton {triton.__version__}, python {sys.version.split()[0]}")
EOF
    [ "${PIPESTATUS[0]}" -eq 0 ] || exit 3

    [ $# -gt 0 ] || set -- tests
    # xdist workers (-n N) take the visible GPUs in turn (tests/conftest.py); MOE_FSM_TEST_GPUS=1 keeps them on one
    export MOE_FSM_TEST_GPUS=${MOE_FSM_TEST_GPUS:-$("$PY" -c "import torch; print(max(1, torch.cuda.device_count()))")}
    say "pytest -m gpu $* over $MOE_FSM_TEST_GPUS GPU(s) (per test ${TEST_TIMEOUT_S:-300} s, suite ${SUITE_S:-1500} s)"
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
    sys.exit(f"gpu suite: no junit report ({err}); pytest exit status {status}")
suites = [root] if root.tag == "testsuite" else list(root)
count = lambda key: sum(int(s.get(key, 0)) for s in suites)  # noqa: E731
failed = [f"{c.get('classname')}::{c.get('name')}" for s in suites for c in s.iter("testcase")
          if c.find("failure") is not None or c.find("error") is not None]
print(f"gpu suite: {count('tests')} tests: {count('tests') - count('failures') - count('errors') - count('skipped')} passed, "
      f"{count('failures')} failed, {count('errors')} errors, {count('skipped')} skipped in {float(root.get('time') or suites[0].get('time') or 0):.0f} s; "
      f"pytest exit status {status}")
for name in failed:
    print(f"  FAILED {name}")
EOF
    exit "$status"
)

# step NAME LIMIT_S -- COMMAND...: run COMMAND under a hard limit that ends every process it started.
#
# COMMAND runs in a session of its own (setsid) with $MOE_FSM_STEP_TAG set to a tag unique to this step. Processes
# that start sessions of their own (moe_fsm.distributed.launch's agent, ranks started with start_new_session=True)
# escape a plain `timeout`, but they inherit the environment, so the tag finds them in /proc. Past LIMIT_S the step
# prints which processes were still running (pid, RANK, command line), asks each rank for its Python stacks (SIGUSR1:
# moe_fsm.distributed.init_from_env registers faulthandler for it, writing into $MOE_FSM_STACKS_DIR, a folder the step
# makes and removes, so that a rank whose stderr is a pipe, as under pytest, is heard too) and prints them, prints the
# tail of each rank's log file, then
# SIGTERMs the step's session and every tagged process and SIGKILLs whatever is left 5 s later. Tagged processes
# left running by a step that ended by itself (orphans) are ended the same way. Exit status: COMMAND's, or 124 when
# the limit was reached (as coreutils' timeout).
step() {
    local name=${1:-} limit=${2:-}
    shift $(( $# < 2 ? $# : 2 ))
    [ "${1:-}" = "--" ] && shift
    case "$limit" in ''|*[!0-9]*) echo "gpu.sh step: LIMIT_S is '$limit'; accepted: a whole number of seconds" >&2; return 2 ;; esac
    [ $# -gt 0 ] || { echo "gpu.sh step: name the command to run after LIMIT_S (step NAME LIMIT_S -- COMMAND...)" >&2; return 2; }
    local tag="moe-fsm-step-$$-$RANDOM-$name" start=$SECONDS pid status stacks
    stacks=$(mktemp -d "${TMPDIR:-/tmp}/moe-fsm-stacks.XXXXXX") || return 1
    MOE_FSM_STEP_TAG=$tag MOE_FSM_STACKS_DIR=$stacks setsid "$@" &
    pid=$!
    while kill -0 "$pid" 2>/dev/null && [ $((SECONDS - start)) -lt "$limit" ]; do sleep 1; done
    if kill -0 "$pid" 2>/dev/null; then
        echo "gpu.sh: step '$name' still running after $limit s: ending it and every process it started"
        describe_tagged "$tag" "$stacks"
        end_tagged "$tag" "$pid"
        wait "$pid" 2>/dev/null
        rm -rf "$stacks"
        echo "gpu.sh: step '$name' ended after $((SECONDS - start)) s (limit $limit s)"
        return 124
    fi
    wait "$pid"
    status=$?
    if [ -n "$(tagged_pids "$tag")" ]; then
        echo "gpu.sh: step '$name' exited ($status) but left processes running: ending them"
        describe_tagged "$tag" "$stacks"
        end_tagged "$tag" ""
    fi
    rm -rf "$stacks"
    return "$status"
}

# The pids whose environment holds MOE_FSM_STEP_TAG=TAG (this user's processes; others cannot be read).
tagged_pids() {
    grep -lzx "MOE_FSM_STEP_TAG=$1" /proc/[0-9]*/environ 2>/dev/null | cut -d/ -f3 | sort -n
}

rank_of() {
    # a process may end between listing and reading: the redirection's error is silenced too
    { tr '\0' '\n' < "/proc/$1/environ"; } 2>/dev/null | sed -n 's/^RANK=//p'
}

# Which processes of the step are running (pid, RANK, command line); each rank's stacks (from the files in STACKS_DIR
# where the rank wrote them there, else in its stderr) and log tail.
describe_tagged() {
    local p rank log pids stacks=${2:-}
    pids=$(tagged_pids "$1")
    for p in $pids; do
        rank=$(rank_of "$p")
        echo "  pid $p${rank:+ RANK=$rank}: $(tr '\0' ' ' < "/proc/$p/cmdline" 2>/dev/null | cut -c1-300)"
    done
    for p in $pids; do
        [ -n "$(rank_of "$p")" ] && kill -USR1 "$p" 2>/dev/null  # faulthandler: the rank's Python stacks
    done
    sleep 2
    for p in $pids; do
        rank=$(rank_of "$p")
        if [ -n "$rank" ] && [ -n "$stacks" ] && [ -s "$stacks/rank$rank-pid$p.txt" ]; then
            echo "  --- RANK=$rank (pid $p), its Python stacks:"
            sed 's/^/  | /' "$stacks/rank$rank-pid$p.txt"
        fi
        log=$(readlink "/proc/$p/fd/2" 2>/dev/null)
        if [ -n "$rank" ] && [ -f "$log" ]; then
            echo "  --- RANK=$rank (pid $p), the last lines of $log:"
            tail -n 40 "$log" | sed 's/^/  | /'
        fi
    done
}

end_tagged() {
    local tag=$1 session=$2 sig p
    for sig in TERM KILL; do
        [ -n "$session" ] && kill -s "$sig" -- "-$session" 2>/dev/null
        for p in $(tagged_pids "$tag"); do kill -s "$sig" "$p" 2>/dev/null; done
        if [ "$sig" = TERM ]; then
            for _ in 1 2 3 4 5; do [ -z "$(tagged_pids "$tag")" ] && break; sleep 1; done
        fi
    done
}

# distributed: the distributed checks and benchmark over NCCL on a machine of N GPUs (nvidia-h100-x2, -x4, ...).
#
#   OUT=/some/dir [NPROC=N] [BENCH_ARGS="..."] bench/gpu.sh distributed
#
# NPROC defaults to every GPU of the machine. Writes into $OUT:
#   env.txt     GPUs, topology, torch/NCCL versions, the NVLink-multicast and timeout variables as found
#   tests.log   the multi-process suite over NCCL (one process per GPU: worlds 2 and 4 where there are that
#               many GPUs) and the CUDA-graph capture test (2 GPUs)
#   bench.log   bench/bench_distributed.py output at world NPROC (BENCH_ARGS are added to its command line)
#   perf/       distributed_nccl_w$NPROC.json and .md (the table docs/perf/distributed.md shows)
# Each step runs under `step` (above) with its own limit, TESTS_S (default 270 s: the whole suite took 197-205 s at worlds 2 and 4 on 4 x H100) and BENCH_S (240 s; 0 runs the tests
# alone, e.g. beside another GPU job whose timings would be disturbed), so the whole ends inside the device tool's 10 minutes whatever hangs, and a hang names its step and ranks. Every process group
# times out after MOE_FSM_DIST_TIMEOUT (default 60 s) and NCCL's watchdog aborts a rank whose collective timed out
# (TORCH_NCCL_ASYNC_ERROR_HANDLING=1, heartbeat monitor TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC=90), both below the steps'
# limits; pytest gives each test TEST_TIMEOUT_S (150 s). The carried wheels (.whl) the machine lacks are installed
# into $SITE (/tmp/moe-fsm-site). Python is $PYTHON, else python3.
#
# NVLink multicast stays off: the machine sets NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and
# NVSHMEM_DISABLE_NVLS=1; this only checks them (and refuses to run without them, exit 3), it never sets, unsets
# or overrides them. Exit status 1 when the tests or the benchmark failed, 124 when a step reached its limit.
distributed() (
    set -uo pipefail
    [ -n "${OUT:-}" ] || { echo "gpu.sh distributed: set OUT to the directory for logs and results" >&2; exit 2; }
    for pair in NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1; do
        name=${pair%%=*}
        want=${pair#*=}
        if [ "${!name-}" != "$want" ]; then
            echo "refusing to run: $name is '${!name-<unset>}', expected $want as the machine sets it (NVLink multicast must stay off)" >&2
            exit 3
        fi
    done
    for pair in "TESTS_S=${TESTS_S-}" "BENCH_S=${BENCH_S-}"; do
        case "${pair#*=}" in
            *[!0-9]*) echo "gpu.sh distributed: ${pair%%=*} is '${pair#*=}'; accepted: a whole number of seconds (BENCH_S=0: no benchmark)" >&2; exit 2 ;;
        esac
    done
    mkdir -p "$OUT/perf"
    PY=${PYTHON:-python3}
    SITE=${SITE:-/tmp/moe-fsm-site}
    if compgen -G "$ROOT/.whl/*.whl" > /dev/null; then
        mapfile -t missing < <(missing_wheels "$PY" "$ROOT/.whl")
        if [ ${#missing[@]} -gt 0 ]; then
            mkdir -p "$SITE"
            "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${missing[@]}" \
                || { echo "gpu.sh distributed: pip could not install the carried wheels" >&2; exit 3; }
        fi
    fi

    export PYTHONPATH="$SITE:$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
    export MOE_FSM_DIST_BACKEND=nccl
    export MOE_FSM_DIST_TIMEOUT=${MOE_FSM_DIST_TIMEOUT:-60}
    export TORCH_NCCL_ASYNC_ERROR_HANDLING=1 TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC=${TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC:-90}
    export PYTHONUNBUFFERED=1
    TESTS_S=${TESTS_S:-270}
    BENCH_S=${BENCH_S:-240}
    NPROC=${NPROC:-$(timeout 60 "$PY" -c "import torch; print(torch.cuda.device_count())")}

    {
        date -u +%FT%TZ
        timeout 30 nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
        timeout 30 nvidia-smi topo -m
        timeout 60 "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', '.'.join(map(str, torch.cuda.nccl.version())), 'gpus', torch.cuda.device_count())"
        env | grep -E '^(NCCL_|TORCH_NCCL_|TORCH_SYMM_MEM_|NVSHMEM_|MOE_FSM_DIST_)' | sort
    } > "$OUT/env.txt" 2>&1

    status=0
    if "$PY" -c "import pytest, pytest_timeout" 2>/dev/null; then
        step tests "$TESTS_S" -- "$PY" -m pytest tests/distributed -m distributed -v -rs -p no:cacheprovider \
            --timeout "${TEST_TIMEOUT_S:-150}" > "$OUT/tests.log" 2>&1
    else
        echo "pytest or pytest-timeout is not installed: running the same suite through tests/distributed/dist_harness.py (no graph test)" > "$OUT/tests.log"
        step tests "$TESTS_S" -- "$PY" tests/distributed/dist_harness.py "$OUT/suite" 2 4 >> "$OUT/tests.log" 2>&1
    fi
    rc=$?
    [ $rc -eq 0 ] || status=$([ $rc -eq 124 ] && echo 124 || echo 1)
    grep -E "^gpu.sh: |^  (pid|---)" "$OUT/tests.log" | tail -n 40
    tail -n 5 "$OUT/tests.log"

    if [ "$BENCH_S" -eq 0 ]; then
        echo "gpu.sh distributed: BENCH_S=0: the benchmark is not run"
        exit $status
    fi
    # shellcheck disable=SC2086  # BENCH_ARGS is a list of arguments
    step bench "$BENCH_S" -- "$PY" bench/bench_distributed.py --nproc "$NPROC" --out "$OUT/perf" --timeout "$((BENCH_S - 15))" \
        ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1
    rc=$?
    [ $rc -eq 0 ] || [ $status -ne 0 ] || status=$([ $rc -eq 124 ] && echo 124 || echo 1)
    grep -E "^gpu.sh: |^  (pid|---)" "$OUT/bench.log" | tail -n 20
    tail -n 30 "$OUT/bench.log"
    exit $status
)

# experts-vs-vllm: GPU tests, `moe-fsm tune` of the named shapes into $OUT/cfg, the host path of a one-token call,
# then bench_experts_vs_vllm.py run with the freshly tuned table (carry .whl and the prepared .vllm_extract/).
# Each step has its own cap, so a slow one leaves the others their share: TEST_S (110), TUNE_S (230), 60 s for
# the host path, BENCH_S (220). TUNE_SHAPES picks the shapes. Writes $OUT/log_{tests,tune,host,bench}.txt, cfg/
# and the benchmark's tables.
experts_vs_vllm() (
    set -o pipefail
    OUT=${OUT:?set OUT to the directory for logs and results}
    export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$ROOT/src
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv | tee "$OUT/log_tests.txt"
    timeout "${TEST_S:-110}" python3 -m pytest -q -p no:cacheprovider -x tests/gpu/test_graph_engine.py tests/gpu/test_tune.py tests/gpu/test_triton_moe.py 2>&1 | tail -25 | tee -a "$OUT/log_tests.txt"
    export MOE_FSM_TRITON_CONFIG_DIR=$OUT/cfg
    timeout "${TUNE_S:-230}" python3 -m moe_fsm.cli.main tune --workers 14 --shape ${TUNE_SHAPES:-qwen3-30b-a3b mixtral-8x7b-fp8-tensor qwen3-30b-a3b-tp2 qwen3-30b-a3b-tp4 deepseek-v3-fp8-block qwen3-30b-a3b-fp8-channel mixtral-8x7b} 2>&1 | grep -v "cannot build" | tee "$OUT/log_tune.txt"
    timeout 60 python3 bench/bench_host_path.py 2>&1 | head -60 | tee "$OUT/log_host.txt"
    timeout "${BENCH_S:-220}" python3 bench/bench_experts_vs_vllm.py run --workers 14 --out-dir "$OUT" 2>&1 | tee "$OUT/log_bench.txt"
)

# hopper-prefill: the Hopper TMA grouped GEMMs' GPU tests, then bench_hopper_prefill.py at the prefill targets
# (Qwen3-30B-A3B and Mixtral-8x7B in bf16, DeepSeek-V3 with 128x128-block FP8, at 8192 tokens): the shipped config
# on the pointer-load kernels, the same tiles through the TMA kernels, and the TMA sweep (persistent, gathered
# input, paired gate/up loads, warp specialization). Carry .whl. The whole stays under 540 s:
#   header <= 20 s | tests TESTS_S (165 s; SIGINT, then killed 30 s later) after ~15 s of wheel/import checks |
#   bench BENCH_S (290 s): precompile in 14 processes <= COMPILE_S (110 s), no new measurement after BUDGET_S
#   (225 s) from the bench's start. Typical total ~470 s, worst ~530 s. BENCH_SHAPES and BENCH_TOKENS pick points.
# Writes $OUT/gpu-suite.{log,xml}, $OUT/summary.txt, $OUT/hopper.json, $OUT/hopper.log.
hopper_prefill() (
    OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
    export PYTHONUNBUFFERED=1
    nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader
    timeout 20 python3 -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, torch.cuda.get_device_name(), torch.cuda.get_device_capability())"

    # the suite installs the carried wheels the machine lacks into /tmp/moe-fsm-site: stop at the first failure
    SUITE_S=${TESTS_S:-165} TEST_TIMEOUT_S=${TEST_TIMEOUT_S:-100} OUT="$OUT" \
        suite .whl -- -x tests/gpu/test_triton_hopper.py 2>&1 | tail -30

    export PYTHONPATH=/tmp/moe-fsm-site:$ROOT/src
    timeout -s INT -k 10 "${BENCH_S:-290}" python3 bench/bench_hopper_prefill.py \
        --shapes ${BENCH_SHAPES:-qwen3-30b-a3b mixtral-8x7b deepseek-v3-fp8-block} --tokens ${BENCH_TOKENS:-8192} \
        --workers 14 --rep-ms 30 --compile-timeout-s "${COMPILE_S:-110}" --budget-s "${BUDGET_S:-225}" \
        --json "$OUT/hopper.json" 2>&1 | tee "$OUT/hopper.log" | grep --line-buffered -v "cannot build" | cut -c1-400
    echo "bench_hopper_prefill exit status ${PIPESTATUS[0]}; cannot build: $(grep -c 'cannot build' "$OUT/hopper.log")"
    grep "cannot build" "$OUT/hopper.log" | head -5 | cut -c1-400
    echo done
)

# transformers: the GPU tests of eager CUDA-graph replay and the compiled paths, the host cost of an eager one-token
# layer call (graphs, no graphs, transformers' implementations), a profile of whole eager forwards, and the eager
# forward at 1 / 32 / 2048 tokens with and without replay (carry .whl). Each stage has its own time limit and
# writes as it goes. STAGES (default "tests host profile forward") picks stages; also "hostpath"
# (bench_host_path.py: the host time of each layer of the call path), "ceiling" (the forward with free experts
# beside the others), "generate" (compiled generate(), free experts included, interleaved: a model copy per
# implementation) and "compiled" (the compiled one-token forward).
transformers() (
    OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
    STAGES=${STAGES:-tests host profile forward}
    has() { case " $STAGES " in *" $1 "*) return 0;; esac; return 1; }
    nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
    if has tests; then
        SUITE_S=${TESTS_S:-200} suite .whl -- tests/gpu/test_eager_graphs.py tests/gpu/test_block_graphs.py \
            tests/integrations/test_compile.py tests/integrations/test_transformers.py tests/integrations/test_block_graphs_cpu.py 2>&1 | tail -25
    fi
    export PYTHONPATH=/tmp/moe-fsm-site:$ROOT/src:$ROOT/bench
    B="python3 bench/bench_transformers.py --device cuda --dtype bfloat16"
    if has host; then
        timeout 90 $B --host-cost --tokens 1 --shape qwen3-30b-a3b --host-calls 50 --json "$OUT/host_cost.json" 2>&1 | grep -v USDT | tail -12
    fi
    if has profile; then
        timeout 90 python3 bench/profile_breakdown.py forward --shape qwen3-30b-a3b --layers 4 --tokens 1 --json "$OUT/profile_forward.json" 2>&1 | grep -v USDT | tail -60
    fi
    if has forward; then
        timeout 120 $B --shape qwen3-30b-a3b --layers 4 --tokens 1 32 2048 --repeats 10 --json "$OUT/forward.json" 2>&1 | grep -v USDT | tail -30
        MOE_FSM_EAGER_GRAPHS=0 timeout 60 $B --shape qwen3-30b-a3b --layers 4 --tokens 1 32 2048 --repeats 10 --impls grouped_mm moe_fsm \
            --json "$OUT/forward_no_graphs.json" 2>&1 | grep -v USDT | tail -12
    fi
    if has hostpath; then
        timeout 90 python3 bench/bench_host_path.py --json "$OUT/host_path.json" 2>&1 | grep -v USDT | tail -40
    fi
    if has ceiling; then
        timeout "${CEILING_S:-150}" $B --shape qwen3-30b-a3b --layers 4 --tokens 1 32 2048 --repeats 5 --rounds "${ROUNDS:-7}" \
            --impls batched_mm grouped_mm moe_fsm --ceiling --json "$OUT/forward_ceiling.json" 2>&1 | grep -v USDT | tail -24
    fi
    if has compiled; then
        timeout 200 $B --shape qwen3-30b-a3b --layers 4 --tokens 1 --repeats 10 --impls batched_mm grouped_mm moe_fsm \
            --compile reduce-overhead --json "$OUT/compiled_forward.json" 2>&1 | grep -v USDT | tail -30
    fi
    if has generate; then
        timeout "${GENERATE_S:-300}" $B --generate --layers 4 --generate-impls ${GENERATE_IMPLS:-batched_mm grouped_mm moe_fsm free_experts} \
            --generate-shapes ${GENERATE_SHAPES:-qwen3-30b-a3b gpt-oss-20b} --generate-repeats 2 --generate-rounds "${GENERATE_ROUNDS:-5}" \
            --batch ${GENERATE_BATCH:-1 8} \
            --json "$OUT/generate.json" 2>&1 | grep -v USDT | tail -30
    fi
    echo done
)

# weight-quantized [BUDGET_S] [EXTRACT] [-- BENCH_ARGS...]: GPU tests (sharded over processes, compiles in
# parallel), the presets with --device cuda, a compile-only pass of the benchmark (fills Triton's cache), then the
# timed benchmark alone on the GPU. EXTRACT is where `bench_weight_quantized.py prepare` put the peers (default its
# own, .xfer/wq_peers). Everything lands in $OUT: summary.txt, logs.tar.gz, wq.json, wq.md, wq_table.json.
# Phases run under timeouts that keep the whole call inside BUDGET_S (default 540). WQ_SKIP_TESTS=1 skips the tests
# and presets; WQ_SHARDS sets the number of pytest processes (default 4: each holds up to ~10 GB of GPU memory at the
# gpt-oss shape, and 8 shards beside the compile-only passes ran the H100 out of memory).
weight_quantized() (
    BUDGET=540
    EXTRACT=$ROOT/.xfer/wq_peers
    if [ $# -gt 0 ] && [ "$1" != "--" ]; then BUDGET=$1; shift; fi
    if [ $# -gt 0 ] && [ "$1" != "--" ]; then EXTRACT=$1; shift; fi
    [ "${1:-}" = "--" ] && shift
    case "$BUDGET" in ''|*[!0-9]*) echo "gpu.sh weight-quantized: BUDGET_S is '$BUDGET'; accepted: a whole number of seconds" >&2; exit 2 ;; esac
    BENCH_ARGS=("$@")
    OUT=${OUT:-/tmp/wq_out}
    W=/tmp/wq_work
    mkdir -p "$OUT" "$W"
    export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
    T0=$(date +%s)
    left() { echo $((BUDGET - ($(date +%s) - T0))); }
    S="$OUT/summary.txt"
    {
        echo "== $(date -u +%FT%TZ)"; nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
        python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
    } >"$S" 2>&1

    pids=()
    if [ "${WQ_SKIP_TESTS:-0}" != 1 ]; then
        SHARDS=${WQ_SHARDS:-4}
        python3 -m pytest -q --co -p no:cacheprovider tests/gpu/test_triton_wq.py 2>/dev/null | grep '::' >"$W/ids.txt"
        echo "tests collected: $(wc -l <"$W/ids.txt")" >>"$S"
        for i in $(seq 0 $((SHARDS - 1))); do
            awk -v n="$SHARDS" -v i="$i" 'NR % n == i' "$W/ids.txt" >"$W/ids_$i.txt"
            # node ids hold spaces ("int4 g128"): one argument per line
            ( mapfile -t ids <"$W/ids_$i.txt"
              timeout 300 python3 -m pytest -q -p no:cacheprovider -rf --tb=short "${ids[@]}" >"$W/pytest_$i.log" 2>&1
              echo "rc=$?" >>"$W/pytest_$i.log" ) &
            pids+=($!)
        done
        ( for p in gpt-oss-20b qwen3-30b-a3b-gptq-int4 deepseek-v3; do
              echo "### moe-fsm run --device cuda --preset $p --layers 4 --tokens 256"
              timeout 150 python3 -m moe_fsm run --device cuda --preset "$p" --layers 4 --tokens 256 --trace-dir "$W/traces_$p"
              echo "rc=$?"
          done >"$W/presets.log" 2>&1 ) &
        pids+=($!)
    fi
    # compile-only benchmark passes, in parallel with the tests (their kernels land in Triton's on-disk cache)
    for part in "gpt-oss-20b MXFP4|1 8 32 128 512 2048 8192" "qwen3-30b-a3b GPTQ-Int4 g128|1 8 32 128 512 2048 8192"; do
        row=${part%%|*}; toks=${part#*|}
        ( timeout 280 python3 bench/bench_weight_quantized.py run --compile-only --extract "$EXTRACT" --out "$W/warm" --rows "$row" \
              --tokens $toks "${BENCH_ARGS[@]}" >"$W/warm_${row%% *}_${toks%% *}.log" 2>&1; echo "rc=$?" >>"$W/warm_${row%% *}_${toks%% *}.log" ) &
        pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p"; done
    echo "== parallel phase done at $(( $(date +%s) - T0 )) s" >>"$S"
    {
        echo "== pytest"; for f in "$W"/pytest_*.log; do tail -n 25 "$f" | grep -E "passed|failed|error|FAILED|ERROR|rc=" ; done
        echo "== presets"; grep -vE "^\s*$" "$W/presets.log" 2>/dev/null | tail -n 60
        echo "== compile-only"; for f in "$W"/warm_*.log; do echo "-- $f"; grep -vE "^\s*$" "$f" | tail -n 8; done
    } >>"$S" 2>&1

    # the timed benchmark, alone on the GPU
    B=$(( $(left) - 25 ))
    if [ "$B" -gt 60 ]; then
        timeout "$B" python3 bench/bench_weight_quantized.py run --extract "$EXTRACT" --out "$OUT" --write-table "$OUT/wq_table.json" \
            --rep-ms 40 "${BENCH_ARGS[@]}" >"$W/bench.log" 2>&1
        echo "== bench rc=$? at $(( $(date +%s) - T0 )) s (limit ${B} s)" >>"$S"
        grep -E "T=|unavailable|failed|Error|\[" "$W/bench.log" | tail -n 70 >>"$S"
    else
        echo "== bench skipped: ${B} s left" >>"$S"
    fi
    tar -czf "$OUT/logs.tar.gz" -C "$W" --exclude='*.json' . 2>/dev/null
    tar -czf "$OUT/traces.tar.gz" -C "$W" $(cd "$W" && ls -d traces_* 2>/dev/null) 2>/dev/null
    echo "== end at $(( $(date +%s) - T0 )) s" >>"$S"
    tail -n 120 "$S"
)

# flashinfer-build start|follow: FlashInfer's SM90 CUTLASS fused-MoE module built on the GPU machine, in two
# phases because the build outlives one call (carry the runtime pack made by tools/build_flashinfer_sm90.py
# --pack-runtime, FLASHINFER_PACK (default .xfer/fi.tar.xz), and the apache-tvm-ffi wheel in TVM_FFI_WHEELS
# (default .xfer)):
#   start   unpack, start `moe-fsm flashinfer build` (DTYPES, default bf16,fp8,fp8_block) under setsid, follow it
#           for WAIT_S (540)
#   follow  follow the running build for WAIT_S, then (when it is done) its GPU tests (TESTS, TEST_S 200) and
#           bench_experts_vs_vllm.py run (BENCH_ARGS, default --columns ours,flashinfer; BENCH_S 240; NO_BENCH=1
#           skips it)
# Everything worth keeping goes under $OUT (build.log compressed, manifest, the module unless NO_MODULE_BACK=1,
# test and bench logs). Exit status 3 when the build failed without a staged module to test.
flashinfer_build() (
    set -o pipefail
    OUT=${OUT:?set OUT to the directory for logs and results}
    export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$ROOT/src
    PACK=${FLASHINFER_PACK:-.xfer/fi.tar.xz}
    WHEELS=${TVM_FFI_WHEELS:-.xfer}
    STATE=/tmp/moe-fsm-flashinfer-build
    FI_OUT=${HOME}/.cache/moe-fsm/flashinfer
    mkdir -p "$STATE"
    case "${1:-}" in
        start)
            tar -xJf "$PACK" -C /tmp/site || exit 1
            python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$WHEELS"/apache_tvm_ffi-*.whl || exit 1
            nvidia-smi --query-gpu=name,clocks.sm,memory.total --format=csv
            free -g | head -2; nproc
            setsid nohup python3 -m moe_fsm.cli.main flashinfer build --dtypes "${DTYPES:-bf16,fp8,fp8_block}" \
                --workspace "$STATE/ws" > "$STATE/build.out" 2>&1 < /dev/null &
            echo $! > "$STATE/pid"
            ;;
        follow) ;;
        *) echo "gpu.sh flashinfer-build: say start or follow, not '${1:-}'" >&2; exit 2 ;;
    esac
    [ -f "$STATE/pid" ] || { echo "gpu.sh flashinfer-build: no build was started on this machine: run start first" >&2; exit 2; }
    pid=$(cat "$STATE/pid")
    deadline=$((SECONDS + ${WAIT_S:-540}))
    while kill -0 "$pid" 2>/dev/null && [ $SECONDS -lt $deadline ]; do sleep 5; done
    tail -n 4 "$STATE/build.out"
    dir=$(ls -d "$FI_OUT"/*/sm90 2>/dev/null | head -1)
    if kill -0 "$pid" 2>/dev/null; then echo "BUILD STILL RUNNING"; exit 0; fi
    echo "BUILD FINISHED"; tail -n 30 "$STATE/build.out"
    for f in build.log manifest.json build-failed.json; do [ -f "$dir/$f" ] && xz -c "$dir/$f" > "$OUT/$f.xz"; done
    cp "$STATE/build.out" "$OUT/" 2>/dev/null
    if [ ! -f "$dir/manifest.json" ]; then
        staging=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1])).get('staging',''))" "$dir/build-failed.json" 2>/dev/null)
        [ -n "$staging" ] || exit 3
        echo "NOT INSTALLED; testing the unchecked module in $staging"; export MOE_FSM_FLASHINFER_PREBUILT=$staging; dir=$staging
    fi
    [ -n "${NO_MODULE_BACK:-}" ] || cp "$dir/moe_fsm_fused_moe_90.so" "$OUT/"
    timeout "${TEST_S:-200}" python3 -m pytest -q -p no:cacheprovider -rs ${TESTS:-tests/gpu/test_flashinfer_cutlass.py} 2>&1 | tail -30 | tee "$OUT/log_tests.txt"
    [ -n "${NO_BENCH:-}" ] || timeout "${BENCH_S:-240}" python3 bench/bench_experts_vs_vllm.py run ${BENCH_ARGS:---columns ours,flashinfer} --out-dir "$OUT" 2>&1 | tail -40 | tee "$OUT/log_bench.txt"
)

SUBCOMMANDS="suite, step, distributed, experts-vs-vllm, hopper-prefill, transformers, weight-quantized, flashinfer-build"
command=${1:-}
shift $(( $# > 0 ? 1 : 0 ))
case "$command" in
    suite) suite "$@" ;;
    step) step "$@" ;;
    distributed) distributed "$@" ;;
    experts-vs-vllm) experts_vs_vllm "$@" ;;
    hopper-prefill) hopper_prefill "$@" ;;
    transformers) transformers "$@" ;;
    weight-quantized) weight_quantized "$@" ;;
    flashinfer-build) flashinfer_build "$@" ;;
    -h|--help|help) sed -n '2,/^set -u$/p' "$ROOT/bench/gpu.sh" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "bench/gpu.sh: unknown subcommand '$command'; accepted: $SUBCOMMANDS (--help says what each does)" >&2; exit 2 ;;
esac
