#!/usr/bin/env bash
# The distributed checks and benchmark over NCCL on a 2-GPU machine (nvidia-h200-x2).
#
#   OUT=/some/dir bash bench/gpu_distributed.sh
#
# Run from the repository root. Writes into $OUT:
#   env.txt           GPUs, topology, torch/NCCL versions, the NVLink-multicast variables as found
#   tests.log         the multi-process suite over NCCL (one process per GPU; world 4 is skipped on 2 GPUs)
#   bench.log         bench/bench_distributed.py output
#   perf/             distributed_nccl_w2.json and .md (copy into docs/perf/ to record the run)
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

{
  date -u +%FT%TZ
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
  nvidia-smi topo -m
  python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', '.'.join(map(str, torch.cuda.nccl.version())), 'gpus', torch.cuda.device_count())"
  env | grep -E '^(NCCL_|TORCH_SYMM_MEM_|NVSHMEM_)' | sort
} > "$OUT/env.txt" 2>&1

status=0
if python -c "import pytest" 2>/dev/null; then
  timeout 300 python -m pytest tests/distributed -m distributed -v -p no:cacheprovider > "$OUT/tests.log" 2>&1 || status=1
else
  echo "pytest is not installed: running the same suite through tests/distributed/dist_harness.py" > "$OUT/tests.log"
  timeout 300 python tests/distributed/dist_harness.py "$OUT/suite" 2 >> "$OUT/tests.log" 2>&1 || status=1
fi
tail -n 3 "$OUT/tests.log"

timeout 240 python bench/bench_distributed.py --nproc 2 --out "$OUT/perf" --timeout 230 > "$OUT/bench.log" 2>&1 || status=1
tail -n 12 "$OUT/bench.log"
exit $status
