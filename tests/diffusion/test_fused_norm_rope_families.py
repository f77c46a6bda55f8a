"""The fused QK-RMSNorm + RoPE attention processors of HunyuanVideo and Qwen-Image.

CPU: each processor against diffusers' own on tiny transformers (fp32) with RMSNorm weights
away from 1 and outlier q/k channels: padded text masks, Qwen-Image's zero_cond_t (a
condition image with its own modulation), the token refiner left alone, under
torch.compile, undo, fallbacks, and through ``accelerate(fused_norm_rope=True)``. omni's
kernel runs as Triton under TRITON_INTERPRET=1 (tests/conftest.py sets it on CPU-only
machines) and as its torch reference with TRITON_INTERPRET=0. GPU: realistic attention
shapes in bf16 against diffusers' processor run in float32, diffusers' bf16 error beside it.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("diffusers")

import omni_diffusion as od  # noqa: E402
from omni_diffusion.adapters import adapter_for_transformer  # noqa: E402
from omni_diffusion.adapters.qwen_image import rotary_tables_from_complex  # noqa: E402
from omni_diffusion.testing import SMALL_CALL, output_tensor, tiny_call_kwargs, tiny_pipeline, tiny_transformer  # noqa: E402
from omni_kernels._triton import triton_interpreter_enabled  # noqa: E402

FUSED = {
    "hunyuan_video": ("HunyuanVideoAttnProcessor2_0", "HunyuanVideoAttnProcessorFusedNormRope"),
    "qwen_image": ("QwenDoubleStreamAttnProcessor2_0", "QwenDoubleStreamAttnProcessorFusedNormRope"),
}
#: (family, tiny_transformer arguments): batch 2 with one padded prompt gives a text mask
CASES = [
    ("hunyuan_video", {}),
    ("hunyuan_video", dict(text_lengths=(8, 5))),
    ("hunyuan_video", dict(image_condition_type="token_replace")),
    ("qwen_image", {}),
    ("qwen_image", dict(text_lengths=(8, 5))),
    ("qwen_image", dict(zero_cond_t=True, text_lengths=(6, 8))),
]
CASE_IDS = ["hunyuan", "hunyuan-padded-text", "hunyuan-token-replace", "qwen", "qwen-padded-text",
            "qwen-zero-cond-t"]
_Q_K_PROJECTIONS = ("attn.to_q", "attn.to_k", "attn.add_q_proj", "attn.add_k_proj")


def _rel(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def _with_random_norms(family, **options):
    """A tiny transformer with RMSNorm weights away from 1 (diffusers initializes them to
    ones; each stream its own) and a few large query/key channels, so a wrong weight,
    stream or rotation shows."""
    model, inputs = tiny_transformer(family, **options)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, module in model.named_modules():
            if type(module).__name__ == "RMSNorm" and getattr(module, "weight", None) is not None:
                module.weight.copy_(1 + 0.5 * torch.randn(module.weight.shape, generator=gen))
            if name.endswith(_Q_K_PROJECTIONS):
                module.weight[:3] *= 8  # outlier channels in head 0
    return model, inputs


def _processors(model):
    return {name: m.processor for name, m in model.named_modules() if hasattr(m, "processor")}


def _qk_norm_calls(model):
    calls = []
    for name, module in model.named_modules():
        if type(module).__name__ == "RMSNorm" and ".attn.norm" in f".{name}":
            module.register_forward_hook(lambda m, a, o, name=name: calls.append(name))
    return calls


def _triton_launches(monkeypatch):
    """Counts launches of omni's Triton kernel (the op imports the launcher on each call)."""
    import omni_kernels.qk_norm_rope.triton_kernel as triton_kernel

    launches = []
    launch = triton_kernel.launch_qk_rmsnorm_rope_triton
    monkeypatch.setattr(triton_kernel, "launch_qk_rmsnorm_rope_triton",
                        lambda *args: launches.append(1) or launch(*args))
    return launches


def _run(model, inputs):
    with torch.no_grad():
        return model(**inputs)[0]


def _blocks(model):
    return [*model.transformer_blocks, *getattr(model, "single_transformer_blocks", [])]


@pytest.mark.parametrize(("family", "options"), CASES, ids=CASE_IDS)
def test_processor_matches_diffusers_and_skips_the_norm_modules(family, options, monkeypatch):
    model, inputs = _with_random_norms(family, **options)
    reference = _run(copy.deepcopy(model), inputs)
    adapter = adapter_for_transformer(model)
    assert adapter.has_fused_norm_rope
    before = _processors(model)
    undo = adapter.apply_fused_norm_rope(model)
    after = _processors(model)
    original, fused = FUSED[family]
    for name in before:
        replaced = type(before[name]).__name__ == original
        assert type(after[name]).__name__ == (fused if replaced else type(before[name]).__name__), name
        assert (after[name] is not before[name]) == replaced, name
    if family == "hunyuan_video":  # the token refiner's attention has no QK norm or rotary: untouched
        refiner = model.context_embedder.token_refiner.refiner_blocks[0].attn
        assert refiner.processor is before["context_embedder.token_refiner.refiner_blocks.0.attn"]
    calls = _qk_norm_calls(model)
    launches = _triton_launches(monkeypatch)
    out = _run(model, inputs)
    assert calls == [], f"diffusers' norm modules ran: {calls}"
    # two kernel calls per attention (one per stream); Triton under the interpreter, else torch's
    assert len(launches) == (2 * len(_blocks(model)) if triton_interpreter_enabled() else 0)
    assert _rel(out, reference) < 1e-5
    undo()
    assert _processors(model) == before
    assert torch.equal(_run(model, inputs), reference)


@pytest.mark.parametrize("family", ["hunyuan_video", "qwen_image"])
def test_processor_keeps_backend_and_parallel_config(family):
    model, _ = _with_random_norms(family)
    first, second = (block.attn for block in _blocks(model)[:2])
    first.processor._attention_backend = "native"
    first.processor._parallel_config = None
    adapter_for_transformer(model).apply_fused_norm_rope(model)
    assert type(first.processor).__name__ == FUSED[family][1]
    assert first.processor._attention_backend == "native"
    assert "_parallel_config" in vars(first.processor)
    assert "_attention_backend" not in vars(second.processor)


@pytest.mark.parametrize(("family", "options"), [CASES[1], CASES[5]], ids=[CASE_IDS[1], CASE_IDS[5]])
def test_processor_under_torch_compile(family, options):
    """The blocks trace whole (fullgraph) through the fused processor and match eager."""
    from torch._dynamo.testing import CompileCounterWithBackend

    model, inputs = _with_random_norms(family, **options)
    adapter_for_transformer(model).apply_fused_norm_rope(model)
    eager = _run(model, inputs)
    counter = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    try:
        for block in _blocks(model):
            block.compile(backend=counter, fullgraph=True)
        compiled = _run(model, inputs)
    finally:
        torch._dynamo.reset()
    assert counter.frame_count >= len({type(block) for block in _blocks(model)})  # it compiled
    assert _rel(compiled, eager) < 1e-6


@pytest.mark.parametrize(("family", "attention", "norms_run"), [
    ("hunyuan_video", "single_transformer_blocks.0.attn", 2),  # norm_q, norm_k over [video, text]
    ("hunyuan_video", "transformer_blocks.0.attn", 4),
    ("qwen_image", "transformer_blocks.0.attn", 4),
])
def test_processor_falls_back_without_rotary_table(family, attention, norms_run):
    model, _ = _with_random_norms(family)
    attn = model.get_submodule(attention)
    gen = torch.Generator().manual_seed(5)
    kwargs = dict(hidden_states=torch.randn(1, 6, attn.query_dim, generator=gen),
                  encoder_hidden_states=torch.randn(1, 3, attn.query_dim, generator=gen))
    with torch.no_grad():
        reference = attn(**kwargs)
        adapter_for_transformer(model).apply_fused_norm_rope(model)
        assert type(attn.processor).__name__ == FUSED[family][1]
        calls = _qk_norm_calls(model)
        outputs = attn(**kwargs)
    assert len(calls) == norms_run, calls  # diffusers' path ran
    assert all(torch.equal(out, ref) for out, ref in zip(outputs, reference, strict=True))


def test_qwen_image_processor_keeps_diffusers_refusals():
    model, _ = _with_random_norms("qwen_image")
    adapter_for_transformer(model).apply_fused_norm_rope(model)
    attn = model.transformer_blocks[0].attn
    image, text = torch.randn(1, 6, attn.query_dim), torch.randn(1, 3, attn.query_dim)
    with pytest.raises(ValueError, match="attention_mask"):
        attn(hidden_states=image, encoder_hidden_states=text, attention_mask=torch.ones(1, 9, dtype=torch.bool))
    with pytest.raises(ValueError, match="encoder_hidden_states"):
        attn(hidden_states=image)


def test_rotary_tables_from_complex_match_diffusers_rotation():
    """The cos/sin tables rotate interleaved pairs exactly as diffusers' complex product does."""
    from diffusers.models.transformers.transformer_qwenimage import apply_rotary_emb_qwen

    from omni_kernels.qk_norm_rope.reference import rmsnorm_rope_reference

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, 3, 8, generator=gen)
    freqs = torch.polar(torch.ones(5, 4), 6.3 * torch.rand(5, 4, generator=gen))  # complex64, as diffusers'
    cos, sin = rotary_tables_from_complex(freqs)
    assert cos.shape == sin.shape == (5, 8)
    ours = rmsnorm_rope_reference(x, None, cos, sin, eps=0.0, interleaved=True, norm_across_heads=False)
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True))
    assert cos.dtype == torch.float32
    # diffusers rotates in float32 too: equal up to float32 rounding
    assert torch.allclose(ours, apply_rotary_emb_qwen(normed, freqs, use_real=False), rtol=0, atol=1e-6)


@pytest.mark.parametrize("family", ["hunyuan_video", "qwen_image"])
def test_accel_config_fused_norm_rope(family):
    pipe = tiny_pipeline(family)

    def run():
        return output_tensor(pipe(**tiny_call_kwargs(family, steps=2, pipe=pipe, **SMALL_CALL)))

    reference = run()
    original, fused = FUSED[family]
    od.accelerate(pipe, od.AccelConfig(attention=None, fused_norm_rope=True))
    try:
        names = {type(p).__name__ for p in _processors(pipe.transformer).values()}
        assert fused in names and original not in names
        assert _rel(run(), reference) < 1e-5
    finally:
        od.undo(pipe)
    assert {type(p).__name__ for p in _processors(pipe.transformer).values()} >= {original}
    assert torch.equal(run(), reference)


# --------------------------------------------------------------------------- GPU


def _gpu_attention(family):
    """One joint attention module of ``family`` at its real width (24 heads x 128, fp32 CPU
    init), RMSNorm weights randomized, moved to CUDA in bf16; dual-stream for Qwen-Image,
    ``dual`` / single-stream for HunyuanVideo."""
    from diffusers.models.attention_processor import Attention

    if family == "qwen_image":
        from diffusers.models.transformers.transformer_qwenimage import QwenDoubleStreamAttnProcessor2_0 as Processor
    else:
        from diffusers.models.transformers.transformer_hunyuan_video import HunyuanVideoAttnProcessor2_0 as Processor
    dual = family != "hunyuan_video_single"
    torch.manual_seed(0)
    attn = Attention(query_dim=3072, cross_attention_dim=None, added_kv_proj_dim=3072 if dual else None,
                     dim_head=128, heads=24, out_dim=3072, context_pre_only=False if dual else None, bias=True,
                     processor=Processor(), qk_norm="rms_norm", eps=1e-6, pre_only=not dual)
    with torch.no_grad():
        for module in attn.modules():
            if type(module).__name__ == "RMSNorm":
                module.weight.copy_(1 + 0.5 * torch.randn(module.weight.shape))
    return attn.to("cuda", torch.bfloat16).eval()


def _gpu_inputs(family, text, text_lengths):
    """Keyword arguments for one call: bf16 activations and the family's rotary tables and text
    mask. HunyuanVideo: 544x960, 33 frames (9 x 34 x 60 = 18360 video tokens); Qwen-Image:
    1024^2 (4096 image tokens)."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    batch = len(text_lengths)
    text_mask = torch.arange(text, device="cuda")[None, :] < torch.tensor(text_lengths, device="cuda")[:, None]
    context = torch.randn(batch, text, 3072, device="cuda", generator=gen).bfloat16()
    if family == "qwen_image":
        from diffusers.models.transformers.transformer_qwenimage import QwenEmbedRope

        rope = QwenEmbedRope(theta=10000, axes_dim=[16, 56, 56], scale_rope=True)
        x = torch.randn(batch, 64 * 64, 3072, device="cuda", generator=gen).bfloat16()
        return dict(hidden_states=x, encoder_hidden_states=context, encoder_hidden_states_mask=text_mask,
                    image_rotary_emb=rope([(1, 64, 64)], device=torch.device("cuda"), max_txt_seq_len=text))
    from diffusers.models.transformers.transformer_hunyuan_video import HunyuanVideoRotaryPosEmbed

    frames, height, width = 9, 34, 60
    latents = torch.empty(batch, 16, frames, 2 * height, 2 * width, device="cuda")
    rotary = HunyuanVideoRotaryPosEmbed(patch_size=2, patch_size_t=1, rope_dim=[16, 56, 56], theta=256.0)(latents)
    video = frames * height * width
    key_mask = torch.cat([torch.ones(batch, video, dtype=torch.bool, device="cuda"), text_mask], dim=1)
    x = torch.randn(batch, video, 3072, device="cuda", generator=gen).bfloat16()
    return dict(hidden_states=x, encoder_hidden_states=context, attention_mask=key_mask[:, None, None, :],
                image_rotary_emb=rotary)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["hunyuan_video", "hunyuan_video_single", "qwen_image"])
def test_gpu_processor_at_realistic_shapes(family):
    """bf16, a padded text prompt: the fused processor's outputs (eager and compiled) against
    diffusers' processor run in float32, with diffusers' own bf16 error beside them."""
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU (CUDA); torch.cuda.is_available() is False")
    attn = _gpu_attention(family)
    text = 256
    kwargs = _gpu_inputs("qwen_image" if family == "qwen_image" else "hunyuan_video", text, (text, 180))
    fp32_kwargs = {name: value.float() if torch.is_tensor(value) and value.dtype == torch.bfloat16 else value
                   for name, value in kwargs.items()}
    with torch.no_grad():
        reference = copy.deepcopy(attn).float()(**fp32_kwargs)
        diffusers_out = attn(**kwargs)
        from diffusers import HunyuanVideoTransformer3DModel, QwenImageTransformer2DModel

        model_class = QwenImageTransformer2DModel if family == "qwen_image" else HunyuanVideoTransformer3DModel
        processor = adapter_for_transformer(model_class).fused_norm_rope_processor(attn)
        assert processor is not None
        attn.set_processor(processor)
        fused = attn(**kwargs)
        torch._dynamo.reset()
        compiled = torch.compile(attn, fullgraph=True)(**kwargs)
        torch._dynamo.reset()
    for stream, (ref, base, out, comp) in zip(("image/video", "text"),
                                              zip(reference, diffusers_out, fused, compiled)):
        err, base_err, comp_err = _rel(out, ref), _rel(base, ref), _rel(comp, ref)
        print(f"fused norm+rope {family} {stream}: rel err {err:.3e} (compiled {comp_err:.3e}; "
              f"diffusers bf16 {base_err:.3e})")
        assert err <= max(2 * base_err, 1e-2) and comp_err <= max(2 * base_err, 1e-2)
