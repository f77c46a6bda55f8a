#!/usr/bin/env bash
# A/B several versions of one CUDA source file of omni_kernels._C in one GPU-machine call.
#
#   bash scripts/cuda_variant_ab.sh SOURCE "VARIANT_FILE ..." [ROUNDS] [TESTS] [-- TIMING_COMMAND...]
#
# SOURCE: the file in the tree the variants replace (e.g. csrc/attention/sage_sm90.cu).
# Each VARIANT_FILE is a whole replacement for it (kept outside csrc/, which the build reads).
# Builds the tree as it is ("head"), then each variant, incrementally (only SOURCE recompiles),
# keeping each build's .so; restores SOURCE; runs TESTS (a pytest -k expression, default
# "cuda_sm90 or sm90_backend", on tests/kernels/test_quantized_attention_*.py, GPU tests only)
# against every variant; then ROUNDS (default 2) rounds of the timing command with the builds
# alternating process by process (head, v1, v2, head, v1, v2, ...): drift between runs of one
# call then shows as a difference between rounds, not between builds. The timing command gets
# the build's name as its last argument; default: python3 bench/sm90_kernel_alone.py.
# Lines the timing command prints with RESULT are echoed.
#
# Environment: scripts/gpu_build_env.sh (CUDA_HOME, OMNI_CUDA_ARCHS default 90a); build logs
# go to $OUT (or /tmp) as build_<name>.log. The tree's own .so is put back at the end.
set -uo pipefail

usage() { sed -n 2,4p "$0" >&2; }
[ $# -ge 2 ] || { usage; exit 2; }
source_file=$1
read -r -a variants <<< "$2"
rounds=${3:-2}
tests=${4:-cuda_sm90 or sm90_backend}
shift $(( $# >= 4 ? 4 : $# ))
[ "${1:-}" = "--" ] && shift
timing=("$@")
[ ${#timing[@]} -gt 0 ] || timing=(python3 bench/sm90_kernel_alone.py)

cd "$(dirname "${BASH_SOURCE[0]}")/.."
[ -f "$source_file" ] || { echo "no such source file: $source_file" >&2; exit 2; }
for v in "${variants[@]}"; do
    [ -f "$v" ] || { echo "no such variant file: $v" >&2; exit 2; }
    case "$(realpath "$v")" in "$(realpath csrc)"/*) echo "keep variants outside csrc/: $v" >&2; exit 2 ;; esac
done
# shellcheck source=scripts/carried_wheels.sh
source scripts/carried_wheels.sh
unset TRITON_INTERPRET
export PYTHONUNBUFFERED=1 OMNI_REQUIRE_CUDA_EXT=1
# shellcheck source=scripts/gpu_build_env.sh
source scripts/gpu_build_env.sh
logs=${OUT:-/tmp}
work=$(mktemp -d)
cp "$source_file" "$work/head.src"
restore() { cp "$work/head.src" "$source_file"; }
trap restore EXIT

extension() { ls omni_kernels/_C*.so 2>/dev/null | head -1; }
build() {  # build the tree as it is now, keep the .so as $work/$1.so
    local t0=$SECONDS
    if ! OMNI_REQUIRE_CUDA_BUILD=1 python3 setup.py build_ext --inplace > "$logs/build_$1.log" 2>&1; then
        tail -30 "$logs/build_$1.log"; echo "build of $1 failed" >&2; exit 1
    fi
    cp "$(extension)" "$work/$1.so"
    echo "built $1 in $(( SECONDS - t0 )) s"
}
name_of() { local b; b=$(basename "$1"); echo "${b%.*}"; }

names=(head)
build head
for v in "${variants[@]}"; do
    n=$(name_of "$v"); names+=("$n")
    cp "$v" "$source_file"; build "$n"
done
restore
so=$(extension)
for n in "${names[@]:1}"; do
    cp "$work/$n.so" "$so"
    python3 -m pytest -q -m gpu tests/kernels/test_quantized_attention_*.py -k "$tests" 2>&1 | tail -1 | sed "s/^/TEST $n: /"
done
for _ in $(seq "$rounds"); do
    for n in "${names[@]}"; do
        cp "$work/$n.so" "$so"
        "${timing[@]}" "$n" 2>&1 | grep RESULT
    done
done
cp "$work/head.so" "$so"
