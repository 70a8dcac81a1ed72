#!/usr/bin/env bash
# tensorwire on a GPU host without network: doctor, the GPU->GPU bench, the GPU tests; results in $OUT.
#
#   On a 2-GPU host (repo root, wheels carried in .whl/):   bash bench/gpu_run.sh
#   CPU dry run of the same steps (tiny sizes, gloo):       bash bench/gpu_run.sh --cpu
#   Download the wheels into .whl/ (a host with network):   bash bench/gpu_run.sh --fetch-wheels
#
# Steps (each bounded by `timeout`, so the whole run ends inside 10 minutes; a failing step does not stop
# the next): 1. install .whl/*.whl into a site directory under $TMPDIR; 2. preflight + `tensorwire doctor` (text and JSON);
# 3. `tensorwire bench --device cuda` GPU0 -> GPU1 with tensorwire-ucx, NCCL, raw ucxx (by worker address and
# through a listener), gRPC (unary, stream; capped at $GRPC_MAX, they take seconds per message) and
# tensorwire-tcp (staged through pinned memory);
# 4. `pytest -m gpu tests/p2p/test_gpu.py`; 5. the Link pipeline example vs NCCL; 6. torch.distributed on the
# GPUs, backend tensorwire vs NCCL (bench/bench_distributed_gpu.py).
# Files written to $OUT: doctor.txt doctor.json bench.log
# gpu_nvlink.md gpu_nvlink.json gpu_nvlink.png gpu_tests.log pipeline_gpu.* distributed_gpu.*
# Knobs (environment): STEPS=bench,tests,staged,pipeline,distributed (a subset picks steps), BACKENDS, MIN_SIZE, MAX_SIZE,
# GRPC_MAX, SCALE (iterations), T_BENCH / T_TESTS (timeouts in s), OUT.
# NVLink multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1).
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 2
MODE=gpu
case "${1:-}" in
  --cpu) MODE=cpu ;;
  --fetch-wheels) MODE=fetch ;;
  "") ;;
  *) echo "usage: bash bench/gpu_run.sh [--cpu | --fetch-wheels]" >&2; exit 2 ;;
esac
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1

if [ "$MODE" = fetch ]; then
  # The ucxx stack (UCX, ucxx, RMM for CUDA 13) plus what tensorwire needs newer than a GPU image may have.
  mkdir -p .whl
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
    "ucxx-cu13==0.52.*" "libucxx-cu13==0.52.*" "libucx-cu13>=1.19,<1.22" "librmm-cu13==26.10.*" \
    "rmm-cu13==26.10.*" "rapids-logger==0.3.*" "grpcio==1.85.1" "grpcio-health-checking==1.85.1" "protobuf>=7.35.1" \
    "mypy==2.4.1" "mypy_extensions>=1.0" "pathspec>=1.0" "librt>=0.16" "ast-serialize>=0.12.1,<1"
  # (mypy and what it needs: mypyc compiles the hot path there, `make native`)
  du -sh .whl
  exit 0
fi

OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
SITE=${TMPDIR:-/tmp}/tensorwire-site
if ls .whl/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" \
    .whl/*.whl; then
  export PYTHONPATH=$SITE:$PWD
else
  [ -d .whl ] && echo "WARNING: no usable wheels in .whl/ (wrong Python/platform?); using what is installed" >&2
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi

if [ "$MODE" = gpu ]; then
  DEVICE=cuda; BACKENDS=${BACKENDS:-tensorwire-ucx,tensorwire-ucx-isend,torch-nccl,raw-ucxx,raw-ucxx-cm,grpc-stream,grpc-unary,tensorwire-tcp}
  SIZES=(--min-size "${MIN_SIZE:-4K}" --max-size "${MAX_SIZE:-1G}"); GRPC_MAX=${GRPC_MAX:-64M}; SCALE=${SCALE:-2}
  T_BENCH=${T_BENCH:-330}; T_TESTS=${T_TESTS:-240}
else
  DEVICE=cpu; BACKENDS=tensorwire-ucx,torch-gloo,raw-ucxx,raw-ucxx-cm,grpc-stream,grpc-unary,tensorwire-tcp
  SIZES=(--min-size 4K --max-size 256K); GRPC_MAX=64K; SCALE=0.05
  T_BENCH=240; T_TESTS=120
fi

{
  echo "== preflight ($MODE) $(date -u +%FT%TZ)"
  python3 - <<'EOF'
import importlib, sys
print("python", sys.version.split()[0])
for mod in ("torch", "numpy", "grpc", "grpc_health.v1.health", "google.protobuf", "ucxx", "matplotlib", "pytest",
            "pytest_timeout", "tensorwire"):
    try:
        m = importlib.import_module(mod)
        print(f"  {mod:<24} {getattr(m, '__version__', 'ok')}")
    except Exception as exc:  # noqa: BLE001
        print(f"  {mod:<24} MISSING: {exc}  (carry its wheel in .whl/: bash bench/gpu_run.sh --fetch-wheels)")
import torch
print("  cuda", torch.version.cuda, "devices", torch.cuda.device_count(),
      [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
EOF
  command -v nvidia-smi >/dev/null && { nvidia-smi -L; nvidia-smi topo -m; }
  echo
  echo "== tensorwire doctor"
  timeout 40 python3 -m tensorwire doctor
} > "$OUT/doctor.txt" 2>&1
timeout 30 python3 -m tensorwire doctor --json > "$OUT/doctor.json" 2>/dev/null
cat "$OUT/doctor.txt"

STEPS=${STEPS:-bench,tests,staged,pipeline,distributed}
has() { case ",$STEPS," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }

if has tests; then
  echo "== pytest (gpu marker + staging): tests/p2p/test_gpu.py tests/p2p/test_staging.py tests/tools/test_staging_bench.py"
  timeout "$T_TESTS" python3 -m pytest -q -rfEs -p no:cacheprovider tests/p2p/test_gpu.py tests/p2p/test_staging.py \
    tests/tools/test_staging_bench.py 2>&1 | tee "$OUT/gpu_tests.log"
  echo "pytest exit: ${PIPESTATUS[0]}" | tee -a "$OUT/gpu_tests.log"
fi

if has bench; then
  echo "== tensorwire bench --device $DEVICE ($BACKENDS)"
  timeout "$T_BENCH" python3 -m tensorwire bench --device "$DEVICE" --backends "$BACKENDS" "${SIZES[@]}" \
    --grpc-max-size "$GRPC_MAX" --iters-scale "$SCALE" --timeout 150 --memcheck-steps 1000 --no-progress \
    --json "$OUT/gpu_nvlink.json" --markdown "$OUT/gpu_nvlink.md" --plot "$OUT/gpu_nvlink.png" \
    2>&1 | tee "$OUT/bench.log"
  echo "bench exit: ${PIPESTATUS[0]}" | tee -a "$OUT/bench.log"
fi

if has staged && [ "$MODE" = gpu ]; then
  echo "== bench/bench_staged_gpu.py (TCP-staged GPU path vs pinned copies and the socket)"
  timeout 150 python3 bench/bench_staged_gpu.py --out "$OUT/staged_gpu.md" --json "$OUT/staged_gpu.json" \
    2>&1 | tee "$OUT/staged.log"
fi

if has pipeline && [ "$MODE" = gpu ]; then
  echo "== bench/bench_pipeline_gpu.py (torchrun, 2 stages, one per GPU)"
  # one job, the variants interleaved step by step (a load change weighs on all of them alike)
  timeout 240 python3 -m torch.distributed.run --standalone --nproc-per-node 2 bench/bench_pipeline_gpu.py \
    --hidden 4096 --batch 4096 --microbatches 4 --steps 10 --warmup 3 --variants tensorwire,tensorwire-blocking,nccl,grpc \
    --out-md "$OUT/pipeline_gpu.md" --out-json "$OUT/pipeline_gpu.json" 2>&1 | tail -30 | tee "$OUT/pipeline_gpu.log"
fi
if has distributed && [ "$MODE" = gpu ]; then
  echo "== bench/bench_distributed_gpu.py (torch.distributed: backend tensorwire vs NCCL, one GPU per rank)"
  timeout 250 python3 bench/bench_distributed_gpu.py --timeout 240 --out "$OUT/distributed_gpu.md" 2>&1 \
    | tail -40 | tee "$OUT/distributed_gpu.log"
fi
ls -l "$OUT"
