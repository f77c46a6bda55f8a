"""Tests of omni's Triton attention forward and the partial-result merge.

CPU part (CI): :func:`flash_attention_forward` under Triton's interpreter
(16x16 blocks, float32/float16) against the float64 reference
(:func:`attention_reference` on upcast inputs) on small odd shapes: both
layouts, strided views, cross-attention, GQA/MQA, top-left causal, key
lengths (including empty samples), log-sum-exp, other block shapes and the
TMA / pipelined-QK variants, argument checks; and
:func:`merge_attention_partials` against attention over the union of keys.

GPU part (``-m gpu``): real DiT shapes (Flux, SD3.5, Wan cross-attention)
and the feature matrix in bfloat16/float16 against a float32 reference.

Every kernel output is first filled with NaN, so an element the kernel fails
to write shows up; the reference is always finite.
"""

from __future__ import annotations

import math

import pytest
import torch

from omni_kernels.attention.merge import merge_attention_partials, merge_attention_partials_
from omni_kernels.attention.reference import attention_reference
from omni_kernels.attention.triton_flash import (
    AttentionConfig,
    default_config,
    flash_attention_forward,
)

# ||out - ref|| / ||ref|| against float64 on the same (rounded) inputs.
# float32: ieee dots, ~1e-7 seen; float16: P and the output rounded to
# float16 (2**-11 relative), ~3e-4 seen.
CPU_TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3}
LSE_TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-4}
GPU_TOLERANCE = 5e-3


# --------------------------------------------------------------------------- helpers


def _shape(layout, b, h, s, d):
    return (b, h, s, d) if layout == "bhsd" else (b, s, h, d)


def _qkv(inputs, layout, b, hq, hkv, sq, skv, d, dtype, device="cpu"):
    """q and k with outlier channels (as DiT projections have), v plain."""
    q = inputs.activations(_shape(layout, b, hq, sq, d), dtype, device)
    k = inputs.activations(_shape(layout, b, hkv, skv, d), dtype, device)
    v = inputs.activations(_shape(layout, b, hkv, skv, d), dtype, device, outlier_channels=0)
    return q, k, v


def _poisoned(q):
    return torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)


def _reference(q, k, v, wide=torch.float64, **kw):
    return attention_reference(q.to(wide), k.to(wide), v.to(wide), return_lse=True, **kw)


def _check(out, lse, ref_out, ref_lse, tol, lse_tol, rel_err):
    assert torch.isfinite(ref_out).all()
    unwritten = torch.isnan(out)
    assert not unwritten.any(), (
        f"{int(unwritten.sum())} of {out.numel()} output elements never written; first at "
        f"{tuple(unwritten.nonzero()[0].tolist())}"
    )
    err = rel_err(out, ref_out)
    assert err <= tol, f"relative error {err:.3e} > {tol:.1e}"
    # elementwise, relative to the data's RMS: a few wrong rows can hide in a norm
    refd = ref_out.double()
    rms = refd.pow(2).mean().sqrt().clamp_min(1e-30)
    worst = ((out.double() - refd).abs() / (refd.abs() + rms)).max().item()
    assert worst <= 20 * tol, f"elementwise error {worst:.3e} > {20 * tol:.1e}"
    if lse is not None:
        assert lse.dtype == torch.float32
        assert lse.shape == ref_lse.shape
        assert not torch.isnan(lse).any(), "lse has NaN (unwritten?)"
        empty = torch.isneginf(ref_lse)
        assert torch.equal(torch.isneginf(lse), empty), "lse is -inf exactly where no key is valid"
        if (~empty).any():
            diff = (lse.double() - ref_lse.double())[~empty].abs().max().item()
            assert diff <= lse_tol * max(1.0, ref_lse[~empty].abs().max().item()), f"lse off by {diff:.3e}"


def _run_case(inputs, rel_err, *, layout, b, hq, hkv, sq, skv, d, dtype, causal=False,
              key_lengths=None, config=None, scale=None):
    q, k, v = _qkv(inputs, layout, b, hq, hkv, sq, skv, d, dtype)
    out = _poisoned(q)
    res, lse = flash_attention_forward(
        q, k, v, layout=layout, causal=causal, key_lengths=key_lengths, return_lse=True,
        out=out, config=config, scale=scale,
    )
    assert res is out
    ref_out, ref_lse = _reference(q, k, v, layout=layout, causal=causal, key_lengths=key_lengths,
                                  scale=scale)
    _check(out, lse, ref_out, ref_lse, CPU_TOLERANCE[dtype], LSE_TOLERANCE[dtype], rel_err)
    return out, lse, ref_out, ref_lse


# --------------------------------------------------------------------------- CPU: kernel vs reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("seq,d", [(1, 16), (17, 32), (33, 64), (65, 16)])
def test_self_attention(inputs, rel_err, dtype, layout, seq, d):
    _run_case(inputs, rel_err, layout=layout, b=2, hq=3, hkv=3, sq=seq, skv=seq, d=d, dtype=dtype)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("sq,skv", [(65, 17), (17, 65), (1, 33), (40, 1)])
def test_cross_attention(inputs, rel_err, layout, sq, skv):
    _run_case(inputs, rel_err, layout=layout, b=2, hq=2, hkv=2, sq=sq, skv=skv, d=32,
              dtype=torch.float32)


@pytest.mark.parametrize("hkv", [2, 1])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_gqa_mqa(inputs, rel_err, layout, hkv):
    _run_case(inputs, rel_err, layout=layout, b=2, hq=4, hkv=hkv, sq=33, skv=41, d=32,
              dtype=torch.float16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("sq,skv", [(33, 33), (65, 65), (17, 50), (50, 17)])
def test_causal(inputs, rel_err, dtype, layout, sq, skv):
    """Top-left causal (SDPA is_causal): query i sees keys j <= i, also for Sq != Skv."""
    _run_case(inputs, rel_err, layout=layout, b=2, hq=2, hkv=2, sq=sq, skv=skv, d=16,
              dtype=dtype, causal=True)


def test_causal_matches_sdpa_convention(inputs):
    q, k, v = _qkv(inputs, "bhsd", 1, 2, 2, 17, 40, 32, torch.float32)
    out = flash_attention_forward(q, k, v, causal=True)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), is_causal=True
    )
    assert (out.double() - expected).abs().max().item() < 1e-5


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_key_lengths(inputs, rel_err, layout, causal):
    """Padded keys are ignored; a sample with no keys gives 0 and lse = -inf."""
    lengths = torch.tensor([0, 1, 23, 65], dtype=torch.int32)
    out, lse, _, _ = _run_case(inputs, rel_err, layout=layout, b=4, hq=2, hkv=1, sq=33, skv=65,
                               d=32, dtype=torch.float16, causal=causal, key_lengths=lengths)
    empty = out[0]
    assert torch.equal(empty, torch.zeros_like(empty))
    assert torch.isneginf(lse[0]).all()


def test_key_lengths_ignore_garbage_in_padding(inputs, rel_err):
    """Whatever the padded keys/values hold (NaN here) must not leak into the output."""
    q, k, v = _qkv(inputs, "bshd", 2, 2, 2, 17, 40, 32, torch.float16)
    lengths = torch.tensor([25, 9], dtype=torch.int32)
    ref_out, ref_lse = _reference(q, k, v, layout="bshd", key_lengths=lengths)
    for b, n in enumerate(lengths.tolist()):
        k[b, n:] = float("nan")
        v[b, n:] = float("inf")
    out = _poisoned(q)
    _, lse = flash_attention_forward(q, k, v, layout="bshd", key_lengths=lengths,
                                     return_lse=True, out=out)
    _check(out, lse, ref_out, ref_lse, CPU_TOLERANCE[torch.float16], 1e-4, rel_err)


def test_key_lengths_clamped_and_int64(inputs, rel_err):
    q, k, v = _qkv(inputs, "bhsd", 3, 2, 2, 17, 20, 16, torch.float32)
    lengths = torch.tensor([-5, 100, 7], dtype=torch.int64)
    out = _poisoned(q)
    _, lse = flash_attention_forward(q, k, v, key_lengths=lengths, return_lse=True, out=out)
    ref_out, ref_lse = _reference(q, k, v, key_lengths=lengths)
    _check(out, lse, ref_out, ref_lse, 1e-5, 1e-5, rel_err)


def test_no_keys(inputs):
    """Skv == 0: every row is empty."""
    q = inputs.activations((2, 2, 9, 32), torch.float32)
    k = torch.empty((2, 2, 0, 32))
    out, lse = flash_attention_forward(q, k, k.clone(), return_lse=True, out=_poisoned(q))
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.isneginf(lse).all()


def test_no_queries(inputs):
    q = torch.empty((2, 0, 2, 32))
    k = inputs.activations((2, 5, 2, 32), torch.float32)
    out, lse = flash_attention_forward(q, k, k, layout="bshd", return_lse=True)
    assert out.shape == q.shape and lse.shape == (2, 2, 0)


def test_fused_qkv_views_bshd(inputs, rel_err):
    """q, k, v as strided views of one [B, S, 3, H, D] projection: read in place."""
    qkv = inputs.activations((2, 33, 3, 4, 32), torch.float16)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    assert not q.is_contiguous()
    out = _poisoned(q)
    _, lse = flash_attention_forward(q, k, v, layout="bshd", causal=True, return_lse=True, out=out)
    assert out.is_contiguous()
    ref_out, ref_lse = _reference(q, k, v, layout="bshd", causal=True)
    _check(out, lse, ref_out, ref_lse, 2e-3, 1e-4, rel_err)


def test_bhsd_views_of_bshd_memory(inputs, rel_err):
    """bhsd tensors that are transposes of bshd storage, and a strided out."""
    q = inputs.activations((2, 17, 3, 32), torch.float32).transpose(1, 2)
    k = inputs.activations((2, 29, 3, 32), torch.float32).transpose(1, 2)
    v = inputs.activations((2, 29, 3, 32), torch.float32, outlier_channels=0).transpose(1, 2)
    out = torch.full((2, 17, 3, 32), float("nan")).transpose(1, 2)  # bhsd view, bshd memory
    res, lse = flash_attention_forward(q, k, v, return_lse=True, out=out)
    assert res is out
    ref_out, ref_lse = _reference(q, k, v)
    _check(out, lse, ref_out, ref_lse, 1e-5, 1e-5, rel_err)


def test_default_out_is_contiguous_in_layout(inputs):
    q, k, v = _qkv(inputs, "bshd", 1, 2, 2, 9, 9, 16, torch.float32)
    out = flash_attention_forward(q[:, :, :, :], k, v, layout="bshd")
    assert out.shape == q.shape and out.is_contiguous()


@pytest.mark.parametrize("d", [48, 80])
def test_padded_head_dim(inputs, rel_err, d):
    """Head dims that are not powers of two run padded to BLOCK_D."""
    _run_case(inputs, rel_err, layout="bshd", b=1, hq=2, hkv=2, sq=33, skv=20, d=d,
              dtype=torch.float32, causal=True)


def test_explicit_scale(inputs, rel_err):
    _run_case(inputs, rel_err, layout="bhsd", b=1, hq=2, hkv=2, sq=20, skv=33, d=32,
              dtype=torch.float32, scale=0.05)


@pytest.mark.parametrize(
    "config",
    [
        AttentionConfig(32, 16, 4, 1),
        AttentionConfig(16, 32, 4, 1),
        AttentionConfig(32, 16, 4, 1, pipeline_qk=True),
        AttentionConfig(16, 16, 4, 1, use_tma=True),
        AttentionConfig(32, 16, 4, 1, use_tma=True, pipeline_qk=True),
    ],
    ids=lambda c: c.describe(),
)
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_configs(inputs, rel_err, config, layout):
    """Other block shapes (diagonal spanning several key blocks, or a key block
    spanning several query blocks) and the TMA / pipelined-QK paths."""
    lengths = torch.tensor([41, 30], dtype=torch.int32)
    for causal in (False, True):
        _run_case(inputs, rel_err, layout=layout, b=2, hq=4, hkv=2, sq=37, skv=41, d=32,
                  dtype=torch.float16, causal=causal, key_lengths=lengths, config=config)


def test_default_config_under_interpreter():
    cfg = default_config(128)
    assert (cfg.block_m, cfg.block_n) == (16, 16) and not cfg.use_tma


# --------------------------------------------------------------------------- CPU: argument checks


def test_argument_errors(inputs):
    q, k, v = _qkv(inputs, "bhsd", 1, 4, 2, 8, 8, 32, torch.float32)
    with pytest.raises(ValueError, match="layout"):
        flash_attention_forward(q, k, v, layout="sbhd")
    with pytest.raises(ValueError, match="head_dim"):
        x = torch.randn(1, 2, 8, 24)
        flash_attention_forward(x, x, x)
    with pytest.raises(ValueError, match="head_dim"):
        x = torch.randn(1, 2, 8, 512)
        flash_attention_forward(x, x, x)
    with pytest.raises(ValueError, match="contiguous"):
        x = torch.randn(1, 2, 32, 8).transpose(2, 3)
        flash_attention_forward(x, x, x)
    with pytest.raises(ValueError, match="multiple"):
        flash_attention_forward(q, k[:, :1].expand(1, 3, 8, 32), v[:, :1].expand(1, 3, 8, 32))
    with pytest.raises(ValueError, match="dtype"):
        flash_attention_forward(q, k.half(), v)
    with pytest.raises(ValueError, match="scale"):
        flash_attention_forward(q, k, v, scale=0.0)
    with pytest.raises(ValueError, match="key_lengths"):
        flash_attention_forward(q, k, v, key_lengths=torch.tensor([1, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="out"):
        flash_attention_forward(q, k, v, out=torch.empty(1, 4, 8, 32, dtype=torch.float16))
    with pytest.raises(ValueError, match="dtype"):
        flash_attention_forward(q.double(), k.double(), v.double())


# --------------------------------------------------------------------------- CPU: merge


def _kernel_partial(q, k, v, layout, **kw):
    out = _poisoned(q)
    _, lse = flash_attention_forward(q, k, v, layout=layout, return_lse=True, out=out, **kw)
    return out, lse


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_merge_two_halves(inputs, rel_err, layout):
    """Attention over keys [0, s) and [s, Skv) merged == attention over all keys."""
    b, hq, hkv, sq, skv, d = 2, 4, 2, 33, 50, 32
    q, k, v = _qkv(inputs, layout, b, hq, hkv, sq, skv, d, torch.float32)
    split = 21
    cut = (lambda t, a, z: t[:, :, a:z]) if layout == "bhsd" else (lambda t, a, z: t[:, a:z])
    out_a, lse_a = _kernel_partial(q, cut(k, 0, split), cut(v, 0, split), layout)
    out_b, lse_b = _kernel_partial(q, cut(k, split, skv), cut(v, split, skv), layout)
    out, lse = merge_attention_partials(out_a, lse_a, out_b, lse_b, layout=layout)
    ref_out, ref_lse = _reference(q, k, v, layout=layout)
    _check(out, lse, ref_out, ref_lse, 1e-5, 1e-5, rel_err)
    # the same from reference partials, and in place
    ra, la = _reference(q, cut(k, 0, split), cut(v, 0, split), layout=layout)
    rb, lb = _reference(q, cut(k, split, skv), cut(v, split, skv), layout=layout)
    acc, acc_lse = ra.clone(), la.clone()
    res = merge_attention_partials_(acc, acc_lse, rb, lb, layout=layout)
    assert res[0] is acc and res[1] is acc_lse
    assert rel_err(acc, ref_out) < 1e-12
    assert (acc_lse - ref_lse).abs().max().item() < 1e-12


def test_merge_with_empty_partials(inputs, rel_err):
    """An empty partial (lse = -inf; its out may hold anything) has no weight;
    two empty partials merge to 0 with lse = -inf."""
    q, k, v = _qkv(inputs, "bshd", 3, 2, 2, 17, 30, 32, torch.float32)
    lengths_b = torch.tensor([0, 30, 0], dtype=torch.int32)  # sample 0: only partial a has keys
    lengths_a = torch.tensor([30, 0, 0], dtype=torch.int32)  # sample 2: neither has keys
    out_a, lse_a = _kernel_partial(q, k, v, "bshd", key_lengths=lengths_a)
    out_b, lse_b = _kernel_partial(q, k, v, "bshd", key_lengths=lengths_b)
    out_b[0] = float("nan")  # garbage in an empty partial must not leak
    out, lse = merge_attention_partials(out_a, lse_a, out_b, lse_b, layout="bshd")
    full_out, full_lse = _reference(q, k, v, layout="bshd")
    assert rel_err(out[:2], full_out[:2]) < 1e-5
    assert (lse[:2] - full_lse[:2]).abs().max().item() < 1e-5
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    assert torch.isneginf(lse[2]).all()


def test_merge_running_accumulator(inputs, rel_err):
    """Ring-attention style: start empty, merge in four key chunks of a float16 run."""
    q, k, v = _qkv(inputs, "bhsd", 1, 2, 2, 33, 64, 32, torch.float16)
    acc = torch.zeros_like(q)
    acc_lse = torch.full((1, 2, 33), float("-inf"))
    for start in range(0, 64, 16):
        o, lse = _kernel_partial(q, k[:, :, start:start + 16], v[:, :, start:start + 16], "bhsd")
        merge_attention_partials_(acc, acc_lse, o, lse)
    ref_out, ref_lse = _reference(q, k, v)
    _check(acc, acc_lse, ref_out, ref_lse, 2e-3, 1e-4, rel_err)


def test_merge_shape_errors():
    o = torch.zeros(1, 2, 3, 16)
    lse = torch.zeros(1, 2, 3)
    with pytest.raises(ValueError):
        merge_attention_partials(o, lse, o, lse, layout="bshd")  # [B, S=2, H=3] vs lse [1, 2, 3]
    with pytest.raises(ValueError):
        merge_attention_partials(o, lse, o[:, :1], lse[:, :1])


def test_reference_matches_sdpa(inputs):
    """The reference itself agrees with torch SDPA (math) where SDPA is defined."""
    q, k, v = _qkv(inputs, "bhsd", 2, 4, 2, 19, 23, 32, torch.float64)
    lengths = torch.tensor([23, 11])
    ours = attention_reference(q, k, v, causal=True, key_lengths=lengths)
    rows = torch.arange(19)[:, None]
    cols = torch.arange(23)[None, :]
    mask = (cols <= rows)[None, None] & (cols[None, None] < lengths[:, None, None, None])
    theirs = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask
    )
    assert (ours - theirs).abs().max().item() < 1e-12


# --------------------------------------------------------------------------- GPU


GPU_CASES = {
    # name: (layout, B, Hq, Hkv, Sq, Skv, D, causal, key_lengths)
    "flux": ("bhsd", 1, 24, 24, 4608, 4608, 128, False, None),
    "flux_bshd": ("bshd", 1, 24, 24, 4608, 4608, 128, False, None),
    "sd35_d64": ("bhsd", 1, 38, 38, 4429, 4429, 64, False, None),
    "wan_cross": ("bshd", 1, 8, 8, 32760, 512, 128, False, None),
    "d256": ("bhsd", 2, 4, 4, 1000, 1000, 256, False, None),
    "causal": ("bshd", 1, 8, 8, 2000, 2000, 128, True, None),
    "causal_cross": ("bhsd", 1, 4, 4, 700, 1500, 64, True, None),
    "gqa": ("bhsd", 2, 16, 4, 1024, 1536, 128, False, None),
    "mqa_causal": ("bshd", 1, 8, 1, 1000, 1000, 64, True, None),
    "key_lengths": ("bshd", 3, 8, 8, 1100, 1536, 128, False, (1536, 777, 0)),
    "padded_d96": ("bhsd", 1, 8, 8, 1000, 777, 96, False, None),
}


def _gpu_case(inputs, rel_err, case, dtype, config=None):
    layout, b, hq, hkv, sq, skv, d, causal, lengths = GPU_CASES[case]
    q, k, v = _qkv(inputs, layout, b, hq, hkv, sq, skv, d, dtype, "cuda")
    if lengths is not None:
        lengths = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    out = _poisoned(q)
    _, lse = flash_attention_forward(q, k, v, layout=layout, causal=causal, key_lengths=lengths,
                                     return_lse=True, out=out, config=config)
    torch.cuda.synchronize()
    ref_out, ref_lse = _reference(q, k, v, wide=torch.float32, layout=layout, causal=causal,
                                  key_lengths=lengths)
    _check(out, lse, ref_out, ref_lse, GPU_TOLERANCE, 1e-3, rel_err)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_gpu_shapes(inputs, rel_err, case, dtype):
    _gpu_case(inputs, rel_err, case, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "config",
    [
        AttentionConfig(128, 64, 8, 3),
        AttentionConfig(128, 128, 8, 3),  # the D=128 default's fallback without TMA
        AttentionConfig(128, 128, 8, 2, pipeline_qk=True),
        AttentionConfig(128, 64, 8, 3, use_tma=True, pipeline_qk=True),
    ],
    ids=lambda c: c.describe(),
)
@pytest.mark.parametrize("case", ["flux_bshd", "causal", "key_lengths", "gqa"])
def test_gpu_config_variants(inputs, rel_err, case, config):
    _gpu_case(inputs, rel_err, case, torch.bfloat16, config=config)


@pytest.mark.gpu
def test_gpu_sdpa_agreement(inputs):
    """bf16 at the Flux shape: the kernel vs torch SDPA's fp32 math backend."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = _qkv(inputs, "bhsd", 1, 24, 24, 4608, 4608, 128, torch.bfloat16, "cuda")
    out = flash_attention_forward(q, k, v, out=_poisoned(q))
    with sdpa_kernel(SDPBackend.MATH):
        ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())
    err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    assert err <= GPU_TOLERANCE and not math.isnan(err)
