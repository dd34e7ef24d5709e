#!/usr/bin/env bash
# Issue 27 on the GPU machine (run from the worktree root; carried: .xfer/i27 with the FlashInfer pack
# and the apache-tvm-ffi wheel). Two phases, because the build outlives one call:
#   bench/gpu_issue27.sh start   unpack, start `moe-fsm flashinfer build` under setsid, follow it for WAIT_S
#   bench/gpu_issue27.sh follow  follow the running build for WAIT_S, then (when it is done) GPU tests + bench
# Everything worth keeping goes under $OUT (build.log compressed, manifest, module, test and bench logs).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
XFER=${XFER:-../../.xfer/i27}
STATE=/tmp/i27
FI_OUT=${HOME}/.cache/moe-fsm/flashinfer
mkdir -p $STATE
if [ "$1" = start ]; then
  tar -xJf $XFER/flashinfer-build.tar.xz -C /tmp/site || exit 1
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $XFER/apache_tvm_ffi-*.whl || exit 1
  nvidia-smi --query-gpu=name,clocks.sm,memory.total --format=csv
  free -g | head -2; nproc
  setsid nohup python3 -m moe_fsm.cli.main flashinfer build --dtypes ${DTYPES:-bf16,fp8,fp8_block} \
    --workspace $STATE/ws > $STATE/build.out 2>&1 < /dev/null &
  echo $! > $STATE/pid
fi
pid=$(cat $STATE/pid)
deadline=$((SECONDS + ${WAIT_S:-540}))
while kill -0 $pid 2>/dev/null && [ $SECONDS -lt $deadline ]; do sleep 5; done
tail -n 4 $STATE/build.out
dir=$(ls -d $FI_OUT/*/sm90 2>/dev/null | head -1)
if kill -0 $pid 2>/dev/null; then echo "BUILD STILL RUNNING"; exit 0; fi
echo "BUILD FINISHED"; tail -n 30 $STATE/build.out
for f in build.log manifest.json build-failed.json; do [ -f $dir/$f ] && xz -c $dir/$f > $OUT/$f.xz; done
cp $STATE/build.out $OUT/ 2>/dev/null
if [ ! -f $dir/manifest.json ]; then
  staging=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1])).get('staging',''))" $dir/build-failed.json 2>/dev/null)
  [ -n "$staging" ] || exit 3
  echo "NOT INSTALLED; testing the unchecked module in $staging"; export MOE_FSM_FLASHINFER_PREBUILT=$staging; dir=$staging
fi
[ -n "$NO_MODULE_BACK" ] || cp $dir/moe_fsm_fused_moe_90.so $OUT/
[ -z "$TESTS" ] && TESTS=tests/gpu/test_flashinfer_cutlass.py
timeout ${TEST_S:-200} python3 -m pytest -q -p no:cacheprovider -rs $TESTS 2>&1 | tail -30 | tee $OUT/log_tests.txt
[ -n "$NO_BENCH" ] || timeout ${BENCH_S:-240} python3 bench/bench_vs_vllm.py run ${BENCH_ARGS:---columns ours,flashinfer} --out-dir $OUT 2>&1 | tail -40 | tee $OUT/log_bench.txt
