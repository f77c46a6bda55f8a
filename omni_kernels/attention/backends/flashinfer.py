"""``flashinfer``: FlashInfer's single-request prefill kernel (package ``flashinfer-python``).

``flashinfer.single_prefill_with_kv_cache`` takes one sample, ``[S, H, D]``
(``NHD``), so the batch is looped in Python (DiT batches are 1-2) and each
sample is a view of the ``bshd`` tensors. FlashInfer picks its FA2 or FA3
(Hopper) kernel itself (``backend="auto"``). Per-sample ``key_lengths`` slice
the keys (one device-to-host read of the lengths). Its causal mask is
bottom-right aligned when ``Sq != Skv``, so causal is offered for ``Sq == Skv``
only. Its log-sum-exp is not exposed here (FlashInfer reports it in base 2;
unverified, so ``lse`` is off). Kernels are JIT-compiled on first use unless
``flashinfer-cubin``/``flashinfer-jit-cache`` supply them.
"""

from __future__ import annotations

import torch

from omni_kernels._packages import OptionalPackage
from omni_kernels.attention.backends._util import all_of, cuda_reason, has_symbols, last_dim_contiguous
from omni_kernels.attention.registry import register_backend
from omni_kernels.attention.spec import BackendSpec

_FLASHINFER = OptionalPackage("flashinfer", "flashinfer-python", "pip install flashinfer-python")


def _sample(x):
    # NHD for one sample: rows of H*D, heads packed.
    return x if x.stride(-2) == x.shape[-1] and x.stride(-3) == x.shape[-1] * x.shape[-2] else x.contiguous()


def _run(q, k, v, *, layout, causal, scale, key_lengths, key_padding_mask, return_lse):
    module, _ = _FLASHINFER.load()
    lengths = key_lengths.tolist() if key_lengths is not None else None
    outs = []
    for b in range(q.shape[0]):
        kb, vb = k[b], v[b]
        if lengths is not None:
            kb, vb = kb[: lengths[b]], vb[: lengths[b]]
        outs.append(
            module.single_prefill_with_kv_cache(
                _sample(q[b]), _sample(kb), _sample(vb), causal=causal, kv_layout="NHD",
                sm_scale=scale,
            )
        )
    return outs[0].unsqueeze(0) if len(outs) == 1 else torch.stack(outs)


def _input_check(problem, q, k, v, key_padding_mask):
    if problem.key_lengths and problem.causal:
        return "cannot take key_lengths with causal=True (its causal mask is bottom-right aligned)"
    return last_dim_contiguous(q, k, v)


SPEC = register_backend(
    BackendSpec(
        name="flashinfer",
        run=_run,
        description="FlashInfer single_prefill_with_kv_cache (FA2/FA3 kernels), looped over the batch",
        head_dims=(64, 128, 256),
        layouts=("bshd",),
        causal_cross=False,
        key_lengths=True,
        min_capability=(8, 0),
        package="flashinfer-python",
        availability=all_of(cuda_reason, has_symbols(_FLASHINFER, "single_prefill_with_kv_cache")),
        input_check=_input_check,
    )
)
