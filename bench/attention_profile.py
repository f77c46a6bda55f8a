"""Run one attention backend at one benchmark shape a few times, for a profiler.

``bench/attention.py`` says how fast each backend is; this script exists so that
Nsight Compute can say *why*: it launches the chosen backend ``--calls`` times on
the shape's inputs (the first call compiles Triton kernels and warms caches), so
``ncu --launch-skip`` can pick a warm launch. Example on the H200::

    ncu --clock-control none -k regex:'attn|fmha|flash|sm90' --launch-skip 1 --launch-count 1 \\
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \\
        --section Occupancy --section LaunchStats \\
        python3 bench/attention_profile.py --backend omni_triton --shape flux

Without a profiler it prints the median time of the calls after the first, which
is only a sanity check (use bench/attention.py for figures).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if __package__:  # imported as bench.<script> (the tests)
    from bench import attention as attention_bench
else:  # run as python3 bench/<script>.py: bench/ itself is on sys.path
    import attention as attention_bench



def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", required=True, help="a registered attention backend name")
    parser.add_argument("--shape", choices=list(attention_bench.SHAPES), default="flux")
    parser.add_argument("--dtype", choices=sorted(attention_bench.DTYPES), default="bf16")
    parser.add_argument("--layout", choices=("bhsd", "bshd"), default="bhsd")
    parser.add_argument("--calls", type=int, default=3, help="launches (>= 2: the first one warms up)")
    args = parser.parse_args(argv)
    if args.calls < 2:
        parser.error(f"--calls must be >= 2 (one warm-up launch plus one to profile), got {args.calls}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("attention_profile.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from omni_kernels.attention import attention

    shape = attention_bench.SHAPES[args.shape]
    q, k, v = attention_bench._make_inputs(shape, attention_bench.DTYPES[args.dtype], args.layout, seed=0)
    times = []
    for _ in range(args.calls):
        torch.cuda.synchronize()
        start = time.perf_counter()
        attention(q, k, v, backend=args.backend, layout=args.layout)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    warm = sorted(times[1:])
    median_s = warm[len(warm) // 2]
    print(f"{args.backend} {shape.name}: {args.calls} calls, median of warm calls {median_s * 1e3:.3f} ms "
          f"({shape.flops / median_s / 1e12:.0f} TFLOP/s, host timing)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
