"""The fused QK-RMSNorm + RoPE attention processor (Flux adapter) and AccelConfig.fused_norm_rope.

CPU: the processor against diffusers' on tiny Flux transformers (fp32; omni's kernels fall back to
their torch reference here, the Triton kernel under TRITON_INTERPRET=1), with fused q/k/v
projections, under torch.compile, undo, the config's auto/True/False. GPU: Flux 1024^2-shaped
attention in bf16 against a float32 reference, diffusers' processor beside it.
"""

from __future__ import annotations

import argparse
import copy
import re

import pytest
import torch

pytest.importorskip("diffusers")

import omni_diffusion as od  # noqa: E402
from omni_diffusion.adapters import adapter_for_transformer  # noqa: E402
from omni_diffusion.config import add_cli_arguments, from_cli_args  # noqa: E402
from omni_diffusion.testing import tiny_flux_transformer  # noqa: E402


def _rel(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def _flux_with_random_norms():
    """The tiny Flux with RMSNorm weights away from 1 (diffusers initializes them to ones) and
    a few large query/key channels, so a wrong weight or stream order shows."""
    model, inputs = tiny_flux_transformer()
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, module in model.named_modules():
            if type(module).__name__ == "RMSNorm" and getattr(module, "weight", None) is not None:
                module.weight.copy_(1 + 0.5 * torch.randn(module.weight.shape, generator=gen))
            if name.endswith("attn.to_q") or name.endswith("attn.add_q_proj"):
                module.weight[:3] *= 8  # outlier channels
    return model, inputs


def _norm_calls(model):
    calls = []
    for name, module in model.named_modules():
        if type(module).__name__ == "RMSNorm" and re.search(r"(^|\.)attn\d?\.norm_", name):
            module.register_forward_hook(lambda m, a, o, name=name: calls.append(name))
    return calls


def _run(model, inputs):
    with torch.no_grad():
        return model(**inputs)[0]


def test_processor_matches_diffusers_and_skips_the_norm_modules():
    model, inputs = _flux_with_random_norms()
    reference = _run(copy.deepcopy(model), inputs)
    adapter = adapter_for_transformer(model)
    assert adapter.has_fused_norm_rope
    before = {name: m.processor for name, m in model.named_modules() if hasattr(m, "processor")}
    undo = adapter.apply_fused_norm_rope(model)
    after = {name: m.processor for name, m in model.named_modules() if hasattr(m, "processor")}
    assert before.keys() == after.keys() and all(before[n] is not after[n] for n in before)
    assert all(type(p).__name__ == "FluxAttnProcessorFusedNormRope" for p in after.values())
    calls = _norm_calls(model)
    out = _run(model, inputs)
    assert calls == [], f"diffusers' norm modules ran: {calls}"
    assert _rel(out, reference) < 1e-5
    undo()
    assert {name: m.processor for name, m in model.named_modules() if hasattr(m, "processor")} == before
    assert torch.equal(_run(model, inputs), reference)


def test_processor_keeps_backend_and_parallel_config():
    model, _ = _flux_with_random_norms()
    attn = model.transformer_blocks[0].attn
    attn.processor._attention_backend = "native"
    attn.processor._parallel_config = None
    adapter_for_transformer(model).apply_fused_norm_rope(model)
    assert attn.processor._attention_backend == "native"
    assert "_attention_backend" not in model.single_transformer_blocks[0].attn.processor.__dict__


def test_processor_with_fused_projections_and_quantization():
    """W8A8 fuses q/k/v into to_qkv / to_added_qkv: the processor reads the fused layers, with
    the quantized model's numbers."""
    from omni_diffusion.quantization import QuantConfig, fused_attention, quantize

    model, inputs = _flux_with_random_norms()
    quantize(model, QuantConfig(method="int8", backend="aten", activation_backend="torch"))
    assert fused_attention(model)
    reference = _run(model, inputs)
    adapter_for_transformer(model).apply_fused_norm_rope(model)
    assert _rel(_run(model, inputs), reference) < 1e-5


def test_processor_under_torch_compile():
    model, inputs = _flux_with_random_norms()
    adapter_for_transformer(model).apply_fused_norm_rope(model)
    eager = _run(model, inputs)
    torch._dynamo.reset()
    for block in [*model.transformer_blocks, *model.single_transformer_blocks]:
        block.compile(backend="aot_eager", fullgraph=True)
    try:
        assert _rel(_run(model, inputs), eager) < 1e-6
    finally:
        torch._dynamo.reset()


def test_processor_falls_back_without_rotary_table():
    model, _ = _flux_with_random_norms()
    adapter_for_transformer(model).apply_fused_norm_rope(model)
    attn = model.single_transformer_blocks[0].attn
    x = torch.randn(1, 5, attn.query_dim)
    calls = _norm_calls(model)
    with torch.no_grad():
        out = attn(hidden_states=x)
    assert out.shape == x.shape and len(calls) == 2  # diffusers' path: norm_q and norm_k ran


def _tiny_wan(image_context: bool = False):
    """A 2-block Wan transformer (fp32) with random RMSNorm weights; with ``image_context``
    the I2V layout (image embeddings and the added k/v projections)."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    extra = dict(image_dim=24, added_kv_proj_dim=32) if image_context else {}
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=16,
        out_channels=16, text_dim=32, freq_dim=256, ffn_dim=64, num_layers=2, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=32, **extra,
    ).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__ == "RMSNorm" and getattr(module, "weight", None) is not None:
                module.weight.copy_(1 + 0.5 * torch.randn(module.weight.shape, generator=gen))
        for block in model.blocks:
            block.attn1.to_q.weight[:3] *= 8
    inputs = dict(
        hidden_states=torch.randn(1, 16, 3, 8, 6, generator=gen),
        timestep=torch.tensor([500]),
        encoder_hidden_states=torch.randn(1, 512 + 4 if image_context else 6, 32, generator=gen),
        return_dict=False,
    )
    if image_context:
        inputs["encoder_hidden_states_image"] = torch.randn(1, 4, 24, generator=gen)
        inputs["encoder_hidden_states"] = torch.randn(1, 6, 32, generator=gen)
    return model, inputs


@pytest.mark.parametrize("image_context", [False, True])
def test_wan_processor_matches_diffusers(image_context):
    """Wan's self-attention norms over all heads then rotates, in one kernel; cross-attention and
    the I2V image context stay diffusers' (their norm modules still run)."""
    model, inputs = _tiny_wan(image_context)
    reference = _run(copy.deepcopy(model), inputs)
    adapter = adapter_for_transformer(model)
    assert adapter.has_fused_norm_rope
    undo = adapter.apply_fused_norm_rope(model)
    assert all(type(b.attn1.processor).__name__ == "WanAttnProcessorFusedNormRope" for b in model.blocks)
    calls = _norm_calls(model)
    out = _run(model, inputs)
    assert not [c for c in calls if ".attn1." in c], calls  # self-attention: the kernel
    assert [c for c in calls if ".attn2." in c]  # cross-attention: diffusers' norms
    assert _rel(out, reference) < 1e-5
    torch._dynamo.reset()
    for block in model.blocks:
        block.compile(backend="aot_eager", fullgraph=True)
    try:
        assert _rel(_run(model, inputs), out) < 1e-6
    finally:
        torch._dynamo.reset()
        for block in model.blocks:
            block._compiled_call_impl = None
    undo()
    assert all(type(b.attn1.processor).__name__ == "WanAttnProcessor" for b in model.blocks)


def _tiny_pipe(family):
    from omni_diffusion.testing import tiny_pipeline

    return tiny_pipeline(family)


def test_accel_config_fused_norm_rope():
    pipe = _tiny_pipe("flux")
    # auto on the CPU: off (omni's kernels are CUDA/Triton; logged)
    od.accelerate(pipe, od.AccelConfig(attention=None))
    assert type(pipe.transformer.transformer_blocks[0].attn.processor).__name__ == "FluxAttnProcessor"
    od.undo(pipe)
    od.accelerate(pipe, od.AccelConfig(attention="sdpa_math", fused_norm_rope=True))
    processor = pipe.transformer.transformer_blocks[0].attn.processor
    assert type(processor).__name__ == "FluxAttnProcessorFusedNormRope"
    assert processor._attention_backend is not None  # the omni attention backend reached it
    od.undo(pipe)
    assert type(pipe.transformer.transformer_blocks[0].attn.processor).__name__ == "FluxAttnProcessor"
    with pytest.raises(ValueError, match="fused_norm_rope"):
        od.AccelConfig(fused_norm_rope="yes")
    sd3 = _tiny_pipe("sd3")
    with pytest.raises(ValueError, match="no fused QK-norm"):
        od.accelerate(sd3, od.AccelConfig(attention=None, fused_norm_rope=True))
    assert not od.is_accelerated(sd3)
    parser = add_cli_arguments(argparse.ArgumentParser())
    assert from_cli_args(parser.parse_args(["--fused-norm-rope", "on"])).fused_norm_rope is True
    assert from_cli_args(parser.parse_args([])).fused_norm_rope is None


# --------------------------------------------------------------------------- GPU


def _flux_attention(dual: bool):
    from diffusers.models.transformers.transformer_flux import FluxAttention

    torch.manual_seed(0)
    attn = FluxAttention(query_dim=3072, heads=24, dim_head=128, added_kv_proj_dim=3072 if dual else None,
                         bias=True, eps=1e-6, pre_only=not dual)
    with torch.no_grad():
        for module in attn.modules():
            if type(module).__name__ == "RMSNorm":
                module.weight.copy_(1 + 0.5 * torch.randn(module.weight.shape))
    return attn.to("cuda", torch.bfloat16).eval()


@pytest.mark.gpu
@pytest.mark.parametrize("dual", [True, False])
def test_gpu_processor_at_flux_1024(dual):
    """Flux 1024^2 (4096 image + 512 text tokens, 24 x 128 heads), bf16: the fused processor's
    output against diffusers' processor run in float32, with diffusers' bf16 error beside it;
    eager and compiled."""
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU (CUDA); torch.cuda.is_available() is False")
    from diffusers.models.embeddings import FluxPosEmbed

    attn = _flux_attention(dual)
    text, image = 512, 4096
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(1, image if dual else text + image, 3072, device="cuda", generator=gen).bfloat16()
    context = torch.randn(1, text, 3072, device="cuda", generator=gen).bfloat16() if dual else None
    ids = torch.cat([torch.zeros(text, 3), torch.stack(torch.meshgrid(
        torch.zeros(1), torch.arange(64.0), torch.arange(64.0), indexing="ij"), -1).reshape(-1, 3)]).cuda()
    rotary = FluxPosEmbed(theta=10000, axes_dim=[16, 56, 56])(ids)
    kwargs = dict(hidden_states=x, encoder_hidden_states=context, image_rotary_emb=rotary)
    with torch.no_grad():
        reference = copy.deepcopy(attn).float()(**{**kwargs, "hidden_states": x.float(),
                                                 "encoder_hidden_states": None if context is None else context.float()})
        diffusers_out = attn(**kwargs)
        from diffusers import FluxTransformer2DModel

        processor = adapter_for_transformer(FluxTransformer2DModel).fused_norm_rope_processor(attn)
        attn.set_processor(processor)
        fused = attn(**kwargs)
        torch._dynamo.reset()
        compiled = torch.compile(attn, fullgraph=True)(**kwargs)
        torch._dynamo.reset()
    pairs = list(zip(*(o if isinstance(o, tuple) else (o,) for o in (reference, diffusers_out, fused, compiled))))
    for ref, base, out, comp in pairs:
        err, base_err, comp_err = _rel(out, ref), _rel(base, ref), _rel(comp, ref)
        print(f"fused norm+rope dual={dual}: rel err {err:.3e} (compiled {comp_err:.3e}; diffusers bf16 {base_err:.3e})")
        assert err <= max(2 * base_err, 1e-2) and comp_err <= max(2 * base_err, 1e-2)



@pytest.mark.gpu
def test_gpu_wan_processor_at_14b_width():
    """Wan2.1-14B self-attention width (40 x 128 heads, RMSNorm over 5120 features) on 4680
    tokens (3 x 30 x 52 latent patches), bf16: the fused processor against diffusers' processor
    run in float32, with diffusers' bf16 error beside it; eager and compiled."""
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU (CUDA); torch.cuda.is_available() is False")
    from diffusers.models.transformers.transformer_wan import WanAttention, WanAttnProcessor, WanRotaryPosEmbed

    torch.manual_seed(0)
    # diffusers' WanAttention has no processor unless given one (its blocks pass WanAttnProcessor).
    attn = WanAttention(dim=5120, heads=40, dim_head=128, eps=1e-6, processor=WanAttnProcessor())
    with torch.no_grad():
        for norm in (attn.norm_q, attn.norm_k):
            norm.weight.copy_(1 + 0.5 * torch.randn(norm.weight.shape))
        attn.to_q.weight[:8] *= 8
    attn = attn.to("cuda", torch.bfloat16).eval()
    rotary = WanRotaryPosEmbed(attention_head_dim=128, patch_size=(1, 2, 2), max_seq_len=1024)
    rotary = tuple(t.cuda() for t in rotary(torch.zeros(1, 16, 3, 60, 104)))
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(1, 3 * 30 * 52, 5120, device="cuda", generator=gen).bfloat16()
    with torch.no_grad():
        reference = copy.deepcopy(attn).float()(x.float(), rotary_emb=rotary)
        diffusers_out = attn(x, rotary_emb=rotary)
        attn.set_processor(adapter_for_transformer(_wan_class()).fused_norm_rope_processor(attn))
        fused = attn(x, rotary_emb=rotary)
        torch._dynamo.reset()
        compiled = torch.compile(attn, fullgraph=True)(x, rotary_emb=rotary)
        torch._dynamo.reset()
    err, base_err, comp_err = _rel(fused, reference), _rel(diffusers_out, reference), _rel(compiled, reference)
    print(f"wan fused norm+rope: rel err {err:.3e} (compiled {comp_err:.3e}; diffusers bf16 {base_err:.3e})")
    assert err <= max(2 * base_err, 1e-2) and comp_err <= max(2 * base_err, 1e-2)


def _wan_class():
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel
