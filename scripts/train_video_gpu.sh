#!/usr/bin/env bash
# Train the embedded video model on one GPU: each named architecture in its own process, all at
# once on the same GPU (the tiny models leave it mostly idle), on the shipped model's VAE, for
# SECONDS each; then score each over 100 seeded clips. Logs and models go to OUT_DIR/<arch>.
#
#   bash scripts/train_video_gpu.sh OUT_DIR [SECONDS] [ARCH ...]    (default: 240 s; wide base deep)
#
# Each log names the step count its budget gave; rerun one with
# `python3 -m omni_diffusion.embedded.train --kind video --vae-from <shipped> --arch A
#  --device cuda --batch 256 --steps N --seed 0 --out DIR` to get the same model.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=${1:?usage: bash scripts/train_video_gpu.sh OUT_DIR [SECONDS] [ARCH ...]}
budget=${2:-240}
shift $(( $# >= 2 ? 2 : 1 ))
archs=("$@")
[ ${#archs[@]} -eq 0 ] && archs=(wide base deep)
export PYTHONUNBUFFERED=1
# shellcheck source=scripts/carried_wheels.sh
source scripts/carried_wheels.sh
vae=omni_diffusion/embedded/models/digits-video
mkdir -p "$out"
for arch in "${archs[@]}"; do
    python3 -m omni_diffusion.embedded.train --kind video --vae-from "$vae" --arch "$arch" \
        --device cuda --batch 256 --time-budget "$budget" --seed 0 --out "$out/$arch" \
        >"$out/$arch.log" 2>&1 &
done
wait
for arch in "${archs[@]}"; do
    python3 -m omni_diffusion.embedded.evaluate --kind video --path "$out/$arch" --device cuda \
        --n 100 >>"$out/$arch.log" 2>&1 &
done
wait
echo "== video training summary (budget ${budget}s each)"
for arch in "${archs[@]}"; do
    echo "-- $arch: $(grep -E 'steps fit|transformer trained' "$out/$arch.log" | tr '\n' ' ')"
    grep -E "adherence|Error|error" "$out/$arch.log" | tail -n 3
done
