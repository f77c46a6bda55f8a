"""torch's ``scaled_dot_product_attention``, one registered backend per SDPA kernel.

* ``sdpa_cudnn``: cuDNN's fused attention (``SDPBackend.CUDNN_ATTENTION``), the
  fastest on Hopper with cuDNN 9.
* ``sdpa_flash``: torch's FlashAttention-2 build (``FLASH_ATTENTION``); on CPU,
  torch's CPU flash kernel.
* ``sdpa_efficient``: the xFormers/CUTLASS memory-efficient kernel
  (``EFFICIENT_ATTENTION``).
* ``sdpa_math``: the unfused reference (``MATH``); every device, every dtype,
  every feature, slow.

They take ``bhsd`` (a ``bshd`` call hands SDPA a transposed view; SDPA reads
strides). Key lengths and key-padding masks become a boolean ``attn_mask``
(flash takes no mask). On CUDA, eligibility is refined by torch's own checks,
``torch.backends.cuda.can_use_{flash,efficient,cudnn}_attention`` (skipped while
``torch.compile`` traces), and the reason they print is passed on.
``return_lse`` goes through the private ATen ops that return the log-sum-exp
(``_scaled_dot_product_{flash,efficient,cudnn}_attention``), without masks.

The C function ``torch._C._nn.scaled_dot_product_attention`` is called directly,
never the Python attribute ``torch.nn.functional.scaled_dot_product_attention``,
so :func:`omni_kernels.attention.patch_sdpa` cannot recurse into itself.
"""

from __future__ import annotations

import warnings

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from omni_kernels.attention.registry import register_backend
from omni_kernels.attention.spec import BackendSpec

_SDPA = torch._C._nn.scaled_dot_product_attention

_KERNELS = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}

_HALF = (torch.float16, torch.bfloat16)


# --------------------------------------------------------------------------- masks


def _bool_mask(q, k, causal, key_lengths, key_padding_mask):
    """The SDPA boolean mask (True = attend) for key lengths / padding / causal, or None."""
    if key_lengths is None and key_padding_mask is None:
        return None
    batch, seq_q, seq_k = q.shape[0], q.shape[2], k.shape[2]
    if key_padding_mask is None:
        positions = torch.arange(seq_k, device=q.device)
        key_padding_mask = positions[None, :] < key_lengths[:, None].to(positions.dtype)
    mask = key_padding_mask[:, None, None, :]
    if causal:  # SDPA takes attn_mask or is_causal, not both: fold the causal part in
        rows = torch.arange(seq_q, device=q.device)[:, None]
        cols = torch.arange(seq_k, device=q.device)[None, :]
        mask = mask & (cols <= rows)[None, None]
    return mask.expand(batch, 1, mask.shape[2], seq_k)


def _expand_kv(q, x):
    group = q.shape[1] // x.shape[1]
    return x if group == 1 else x.repeat_interleave(group, dim=1)


# --------------------------------------------------------------------------- run


def _sdpa(kind, q, k, v, mask, causal, scale):
    kwargs = {}
    if q.shape[1] != k.shape[1]:
        kwargs["enable_gqa"] = True
    with sdpa_kernel([_KERNELS[kind]]):
        return _SDPA(
            q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=causal and mask is None,
            scale=scale, **kwargs,
        )


def _lse_shape(lse, q):
    batch, heads, seq = q.shape[0], q.shape[1], q.shape[2]
    return lse.reshape(batch, heads, -1)[:, :, :seq].to(torch.float32).contiguous()


def _math_with_lse(q, k, v, mask, causal, scale):
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    k = _expand_kv(q, k)
    v = _expand_kv(q, v)
    scores = torch.matmul(q.to(compute), k.to(compute).transpose(-1, -2)) * scale
    if mask is None and causal:
        rows = torch.arange(q.shape[2], device=q.device)[:, None]
        cols = torch.arange(k.shape[2], device=q.device)[None, :]
        mask = (cols <= rows)[None, None]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.softmax(scores, dim=-1), v.to(compute))
    return out.to(q.dtype), lse.to(torch.float32)


def _with_lse(kind, q, k, v, mask, causal, scale):
    if kind == "math":
        return _math_with_lse(q, k, v, mask, causal, scale)
    k = _expand_kv(q, k)
    v = _expand_kv(q, v)
    if q.device.type == "cpu":  # only sdpa_flash reaches here on CPU
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale
        )[:2]
    elif kind == "flash":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale
        )[:2]
    elif kind == "efficient":
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, causal, scale=scale
        )[:2]
    else:
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, causal, False, scale=scale
        )[:2]
    return out, _lse_shape(lse, q)


def _runner(kind):
    def run(q, k, v, *, layout, causal, scale, key_lengths, key_padding_mask, return_lse):
        mask = _bool_mask(q, k, causal, key_lengths, key_padding_mask)
        if return_lse:
            return _with_lse(kind, q, k, v, mask, causal, scale)
        return _sdpa(kind, q, k, v, mask, causal, scale)

    run.__name__ = f"sdpa_{kind}"
    return run


# --------------------------------------------------------------------------- checks


def _sdpa_params(q, k, v, mask, is_causal, gqa):
    try:
        return torch.backends.cuda.SDPAParams(q, k, v, mask, 0.0, is_causal, gqa)
    except TypeError:  # torch < 2.5: no enable_gqa
        return torch.backends.cuda.SDPAParams(q, k, v, mask, 0.0, is_causal)


def _torch_check(kind, q, k, v, mask, causal) -> str | None:
    """torch's own ``can_use_*_attention`` verdict, with the reason it prints."""
    check = getattr(torch.backends.cuda, f"can_use_{kind}_attention", None)
    if check is None:
        return None
    try:
        params = _sdpa_params(q, k, v, mask, causal and mask is None, q.shape[1] != k.shape[1])
        if check(params, False):
            return None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            check(params, True)
    except Exception:  # the check itself is not available for these inputs: let SDPA decide
        return None
    said = "; ".join(str(w.message).strip() for w in caught)
    if not said and q.shape[1] != k.shape[1]:
        # Retry with K/V heads broadcast to Hq (a view): if that passes, GQA was the reason.
        group = q.shape[1] // k.shape[1]
        k2, v2 = (t[:, :, None].expand(t.shape[0], t.shape[1], group, *t.shape[2:]).flatten(1, 2)
                  for t in (k, v))
        try:
            if check(_sdpa_params(q, k2, v2, mask, causal and mask is None, False), False):
                said = f"no GQA (Hq={q.shape[1]}, Hkv={k.shape[1]}) in torch {torch.__version__}"
        except Exception:
            pass
    if not said:  # torch printed its reason on stderr (C++ warning), not as a Python warning
        said = "rejected (torch printed the reason on stderr)"
    return f"cannot take these inputs: torch.backends.cuda.can_use_{kind}_attention: {said}"


def _mask_for_check(problem):
    # Shaped and strided as _bool_mask builds it: the last dim contiguous (fused
    # kernels reject a stride-0 last dim), the rest broadcast.
    if not (problem.key_lengths or problem.key_padding_mask):
        return None
    rows = problem.seq_q if problem.causal else 1
    return torch.ones((1, 1, 1, problem.seq_kv), dtype=torch.bool, device=problem.device).expand(
        problem.batch, 1, rows, problem.seq_kv
    )


def _input_check(kind):
    def check(problem, q, k, v, key_padding_mask) -> str | None:
        if problem.return_lse and kind != "math":
            if problem.key_lengths or problem.key_padding_mask:
                return "cannot return lse with key_lengths or a key-padding mask (only sdpa_math can)"
            if problem.causal and problem.cross and problem.device.type == "cuda":
                return "cannot return lse with causal=True and Sq != Skv on CUDA (sdpa_math can)"
        if problem.device.type != "cuda" or kind == "math" or torch.compiler.is_compiling():
            return None
        if problem.layout == "bshd":
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        return _torch_check(kind, q, k, v, _mask_for_check(problem), problem.causal)

    return check


_flash_common_check = _input_check("flash")


def _flash_check(problem, q, k, v, key_padding_mask):
    if problem.device.type == "cuda" and problem.dtype == torch.float32:
        return "cannot take dtype=float32 on CUDA: supports (float16, bfloat16)"
    return _flash_common_check(problem, q, k, v, key_padding_mask)


def _cuda_available(device):
    if device is not None and device.type == "cpu":
        return None
    if not torch.cuda.is_available():
        return "CUDA is not available (torch.cuda.is_available() is False)"
    return None


def _cudnn_available(device):
    reason = _cuda_available(device)
    if reason is not None:
        return reason
    if not torch.backends.cudnn.is_available():
        return "torch was built without cuDNN (torch.backends.cudnn.is_available() is False)"
    return None


def _cpu_or_cuda(device):
    if device is not None and device.type == "cpu":
        return None
    return _cuda_available(device)


def _register(kind: str, description: str, **declared) -> BackendSpec:
    """Register ``sdpa_{kind}``: every SDPA kernel returns the LSE and has a backward."""
    fields = dict(
        name=f"sdpa_{kind}", run=_runner(kind), description=description, lse=True, backward=True,
        package="torch", input_check=_input_check(kind),
    )
    return register_backend(BackendSpec(**{**fields, **declared}))


SDPA_CUDNN = _register(
    "cudnn",
    "torch SDPA, cuDNN fused attention (SDPBackend.CUDNN_ATTENTION)",
    dtypes=_HALF,
    key_lengths=True,
    key_padding_mask=True,
    min_capability=(8, 0),
    availability=_cudnn_available,
)

SDPA_FLASH = _register(
    "flash",
    "torch SDPA, FlashAttention-2 (SDPBackend.FLASH_ATTENTION); CPU flash kernel on CPU",
    devices=("cuda", "cpu"),
    dtypes=(torch.float16, torch.bfloat16, torch.float32),
    head_dims=range(1, 257),
    min_capability=(8, 0),
    availability=_cpu_or_cuda,
    input_check=_flash_check,
)

SDPA_EFFICIENT = _register(
    "efficient",
    "torch SDPA, memory-efficient attention (SDPBackend.EFFICIENT_ATTENTION)",
    dtypes=(torch.float16, torch.bfloat16, torch.float32),
    head_dims=None,
    key_lengths=True,
    key_padding_mask=True,
    min_capability=(5, 0),
    availability=_cuda_available,
)

SDPA_MATH = _register(
    "math",
    "torch SDPA, unfused math reference (SDPBackend.MATH)",
    devices=("cuda", "cpu"),
    dtypes=(torch.float16, torch.bfloat16, torch.float32, torch.float64),
    head_dims=None,
    key_lengths=True,
    key_padding_mask=True,
    availability=_cpu_or_cuda,
)
