"""omni_diffusion.accelerate() on tiny pipelines of every family, against the untouched pipeline.

Each family's pipeline (``omni_diffusion.testing.tiny_pipeline``: random weights,
float32, a few blocks a few dozen channels wide, byte-level tokenizers) runs 3
steps at 32x32 with classifier-free guidance where the family has it, once
untouched (the reference) and once per feature, same seed. Bounds:

* lossless features (omni attention with ``sdpa_math``, regional compile with
  the ``eager`` backend): relative error <= 1e-5 (float32 rounding);
* caching with threshold 0: bit-identical; with a huge threshold: some steps
  are served from the cache, the output is finite and within 10% (relative L2)
  of the reference (random weights change little between steps);
* quantization: int8 W8A8 <= 2%, fp8 W8A8 <= 5% relative error;
* undo: the output is bit-identical to the reference again, and every module,
  processor and attention flag is the one from before (quantization's fused
  q/k/v projections removed, the separate ones back).
"""

from __future__ import annotations

import fnmatch

import pytest
import torch

pytest.importorskip("diffusers")

import omni_diffusion as od  # noqa: E402
from omni_diffusion.testing import output_tensor, tiny_call_kwargs, tiny_pipeline  # noqa: E402

FAMILIES = ["flux", "flux_kontext", "sd3", "wan", "wan22", "wan_i2v", "qwen_image", "hunyuan_video"]
STEPS = 3
#: activation quantization with torch's CPU ops: "auto" may pick the Triton kernel, which on a
#: CPU-only machine runs under Triton's interpreter (minutes for a tiny pipeline)
CPU_QUANT = {"activation_backend": "torch"}


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


class Family:
    def __init__(self, name: str) -> None:
        self.name = name
        self.pipe = tiny_pipeline(name)
        self.reference = self.run()

    def run(self, steps: int = STEPS, **overrides) -> torch.Tensor:
        return output_tensor(self.pipe(**tiny_call_kwargs(self.name, steps=steps, pipe=self.pipe,
                                                          **overrides)))

    def accelerated(self, config, **kwargs) -> torch.Tensor:
        od.accelerate(self.pipe, config, **kwargs)
        return self.run()


_CACHE: dict[str, Family] = {}


@pytest.fixture(params=FAMILIES)
def family(request):
    name = request.param
    if name not in _CACHE:
        _CACHE[name] = Family(name)
    fam = _CACHE[name]
    yield fam
    od.undo(fam.pipe)


def test_attention_sdpa_math_matches(family):
    out = family.accelerated(od.AccelConfig(attention="sdpa_math"))
    assert rel(out, family.reference) < 1e-5
    od.undo(family.pipe)
    assert torch.equal(family.run(), family.reference)


def test_regional_compile_fullgraph_with_auto_attention(family):
    """attention="auto" reads the attention_backend() context: that must trace with fullgraph."""
    torch._dynamo.reset()
    out = family.accelerated(od.AccelConfig(attention="auto", compile=True, compile_backend="eager",
                                            compile_fullgraph=True))
    assert rel(out, family.reference) < 1e-5
    od.undo(family.pipe)


def test_regional_compile_matches(family):
    torch._dynamo.reset()
    out = family.accelerated(od.AccelConfig(attention="sdpa_math", compile=True, compile_backend="eager"))
    assert rel(out, family.reference) < 1e-5
    transformer = family.pipe.transformer
    compiled = [m for m in transformer.modules() if m._compiled_call_impl is not None]
    assert compiled and all(type(m).__name__ in _repeated(family) for m in compiled)
    od.undo(family.pipe)
    assert all(m._compiled_call_impl is None for m in transformer.modules())


def _repeated(family) -> tuple[str, ...]:
    from omni_diffusion.adapters import adapter_for

    return adapter_for(family.pipe).repeated_block_classes(family.pipe.transformer)


@pytest.mark.parametrize("kind", ["first_block", "teacache"])
def test_cache_threshold_zero_is_exact(family, kind):
    out = family.accelerated(od.AccelConfig(attention=None, cache=od.CacheConfig(kind, threshold=0)))
    assert torch.equal(out, family.reference)
    stats = od.last_cache_stats(family.pipe)
    assert stats.hits == 0 and stats.passes >= STEPS and stats.blocks_skipped == 0
    assert stats is family.pipe.omni_stats


@pytest.mark.parametrize("kind", ["first_block", "teacache"])
def test_cache_large_threshold_hits_within_bound(family, kind):
    cache = od.CacheConfig(kind, threshold=1e6, warmup_steps=1, final_steps=0)
    out = family.accelerated(od.AccelConfig(attention=None, cache=cache))
    stats = od.last_cache_stats(family.pipe)
    cfg_branches = {key.split("/")[1] for key in stats.branches}  # cond/uncond or call0/call1
    assert stats.passes == STEPS * len(cfg_branches)
    # every step after the warm-up is a hit, in every branch (Wan 2.2: per expert)
    assert stats.hits == sum(max(0, b["passes"] - 1) for b in stats.branches.values()) > 0, stats
    assert stats.blocks_skipped > 0 and 0 < stats.skipped_fraction < 1
    assert torch.isfinite(out).all()
    assert 0 < rel(out, family.reference) < 0.1
    # state is reset per call: a second call gives the same output and stats
    again = family.run()
    assert torch.equal(again, out) and od.last_cache_stats(family.pipe) == stats
    od.undo(family.pipe)
    assert torch.equal(family.run(), family.reference)


@pytest.mark.parametrize("method, bound", [("int8", 0.02), ("fp8", 0.05)])
def test_quantization_within_bound(family, method, bound):
    pytest.importorskip("omni_diffusion.quantization",
                        reason="omni_diffusion.quantization (the linear-quantization issue) is missing")
    from omni_kernels.quant import QuantizedLinear

    from omni_diffusion.adapters import adapter_for

    out = family.accelerated(od.AccelConfig(attention=None, quant=method, quant_options=CPU_QUANT))
    adapter = adapter_for(family.pipe)
    for transformer in adapter.transformers(family.pipe).values():
        quantized = [n for n, m in transformer.named_modules() if isinstance(m, QuantizedLinear)]
        assert quantized
        assert "proj_out" not in quantized  # the adapter's skip list applies
        # the adapter's modulation layers: INT8 weights, 16-bit input
        for name, module in transformer.named_modules():
            if any(fnmatch.fnmatchcase(name, p) for p in adapter.quant_weight_only):
                assert isinstance(module, QuantizedLinear) and module.method == "int8_weight_only", name
    assert rel(out, family.reference) < bound
    od.undo(family.pipe)
    for transformer in adapter.transformers(family.pipe).values():
        assert not any(isinstance(m, QuantizedLinear) for m in transformer.modules())
    assert torch.equal(family.run(), family.reference)


MODULATION = ("transformer_blocks.*.norm1.linear", "transformer_blocks.*.norm1_context.linear",
              "single_transformer_blocks.*.norm.linear")


@pytest.mark.parametrize("override", ["none", "quant_skip", "layer_methods"])
def test_adapter_weight_only_layers_and_their_overrides(override, monkeypatch):
    """An adapter's quant_weight_only layers (here Flux's adaLN modulation linears, declared for
    the test) get INT8 weight-only under W8A8; the caller's quant_skip keeps them in 16 bits and
    the caller's layer_methods pick another method."""
    pytest.importorskip("omni_diffusion.quantization",
                        reason="omni_diffusion.quantization (the linear-quantization issue) is missing")
    from omni_diffusion.adapters import adapter_for

    family = Family("flux")
    adapter = adapter_for(family.pipe)
    monkeypatch.setattr(adapter, "quant_weight_only", MODULATION)
    monkeypatch.setattr(adapter, "quant_skip", tuple(p for p in adapter.quant_skip if p not in MODULATION))
    options = dict(CPU_QUANT)
    fields = {}
    if override == "quant_skip":
        fields["quant_skip"] = ("transformer_blocks.*.norm1.linear",)
    if override == "layer_methods":
        options["layer_methods"] = {"single_transformer_blocks.*.norm.linear": "fp8_weight_only"}
    out = family.accelerated(od.AccelConfig(attention=None, quant="int8", quant_options=options, **fields))
    transformer = adapter.transformers(family.pipe)["transformer"]
    kinds = {}
    for name, module in transformer.named_modules():
        for pattern in MODULATION:
            if fnmatch.fnmatchcase(name, pattern):
                kinds.setdefault(pattern, set()).add(getattr(module, "method", type(module).__name__))
    expected = {p: {"int8_weight_only"} for p in MODULATION}
    if override == "quant_skip":
        expected["transformer_blocks.*.norm1.linear"] = {"Linear"}
    if override == "layer_methods":
        expected["single_transformer_blocks.*.norm.linear"] = {"fp8_weight_only"}
    assert kinds == expected
    assert rel(out, family.reference) < 0.02
    od.undo(family.pipe)
    assert torch.equal(family.run(), family.reference)


@pytest.mark.parametrize("bad", ["*.norm1.linear", [("*.norm1.linear",)], {"*.norm1.linear": "int4"}])
def test_bad_layer_methods_with_adapter_weight_only_layers(bad, monkeypatch):
    """A malformed quant_options["layer_methods"] raises QuantConfig's error naming it, also
    where the adapter's own weight-only patterns are merged into it first."""
    pytest.importorskip("omni_diffusion.quantization")
    from omni_diffusion.adapters import adapter_for

    family = Family("flux")
    adapter = adapter_for(family.pipe)
    monkeypatch.setattr(adapter, "quant_weight_only", MODULATION)
    monkeypatch.setattr(adapter, "quant_skip", tuple(p for p in adapter.quant_skip if p not in MODULATION))
    with pytest.raises(ValueError, match=r"QuantConfig\.layer_methods"):
        od.accelerate(family.pipe, od.AccelConfig(attention=None, quant="int8",
                                                  quant_options=dict(CPU_QUANT, layer_methods=bad)))
    assert torch.equal(family.run(), family.reference)  # nothing was left changed


def test_flux_keeps_its_modulation_linears_in_16_bits():
    """Measured on the H200 (bench/results/pipeline-flux-modulation_*): INT8 weight-only through
    omni's GEMV did not pay yet, so Flux's adapter skips its modulation linears."""
    from omni_diffusion.adapters import adapter_for

    adapter = adapter_for(tiny_pipeline("flux"))
    assert not adapter.quant_weight_only and set(MODULATION) <= set(adapter.quant_skip)


def test_progress_callback(family):
    calls = []
    user_calls = []

    def user_callback(pipe, step, timestep, callback_kwargs):
        user_calls.append(step)
        return callback_kwargs

    od.accelerate(family.pipe, od.AccelConfig(attention=None),
                  progress=lambda step, total, latents: calls.append((step, total, latents is not None)))
    out = family.run(callback_on_step_end=user_callback)
    assert calls == [(i + 1, STEPS, True) for i in range(STEPS)]
    assert user_calls == list(range(STEPS))
    assert torch.equal(out, family.reference)
    assert od.last_cache_stats(family.pipe).passes == 0  # no cache configured


# --------------------------------------------------------------------------- one family


@pytest.fixture
def flux():
    if "flux" not in _CACHE:
        _CACHE["flux"] = Family("flux")
    fam = _CACHE["flux"]
    yield fam
    od.undo(fam.pipe)


def _snapshot(pipe):
    from omni_diffusion.adapters import adapter_for

    snap = {"class": type(pipe), "dict": set(pipe.__dict__)}
    for attr, transformer in adapter_for(pipe).transformers(pipe).items():
        snap[attr] = dict(
            modules=[(name, m) for name, m in transformer.named_modules()],
            classes=[(name, type(m)) for name, m in transformer.named_modules()],
            params=[(name, p) for name, p in transformer.named_parameters()],
            processors=[(name, m.processor, m.processor.__dict__.get("_attention_backend", "unset"))
                        for name, m in transformer.named_modules() if hasattr(m, "processor")],
            fused=[(name, m.__dict__.get("fused_projections", "unset"))
                   for name, m in transformer.named_modules() if hasattr(m, "processor")],
            compiled=[(name, m._compiled_call_impl) for name, m in transformer.named_modules()],
            forwards=[(name, m.__dict__.get("forward")) for name, m in transformer.named_modules()],
            dict=set(transformer.__dict__),
            hooks=(len(transformer._forward_hooks), len(transformer._forward_pre_hooks)),
        )
    return snap


def _same(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, tuple):
        return len(a) == len(b) and all(x is y or x == y for x, y in zip(a, b))
    return a is b or a == b


@pytest.mark.parametrize("name", ["flux", "sd3", "wan22"])
def test_undo_restores_everything(name):
    # A pipeline of its own: one shared with other tests may carry what their accelerate/undo
    # left behind into the "before" snapshot and hide it (it did: q/k/v order, the fold record).
    fam = Family(name)
    pipe = fam.pipe
    before = _snapshot(pipe)
    has_quant = True
    try:
        import omni_diffusion.quantization  # noqa: F401
    except ImportError:
        has_quant = False
    config = od.AccelConfig(attention="sdpa_math", quant="int8" if has_quant else None,
                            quant_options=CPU_QUANT if has_quant else {},
                            cache=od.CacheConfig("first_block", threshold=0.5), compile=True,
                            compile_backend="eager")
    od.accelerate(pipe, config, progress=lambda *a: None)
    try:
        assert od.is_accelerated(pipe) and od.accel_config(pipe) == config
        assert type(pipe) is not before["class"] and type(pipe).__name__ == before["class"].__name__
        assert isinstance(pipe, before["class"])
        if has_quant:  # int8 W8A8 fuses the q/k/v triples the adapter declares (Flux, SD3)
            from omni_diffusion.quantization import fused_attention

            fused = fused_attention(pipe.transformer)
            assert bool(fused) == (od.adapters.adapter_for(pipe).fusable_attention != ())
            # and folds the MLP GELUs into the layers reading them (every family here has one)
            from omni_diffusion.quantization import fused_activations

            assert fused_activations(pipe.transformer)
            # Flux's single blocks read attention and MLP apart (an instance forward, removed on undo)
            singles = getattr(pipe.transformer, "single_transformer_blocks", [])
            assert all("forward" in block.__dict__ for block in singles)
        fam.run(steps=2)
    finally:
        od.undo(pipe)
    after = _snapshot(pipe)
    assert _same(before, after)
    assert not od.is_accelerated(pipe) and od.last_cache_stats(pipe) is None
    assert torch.equal(fam.run(), fam.reference)
    assert od.undo(pipe) is pipe  # no-op when not accelerated


def test_accelerate_twice_reapplies(flux):
    pipe = flux.pipe
    od.accelerate(pipe, od.AccelConfig(attention=None, cache="first_block"))
    blocks_cls = type(pipe.transformer.transformer_blocks)
    assert blocks_cls is not torch.nn.ModuleList
    od.accelerate(pipe, {"attention": "sdpa_math"})  # replaces, does not stack
    assert type(pipe.transformer.transformer_blocks) is torch.nn.ModuleList
    assert type(pipe).__dict__.get("_omni_base_class") is None  # no __call__ wrapper without cache
    assert od.accel_config(pipe).cache is None
    assert rel(flux.run(), flux.reference) < 1e-5


def test_omni_triton_attention_matches(flux):
    import omni_kernels.attention as A

    if A.get_backend("omni_triton").unavailable_reason("cpu") is not None:
        pytest.skip("omni_triton cannot run on CPU here (needs TRITON_INTERPRET=1)")
    reference = flux.run(steps=1, cfg=False)
    od.accelerate(flux.pipe, od.AccelConfig(attention="omni_triton"))
    assert rel(flux.run(steps=1, cfg=False), reference) < 1e-4


def test_fullgraph_aot_eager_with_omni_attention_and_cache(flux):
    torch._dynamo.reset()
    cache = od.CacheConfig("first_block", threshold=0)
    out = flux.accelerated(od.AccelConfig(attention="sdpa_math", compile=True,
                                          compile_backend="aot_eager", compile_fullgraph=True,
                                          cache=cache))
    assert rel(out, flux.reference) < 1e-5
    torch._dynamo.reset()


def test_attention_policy_steers_lossy_calls(flux, tmp_path, monkeypatch):
    """AccelConfig.attention_policy: the calls past the auto table's crossover run the lossy
    backend it lists, except the policy's first steps and layers; undo removes the policy."""
    import json

    import omni_kernels.attention as A

    calls = []

    def exact_spy(q, k, v, *, layout, causal, scale, key_lengths, key_padding_mask, return_lse):
        calls.append(q.shape[2])  # a lossy backend in the registry's eyes, SDPA's math in fact
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale)

    A.register_backend(A.BackendSpec(name="spy_quantized", run=exact_spy, devices=("cpu",),
                                     dtypes=(torch.float32,), lossy=True, causal=False))
    table = tmp_path / "table.json"
    table.write_text(json.dumps({"archs": {"cpu": {"ranking": ["spy_quantized", "sdpa_math"],
                                                   "lossy_min_seq": {"spy_quantized": 1}}}}))
    monkeypatch.setenv(A.ENV_AUTO_TABLE, str(table))
    A.reload_auto_table()
    try:
        reference = flux.run()
        od.accelerate(flux.pipe, od.AccelConfig(attention_policy={}))
        out = flux.run()
        everything = len(calls)
        assert everything % STEPS == 0 and everything > 0 and rel(out, reference) < 1e-5
        per_step = everything // STEPS
        calls.clear()
        od.accelerate(flux.pipe, od.AccelConfig(attention_policy={"first_steps": 1, "last_steps": 1}))
        flux.run()
        assert len(calls) == per_step * (STEPS - 2)
        calls.clear()
        od.accelerate(flux.pipe, od.AccelConfig(attention_policy={"full_precision_layers": [-1]}))
        flux.run()
        from omni_diffusion.attention_policy import attention_modules

        modules = len(attention_modules(flux.pipe.transformer))  # each runs once a transformer call
        assert len(calls) == everything * (modules - 1) // modules  # the last one stays exact
        od.undo(flux.pipe)
        calls.clear()
        assert torch.equal(flux.run(), reference) and not calls
        # past the crossover only: raise it above the tiny model's token count
        table.write_text(json.dumps({"archs": {"cpu": {"ranking": ["spy_quantized", "sdpa_math"],
                                                       "lossy_min_seq": {"spy_quantized": 10 ** 6}}}}))
        A.reload_auto_table()
        od.accelerate(flux.pipe, od.AccelConfig(attention_policy={}))
        flux.run()
        assert not calls
    finally:
        od.undo(flux.pipe)
        A.unregister_backend("spy_quantized")
        monkeypatch.delenv(A.ENV_AUTO_TABLE)
        A.reload_auto_table()


def test_bad_configs_raise(flux, monkeypatch):
    import diffusers

    pipe = flux.pipe
    with pytest.raises(ValueError, match="cuda_graphs"):
        od.accelerate(pipe, od.AccelConfig(compile=True, cuda_graphs=True))
    assert not od.is_accelerated(pipe) and type(pipe) is diffusers.FluxPipeline
    with pytest.raises(ValueError, match="AccelConfig.attention"):
        od.accelerate(pipe, {"attention": "nope"})
    with pytest.raises(TypeError):
        od.accelerate(pipe, "fast")

    class Unknown(diffusers.DiffusionPipeline):
        pass

    with pytest.raises(ValueError, match="supported pipelines: FluxPipeline"):
        od.accelerate(Unknown(), od.AccelConfig())

    # a transformer shared with another accelerated pipeline
    other = diffusers.FluxPipeline(**pipe.components)
    od.accelerate(other, od.AccelConfig(attention=None, cache="first_block"))
    try:
        with pytest.raises(ValueError, match="already accelerated through another pipeline"):
            od.accelerate(pipe, od.AccelConfig(attention=None))
    finally:
        od.undo(other)


def test_attention_backend_ineligible_on_the_pipeline_device_raises_at_accelerate(flux):
    """A backend that cannot run on the transformer's device is refused by accelerate(), naming
    the backend, the reason and what can run there, not at the pipeline's first call."""
    pipe = flux.pipe
    with pytest.raises(ValueError) as info:
        od.accelerate(pipe, od.AccelConfig(attention="SDPA_cuDNN"))
    message = str(info.value)
    assert "AccelConfig.attention: 'sdpa_cudnn' cannot run on transformer's device cpu" in message
    assert "runs on cuda only" in message and "'sdpa_math'" in message and "'flash_attn'" not in message
    assert not od.is_accelerated(pipe)
    assert torch.equal(flux.run(), flux.reference)  # nothing was left installed


def test_cache_dit_missing_is_a_clear_error(flux):
    try:
        import cache_dit  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("cache-dit is installed")
    with pytest.raises(ImportError, match="needs the cache-dit package"):
        od.accelerate(flux.pipe, od.AccelConfig(cache="cache_dit"))
    assert not od.is_accelerated(flux.pipe)
    assert type(flux.pipe.transformer.transformer_blocks) is torch.nn.ModuleList


def test_teacache_needs_adapter_support(flux):
    from omni_diffusion.adapters.base import BlockList, ModelAdapter

    class Bare(ModelAdapter):
        name = "bare"
        block_lists = (BlockList("transformer_blocks"), BlockList("single_transformer_blocks"))

    with pytest.raises(ValueError, match="TeaCache needs the model's timestep-modulated input"):
        od.accelerate(flux.pipe, od.AccelConfig(attention=None, cache="teacache"), adapter=Bare())
    # First-Block-Cache needs only the block lists
    od.accelerate(flux.pipe, od.AccelConfig(attention=None, cache={"kind": "first_block", "threshold": 0}),
                  adapter=Bare())
    assert torch.equal(flux.run(), flux.reference)
    assert od.last_cache_stats(flux.pipe).passes == 2 * STEPS  # cond + uncond


def test_bare_transformer():
    """accelerate() on a transformer alone: caching inside generations the caller opens."""
    from omni_diffusion import cache

    if "wan" not in _CACHE:
        _CACHE["wan"] = Family("wan")
    transformer = _CACHE["wan"].pipe.transformer
    gen = torch.Generator().manual_seed(0)
    inputs = dict(hidden_states=torch.randn(1, 4, 2, 8, 8, generator=gen), timestep=torch.tensor([500.0]),
                  encoder_hidden_states=torch.randn(1, 8, 32, generator=gen), return_dict=False)
    with torch.no_grad():
        expected = transformer(**inputs)[0]
        od.accelerate(transformer, od.AccelConfig(attention="sdpa_math", cache=od.CacheConfig(
            "first_block", threshold=1e6)))
        try:
            assert od.is_accelerated(transformer)
            with cache.generation() as state:
                outs = [transformer(**inputs)[0] for _ in range(2)]
            # same timestep twice without a branch name: two branches ("call0", "call1"), no hit
            assert state.stats().hits == 0 and set(state.stats().branches) == {
                "transformer/call0", "transformer/call1"}
            assert all(rel(o, expected) < 1e-5 for o in outs)
            with pytest.raises(ValueError, match="progress needs a pipeline"):
                od.accelerate(transformer, od.AccelConfig(), progress=print)
        finally:
            od.undo(transformer)
    assert not od.is_accelerated(transformer)
    assert type(transformer.blocks) is torch.nn.ModuleList
