#!/usr/bin/env bash
# The GPU checks in one command, on a machine with a CUDA GPU, from the repository's root:
#   benchmarks/gpu_check.sh OUTDIR [extra `dqsgd bench gpu` flags]
# 1. the tests that take their CUDA branch (device codec, trainer device, hook codec; one bucket's exchange
#    with no synchronizing call and no recompilation after its first step; one bucket's codec calls captured
#    once in a CUDA graph and replayed at several steps, the step's keys written into the captured key tensors,
#    each replay as that step's eager calls): pytest-device.txt
# 2. `dqsgd bench gpu` (correctness against the CPU kernels, codec speed as a ratio to copy_ and in GB/s,
#    loopback DDP step time of no hook, fp16, bf16, PowerSGD ranks 1 and 4, qsgd-4bit and dqsgd, the step
#    modelled on a 10/25/100 Gbit/s link, host time per bucket, recompilations, simulation steps/s):
#    OUTDIR/gpu/gpu.md and gpu.json, log in bench.txt
# 3. the Triton kernel matrix of tests/kernels/test_kernels_triton.py compiled on the GPU instead of
#    interpreted on the CPU (widths 1-16, three dtypes, odd sizes, bitwise against numba; the crc fused into the
#    encode across 2 KiB blocks, one payload and batched: test_kernels_triton_fused; the step's key read from a
#    device tensor, and the batched decode summing a place's payloads in registers, written without reading
#    the output: test_kernels_triton_exchange_calls): pytest-triton.txt
# 4. each leg of one bucket's codec calls on one rank (uplink: batched encode + decode-average; downlink:
#    encode + decode; as the exchange calls them) against copy_ of the bucket, n = 25M, 4 bits, W = 4 and 8
#    (benchmarks/gpu_call_cost.py --bucket): OUTDIR/bucket_cost.md, log in bucket.txt
# Each step has its own time limit (150 + 240 + 120 + 60 s by default: 9.5 minutes at most); the exit code is
# the first failing step's (0 = all passed).
# Uses $PYTHON (default python3) with torch + CUDA, numba, triton, pytest; dqsgd from src/ (zstandard is
# optional: the tests that need it skip).
set -u
out=${1:?usage: benchmarks/gpu_check.sh OUTDIR [bench gpu flags]}
shift
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
{ nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  $py -c "import torch, triton, numba, sys; print('python', sys.version.split()[0], 'torch', torch.__version__,
'cuda', torch.version.cuda, 'triton', triton.__version__, 'numba', numba.__version__)"; } >"$out/env.txt" 2>&1
rc=0
step() {  # step NAME SECONDS CMD...: run CMD under a time limit, log to OUTDIR/NAME.txt, keep the first failure
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" >"$out/$name.txt" 2>&1
  local r=$?
  echo "gpu_check: $name rc=$r in $((SECONDS - t0)) s" | tee -a "$out/env.txt"
  tail -n 3 "$out/$name.txt"
  [ "$rc" -ne 0 ] || rc=$r
}
step pytest-device "${DEVICE_TESTS_S:-150}" $py -m pytest -p no:cacheprovider -rs tests/kernels/test_kernels_device.py \
  tests/kernels/test_kernels_method.py tests/api/test_api_device.py tests/train/test_train_device.py \
  tests/cli/test_bench_gpu.py tests/topology/test_downlink_coding.py tests/kernels/test_kernels_cuda_exchange.py \
  tests/kernels/test_kernels_cuda_graph.py
step bench "${BENCH_S:-240}" $py -m dqsgd bench gpu --out "$out/gpu" "$@"
step pytest-triton "${TRITON_TESTS_S:-120}" env DQSGD_TRITON_TEST_DEVICE=cuda $py -m pytest -p no:cacheprovider -rs \
  tests/kernels/test_kernels_triton.py tests/kernels/test_kernels_triton_fused.py \
  tests/kernels/test_kernels_triton_exchange_calls.py
step bucket "${BUCKET_S:-60}" $py benchmarks/gpu_call_cost.py --bucket --sizes 25000000 --workers 4,8 --out "$out"
exit "$rc"
