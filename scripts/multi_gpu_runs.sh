#!/usr/bin/env bash
# Issue 11's multi-GPU runs, one part per call (each fits the device tool's 10-minute limit):
#
#   bash scripts/multi_gpu_runs.sh NGPUS PART [extra bench arguments...]
#
# PART: flux | flux-2048 | wan-720p   (bench/parallel_scaling.py: every strategy that fits NGPUS,
#                                      with the acceleration stack: --compile --quant fp8)
#       flux-eager                    (the same without the stack, for comparison)
#       vae-wan | vae-flux            (bench/vae_parallel_scaling.py: tile and spatial decode)
# Results go to $OUT (else bench/results/parallel/), one JSON + markdown per run, named by the bench.
# Wan 720p is long (about 10 s a forward on one H200): run its strategies in two calls if the
# first hits the limit, e.g. `... wan-720p --strategies ulysses ring usp` then `... --strategies tp cfg cfg_ulysses`.
set -uo pipefail

if [ $# -lt 2 ]; then
    echo "usage: bash scripts/multi_gpu_runs.sh NGPUS flux|flux-2048|wan-720p|flux-eager|vae-wan|vae-flux [bench args...]" >&2
    exit 2
fi
gpus=$1
part=$2
shift 2
case "$gpus" in
    '' | *[!0-9]*) echo "NGPUS must be a number; got '$gpus'" >&2; exit 2 ;;
esac
case "$part" in
    flux | flux-2048 | wan-720p | flux-eager | vae-wan | vae-flux) ;;
    *) echo "PART must be flux, flux-2048, wan-720p, flux-eager, vae-wan or vae-flux; got '$part'" >&2; exit 2 ;;
esac

cd "$(dirname "${BASH_SOURCE[0]}")/.."
# Keep NVLink multicast off on shared multi-GPU hosts (device README).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
# shellcheck source=scripts/carried_wheels.sh
source scripts/carried_wheels.sh
run=(python3 -m torch.distributed.run --nproc_per_node "$gpus")

case "$part" in
    flux | flux-2048 | wan-720p)
        "${run[@]}" bench/parallel_scaling.py --model "$part" --compile --quant fp8 "$@" ;;
    flux-eager)
        "${run[@]}" bench/parallel_scaling.py --model flux "$@" ;;
    vae-wan)
        "${run[@]}" bench/vae_parallel_scaling.py --model wan --iters 2 "$@" ;;
    vae-flux)
        "${run[@]}" bench/vae_parallel_scaling.py --model flux "$@" ;;
esac
