#!/usr/bin/env bash
# The distributed checks and benchmark over NCCL on a machine of N GPUs (nvidia-h200-x2, -x4, -x8).
#
#   OUT=/some/dir [NPROC=N] bash bench/gpu_distributed.sh
#
# Run from the repository root; NPROC defaults to every GPU of the machine. Writes into $OUT:
#   env.txt           GPUs, topology, torch/NCCL versions, the NVLink-multicast variables as found
#   tests.log         the multi-process suite over NCCL (one process per GPU: worlds 2 and 4 where there
#                     are that many GPUs) and the CUDA-graph capture test (2 GPUs)
#   bench.log         bench/bench_distributed.py output at world NPROC
#   perf/             distributed_nccl_w$NPROC.json and .md (copy into docs/perf/ to record the run)
# Each step has its own time limit (tests 250 s, benchmark 300 s), so one call fits in the device
# tool's 10 minutes; docs/perf/distributed_todo.md has the exact calls.
#
# NVLink multicast stays off: the machine sets NCCL_NVLS_ENABLE=0,
# TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1; this script only
# checks them (and refuses to run without them), it never sets, unsets or overrides them.
set -uo pipefail

: "${OUT:?set OUT to the directory for logs and results}"
mkdir -p "$OUT/perf"

for pair in NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1; do
  name=${pair%%=*}
  want=${pair#*=}
  if [ "${!name-}" != "$want" ]; then
    echo "refusing to run: $name is '${!name-<unset>}', expected $want as the machine sets it (NVLink multicast must stay off)" >&2
    exit 3
  fi
done

export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export MOE_FSM_DIST_BACKEND=nccl
export MOE_FSM_DIST_TIMEOUT=120
export PYTHONUNBUFFERED=1
NPROC=${NPROC:-$(python -c "import torch; print(torch.cuda.device_count())")}

{
  date -u +%FT%TZ
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
  nvidia-smi topo -m
  python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', '.'.join(map(str, torch.cuda.nccl.version())), 'gpus', torch.cuda.device_count())"
  env | grep -E '^(NCCL_|TORCH_SYMM_MEM_|NVSHMEM_)' | sort
} > "$OUT/env.txt" 2>&1

status=0
if python -c "import pytest" 2>/dev/null; then
  timeout 250 python -m pytest tests/distributed -m distributed -v -rs -p no:cacheprovider > "$OUT/tests.log" 2>&1 || status=1
else
  echo "pytest is not installed: running the same suite through tests/distributed/dist_harness.py (no graph test)" > "$OUT/tests.log"
  timeout 250 python tests/distributed/dist_harness.py "$OUT/suite" 2 4 >> "$OUT/tests.log" 2>&1 || status=1
fi
tail -n 5 "$OUT/tests.log"

timeout 300 python bench/bench_distributed.py --nproc "$NPROC" --out "$OUT/perf" --timeout 290 > "$OUT/bench.log" 2>&1 || status=1
tail -n 20 "$OUT/bench.log"
exit $status
