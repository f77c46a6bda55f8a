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
score 0 and bias the output (8.5% relative error at ``Skv = 333`` on an H200).
So with 1.x this backend takes only ``Skv % 64 == 0`` (Flux 4608, Wan 32760 and
75600, HunyuanVideo 119040, Wan cross-attention 512; not SD3.5's 4429 or
Qwen-Image's 7401).
"""

from __future__ import annotations

import torch

from omni_kernels.attention.backends._util import (
    cuda_reason,
    last_dim_contiguous,
    lazy_import,
    package_version,
)
from omni_kernels.attention.registry import register_backend
from omni_kernels.attention.spec import BackendSpec

_TENSOR_LAYOUT = {"bshd": "NHD", "bhsd": "HND"}
_V1_KEY_BLOCK = 64
_MAJOR: dict[str, int | None] = {}


def _major_version() -> int | None:
    if "major" not in _MAJOR:
        version = package_version("sageattention")
        try:
            _MAJOR["major"] = int(version.split(".")[0]) if version else None
        except ValueError:
            _MAJOR["major"] = None
    return _MAJOR["major"]


def _input_check(problem, q, k, v, key_padding_mask):
    major = _major_version()
    if major is not None and major < 2 and problem.seq_kv % _V1_KEY_BLOCK:
        return (
            f"cannot take Skv={problem.seq_kv} with sageattention {package_version('sageattention')}: "
            f"1.x does not mask a partial last key block (needs Skv % {_V1_KEY_BLOCK} == 0)"
        )
    return last_dim_contiguous(q, k, v)


def _module():
    return lazy_import("sageattention", "sageattention", "pip install sageattention")


def _availability(device):
    reason = cuda_reason(device)
    if reason is not None:
        return reason
    module, reason = _module()
    if reason is not None:
        return reason
    if not hasattr(module, "sageattn"):
        return "sageattention has no sageattn (unsupported version)"
    return None


def _run(q, k, v, *, layout, causal, scale, key_lengths, key_padding_mask, return_lse):
    module, _ = _module()
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
        devices=("cuda",),
        dtypes=(torch.float16, torch.bfloat16),
        head_dims=(64, 128),
        layouts=("bshd", "bhsd"),
        causal=True,
        causal_cross=False,
        gqa=True,
        key_lengths=False,
        key_padding_mask=False,
        lse=False,
        backward=False,
        min_capability=(8, 0),
        lossy=True,
        package="sageattention",
        availability=_availability,
        input_check=_input_check,
    )
)
