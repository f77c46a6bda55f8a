"""Time the Hopper quantized attention kernel (``omni_sage_sm90``) alone, for A/B runs.

One line per shape, ``RESULT <tag> <shape> kernel <ms> ms <TFLOP/s> TFLOP/s dit kernel <TFLOP/s> cos <c> rel <r>``,
so that several builds of ``omni_kernels._C`` (see ``scripts/cuda_variant_ab.sh``) can be run
one after the other in the same call and compared with ``grep RESULT``:

* time: the attention kernel alone (no quantization, no dispatch) on
  ``quantize_qkv(block_n=128, permute_v=True)`` outputs of ``randn`` bf16 inputs,
  ``triton.testing.do_bench`` median (warmup 10, rep 60);
* the same time on the DiT-like inputs of
  :func:`~omni_kernels.attention.quantized.reference.dit_like_qkv` (``dit kernel``): the
  kernel's work does not depend on the data, but its power does (at HunyuanVideo's size, at
  the 700 W cap, these inputs ran 2% slower than randn on the H200), and a kernel variant
  whose work does (a softmax path taken by score range) shows it here;
* accuracy: mean row cosine and relative L2 error against float32 attention on those DiT-like
  inputs (2 heads, the first 1024 queries; ``bench/quantized_attention_tune.py``'s ``errors``),
  through the whole quantized forward.

Usage (on an sm_90 GPU with the extension built)::

    python3 bench/sm90_kernel_alone.py TAG [--shapes flux,wan720,hunyuan] [--quantizers]

``--quantizers`` appends each quantizer's time alone (Triton's and the CUDA one's) and the
whole forward's TFLOP/s-equivalent on each, on the same inputs.

TFLOP/s-equivalent is ``4*B*H*S*S*D / t``. For the figures the README quotes, use
``bench/attention.py`` (end to end, every backend in one run).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

import torch

if __package__:  # imported as bench.<script> (the tests)
    from bench import quantized_attention_tune as tune
else:  # run as python3 bench/<script>.py: bench/ itself is on sys.path
    import quantized_attention_tune as tune

import triton

from omni_kernels.attention.quantized.attention_kernel import (
    CUDA_SM90_CONFIG,
    cuda_sm90_unsupported_reason,
    sage_attention_forward,
    sage_attention_quantized,
)
from omni_kernels.attention.quantized.quantize import quantize_qkv
from omni_kernels.attention.quantized.reference import dit_like_qkv


def _quantizer_columns(q, k, v, b, h, s, d) -> str:
    """`` quant triton <us> us <TB/s> cuda <us> us <TB/s> fwd triton-q <TFLOP/s> cuda-q <TFLOP/s>``:
    each quantizer alone (K's mean and the codes; TB/s counts 2 bytes read and 1 written an
    element of Q, K and V), and the whole forward on it."""
    from omni_kernels.attention.quantized.quantize_cuda import quantize_qkv_cuda

    moved = 3 * (q.numel() + k.numel() + v.numel())

    def bench(fn):
        return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")

    t_tri = bench(lambda: quantize_qkv(q, k, v, block_n=128, permute_v=True))
    t_cuda = bench(lambda: quantize_qkv_cuda(q, k, v, permute_v=True))
    fwd = {}
    for name, quantizer in (("triton-q", False), ("cuda-q", True)):
        cfg = replace(CUDA_SM90_CONFIG, cuda_quantizer=quantizer)
        fwd[name] = tune.flops(b, h, s, d) / bench(lambda: sage_attention_forward(q, k, v, config=cfg)) / 1e9
    return (f"  quant triton {t_tri * 1e3:6.1f} us {moved / t_tri / 1e9:4.2f} TB/s"
            f" cuda {t_cuda * 1e3:6.1f} us {moved / t_cuda / 1e9:4.2f} TB/s"
            f"  fwd triton-q {fwd['triton-q']:6.1f} cuda-q {fwd['cuda-q']:6.1f} TFLOP/s")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tag", help="a name for this build, printed on every line")
    parser.add_argument("--shapes", default="flux,wan720,hunyuan",
                        help=f"comma-separated, from {sorted(tune.SHAPES)}")
    parser.add_argument("--quantizers", action="store_true",
                        help="also time the Triton and the CUDA quantizer alone, and the whole "
                             "forward with each")
    args = parser.parse_args(argv)
    names = [n for n in args.shapes.split(",") if n]
    unknown = [n for n in names if n not in tune.SHAPES]
    if unknown or not names:
        parser.error(f"--shapes must name some of {sorted(tune.SHAPES)}; got {args.shapes!r}")
    if not torch.cuda.is_available():
        print("sm90_kernel_alone.py needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    reason = cuda_sm90_unsupported_reason(device, 128, torch.bfloat16)
    if reason is not None:
        print(f"sm90_kernel_alone.py: {reason}", file=sys.stderr)
        return 2
    gen = torch.Generator(device).manual_seed(0)
    for name in names:
        b, h, s, d = tune.SHAPES[name]
        q, k, v = (torch.randn(b, h, s, d, device=device, dtype=torch.bfloat16, generator=gen)
                   for _ in range(3))
        qkv = quantize_qkv(q, k, v, block_n=128, permute_v=True)
        out = torch.empty_like(q)
        def kernel_ms():
            return triton.testing.do_bench(
                lambda: sage_attention_quantized(qkv, out, layout="bhsd", scale=d ** -0.5,
                                                 config=CUDA_SM90_CONFIG),
                warmup=10, rep=60, return_mode="median")

        ms = kernel_ms()
        tflops = tune.flops(b, h, s, d) / ms / 1e9
        quant = ""
        if args.quantizers:
            quant = _quantizer_columns(q, k, v, b, h, s, d)
        qkv = out = q = k = v = None  # free the timing inputs before the accuracy inputs
        q, k, v = dit_like_qkv(gen, (b, h, s, d), torch.bfloat16, "cuda")
        qkv = quantize_qkv(q, k, v, block_n=128, permute_v=True)
        out = torch.empty_like(q)
        dit_tflops = tune.flops(b, h, s, d) / kernel_ms() / 1e9
        qkv = out = None
        cos, rel = tune.errors(sage_attention_forward(q, k, v, config=CUDA_SM90_CONFIG), q, k, v)
        q = k = v = None
        print(f"RESULT {args.tag:8s} {name:8s} kernel {ms:8.3f} ms {tflops:6.1f} TFLOP/s  "
              f"dit kernel {dit_tflops:6.1f} cos {cos:.5f} rel {rel:.3e}{quant}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
