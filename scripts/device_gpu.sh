#!/usr/bin/env bash
# The one command for a GPU machine: build omni_kernels._C in place with this
# machine's python3 and torch, run the GPU tests, run the benchmarks.
#
#   bash scripts/device_gpu.sh [test|bench|all]     (default: all)
#
# It installs nothing from the network. Python packages the machine lacks
# (diffusers, say) travel as wheels in .whl/ at the repo root; they are
# installed into /tmp/site, without their dependencies, and put on PYTHONPATH.
#
# Environment: OMNI_GPU_TESTS (test paths, default tests), OMNI_BENCHES (default
# "qk_norm_rope attention linear halo parallel_overhead"), OMNI_GIT_COMMIT (the commit the results name: the copied tree
# has no .git), OMNI_CUDA_ARCHS (default 90a, for an H100/H200), CUDA_HOME
# (default: /usr/local/cuda-13.0 or /usr/local/cuda when they hold nvcc),
# OUT (benchmark results go to $OUT, else each benchmark's bench/results/<topic>/).
#
# Exit status: non-zero when the build, the tests or the benchmark failed;
# with `all`, the benchmark runs even when tests failed.
set -uo pipefail

usage() { echo "usage: bash scripts/device_gpu.sh [test|bench|all]" >&2; }
mode=${1:-all}
case "$mode" in
    test | bench | all) ;;
    -h | --help) usage; exit 0 ;;
    *) usage; exit 2 ;;
esac

cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$PWD
export PYTHONUNBUFFERED=1
# Keep NVLink multicast off on shared multi-GPU hosts.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# Triton kernels run compiled on the GPU here, never interpreted.
unset TRITON_INTERPRET

# shellcheck source=scripts/carried_wheels.sh
source scripts/carried_wheels.sh

# shellcheck source=scripts/gpu_build_env.sh
source scripts/gpu_build_env.sh
out_dir=${OUT:-bench/results/<topic>}  # the benchmarks read $OUT themselves

echo "== environment"
python3 - <<'EOF'
import sys
import torch
print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda})")
if torch.cuda.is_available():
    for i in range(torch.cuda.device_count()):
        print(f"cuda:{i} {torch.cuda.get_device_name(i)}")
else:
    print("no CUDA device visible to torch")
try:
    import triton
    print(f"triton {triton.__version__}")
except ImportError:
    print("triton not installed")
EOF
command -v nvcc >/dev/null && nvcc --version | tail -n 2 | head -n 1
echo "CUDA_HOME=${CUDA_HOME:-<unset>} OMNI_CUDA_ARCHS=$OMNI_CUDA_ARCHS"

echo "== build: python3 setup.py build_ext --inplace"
start=$(date +%s)
OMNI_REQUIRE_CUDA_BUILD=1 python3 setup.py build_ext --inplace
build_rc=$?
build_s=$(( $(date +%s) - start ))
if [ "$build_rc" -ne 0 ]; then
    echo "== summary: build FAILED (exit $build_rc, ${build_s}s); nothing tested" >&2
    exit "$build_rc"
fi

test_rc=skipped
test_s=0
if [ "$mode" != bench ]; then
    # OMNI_GPU_TESTS narrows the run to some test files (default: every gpu test).
    test_paths=${OMNI_GPU_TESTS:-tests}
    echo "== test: python3 -m pytest -m gpu -q $test_paths"
    start=$(date +%s)
    # shellcheck disable=SC2086  # a space-separated list of paths
    OMNI_REQUIRE_CUDA_EXT=1 python3 -m pytest -m gpu -q $test_paths
    test_rc=$?
    test_s=$(( $(date +%s) - start ))
fi

bench_rc=skipped
bench_s=0
if [ "$mode" != test ]; then
    start=$(date +%s)
    bench_rc=0
    # OMNI_BENCHES picks benchmarks (default: all of them); each records its results in $out_dir.
    for bench in ${OMNI_BENCHES:-qk_norm_rope attention linear halo parallel_overhead}; do
        echo "== bench: python3 bench/$bench.py (results in $out_dir)"
        python3 "bench/$bench.py" || bench_rc=$?
    done
    bench_s=$(( $(date +%s) - start ))
fi

echo "== summary"
echo "build: ok (${build_s}s, OMNI_CUDA_ARCHS=$OMNI_CUDA_ARCHS)"
echo "tests: $( [ "$test_rc" = skipped ] && echo skipped || { [ "$test_rc" -eq 0 ] && echo "ok (${test_s}s)" || echo "FAILED, exit $test_rc (${test_s}s)"; })"
echo "bench: $( [ "$bench_rc" = skipped ] && echo skipped || { [ "$bench_rc" -eq 0 ] && echo "ok (${bench_s}s), results in $out_dir" || echo "FAILED, exit $bench_rc (${bench_s}s)"; })"

for rc in "$test_rc" "$bench_rc"; do
    if [ "$rc" != skipped ] && [ "$rc" -ne 0 ]; then exit "$rc"; fi
done
exit 0
