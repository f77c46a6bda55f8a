"""``sageattention``: SageAttention (package ``sageattention``), INT8 ``Q K^T``. **Lossy.**

Quantizes Q and K to INT8 per block (and, in SageAttention 2, P V to FP8), so
its output differs from exact attention by more than rounding: it is never
chosen by ``"auto"`` unless the ranking table lists it for the GPU's
architecture and the caller allows lossy backends.

``sageattn(q, k, v, tensor_layout="NHD"|"HND", is_causal, sm_scale)`` takes both
layouts. SageAttention 1.x subtracts the key mean *in place* from the caller's
``k`` (``smooth_k``), so this backend does the smoothing itself, out of place
(softmax is unchanged by a per-row constant), and passes ``smooth_k=False``.
Causal only for ``Sq == Skv``; no key lengths; no log-sum-exp.

SageAttention 1.x (the Triton-only release on PyPI) does not mask the keys past
``Skv`` in its last, partial key block (64 keys): they enter the softmax with
score 0 and bias the output. So with 1.x this backend takes only ``Skv % 64 == 0``
(Flux 4608, Wan 32760 and 75600, HunyuanVideo 119040, Wan cross-attention 512; not
SD3.5's 4429 or Qwen-Image's 7401).
"""

from __future__ import annotations

from omni_kernels._packages import OptionalPackage
from omni_kernels.attention.backends._util import all_of, cuda_reason, has_symbols, last_dim_contiguous
from omni_kernels.attention.registry import register_backend
from omni_kernels.attention.spec import BackendSpec

_SAGEATTENTION = OptionalPackage("sageattention", "sageattention", "pip install sageattention")
_TENSOR_LAYOUT = {"bshd": "NHD", "bhsd": "HND"}
_V1_KEY_BLOCK = 64


def _input_check(problem, q, k, v, key_padding_mask):
    major = _SAGEATTENTION.major_version()
    if major is not None and major < 2 and problem.seq_kv % _V1_KEY_BLOCK:
        return (
            f"cannot take Skv={problem.seq_kv} with sageattention {_SAGEATTENTION.version()}: "
            f"1.x does not mask a partial last key block (needs Skv % {_V1_KEY_BLOCK} == 0)"
        )
    return last_dim_contiguous(q, k, v)


def _run(q, k, v, *, layout, causal, scale, key_lengths, key_padding_mask, return_lse):
    module, _ = _SAGEATTENTION.load()
    seq_dim = 1 if layout == "bshd" else 2
    k = k - k.mean(dim=seq_dim, keepdim=True)  # smooth_k, out of place
    return module.sageattn(
        q, k, v, tensor_layout=_TENSOR_LAYOUT[layout], is_causal=causal, sm_scale=scale,
        smooth_k=False,
    )


SPEC = register_backend(
    BackendSpec(
        name="sageattention",
        run=_run,
        description="SageAttention (INT8 QK^T, lossy)",
        head_dims=(64, 128),
        layouts=("bshd", "bhsd"),
        causal_cross=False,
        min_capability=(8, 0),
        lossy=True,
        package="sageattention",
        availability=all_of(cuda_reason, has_symbols(_SAGEATTENTION, "sageattn")),
        input_check=_input_check,
    )
)
