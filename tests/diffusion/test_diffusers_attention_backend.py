"""omni as a diffusers attention backend: ``transformer.set_attention_backend("omni")``.

On CPU the tiny transformers run in float32 with omni's Triton kernel under
Triton's interpreter (tests/conftest.py), compared with diffusers' default
("native" SDPA) backend.
"""

from __future__ import annotations

import importlib.util
import logging

import pytest
import torch

pytest.importorskip("diffusers")
if importlib.util.find_spec("diffusers.models.attention_dispatch") is None:
    pytest.skip("diffusers has no attention_dispatch (needs diffusers >= 0.35)", allow_module_level=True)

from diffusers.models import attention_dispatch as ad  # noqa: E402

import omni_kernels.attention as A  # noqa: E402
import omni_kernels.attention.ops as ops  # noqa: E402
from omni_diffusion.attention import diffusers_backend as ob  # noqa: E402
from omni_diffusion.testing import tiny_flux_transformer  # noqa: E402

HAS_TRITON_FLASH = importlib.util.find_spec("omni_kernels.attention.triton_flash") is not None
needs_omni_triton = pytest.mark.skipif(
    not HAS_TRITON_FLASH or A.get_backend("omni_triton").unavailable_reason("cpu") is not None,
    reason="omni_triton cannot run on CPU here (triton_flash missing, or no TRITON_INTERPRET=1)",
)


def _rel(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.fixture
def op_calls(monkeypatch):
    """Counts calls of omni's Triton custom op (proves omni_triton ran)."""
    calls = []
    real = ops.flash_attention_fwd

    def counting(*args, **kwargs):
        calls.append(args[3])  # layout
        return real(*args, **kwargs)

    monkeypatch.setattr(ops, "flash_attention_fwd", counting)
    return calls


@pytest.fixture
def restore_active_backend():
    before = ad._AttentionBackendRegistry._active_backend
    yield
    ad._AttentionBackendRegistry._active_backend = before


def _tiny_flux():
    return tiny_flux_transformer()


def _run(model, inputs):
    with torch.no_grad():
        return model(**inputs)[0]


def test_registration_extends_enum_cleanly():
    member = ob.register_omni_attention_backend()
    assert member is ob.register_omni_attention_backend()  # idempotent
    enum_cls = ad.AttentionBackendName
    assert member is enum_cls("omni") is enum_cls["OMNI"] is enum_cls.OMNI
    assert member == "omni" and member.value == "omni" and isinstance(member, enum_cls)
    assert member in list(enum_cls) and "omni" in {m.value for m in enum_cls.__members__.values()}
    assert enum_cls("native") is enum_cls.NATIVE  # native members untouched
    assert "omni" in ad._AttentionBackendRegistry._backends  # str lookup, as diffusers does
    assert not ad._AttentionBackendRegistry._is_context_parallel_available(member)
    with pytest.raises(ValueError, match="unknown attention backend"):
        ob.register_omni_attention_backend("omni:x", omni_backend="nope")


@needs_omni_triton
def test_flux_set_attention_backend_omni_matches_native(op_calls, restore_active_backend):
    model, inputs = _tiny_flux()
    expected = _run(model, inputs)
    ob.register_omni_attention_backend()
    model.set_attention_backend("omni")
    with A.attention_backend("omni_triton"):
        got = _run(model, inputs)
    assert op_calls and set(op_calls) == {"bshd"}  # diffusers' [B, S, H, D], no permute
    assert _rel(got, expected) < 1e-4
    model.reset_attention_backend()


@needs_omni_triton
def test_flux_pinned_omni_backend_and_diffusers_context(op_calls, restore_active_backend):
    model, inputs = _tiny_flux()
    expected = _run(model, inputs)
    name = ob.set_attention_backend(model, "omni", omni_backend="omni_triton")
    assert name == "omni:omni_triton"
    got = _run(model, inputs)
    assert len(op_calls) == 2  # one joint block + one single block
    assert _rel(got, expected) < 1e-4
    model.reset_attention_backend()
    ob.register_omni_attention_backend()
    op_calls.clear()
    with ad.attention_backend("omni"), A.attention_backend("omni_triton"):
        got = _run(model, inputs)
    assert len(op_calls) == 2 and _rel(got, expected) < 1e-4


@needs_omni_triton
def test_flux_compile_fullgraph_with_omni(restore_active_backend):
    model, inputs = _tiny_flux()
    expected = _run(model, inputs)
    ob.set_attention_backend(model, "omni", omni_backend="omni_triton")
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    assert _rel(_run(compiled, inputs), expected) < 1e-4
    torch._dynamo.reset()


@needs_omni_triton
def test_tiny_wan_matches_native(op_calls, restore_active_backend):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4,
        out_channels=4, text_dim=32, freq_dim=32, ffn_dim=32, num_layers=1, rope_max_seq_len=32,
    ).eval()
    gen = torch.Generator().manual_seed(1)
    inputs = dict(hidden_states=torch.randn(1, 4, 2, 8, 8, generator=gen), timestep=torch.tensor([500]),
                  encoder_hidden_states=torch.randn(1, 12, 32, generator=gen), return_dict=False)
    expected = _run(model, inputs)
    ob.set_attention_backend(model, "omni", omni_backend="omni_triton")
    got = _run(model, inputs)
    assert len(op_calls) == 2  # self-attention (32 tokens) and cross-attention (12 text keys)
    assert _rel(got, expected) < 1e-4


def test_dispatch_masks_and_fallbacks(caplog, restore_active_backend):
    """Through dispatch_attention_fn directly: masks omni takes, and those it hands to SDPA."""
    member = ob.register_omni_attention_backend()
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 12, 4, 16, generator=gen)  # [B, S, H, D]
    k = torch.randn(2, 10, 4, 16, generator=gen)
    v = torch.randn(2, 10, 4, 16, generator=gen)
    native = ad.AttentionBackendName.NATIVE

    def both(**kwargs):
        return (ad.dispatch_attention_fn(q, k, v, backend=member, **kwargs),
                ad.dispatch_attention_fn(q, k, v, backend=native, **kwargs))

    got, want = both()
    assert got.shape == want.shape and _rel(got, want) < 1e-5
    got, want = both(is_causal=True)
    assert _rel(got, want) < 1e-5
    key_pad = torch.ones(2, 10, dtype=torch.bool)
    key_pad[0, 6:] = False  # prefix: becomes key_lengths
    got, want = both(attn_mask=key_pad)
    assert _rel(got, want) < 1e-5
    holes = key_pad.clone()
    holes[1, 2] = False  # Qwen-Image-like non-prefix mask, as [B, 1, 1, Skv]
    got, want = both(attn_mask=holes[:, None, None, :])
    assert _rel(got, want) < 1e-5
    ob.FALLBACKS.clear()
    with caplog.at_level(logging.INFO, logger="omni_diffusion.attention_backend"):
        additive = torch.zeros(2, 1, 12, 10)
        additive[..., 3] = -1e4
        got, want = both(attn_mask=additive)
        both(attn_mask=additive)
    assert _rel(got, want) < 1e-6
    assert sum(ob.FALLBACKS.values()) == 2
    assert sum("falling back" in r.getMessage() for r in caplog.records) == 1
    with pytest.raises(ValueError, match="context parallelism"):
        ad.dispatch_attention_fn(q, k, v, backend=member, parallel_config=object())


def test_set_attention_backend_passthrough_and_errors(restore_active_backend):
    model, _ = _tiny_flux()
    assert ob.set_attention_backend(model, "native") == "native"
    with pytest.raises(ValueError, match="omni_backend only applies"):
        ob.set_attention_backend(model, "native", omni_backend="sdpa_math")
    with pytest.raises(ValueError, match="unknown attention backend"):
        ob.set_attention_backend(model, "omni", omni_backend="nope")


@pytest.mark.gpu
@pytest.mark.parametrize("omni_backend", [None, "omni_triton"])
def test_gpu_flux_bf16_omni_matches_native(omni_backend, restore_active_backend):
    model, inputs = _tiny_flux()
    model = model.to("cuda", torch.bfloat16)
    inputs = {k: (v.to("cuda", torch.bfloat16) if isinstance(v, torch.Tensor) and v.is_floating_point()
                  else v) for k, v in inputs.items()}
    expected = _run(model, inputs).float()
    ob.set_attention_backend(model, "omni", omni_backend=omni_backend)
    got = _run(model, inputs).float()
    assert _rel(got, expected) < 2e-2
    model.reset_attention_backend()
