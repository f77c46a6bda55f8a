"""Norm-fused block forwards (``QuantConfig.fuse_norms``): the LayerNorm + adaLN outputs of
Flux's blocks quantized once, in omni's fused kernel, for every W8A8 layer reading them.

CPU: the forwards against the blocks' own forwards on the same quantized layers (the
activation quantization of the two paths differs only in where the norm's float32 result is
rounded), where they install and where they do not, the fallbacks, undo and config errors.
GPU: the same comparison at Flux.1 widths (2 + 2 blocks, 1024^2 tokens) compiled and eager,
with omni's Triton kernel under Inductor.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("diffusers")

import omni_diffusion.quantization.norm_fusion as norm_fusion  # noqa: E402
from omni_diffusion import quantization as Q  # noqa: E402
from omni_kernels._triton import triton_interpreter_enabled  # noqa: E402
from omni_diffusion.adapters import adapter_for_transformer  # noqa: E402
from omni_diffusion.adapters.flux import (  # noqa: E402
    dual_block_forward_norm_fused,
    single_block_forward_norm_fused,
)
from omni_diffusion.quantization import QuantConfig, norm_fused_blocks, quantize  # noqa: E402
from omni_diffusion.testing import tiny_flux_transformer  # noqa: E402

CPU_OPTIONS = dict(backend="aten", activation_backend="torch")
BLOCKS = ["transformer_blocks.0", "single_transformer_blocks.0"]


def _rel(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def _run(model, inputs):
    with torch.no_grad():
        return model(**inputs)[0]


def _quantized_pair(method="fp8", fused_processor=True, **options):
    """The tiny Flux transformer quantized twice, without and with norm fusion; float32 inputs."""
    model, inputs = tiny_flux_transformer()
    adapter = adapter_for_transformer(model)
    plain, fused = copy.deepcopy(model), copy.deepcopy(model)
    options = {**CPU_OPTIONS, **options}
    quantize(plain, QuantConfig(method=method, fuse_norms=False, **options), adapter=adapter)
    quantize(fused, QuantConfig(method=method, **options), adapter=adapter)
    if fused_processor:
        adapter.apply_fused_norm_rope(plain)
        adapter.apply_fused_norm_rope(fused)
    return model, plain, fused, inputs


@pytest.mark.parametrize("method", ["fp8", "int8"])
def test_norm_fused_forwards_match_the_block_forwards(method, monkeypatch):
    """Installed on both block kinds by default for W8A8; the step output equals the unfused
    one's within float32 rounding; every modulated norm is quantized by one call of the fused
    path (4 a dual block, 1 a single block), and no layer quantizes its own input there."""
    model, plain, fused, inputs = _quantized_pair(method)
    assert norm_fused_blocks(fused) == BLOCKS and norm_fused_blocks(plain) == []
    assert [fused.get_submodule(b).__dict__["forward"].__func__ for b in BLOCKS] == [
        dual_block_forward_norm_fused, single_block_forward_norm_fused]
    calls = []
    original = norm_fusion.quantize_per_token

    def counting(x, *args, **kwargs):
        prefix = kwargs.get("prefix")
        calls.append((tuple(x.shape), kwargs.get("norm"), None if prefix is None else tuple(prefix.shape)))
        return original(x, *args, **kwargs)

    monkeypatch.setattr(norm_fusion, "quantize_per_token", counting)
    out = _run(fused, inputs)
    # dual block: image norm1, text norm1_context, image norm2, text norm2_context; single: the
    # joint norm, its text tokens read from their own tensor (no cat)
    assert calls == [((1, 16, 32), "layer", None), ((1, 8, 32), "layer", None), ((1, 16, 32), "layer", None),
                     ((1, 8, 32), "layer", None), ((1, 16, 32), "layer", (1, 8, 32))]
    ref = _run(plain, inputs)
    assert _rel(out, ref) < 1e-4, _rel(out, ref)
    assert _rel(out, _run(model, inputs)) < 0.1  # and as close to the unquantized model as before


def test_norm_fused_forwards_batch_of_two_samples():
    """Two samples with different timesteps (their own adaLN tables, as a CFG batch has): each
    sample's rows take its own modulation in the fused kernel."""
    model, plain, fused, inputs = _quantized_pair("fp8")
    gen = torch.Generator().manual_seed(5)
    batch = dict(inputs)
    for key in ("hidden_states", "encoder_hidden_states", "pooled_projections"):
        batch[key] = torch.cat([inputs[key], torch.randn(inputs[key].shape, generator=gen)])
    batch["timestep"] = torch.tensor([0.5, 0.9])
    out, ref = _run(fused, batch), _run(plain, batch)
    assert _rel(out, ref) < 1e-4, _rel(out, ref)
    # the first sample is what it is alone
    assert _rel(out[:1], _run(fused, inputs)) < 1e-5


@pytest.mark.skipif(not triton_interpreter_enabled(),
                    reason="needs TRITON_INTERPRET=1 (omni's Triton kernels on the CPU, float32); on a GPU "
                           "test_gpu_flux_norm_fused_forwards covers the same path in bf16")
def test_norm_fused_forwards_with_the_triton_kernels():
    """With the layers' activation quantization on omni's Triton kernels (the interpreter here),
    the single blocks' joint sequence read as two tensors (the prefix launch) and the
    norm/adaLN-fused kernel give the unfused blocks' output within float32 rounding."""
    _, plain, fused, inputs = _quantized_pair("int8", activation_backend="triton")
    out, ref = _run(fused, inputs), _run(plain, inputs)
    assert _rel(out, ref) < 1e-4, _rel(out, ref)


def test_norm_fused_forwards_fall_back_without_the_fused_processor():
    """With diffusers' own attention processor (or IP-adapter kwargs) the installed forwards
    run the 16-bit path: the same numbers as the blocks' forwards, no fused-norm call."""
    model, plain, fused, inputs = _quantized_pair("int8", fused_processor=False)
    assert norm_fused_blocks(fused) == BLOCKS
    assert torch.equal(_run(fused, inputs), _run(plain, inputs))


def test_norm_fused_forwards_left_out_where_they_do_not_fit():
    """A reader kept in full precision, weight-only methods, fuse_norms=False, or a block with an
    instance forward of its own: that block keeps its forward."""
    model, inputs = tiny_flux_transformer()
    quantize(model, QuantConfig(method="fp8", skip=("single_transformer_blocks.0.proj_mlp",), **CPU_OPTIONS))
    assert norm_fused_blocks(model) == ["transformer_blocks.0"]
    unfit = adapter_for_transformer(model).norm_fusions[1].unfit(model.single_transformer_blocks[0])
    assert "not a W8A8 QuantizedLinear" in unfit

    model, _ = tiny_flux_transformer()
    quantize(model, QuantConfig(method="int8", layer_methods={"transformer_blocks.0.ff.*": "int8_weight_only"},
                                **CPU_OPTIONS))
    assert norm_fused_blocks(model) == ["single_transformer_blocks.0"]

    model, _ = tiny_flux_transformer()
    quantize(model, QuantConfig(method="fp8_weight_only", **CPU_OPTIONS))
    assert norm_fused_blocks(model) == []

    model, _ = tiny_flux_transformer()
    own = model.transformer_blocks[0].forward
    model.transformer_blocks[0].forward = own
    quantize(model, QuantConfig(method="fp8", **CPU_OPTIONS))
    assert norm_fused_blocks(model) == ["single_transformer_blocks.0"]
    assert model.transformer_blocks[0].__dict__["forward"] is own


def test_norm_fusion_without_the_other_fusions_and_explicit_request_that_finds_nothing(caplog):
    """fuse_norms alone (projections and GELUs not fused) still installs both forwards; an explicit
    fuse_norms=True on a model whose adapter declares no such blocks warns, naming the adapter."""
    model, inputs = tiny_flux_transformer()
    plain = copy.deepcopy(model)
    options = dict(method="fp8", fuse_projections=False, fuse_activations=False, **CPU_OPTIONS)
    quantize(model, QuantConfig(**options))
    quantize(plain, QuantConfig(fuse_norms=False, **options))
    assert norm_fused_blocks(model) == BLOCKS
    for m in (model, plain):
        adapter_for_transformer(m).apply_fused_norm_rope(m)
    assert _rel(_run(model, inputs), _run(plain, inputs)) < 1e-4  # separate q/k/v read the one quantized input

    from omni_diffusion.testing import tiny_transformer

    other, _ = tiny_transformer("qwen_image")
    with caplog.at_level("WARNING", logger="omni_diffusion.quantization"):
        quantize(other, QuantConfig(method="int8", fuse_norms=True, **CPU_OPTIONS))
    assert norm_fused_blocks(other) == []
    assert "fuse_norms=True, but no block of QwenImageTransformer2DModel" in caplog.text
    assert "the 'qwen_image' adapter declares none" in caplog.text


def test_norm_fused_forwards_removed_on_undo_and_reinstalled_on_load(tmp_path):
    """remove_norm_fused_forwards puts the class forwards back (same output as the unfused
    model); a saved checkpoint loads with the forwards installed again."""
    model, plain, fused, inputs = _quantized_pair("fp8")
    expected = _run(fused, inputs)
    Q.remove_norm_fused_forwards(fused)
    assert norm_fused_blocks(fused) == []
    assert "forward" not in fused.transformer_blocks[0].__dict__
    # the single block keeps no instance forward either: its concat-free one was never installed
    assert "forward" not in fused.single_transformer_blocks[0].__dict__
    assert _rel(_run(fused, inputs), _run(plain, inputs)) == 0.0

    path = tmp_path / "flux.safetensors"
    Q.save_quantized(plain, path)
    loaded, _ = tiny_flux_transformer()
    Q.load_quantized(loaded, path)
    assert norm_fused_blocks(loaded) == BLOCKS
    adapter_for_transformer(loaded).apply_fused_norm_rope(loaded)
    assert _rel(_run(loaded, inputs), expected) < 1e-4


def test_accelerate_installs_and_undo_removes_norm_fused_forwards():
    import omni_diffusion as od

    model, inputs = tiny_flux_transformer()
    ref = _run(model, inputs)
    od.accelerate(model, od.AccelConfig(attention="sdpa_math", quant="fp8",
                                        quant_options=dict(activation_backend="torch", backend="aten")))
    assert norm_fused_blocks(model) == BLOCKS
    assert _rel(_run(model, inputs), ref) < 0.1
    od.undo(model)
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert torch.equal(_run(model, inputs), ref)


@pytest.mark.parametrize("fused_processor", [True, False], ids=["norm-fused", "fallback"])
def test_norm_fused_forwards_compile_fullgraph(fused_processor):
    """Regional torch.compile(fullgraph=True) traces the installed forwards, the norm-fused
    path and the fallback to the class forward alike, with the eager output."""
    _, _, fused, inputs = _quantized_pair("fp8", fused_processor=fused_processor)
    expected = _run(fused, inputs)
    torch._dynamo.reset()
    for block in [*fused.transformer_blocks, *fused.single_transformer_blocks]:
        block.compile(backend="aot_eager", fullgraph=True)
    try:
        assert torch.equal(_run(fused, inputs), expected)
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("value", ["yes", 1])
def test_fuse_norms_config_errors(value):
    with pytest.raises(ValueError, match=r"QuantConfig.fuse_norms must be True, False or None"):
        QuantConfig(method="fp8", fuse_norms=value)
    with pytest.raises(ValueError, match=r"fuse_norms=True needs a W8A8 method"):
        QuantConfig(method="int8_weight_only", fuse_norms=True)
    assert not QuantConfig(method="int8_weight_only").fuses_norms and QuantConfig(method="int8").fuses_norms


def test_fused_processor_attend_projected_is_its_call():
    """The processor's ``attend_projected`` on diffusers' projections is its ``__call__``."""
    model, inputs = tiny_flux_transformer()
    adapter_for_transformer(model).apply_fused_norm_rope(model)
    captured = {}

    def hook(module, args, kwargs, output):
        captured[module] = (kwargs, output)

    handles = [b.attn.register_forward_hook(hook, with_kwargs=True)
               for b in (model.transformer_blocks[0], model.single_transformer_blocks[0])]
    _run(model, inputs)
    for handle in handles:
        handle.remove()
    from diffusers.models.transformers.transformer_flux import _get_qkv_projections

    with torch.no_grad():
        for attn, (kwargs, output) in captured.items():
            projections = _get_qkv_projections(attn, kwargs["hidden_states"], kwargs.get("encoder_hidden_states"))
            again = attn.processor.attend_projected(attn, *projections, kwargs["image_rotary_emb"])
            for a, b in zip(again if isinstance(again, tuple) else (again,),
                            output if isinstance(output, tuple) else (output,), strict=True):
                assert torch.equal(a, b)


# =========================================================================== GPU


def _flux_widths_cuda():
    """Flux.1 widths (3072, 24 heads x 128) with 2 + 2 blocks, random bf16 weights on the GPU;
    1024^2 inputs (4096 image + 512 text tokens)."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    model = FluxTransformer2DModel(num_layers=2, num_single_layers=2).to("cuda", torch.bfloat16).eval()
    with torch.no_grad():  # diffusers zero-initializes nothing here, but keep the scales realistic
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.normal_(0, module.in_features ** -0.5)
    gen = torch.Generator(device="cuda").manual_seed(1)
    side = 64
    rows = torch.arange(side, device="cuda").repeat_interleave(side)
    cols = torch.arange(side, device="cuda").repeat(side)
    inputs = dict(
        hidden_states=torch.randn(1, side * side, 64, device="cuda", generator=gen, dtype=torch.bfloat16),
        encoder_hidden_states=torch.randn(1, 512, 4096, device="cuda", generator=gen, dtype=torch.bfloat16),
        pooled_projections=torch.randn(1, 768, device="cuda", generator=gen, dtype=torch.bfloat16),
        timestep=torch.tensor([0.5], device="cuda", dtype=torch.bfloat16),
        img_ids=torch.stack((torch.zeros_like(rows), rows, cols), dim=-1).float(),
        txt_ids=torch.zeros(512, 3, device="cuda"),
        return_dict=False,
    )
    return model, inputs


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_gpu_flux_norm_fused_forwards(compiled):
    """At Flux.1 widths on the GPU, FP8: the norm-fused blocks' output as close to the bf16
    model's as the unfused blocks' (relative L2 within 10% of it, and under the issue's 3%);
    eager and under torch.compile (omni's Triton kernel launched by Inductor). The two FP8
    paths differ from each other by about their own quantization error (the fused kernel keeps
    the norm in float32, the blocks round it to bf16 first, which moves FP8 codes), so they
    are compared through the bf16 reference."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a CUDA GPU with FP8 tensor cores (compute capability >= 8.9)")
    import omni_diffusion as od

    model, inputs = _flux_widths_cuda()
    reference = _run(model, inputs).float()
    errors = {}
    for fuse_norms in (False, True):
        torch._dynamo.reset()
        od.accelerate(model, od.AccelConfig(attention="auto", quant="fp8", compile=compiled,
                                            quant_options=dict(fuse_norms=fuse_norms)))
        assert norm_fused_blocks(model) == ([] if not fuse_norms else
                                            ["transformer_blocks.0", "transformer_blocks.1",
                                             "single_transformer_blocks.0", "single_transformer_blocks.1"])
        out = _run(model, inputs).float()
        od.undo(model)
        assert torch.isfinite(out).all()
        errors[fuse_norms] = _rel(out, reference)
    torch._dynamo.reset()
    print(f"rel L2 vs bf16 ({'compiled' if compiled else 'eager'}): unfused {errors[False]:.3e}, "
          f"norm-fused {errors[True]:.3e}")
    assert errors[True] <= 1.1 * errors[False] and errors[True] < 0.03, errors


# =========================================================================== releasing the originals


def test_quantize_releases_each_layer_as_it_goes():
    """quantize(on_released=...) hands over every replaced full-precision linear (the fused
    projections' three separate layers included) before it quantizes the next one."""
    model, _ = tiny_flux_transformer()
    linears = {name for name, m in model.named_modules() if type(m) is torch.nn.Linear}
    events = []
    original = Q.QuantizedLinear.from_linear

    def recording(linear, method, **options):
        events.append(("quantize", linear))
        return original(linear, method, **options)

    def released(name, layer):
        assert model.get_submodule(name) is not layer if name in dict(model.named_modules()) else True
        events.append(("released", layer, name))

    Q.QuantizedLinear.from_linear = recording
    try:
        quantize(model, QuantConfig(method="fp8", **CPU_OPTIONS), on_released=released)
    finally:
        Q.QuantizedLinear.from_linear = original
    released_names = {e[2] for e in events if e[0] == "released"}
    assert released_names == linears  # every original linear; no fused bf16 to_qkv (built inside)
    # each plain layer is released right after its own quantization
    for i, event in enumerate(events):
        if event[0] == "released" and not event[2].endswith(("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj",
                                                              "add_v_proj")):
            assert events[i - 1] == ("quantize", event[1])


@pytest.mark.gpu
def test_gpu_accelerate_quantization_peak_memory():
    """accelerate(quant="fp8") moves each bf16 original to the CPU as soon as its FP8 layer is in
    place: the GPU never holds both models in full. Peak above the bf16 model <= 30% of it: one
    layer's float32 quantization temporaries (~18% here, the 3072 x 12288 MLP weights); keeping
    every original until the end, as before, added the whole FP8 model (~50%) on top."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a CUDA GPU with FP8 tensor cores (compute capability >= 8.9)")
    import omni_diffusion as od

    model, _ = _flux_widths_cuda()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    start = torch.cuda.memory_allocated()
    model_bytes = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    torch.cuda.reset_peak_memory_stats()
    od.accelerate(model, od.AccelConfig(attention="auto", quant="fp8"))
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - start
    after = torch.cuda.memory_allocated() - start
    print(f"bf16 model {model_bytes / 2**30:.2f} GiB; quantizing peak +{peak / 2**30:.2f} GiB, "
          f"after {after / 2**30:+.2f} GiB")
    assert peak <= 0.30 * model_bytes, (peak, model_bytes)
    assert after < -0.3 * model_bytes  # most of the weights are 8-bit now
    od.undo(model)
    assert all(p.device.type == "cuda" for p in model.parameters())
