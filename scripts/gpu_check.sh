#!/usr/bin/env bash
# The device check, for a machine with a CUDA GPU and a Python that has torch with CUDA:
#   1. the `gpu` tests (CUDA graphs vs eager, FlashAttention varlen vs SDPA, sampling on the
#      device, the engine's greedy tokens on the device);
#   2. bench.gpu (decode with and without graphs, prefill, the engine; vs the device's limits);
#   3. bench.serving --quick on the device (the gateway vs the bare engine, bf16).
# Each step has its own time limit and log; a failed step does not stop the next.
#
#   OUT=dir scripts/gpu_check.sh      (default OUT: run/gpu-check)
#   STEPS="pytest_gpu serving_gpu" scripts/gpu_check.sh     (a subset)
#
# Wheels of packages the machine lacks can be put in .whl/ (git-ignored): they are installed
# into /tmp/site first and put on PYTHONPATH ahead of the machine's own. For a Python 3.12
# machine with torch but none of the mesh's own dependencies (what the 2026-11-27 run used):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 --platform any -d .whl grpcio==1.85.1 protobuf==7.36.2 \
#     grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 pydantic==2.14.4 pydantic-core==2.50.5 \
#     typing-inspection annotated-types typing-extensions structlog google-crc32c gguf pytest-asyncio \
#     cryptography cffi pycparser   (the mesh makes its mTLS certificates with cryptography)
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-run/gpu-check}
PY=${PY:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# The mesh talks over loopback: a proxy from the environment must not take those calls
# (gRPC and aiohttp both honour http_proxy).
env | grep -i _proxy= | sed 's/=.*/=(set; unset here)/'
unset http_proxy https_proxy HTTP_PROXY HTTPS_PROXY grpc_proxy all_proxy ALL_PROXY
export no_proxy=localhost,127.0.0.1,::1 NO_PROXY=localhost,127.0.0.1,::1
if compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "installing .whl/ failed"; exit 1; }
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi

STEPS=${STEPS:-"pytest_gpu bench_gpu serving_gpu"}
status=()
step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    [[ " $STEPS " == *" $name "* ]] || return 0
    local t0=$SECONDS
    echo "=== $name (limit ${limit}s): $*"
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    tail -n 25 "$OUT/$name.log"
    status+=("$name rc=$rc $((SECONDS - t0))s")
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee "$OUT/device.txt"
$PY -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())" 2>&1 | tee -a "$OUT/device.txt"

step pytest_gpu 90 $PY -m pytest -m gpu tests/unit/test_worker_device.py tests/integration/test_kv_transfer.py -q -p no:cacheprovider -o addopts="-ra"
step bench_gpu 110 $PY -m bench.gpu --out "$OUT/gpu.json"
step serving_gpu 120 $PY -m bench.serving --quick --device cuda --dtype bfloat16 --systems gateway,engine \
    --threads 4 --run-dir /tmp/bench-serving --model-dir /tmp/models --out "$OUT/serving_gpu.json"

if [ -d /tmp/bench-serving ]; then  # the mesh's own logs, for a failed or slow serving run
    tar -czf "$OUT/mesh_logs.tar.gz" -C /tmp bench-serving 2>/dev/null
    for f in /tmp/bench-serving/*.log; do echo "--- $f"; tail -n 8 "$f"; done
fi

echo "=== summary"
printf '%s\n' "${status[@]}" | tee "$OUT/summary.txt"
