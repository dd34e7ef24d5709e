#!/usr/bin/env bash
# One GPU call for the weight-quantized MoE (issue 19): GPU tests (sharded over processes, compiles in parallel),
# the presets with --device cuda, a compile-only pass of the benchmark (fills Triton's cache), then the timed
# benchmark alone on the GPU. Everything lands in $OUT: summary.txt, logs.tar.gz, wq.json, wq.md, wq_table.json.
#
#   bash bench/wq_gpu_session.sh [BUDGET_S] [EXTRACT] [-- bench args...]
#
# Phases run under timeouts that keep the whole call inside BUDGET_S (default 540). WQ_SKIP_TESTS=1 skips the
# tests and presets; WQ_SHARDS sets the number of pytest processes (default 4: each holds up to ~10 GB of GPU
# memory at the gpt-oss shape, and 8 shards beside the compile-only passes ran the H100 out of memory).
set -u
BUDGET=${1:-540}
EXTRACT=${2:-../../.xfer/i19/wq_peers}
shift 2 2>/dev/null || true
[ "${1:-}" = "--" ] && shift
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
  ( timeout 280 python3 bench/bench_wq.py run --compile-only --extract "$EXTRACT" --out "$W/warm" --rows "$row" \
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
  timeout "$B" python3 bench/bench_wq.py run --extract "$EXTRACT" --out "$OUT" --write-table "$OUT/wq_table.json" \
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
