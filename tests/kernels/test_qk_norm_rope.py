"""Tests of the fused QK-RMSNorm + RoPE (:func:`omni_kernels.qk_rmsnorm_rope`).

CPU part (CI): the Triton kernel under Triton's interpreter against the
float64 reference, on small odd shapes; the torch backend; argument checks;
``torch.library.opcheck``; ``torch.compile``. Shapes stay small because the
interpreter runs each program in Python (tens of ms per program).

GPU part (``-m gpu``): the CUDA and Triton kernels on the shapes of real models
(Flux, Wan 2.1, Qwen-Image, SD3.5) in bfloat16/float16 against a float32
reference. ``OMNI_REQUIRE_CUDA_EXT=1`` turns a missing compiled extension from
a skip into a failure (the documented GPU test command builds it first).

Every kernel output is first filled with NaN, so an element the kernel fails
to write shows up; the reference is always finite.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch

import omni_kernels
from omni_kernels import has_compiled_extension, qk_rmsnorm_rope
from omni_kernels._triton import triton_interpreter_enabled
from omni_kernels.qk_norm_rope import supported_backends

# ||out - ref|| / ||ref|| against the reference on upcast inputs. float32: the
# kernel's own arithmetic (~1e-7 seen); float16: the final rounding
# (2**-11 relative at most, ~2e-4 RMS seen).
CPU_TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-3, torch.float64: 1e-12}
# bfloat16 rounding is 2**-9 relative at most (~2e-3 RMS expected);
# 1e-2 leaves room for float16/bfloat16 weights and cancellation in the rotation.
GPU_TOLERANCE = 1e-2


def _poisoned_like(x: torch.Tensor) -> torch.Tensor:
    return torch.full_like(x, float("nan"), memory_format=torch.contiguous_format)


def _check_output(out, ref, dtype, rel_err, tolerance=None):
    """Every element written (no NaN left), and close to ``ref`` as a whole and elementwise."""
    tolerance = CPU_TOLERANCE[dtype] if tolerance is None else tolerance
    assert torch.isfinite(ref).all(), "the reference must be finite for the NaN check to mean anything"
    unwritten = torch.isnan(out)
    assert not unwritten.any(), (
        f"{int(unwritten.sum())} of {out.numel()} output elements were never written; first at "
        f"{tuple(unwritten.nonzero()[0].tolist())}"
    )
    err = rel_err(out, ref)
    assert err <= tolerance, f"relative error {err:.3e} > {tolerance:.1e}"
    # Elementwise: a few wrong elements (one head, one padded lane) can hide in
    # a norm over the whole tensor. Each element may be off by its rounding
    # (relative) plus the compute error, relative to the data's RMS.
    refd = ref.double()
    rms = refd.pow(2).mean().sqrt()
    bound = tolerance * (refd.abs() + rms)
    excess = (out.double() - refd).abs() - bound
    worst = int(excess.argmax())
    assert excess.reshape(-1)[worst] <= 0, (
        f"elementwise error exceeds the bound at index "
        f"{tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), excess.shape))}: "
        f"got {out.reshape(-1)[worst].item()!r}, expected {refd.reshape(-1)[worst].item()!r}"
    )


def _weights(inputs, mode, heads, head_dim, norm_across_heads, dtype, device="cpu"):
    if mode is None:
        return None
    numel = heads * head_dim if norm_across_heads else head_dim
    return inputs.weight(numel, dtype if mode == "same" else mode, device)


# =========================================================================== CPU: Triton kernel
#
# (B, S, Hq, Hk, D, q weight, k weight): weight None, torch.float32 or "same"
# (the activation dtype). Sizes are odd and small; head counts and D=48/80 are
# not powers of two, so the masks on heads and on head_dim are exercised, and
# Hq != Hk (GQA).
CPU_CASES = [
    pytest.param(1, 1, 1, 1, 16, None, None, id="S1-H1-D16-noweight"),
    pytest.param(2, 7, 3, 5, 48, torch.float32, torch.float32, id="S7-Hq3-Hk5-D48-w32"),
    pytest.param(1, 33, 5, 3, 64, "same", "same", id="S33-Hq5-Hk3-D64-wsame"),
    pytest.param(2, 3, 2, 1, 128, torch.float32, None, id="S3-Hq2-Hk1-D128-qweightonly"),
    pytest.param(1, 5, 3, 2, 80, "same", torch.float32, id="S5-Hq3-Hk2-D80-wmixed"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("interleaved", [True, False], ids=["pairs", "halves"])
@pytest.mark.parametrize("norm_across_heads", [False, True], ids=["per_head", "across_heads"])
@pytest.mark.parametrize("batch,seq,heads_q,heads_k,head_dim,q_wmode,k_wmode", CPU_CASES)
def test_triton_matches_reference(
    inputs, rel_err, qk_reference,
    batch, seq, heads_q, heads_k, head_dim, q_wmode, k_wmode,
    norm_across_heads, interleaved, dtype,
):
    q = inputs.activations((batch, seq, heads_q, head_dim), dtype)
    k = inputs.activations((batch, seq, heads_k, head_dim), dtype)
    q_weight = _weights(inputs, q_wmode, heads_q, head_dim, norm_across_heads, dtype)
    k_weight = _weights(inputs, k_wmode, heads_k, head_dim, norm_across_heads, dtype)
    cos, sin = inputs.rope_tables(seq, head_dim, interleaved)
    options = dict(eps=1e-6, interleaved=interleaved, norm_across_heads=norm_across_heads)

    q_out, k_out = _poisoned_like(q), _poisoned_like(k)
    result = qk_rmsnorm_rope(
        q, k, q_weight, k_weight, cos, sin, backend="triton", q_out=q_out, k_out=k_out, **options
    )
    assert result[0] is q_out and result[1] is k_out

    q_ref, k_ref = qk_reference(q, k, q_weight, k_weight, cos, sin, **options)
    _check_output(q_out, q_ref, dtype, rel_err)
    _check_output(k_out, k_ref, dtype, rel_err)


@pytest.mark.parametrize("norm_across_heads", [False, True], ids=["per_head", "across_heads"])
@pytest.mark.parametrize("interleaved", [True, False], ids=["pairs", "halves"])
def test_triton_many_heads(inputs, rel_err, qk_reference, interleaved, norm_across_heads):
    """40 heads of 128 (Wan's layout): several head blocks with a padded last one.

    Also returns fresh outputs (no ``out=``), which must be new contiguous tensors.
    """
    dtype = torch.float16
    q = inputs.activations((1, 2, 40, 128), dtype)
    k = inputs.activations((1, 2, 36, 128), dtype)
    q_weight = _weights(inputs, "same", 40, 128, norm_across_heads, dtype)
    k_weight = _weights(inputs, "same", 36, 128, norm_across_heads, dtype)
    cos, sin = inputs.rope_tables(2, 128, interleaved)
    options = dict(eps=1e-6, interleaved=interleaved, norm_across_heads=norm_across_heads)
    q_out, k_out = qk_rmsnorm_rope(q, k, q_weight, k_weight, cos, sin, backend="triton", **options)
    assert q_out.is_contiguous() and k_out.is_contiguous()
    assert q_out.data_ptr() != q.data_ptr()
    q_ref, k_ref = qk_reference(q, k, q_weight, k_weight, cos, sin, **options)
    _check_output(q_out, q_ref, dtype, rel_err)
    _check_output(k_out, k_ref, dtype, rel_err)


@pytest.mark.parametrize("interleaved", [True, False], ids=["pairs", "halves"])
def test_triton_unpaired_tables(inputs, rel_err, qk_reference, interleaved):
    """Tables whose two pair members differ: each element must use its own cos/sin entry.

    diffusers' tables repeat each value for both members of a pair, which would
    hide a kernel that reads one entry for both (or swaps them).
    """
    dtype = torch.float32
    q = inputs.activations((1, 5, 2, 32), dtype)
    k = inputs.activations((1, 5, 3, 32), dtype)
    cos, sin = inputs.rope_tables(5, 32, interleaved, paired=False)
    options = dict(eps=1e-6, interleaved=interleaved, norm_across_heads=False)
    q_out, k_out = _poisoned_like(q), _poisoned_like(k)
    qk_rmsnorm_rope(q, k, None, None, cos, sin, backend="triton", q_out=q_out, k_out=k_out, **options)
    q_ref, k_ref = qk_reference(q, k, None, None, cos, sin, **options)
    _check_output(q_out, q_ref, dtype, rel_err)
    _check_output(k_out, k_ref, dtype, rel_err)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("interleaved", [True, False], ids=["pairs", "halves"])
def test_triton_strided_views_and_joint_buffer(inputs, rel_err, qk_reference, interleaved, dtype):
    """q/k are views of one fused QKV projection; outputs are slices of larger buffers.

    * q/k: ``qkv[..., :H*D]`` and ``qkv[..., H*D:2*H*D]`` of a ``[B, S, 3*H*D]``
      tensor, unflattened to ``[B, S, H, D]`` (row stride 3*H*D, not H*D).
    * q_out: the image part ``[:, S_txt:]`` of a joint text+image buffer.
    * k_out: a ``[B, H, S, D]`` (SDPA layout) buffer seen as ``[B, S, H, D]``.

    Every buffer element outside the outputs must keep its NaN poison: the
    kernel writes nothing outside its views.
    """
    batch, seq, heads, head_dim, seq_txt = 2, 6, 3, 48, 4
    qkv = inputs.activations((batch, seq, 3 * heads * head_dim), dtype)
    q = qkv[..., : heads * head_dim].unflatten(-1, (heads, head_dim))
    k = qkv[..., heads * head_dim : 2 * heads * head_dim].unflatten(-1, (heads, head_dim))
    assert not q.is_contiguous() and q.stride(1) == 3 * heads * head_dim
    qkv_before = qkv.clone()

    joint = torch.full((batch, seq_txt + seq, heads, head_dim), float("nan"), dtype=dtype)
    q_out = joint[:, seq_txt:]
    sdpa = torch.full((batch, heads, seq, head_dim), float("nan"), dtype=dtype)
    k_out = sdpa.transpose(1, 2)

    q_weight = inputs.weight(head_dim, dtype)
    k_weight = inputs.weight(head_dim, torch.float32)
    cos, sin = inputs.rope_tables(seq, head_dim, interleaved)
    options = dict(eps=1e-6, interleaved=interleaved, norm_across_heads=False)
    qk_rmsnorm_rope(
        q, k, q_weight, k_weight, cos, sin, backend="triton", q_out=q_out, k_out=k_out, **options
    )

    assert torch.equal(qkv, qkv_before), "inputs must not be modified"
    assert torch.isnan(joint[:, :seq_txt]).all(), "wrote outside q_out (into the text part)"
    q_ref, k_ref = qk_reference(q, k, q_weight, k_weight, cos, sin, **options)
    _check_output(q_out, q_ref, dtype, rel_err)
    _check_output(k_out, k_ref, dtype, rel_err)


@pytest.mark.parametrize("norm_across_heads", [False, True], ids=["per_head", "across_heads"])
@pytest.mark.parametrize("interleaved", [True, False], ids=["pairs", "halves"])
def test_triton_in_place(inputs, rel_err, qk_reference, interleaved, norm_across_heads):
    """``q_out=q, k_out=k`` on views of a fused QKV tensor: in place, V untouched."""
    dtype = torch.float16
    batch, seq, heads, head_dim = 1, 5, 5, 64
    qkv = inputs.activations((batch, seq, 3, heads, head_dim), dtype)
    q, k, v = qkv.unbind(2)
    v_before = v.clone()
    q_weight = _weights(inputs, "same", heads, head_dim, norm_across_heads, dtype)
    k_weight = _weights(inputs, torch.float32, heads, head_dim, norm_across_heads, dtype)
    cos, sin = inputs.rope_tables(seq, head_dim, interleaved)
    options = dict(eps=1e-6, interleaved=interleaved, norm_across_heads=norm_across_heads)
    q_ref, k_ref = qk_reference(q, k, q_weight, k_weight, cos, sin, **options)

    q_res, k_res = qk_rmsnorm_rope(
        q, k, q_weight, k_weight, cos, sin, backend="triton", q_out=q, k_out=k, **options
    )
    assert q_res is q and k_res is k
    _check_output(q, q_ref, dtype, rel_err)
    _check_output(k, k_ref, dtype, rel_err)
    assert torch.equal(v, v_before)


def test_triton_zero_head_and_large_eps(inputs, rel_err, qk_reference):
    """An all-zero head gives zeros (eps keeps it finite); a large eps is honoured."""
    dtype = torch.float32
    q = inputs.activations((1, 3, 2, 16), dtype)
    k = inputs.activations((1, 3, 2, 16), dtype)
    q[:, 1, 0] = 0.0
    cos, sin = inputs.rope_tables(3, 16, True)
    for eps in (1e-6, 4.0):
        options = dict(eps=eps, interleaved=True, norm_across_heads=False)
        q_out, k_out = _poisoned_like(q), _poisoned_like(k)
        qk_rmsnorm_rope(q, k, None, None, cos, sin, backend="triton", q_out=q_out, k_out=k_out, **options)
        assert torch.equal(q_out[:, 1, 0], torch.zeros_like(q_out[:, 1, 0]))
        q_ref, k_ref = qk_reference(q, k, None, None, cos, sin, **options)
        _check_output(q_out, q_ref, dtype, rel_err)
        _check_output(k_out, k_ref, dtype, rel_err)


def test_triton_float64(inputs, rel_err, qk_reference):
    """float64 inputs are computed in float64, like the reference."""
    dtype = torch.float64
    q = inputs.activations((1, 3, 2, 16), dtype)
    k = inputs.activations((1, 3, 1, 16), dtype)
    q_weight = inputs.weight(16, dtype)
    cos, sin = inputs.rope_tables(3, 16, False)
    options = dict(eps=1e-6, interleaved=False, norm_across_heads=False)
    q_out, k_out = qk_rmsnorm_rope(q, k, q_weight, None, cos, sin, backend="triton", **options)
    q_ref, k_ref = qk_reference(q, k, q_weight, None, cos, sin, **options)
    _check_output(q_out, q_ref, dtype, rel_err)
    _check_output(k_out, k_ref, dtype, rel_err)


def test_auto_backend_on_cpu(inputs):
    """On CPU, ``auto`` skips CUDA (with its reason) and runs Triton under the interpreter."""
    q = inputs.activations((1, 3, 2, 16), torch.float32)
    k = inputs.activations((1, 3, 2, 16), torch.float32)
    cos, sin = inputs.rope_tables(3, 16, True)
    reasons = supported_backends(q, k)
    assert reasons["cuda"] is not None and reasons["torch"] is None
    if triton_interpreter_enabled():
        assert reasons["triton"] is None
        auto = qk_rmsnorm_rope(q, k, None, None, cos, sin, backend="auto")
        triton_out = qk_rmsnorm_rope(q, k, None, None, cos, sin, backend="triton")
        assert torch.equal(auto[0], triton_out[0]) and torch.equal(auto[1], triton_out[1])


@pytest.mark.gpu
@pytest.mark.parametrize(
    "norm_across_heads, expected", [(False, "cuda"), (True, "triton")], ids=["per_head", "across"]
)
def test_gpu_auto_follows_the_measured_order(inputs, caplog, norm_across_heads, expected):
    """``auto`` picks the backend the H200 benchmark ranked first for the norm mode, and logs it."""
    if expected == "cuda" and not omni_kernels.has_compiled_extension():
        pytest.skip("omni_kernels._C is not built")
    import omni_kernels.qk_norm_rope.dispatch as dispatch

    dispatch._logged_auto_choices.clear()
    q = inputs.activations((1, 9, 4, 128), torch.bfloat16, device="cuda")
    k = inputs.activations((1, 9, 4, 128), torch.bfloat16, device="cuda")
    cos, sin = inputs.rope_tables(9, 128, True, device="cuda")
    with caplog.at_level(logging.INFO, logger=dispatch.__name__):
        qk_rmsnorm_rope(q, k, None, None, cos, sin, norm_across_heads=norm_across_heads)
        qk_rmsnorm_rope(q, k, None, None, cos, sin, norm_across_heads=norm_across_heads)
    choices = [r.getMessage() for r in caplog.records if "backend='auto' chose" in r.getMessage()]
    assert len(choices) == 1, choices  # logged once, not per call
    assert f"chose '{expected}'" in choices[0]


# =========================================================================== CPU: torch backend


@pytest.mark.parametrize("norm_across_heads", [False, True], ids=["per_head", "across_heads"])
@pytest.mark.parametrize("interleaved", [True, False], ids=["pairs", "halves"])
def test_torch_backend_is_the_reference(inputs, interleaved, norm_across_heads):
    dtype = torch.float16
    q = inputs.activations((2, 5, 3, 32), dtype)
    k = inputs.activations((2, 5, 2, 32), dtype)
    q_weight = _weights(inputs, "same", 3, 32, norm_across_heads, dtype)
    k_weight = _weights(inputs, torch.float32, 2, 32, norm_across_heads, dtype)
    cos, sin = inputs.rope_tables(5, 32, interleaved)
    options = dict(eps=1e-5, interleaved=interleaved, norm_across_heads=norm_across_heads)
    expected = omni_kernels.qk_rmsnorm_rope_reference(q, k, q_weight, k_weight, cos, sin, **options)

    got = qk_rmsnorm_rope(q, k, q_weight, k_weight, cos, sin, backend="torch", **options)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])

    q_out, k_out = _poisoned_like(q), _poisoned_like(k)
    got = qk_rmsnorm_rope(
        q, k, q_weight, k_weight, cos, sin, backend="torch", q_out=q_out, k_out=k_out, **options
    )
    assert got[0] is q_out and got[1] is k_out
    assert torch.equal(q_out, expected[0]) and torch.equal(k_out, expected[1])


def test_reference_matches_diffusers_formula(inputs):
    """The reference is diffusers' RMSNorm + apply_rotary_emb up to its extra rounding.

    Restated here for the interleaved case (use_real_unbind_dim=-1) in float64,
    where the intermediate rounding of diffusers disappears, so the two must
    agree to float64 precision.
    """
    dtype = torch.float64
    q = inputs.activations((1, 4, 2, 16), dtype)
    weight = inputs.weight(16, dtype)
    cos, sin = inputs.rope_tables(4, 16, True)
    eps = 1e-6
    # diffusers RMSNorm
    normed = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + eps) * weight
    # diffusers apply_rotary_emb(use_real=True, use_real_unbind_dim=-1), sequence_dim=1
    c, s = cos.double()[None, :, None, :], sin.double()[None, :, None, :]
    x_real, x_imag = normed.reshape(*normed.shape[:-1], -1, 2).unbind(-1)
    x_rotated = torch.stack([-x_imag, x_real], dim=-1).flatten(3)
    expected = normed * c + x_rotated * s
    got, _ = omni_kernels.qk_rmsnorm_rope_reference(
        q, q, weight, weight, cos, sin, eps=eps, interleaved=True, norm_across_heads=False
    )
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


# =========================================================================== CPU: argument checks


def _valid_arguments():
    q = torch.randn(1, 4, 2, 16)
    k = torch.randn(1, 4, 3, 16)
    cos = torch.randn(4, 16)
    sin = torch.randn(4, 16)
    return dict(q=q, k=k, q_weight=torch.ones(16), k_weight=None, cos=cos, sin=sin)


# (name, change to the valid arguments, regex the ValueError must match)
BAD_ARGUMENTS = [
    ("q_3d", dict(q=torch.randn(4, 2, 16)), r"q must be a 4-D tensor"),
    ("k_int", dict(k=torch.ones(1, 4, 3, 16, dtype=torch.int32)), r"k must be a floating-point"),
    ("q_last_stride", dict(q=torch.randn(1, 4, 16, 2).transpose(2, 3)), r"q must have a contiguous last"),
    ("k_seq", dict(k=torch.randn(1, 5, 3, 16)), r"k must match q in batch, sequence and head_dim"),
    ("k_dtype", dict(k=torch.randn(1, 4, 3, 16, dtype=torch.float16)), r"q and k must share dtype"),
    (
        "odd_head_dim",
        dict(q=torch.randn(1, 4, 2, 15), k=torch.randn(1, 4, 3, 15), q_weight=None,
             cos=torch.randn(4, 15), sin=torch.randn(4, 15)),
        r"head_dim must be even",
    ),
    ("q_weight_numel", dict(q_weight=torch.ones(32)), r"q_weight must be 1-D with 16 elements"),
    ("k_weight_2d", dict(k_weight=torch.ones(3, 16)), r"k_weight must be 1-D with 16 elements"),
    (
        "q_weight_across",
        dict(q_weight=torch.ones(16), norm_across_heads=True),
        r"q_weight must be 1-D with 32 elements, H\*D",
    ),
    ("cos_size", dict(cos=torch.randn(3, 16)), r"cos must hold \[S, D\] = \[4, 16\]"),
    ("sin_size", dict(sin=torch.randn(4, 8)), r"sin must hold \[S, D\]"),
    ("negative_eps", dict(eps=-1.0), r"eps must be >= 0"),
    ("q_out_shape", dict(q_out=torch.empty(1, 4, 3, 16)), r"q_out must match q"),
    ("k_out_dtype", dict(k_out=torch.empty(1, 4, 3, 16, dtype=torch.float16)), r"k_out must match k"),
    ("unknown_backend", dict(backend="flash"), r"backend must be one of .*'flash'"),
]


@pytest.mark.parametrize("change,match", [pytest.param(c, m, id=n) for n, c, m in BAD_ARGUMENTS])
def test_bad_arguments_raise_value_error(change, match):
    arguments = _valid_arguments()
    arguments.update(change)
    with pytest.raises(ValueError, match=match):
        qk_rmsnorm_rope(**arguments)


def test_valid_arguments_are_accepted():
    # The baseline of the table above must itself pass, or every case there
    # would raise for the wrong reason.
    qk_rmsnorm_rope(**_valid_arguments(), backend="torch")


def test_cuda_backend_on_cpu_names_what_is_missing():
    arguments = _valid_arguments()
    if has_compiled_extension():
        match = r"backend='cuda' cannot take these inputs: .*needs CUDA tensors"
    else:
        # Without the extension the message says it is missing and how to build it.
        match = r"backend='cuda' cannot take these inputs: omni_kernels\._C is not available.*pip install"
    with pytest.raises(ValueError, match=match):
        qk_rmsnorm_rope(**arguments, backend="cuda")


def test_triton_backend_on_cpu_without_interpreter(monkeypatch):
    # TRITON_INTERPRET is read once at import (Triton reads it when kernels are
    # defined), so the "not set" case is simulated at the function that reports it.
    import omni_kernels._triton

    monkeypatch.setattr(omni_kernels._triton, "triton_interpreter_enabled", lambda: False)
    with pytest.raises(ValueError, match=r"backend='triton'.*TRITON_INTERPRET=1"):
        qk_rmsnorm_rope(**_valid_arguments(), backend="triton")


# =========================================================================== CPU: torch.library / torch.compile


def _op_arguments(inputs, device, dtype, norm_across_heads):
    q = inputs.activations((1, 3, 2, 64), dtype, device)
    k = inputs.activations((1, 3, 1, 64), dtype, device)
    q_weight = _weights(inputs, torch.float32, 2, 64, norm_across_heads, dtype, device)
    cos, sin = inputs.rope_tables(3, 64, True, device)
    q_out = torch.empty_like(q)
    k_out = torch.empty_like(k)
    return (q_out, k_out, q, k, q_weight, None, cos, sin, 1e-6, True, norm_across_heads)


# test_aot_dispatch_dynamic is included: the op mutates only its declared
# outputs (q_out, k_out), which AOTAutograd functionalizes, so it applies.
OPCHECK_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("norm_across_heads", [False, True], ids=["per_head", "across_heads"])
def test_opcheck_triton_op_cpu(inputs, norm_across_heads):
    args = _op_arguments(inputs, "cpu", torch.float32, norm_across_heads)
    torch.library.opcheck(
        torch.ops.omni_kernels.qk_rmsnorm_rope_triton, args, test_utils=OPCHECK_UTILS
    )


class _QKBlock(torch.nn.Module):
    """The slice of a DiT attention block around the op: projections, norm + RoPE, output."""

    def __init__(self, dim, heads, out_mode, backend, norm_across_heads=False):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.to_qk = torch.nn.Linear(dim, 2 * dim, bias=False)
        norm_numel = dim if norm_across_heads else self.head_dim
        self.q_weight = torch.nn.Parameter(1.0 + 0.1 * torch.randn(norm_numel))
        self.k_weight = torch.nn.Parameter(1.0 + 0.1 * torch.randn(norm_numel))
        self.out_mode, self.backend, self.norm_across_heads = out_mode, backend, norm_across_heads

    def forward(self, x, cos, sin):
        q, k = self.to_qk(x).unflatten(-1, (2, self.heads, self.head_dim)).unbind(2)
        options = dict(backend=self.backend, norm_across_heads=self.norm_across_heads)
        if self.out_mode == "inplace":
            options.update(q_out=q, k_out=k)
        elif self.out_mode == "joint":
            # Write q after 2 "text" tokens of a joint buffer, as joint attention does.
            joint = torch.zeros(q.shape[0], q.shape[1] + 2, *q.shape[2:], dtype=q.dtype, device=q.device)
            options.update(q_out=joint[:, 2:])
        q, k = qk_rmsnorm_rope(q, k, self.q_weight, self.k_weight, cos, sin, **options)
        if self.out_mode == "joint":
            # The whole joint buffer flows on, text part included (it must stay zero).
            q = joint
            k = torch.cat((k.new_zeros(k.shape[0], 2, *k.shape[2:]), k), dim=1)
        return (q * k).sum(-1)


@pytest.mark.parametrize("out_mode", ["new", "inplace", "joint"])
@pytest.mark.parametrize("compile_backend", ["eager", "aot_eager"])
def test_torch_compile_fullgraph_triton(inputs, compile_backend, out_mode):
    """``torch.compile(fullgraph=True)`` traces through the op and matches eager.

    Inductor would need a GPU here, so the compiler backends are ``eager``
    (Dynamo only) and ``aot_eager`` (Dynamo + AOTAutograd functionalization of
    the mutating op).
    """
    torch.manual_seed(inputs.seed)
    block = _QKBlock(dim=64, heads=2, out_mode=out_mode, backend="triton").eval()
    x = inputs.activations((1, 5, 64), torch.float32)
    cos, sin = inputs.rope_tables(5, 32, True)
    torch._dynamo.reset()
    compiled = torch.compile(block, backend=compile_backend, fullgraph=True)
    with torch.no_grad():
        expected = block(x, cos, sin)
        got = compiled(x, cos, sin)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        reference_block = _QKBlock(dim=64, heads=2, out_mode=out_mode, backend="torch").eval()
        reference_block.load_state_dict(block.state_dict())
        torch.testing.assert_close(got, reference_block(x, cos, sin), rtol=1e-4, atol=1e-4)


# =========================================================================== GPU
#
# Shapes of real models at their usual resolutions: (B, S, Hq, Hk, D,
# interleaved, norm_across_heads, weight dtype: None = activation dtype).
GPU_CASES = [
    # Flux.1 at 1024x1024: 4096 image + 512 text tokens, 24 heads of 128.
    pytest.param(1, 4608, 24, 24, 128, True, False, None, id="flux-1024"),
    # Wan 2.1 14B, 720p 81 frames: 21 x 45 x 80 latent tokens, 40 heads, norm over H*D.
    pytest.param(1, 75600, 40, 40, 128, True, True, None, id="wan-720p-81f"),
    # Qwen-Image at 1328x1328: 83 x 83 image + 512 text tokens; float32 weights.
    pytest.param(1, 7401, 24, 24, 128, True, False, torch.float32, id="qwen-image-1328"),
    # Odd sequence lengths, GQA and the half-split rotation.
    pytest.param(2, 4097, 24, 8, 128, False, False, None, id="S4097-gqa-halves"),
    pytest.param(3, 333, 24, 24, 128, True, False, torch.float32, id="S333-B3"),
    # SD3.5 Large's head layout: 38 heads of 64.
    pytest.param(2, 4429, 38, 38, 64, True, False, None, id="sd35-D64-H38"),
    pytest.param(1, 1025, 16, 16, 256, True, True, None, id="D256-across"),
]

GPU_BACKENDS = ["cuda", "triton"]


def _require_backend(backend):
    """Skip (or, with OMNI_REQUIRE_CUDA_EXT=1, fail) when the CUDA extension is not built."""
    if backend == "cuda" and not has_compiled_extension():
        from omni_kernels._extension import compiled_extension_error

        message = f"backend='cuda' needs the compiled extension: {compiled_extension_error()}"
        if os.environ.get("OMNI_REQUIRE_CUDA_EXT", "0") not in ("", "0"):
            pytest.fail(message + " (OMNI_REQUIRE_CUDA_EXT=1 makes this a failure)")
        pytest.skip(message)


def _gpu_inputs(inputs, batch, seq, heads_q, heads_k, head_dim, interleaved, norm_across_heads,
                weight_dtype, dtype):
    device = "cuda"
    q = inputs.activations((batch, seq, heads_q, head_dim), dtype, device)
    k = inputs.activations((batch, seq, heads_k, head_dim), dtype, device)
    weight_dtype = dtype if weight_dtype is None else weight_dtype
    q_numel = heads_q * head_dim if norm_across_heads else head_dim
    k_numel = heads_k * head_dim if norm_across_heads else head_dim
    q_weight = inputs.weight(q_numel, weight_dtype, device)
    k_weight = inputs.weight(k_numel, weight_dtype, device)
    cos, sin = inputs.rope_tables(seq, head_dim, interleaved, device)
    return q, k, q_weight, k_weight, cos, sin


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize(
    "batch,seq,heads_q,heads_k,head_dim,interleaved,norm_across_heads,weight_dtype", GPU_CASES
)
def test_gpu_matches_reference(
    inputs, rel_err, qk_reference, backend, dtype,
    batch, seq, heads_q, heads_k, head_dim, interleaved, norm_across_heads, weight_dtype,
):
    _require_backend(backend)
    q, k, q_weight, k_weight, cos, sin = _gpu_inputs(
        inputs, batch, seq, heads_q, heads_k, head_dim, interleaved, norm_across_heads,
        weight_dtype, dtype,
    )
    options = dict(eps=1e-6, interleaved=interleaved, norm_across_heads=norm_across_heads)
    q_out, k_out = _poisoned_like(q), _poisoned_like(k)
    qk_rmsnorm_rope(
        q, k, q_weight, k_weight, cos, sin, backend=backend, q_out=q_out, k_out=k_out, **options
    )
    torch.cuda.synchronize()
    q_ref, k_ref = qk_reference(q, k, q_weight, k_weight, cos, sin, dtype=torch.float32, **options)
    _check_output(q_out, q_ref, dtype, rel_err, GPU_TOLERANCE)
    del q_ref
    _check_output(k_out, k_ref, dtype, rel_err, GPU_TOLERANCE)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "batch,seq,heads_q,heads_k,head_dim,interleaved,norm_across_heads,weight_dtype",
    [GPU_CASES[0], GPU_CASES[1], GPU_CASES[3]],
)
def test_gpu_backends_agree(
    inputs, batch, seq, heads_q, heads_k, head_dim, interleaved, norm_across_heads, weight_dtype
):
    """CUDA and Triton both round the float32 result once, like the torch backend.

    So nearly every bfloat16 output is bit-identical to the torch backend's: an
    element differs only where the float32 values (different summation order,
    rsqrt) straddle a rounding boundary, about 1 in 10^4. Rounding twice (after
    the norm and again after the rotation, as diffusers does) would make many
    percent of the elements differ.
    """
    dtype = torch.bfloat16
    q, k, q_weight, k_weight, cos, sin = _gpu_inputs(
        inputs, batch, seq, heads_q, heads_k, head_dim, interleaved, norm_across_heads,
        weight_dtype, dtype,
    )
    options = dict(eps=1e-6, interleaved=interleaved, norm_across_heads=norm_across_heads)
    expected = qk_rmsnorm_rope(q, k, q_weight, k_weight, cos, sin, backend="torch", **options)
    backends = ["triton"] + (["cuda"] if has_compiled_extension() else [])
    for backend in backends:
        got = qk_rmsnorm_rope(q, k, q_weight, k_weight, cos, sin, backend=backend, **options)
        for name, g, e in zip(("q", "k"), got, expected):
            same = (g == e).double().mean().item()
            assert same >= 0.99, f"{backend} {name}: only {same:.4%} of elements match the torch backend"


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("interleaved", [True, False], ids=["pairs", "halves"])
def test_gpu_strided_joint_and_in_place(inputs, rel_err, qk_reference, backend, interleaved):
    """Views of a fused QKV projection in, a joint text+image buffer out; then in place."""
    _require_backend(backend)
    dtype = torch.bfloat16
    batch, seq, heads, head_dim, seq_txt = 2, 1031, 24, 128, 512
    qkv = inputs.activations((batch, seq, 3 * heads * head_dim), dtype, "cuda")
    q = qkv[..., : heads * head_dim].unflatten(-1, (heads, head_dim))
    k = qkv[..., heads * head_dim : 2 * heads * head_dim].unflatten(-1, (heads, head_dim))
    v_before = qkv[..., 2 * heads * head_dim :].clone()
    q_weight = inputs.weight(head_dim, dtype, "cuda")
    k_weight = inputs.weight(head_dim, dtype, "cuda")
    cos, sin = inputs.rope_tables(seq, head_dim, interleaved, "cuda")
    options = dict(eps=1e-6, interleaved=interleaved, norm_across_heads=False)
    q_ref, k_ref = qk_reference(q, k, q_weight, k_weight, cos, sin, dtype=torch.float32, **options)

    joint_q = torch.full((batch, seq_txt + seq, heads, head_dim), float("nan"), dtype=dtype, device="cuda")
    joint_k = torch.full_like(joint_q, float("nan"))
    qk_rmsnorm_rope(
        q, k, q_weight, k_weight, cos, sin, backend=backend,
        q_out=joint_q[:, seq_txt:], k_out=joint_k[:, seq_txt:], **options,
    )
    assert torch.isnan(joint_q[:, :seq_txt]).all() and torch.isnan(joint_k[:, :seq_txt]).all()
    _check_output(joint_q[:, seq_txt:], q_ref, dtype, rel_err, GPU_TOLERANCE)
    _check_output(joint_k[:, seq_txt:], k_ref, dtype, rel_err, GPU_TOLERANCE)

    qk_rmsnorm_rope(q, k, q_weight, k_weight, cos, sin, backend=backend, q_out=q, k_out=k, **options)
    _check_output(q, q_ref, dtype, rel_err, GPU_TOLERANCE)
    _check_output(k, k_ref, dtype, rel_err, GPU_TOLERANCE)
    assert torch.equal(qkv[..., 2 * heads * head_dim :], v_before)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_sdpa_layout_output(inputs, rel_err, qk_reference, backend):
    """Output straight into a ``[B, H, S, D]`` buffer (heads not packed).

    The Triton kernel takes any head stride; the CUDA kernel needs packed
    heads, so an explicit request for it must say so instead of writing garbage.
    """
    _require_backend(backend)
    dtype = torch.bfloat16
    q, k, q_weight, k_weight, cos, sin = _gpu_inputs(
        inputs, 1, 1000, 24, 24, 128, True, False, None, dtype
    )
    options = dict(eps=1e-6, interleaved=True, norm_across_heads=False)
    q_out = torch.full((1, 24, 1000, 128), float("nan"), dtype=dtype, device="cuda").transpose(1, 2)
    k_out = torch.full_like(q_out, float("nan"))
    if backend == "cuda":
        with pytest.raises(ValueError, match=r"heads of q_out packed"):
            qk_rmsnorm_rope(q, k, q_weight, k_weight, cos, sin, backend="cuda", q_out=q_out, k_out=k_out, **options)
        return
    qk_rmsnorm_rope(q, k, q_weight, k_weight, cos, sin, backend=backend, q_out=q_out, k_out=k_out, **options)
    q_ref, k_ref = qk_reference(q, k, q_weight, k_weight, cos, sin, dtype=torch.float32, **options)
    _check_output(q_out, q_ref, dtype, rel_err, GPU_TOLERANCE)
    _check_output(k_out, k_ref, dtype, rel_err, GPU_TOLERANCE)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("norm_across_heads", [False, True], ids=["per_head", "across_heads"])
def test_gpu_opcheck(inputs, backend, norm_across_heads):
    _require_backend(backend)
    op = (
        torch.ops.omni_kernels.qk_rmsnorm_rope
        if backend == "cuda"
        else torch.ops.omni_kernels.qk_rmsnorm_rope_triton
    )
    args = _op_arguments(inputs, "cuda", torch.bfloat16, norm_across_heads)
    torch.library.opcheck(op, args, test_utils=OPCHECK_UTILS)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("out_mode", ["new", "inplace", "joint"])
def test_gpu_torch_compile_inductor(inputs, backend, out_mode):
    """Inductor, fullgraph: the op stays one opaque call and matches eager."""
    _require_backend(backend)
    torch.manual_seed(inputs.seed)
    block = _QKBlock(dim=3072, heads=24, out_mode=out_mode, backend=backend).cuda().to(torch.bfloat16).eval()
    x = inputs.activations((1, 333, 3072), torch.bfloat16, "cuda")
    cos, sin = inputs.rope_tables(333, 128, True, "cuda")
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, dynamic=False)
    with torch.no_grad():
        expected = block(x, cos, sin)
        got = compiled(x, cos, sin)
    # The projection may be fused differently by Inductor; the op's inputs then
    # differ by bf16 rounding, hence the bf16-level tolerance.
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())
