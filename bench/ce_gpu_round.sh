#!/usr/bin/env bash
# One round of the copy-engine path's GPU work on a GPU host without network: GPU tests, the copy-engine
# benchmark, and (with two GPUs) the torch.distributed benchmark against NCCL. Results in $OUT.
#
#   bash bench/ce_gpu_round.sh            (repo root; grpc wheels carried in .whl/: bash bench/gpu_run.sh --fetch-wheels)
#
# Knobs: NCCL_CAPTURE=1 (also try NCCL's captured step), STEPS=tests,ce,graph,profile,dist (a subset picks steps; add
# multi for the N-GPU benchmark, bench/bench_multi_gpu.py, and overlap, bench/bench_overlap_gpu.py), MACHINE (names the result files),
# PROFILE_BYTES / PROFILE_COPY (the profile's message sizes, and copy calls: generic, dtod).
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 2
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
SITE=${TMPDIR:-/tmp}/tensorwire-site
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl && export PYTHONPATH=$SITE:$PWD
else
  export PYTHONPATH=$PWD
fi
STEPS=${STEPS:-tests,ce,graph,profile,dist}
MACHINE=${MACHINE:-gpu}
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
echo "GPUs: $NGPU"
if [[ ,$STEPS, == *,tests,* ]]; then
  echo "=== pytest -m gpu (copy-engine tests)"
  timeout 300 python3 -m pytest -m gpu tests/distributed/test_copyengine_gpu.py -q -p no:cacheprovider -rA \
    >"$OUT/ce_gpu_tests_$MACHINE.log" 2>&1
  grep -E "^(PASSED|FAILED|ERROR)|passed|failed" "$OUT/ce_gpu_tests_$MACHINE.log" | tail -12
fi
if [[ ,$STEPS, == *,ce,* ]]; then
  echo "=== bench/bench_ce_gpu.py"
  timeout 240 python3 -m torch.distributed.run --standalone --nproc-per-node 2 bench/bench_ce_gpu.py \
    --out "$OUT/ce-gpu_$MACHINE.md" >"$OUT/ce-gpu_$MACHINE.log" 2>&1
  tail -12 "$OUT/ce-gpu_$MACHINE.log"
fi
if [[ ,$STEPS, == *,graph,* ]]; then
  # with NCCL_CAPTURE (two GPUs), NCCL's step is captured too; a stall prints every thread's stack (NCCL may hang
  # where tensorwire does not)
  capture=(); stall=190
  if [ "$NGPU" -ge 2 ] && [ -n "${NCCL_CAPTURE:-}" ]; then capture=(--nccl-capture); fi
  echo "=== bench/bench_graph_gpu.py ${capture[*]}"
  NCCL_DEBUG=WARN timeout 200 python3 -m torch.distributed.run --standalone --nproc-per-node 2 bench/bench_graph_gpu.py \
    --steps 10 "${capture[@]}" --stall-s "$stall" --teardown-s 20 --out "$OUT/graph-gpu_$MACHINE.md" >"$OUT/graph-gpu_$MACHINE.log" 2>&1
  echo "exit $?"
  grep -E "^\[graph bench\]|capture failed|^\||NCCL WARN|File |Thread|Stack" "$OUT/graph-gpu_$MACHINE.log" | tail -60
fi
if [[ ,$STEPS, == *,overlap,* ]] && [ "$NGPU" -ge 2 ]; then
  echo "=== bench/bench_overlap_gpu.py"
  timeout 240 python3 -m torch.distributed.run --standalone --nproc-per-node 2 bench/bench_overlap_gpu.py \
    --machine "$MACHINE" --out "$OUT/overlap-gpu_$MACHINE.md" >"$OUT/overlap-gpu_$MACHINE.log" 2>&1
  echo "exit $?"; tail -25 "$OUT/overlap-gpu_$MACHINE.log"
fi
if [[ ,$STEPS, == *,profile,* ]]; then
  echo "=== bench/profile_ce_host.py"
  for size in ${PROFILE_BYTES:-65536 1048576}; do
    for call in ${PROFILE_COPY:-generic}; do
      log="$OUT/profile_${MACHINE}_${size}_$call.log"
      timeout 120 python3 -m torch.distributed.run --standalone --nproc-per-node 2 bench/profile_ce_host.py \
        --bytes "$size" --iters 1000 --copy-call "$call" --driver-times --levels >"$log" 2>&1
      grep -E "^piece|host time per call|CPU clock|driver |level |one-way|part in its messages|pair.s lock|host.s calls" "$log"
    done
  done
fi
if [[ ,$STEPS, == *,dist,* ]] && [ "$NGPU" -ge 2 ]; then
  echo "=== bench/bench_distributed_gpu.py (p2p, pipelining)"
  timeout 330 python3 bench/bench_distributed_gpu.py --parts p2p,pipelining --machine "$MACHINE" --timeout 320 \
    --out "$OUT/distributed-gpu_$MACHINE.md" >"$OUT/distributed-gpu_$MACHINE.log" 2>&1
  tail -40 "$OUT/distributed-gpu_$MACHINE.log"
fi
if [[ ,$STEPS, == *,multi,* ]] && [ "$NGPU" -ge 2 ]; then
  echo "=== bench/bench_multi_gpu.py ($NGPU GPUs: pipelining, ring)"
  timeout 420 python3 bench/bench_multi_gpu.py --machine "$MACHINE" --timeout 400 \
    --out "$OUT/multi-gpu_$MACHINE.md" >"$OUT/multi-gpu_$MACHINE.log" 2>&1
  tail -40 "$OUT/multi-gpu_$MACHINE.log"
fi
