"""Tests of GELU folding (``QuantConfig.fuse_activations``, CPU, CI): the tanh GELUs folded into
their W8A8 consumers' activation quantization, single blocks reading attention and MLP apart
without the cat, and where the fold or the concat-free forward is left out.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

pytest.importorskip("diffusers")
pytest.importorskip("safetensors")

import omni_kernels.quant.dispatch as quant_dispatch  # noqa: E402
from omni_diffusion import quantization as Q  # noqa: E402
from omni_diffusion.quantization import QuantConfig, quantize  # noqa: E402
from omni_kernels.quant import QuantizedLinear  # noqa: E402

from quantization_cases import CPU_OPTIONS, TINY_MODELS, _rel, _run, _tiny_flux  # noqa: E402


def _tiny_hunyuan_video():
    from omni_diffusion.testing import tiny_transformer

    return tiny_transformer("hunyuan_video")


FOLD_MODELS = {**TINY_MODELS, "hunyuan_video": _tiny_hunyuan_video}


def _expected_folds(model):
    """{consumer: (activation, activation_from)} the adapters declare, read off the model."""
    expected = {}
    for name, module in model.named_modules():
        kind = type(module).__name__
        if kind == "FeedForward" and getattr(module.net[0], "approximate", None) == "tanh":
            expected[f"{name}.net.2"] = (f"{name}.net.0", 0)
        elif kind in ("FluxSingleTransformerBlock", "HunyuanVideoSingleTransformerBlock"):
            expected[f"{name}.proj_out"] = (f"{name}.act_mlp", module.proj_out.in_features - module.proj_mlp.out_features)
    return expected


@pytest.mark.parametrize("family", sorted(FOLD_MODELS))
def test_gelus_folded_into_their_consumers(family):
    """W8A8 quantization folds every MLP GELU the adapter declares into the layer reading it:
    the GELU module goes (diffusers' GELU keeps its proj), the consumer applies the GELU in its
    quantization. With the torch backend the numbers are those of the unfolded model exactly
    (the same float32 ops); with the Triton kernel (interpreter) within INT8 rounding."""
    model, inputs = FOLD_MODELS[family]()
    unfolded = copy.deepcopy(model)
    expected = _expected_folds(model)
    assert expected, f"{family}: the tiny model has no tanh-GELU MLP"
    quantize(model, QuantConfig(method="int8", **CPU_OPTIONS))
    quantize(unfolded, QuantConfig(method="int8", fuse_activations=False, **CPU_OPTIONS))
    assert Q.fused_activations(unfolded) == {}
    folded = Q.fused_activations(model)
    assert {c: (e["activation"], e["activation_from"]) for c, e in folded.items()} == expected
    for consumer, (activation, activation_from) in expected.items():
        layer = model.get_submodule(consumer)
        assert layer.input_activation == "gelu_tanh" and layer.activation_from == activation_from
        gone = model.get_submodule(activation)
        assert isinstance(gone, (nn.Identity, Q.GELUProjection)), type(gone)
        if isinstance(gone, Q.GELUProjection):
            assert isinstance(gone.proj, QuantizedLinear)  # the projection itself is still quantized
    assert torch.equal(_run(model, inputs), _run(unfolded, inputs))
    if quant_dispatch.triton_interpreter_enabled():
        for layer in model.modules():
            if isinstance(layer, QuantizedLinear):
                layer.activation_backend = "triton"
        assert _rel(_run(model, inputs), _run(unfolded, inputs)) <= 1e-2


@pytest.mark.parametrize("family", ["flux", "hunyuan_video"])
def test_single_blocks_read_attention_and_mlp_apart(family, monkeypatch):
    """The adapters' concat-free single-block forward: installed on every single block whose
    GELU is folded, it hands proj_out the attention output and the MLP input apart (no cat of
    the two is built on the kernel path), with the class forward's numbers exactly; removed,
    the class forward is back."""
    model, inputs = FOLD_MODELS[family]()
    # fuse_norms=False: Flux's norm-fused single-block forward (which does the same) would take its place
    quantize(model, QuantConfig(method="int8", fuse_norms=False, **CPU_OPTIONS))
    singles = [m for m in model.modules() if type(m).__name__.endswith("SingleTransformerBlock")]
    assert singles and all("forward" in m.__dict__ for m in singles)
    assert all(type(m).__name__ != type(singles[0]).__name__ or "forward" not in m.__dict__
               for m in model.modules() if m not in singles)
    calls = []
    for block in singles:
        original = block.proj_out.forward_concat
        monkeypatch.setattr(block.proj_out, "forward_concat",
                            lambda head, tail, _f=original: calls.append(head.shape[-1]) or _f(head, tail))
    installed = _run(model, inputs)
    assert calls == [block.proj_out.activation_from for block in singles]
    Q.remove_concat_free_forwards(model)
    assert not any("forward" in m.__dict__ for m in singles)
    assert torch.equal(installed, _run(model, inputs))
    if quant_dispatch.triton_interpreter_enabled():  # the two-input kernel against the kernel on the cat
        for layer in model.modules():
            if isinstance(layer, QuantizedLinear):
                layer.activation_backend = "triton"
        with_cat = _run(model, inputs)
        Q.install_concat_free_forwards(model, None)  # no adapter: nothing installed
        assert not any("forward" in m.__dict__ for m in singles)
        from omni_diffusion.adapters import adapter_for_transformer

        assert len(Q.install_concat_free_forwards(model, adapter_for_transformer(model))) == len(singles)
        assert torch.equal(_run(model, inputs), with_cat)


def test_concat_free_forward_left_out_where_it_does_not_fit():
    """No fold (weight-only), a block with an instance forward of its own, or a block class
    whose forward takes other parameters keeps its forward."""
    model, _ = _tiny_flux()
    quantize(model, QuantConfig(method="int8_weight_only", **CPU_OPTIONS))
    assert not any("forward" in m.__dict__ for m in model.single_transformer_blocks)
    model, _ = _tiny_hunyuan_video()
    first, second = model.single_transformer_blocks
    own = first.forward
    first.forward = own
    quantize(model, QuantConfig(method="int8", **CPU_OPTIONS))
    assert first.__dict__["forward"] is own and "forward" in second.__dict__

    class OtherSingleBlock(type(second)):
        def forward(self, hidden_states, temb, image_rotary_emb=None):
            raise AssertionError("not called")

    model, _ = _tiny_hunyuan_video()
    first, second = model.single_transformer_blocks
    second.__class__ = OtherSingleBlock
    quantize(model, QuantConfig(method="int8", **CPU_OPTIONS))
    assert "forward" in first.__dict__ and "forward" not in second.__dict__


def test_fold_needs_a_w8a8_consumer_and_a_tanh_gelu():
    """Weight-only methods fold nothing (no activation quantization to fuse into); a consumer
    kept in full precision or an exact (erf) GELU is left as it is."""
    model, _ = _tiny_flux()
    quantize(model, QuantConfig(method="int8_weight_only", **CPU_OPTIONS))
    assert Q.fused_activations(model) == {}
    model, _ = _tiny_flux()
    quantize(model, QuantConfig(method="int8", skip=("transformer_blocks.0.ff.net.2",), **CPU_OPTIONS))
    folded = Q.fused_activations(model)
    assert "transformer_blocks.0.ff.net.2" not in folded and "transformer_blocks.0.ff_context.net.2" in folded
    assert type(model.transformer_blocks[0].ff.net[0]).__name__ == "GELU"
    model, _ = _tiny_flux()
    model.single_transformer_blocks[0].act_mlp = nn.GELU()  # exact GELU: the kernel's is tanh
    quantize(model, QuantConfig(method="int8", **CPU_OPTIONS))
    assert "single_transformer_blocks.0.proj_out" not in Q.fused_activations(model)
