"""AccelConfig / CacheConfig: validation, dict round trip, CLI flags; the adapter registry."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from omni_diffusion.config import (
    AccelConfig,
    CacheConfig,
    add_cli_arguments,
    from_cli_args,
)


def test_defaults():
    config = AccelConfig()
    assert config.attention == "auto" and config.quant is None and config.cache is None
    assert config.compile is False and not config.cuda_graphs and config.lossless
    cache = CacheConfig()
    assert cache.kind == "first_block" and cache.threshold == 0.08 and cache.final_steps == 0
    assert CacheConfig("teacache").threshold == 0.25 and CacheConfig("teacache").final_steps == 1


@pytest.mark.parametrize("kwargs, field, allowed", [
    (dict(attention="flashy"), "attention", "omni_triton"),
    (dict(attention=3), "attention", "'auto'"),
    (dict(quant="fp4"), "quant", "'fp8'"),
    (dict(cache="deepcache"), "kind", "'first_block'"),
    (dict(cache=3.0), "cache", "CacheConfig"),
    (dict(compile="max"), "compile", "'regional'"),
    (dict(compile_backend=""), "compile_backend", "inductor"),
    (dict(compile_fullgraph="yes"), "compile_fullgraph", "None, True or False"),
    (dict(cuda_graphs=True), "cuda_graphs", "compile"),
    (dict(compile=True, cuda_graphs=True, compile_mode="max-autotune"), "compile_mode", "reduce-overhead"),
    (dict(quant_skip=("x",)), "quant_skip", "only with quant"),
    (dict(quant="int8", quant_skip="x_embedder"), None, None),  # a single string is one pattern
    (dict(quant="int8", quant_min_features=-1), "quant_min_features", "integer >= 0"),
    (dict(attention_policy="yes"), "attention_policy", "FullPrecisionPolicy"),
    (dict(attention="sdpa_math", attention_policy={}), "attention", "'auto' with attention_policy"),
    (dict(attention_policy={}, compile=True), "compile", "False with attention_policy"),
    (dict(attention_policy={}, parallel={"ulysses": 2}), "attention_policy", "sequence parallelism"),
])
def test_accel_config_validation(kwargs, field, allowed):
    if field is None:
        assert AccelConfig(**kwargs).quant_skip == ("x_embedder",)
        return
    with pytest.raises(ValueError) as info:
        AccelConfig(**kwargs)
    message = str(info.value)
    assert field in message and allowed in message
    bad = next(iter(kwargs.values())) if len(kwargs) == 1 else None
    if bad is not None and not isinstance(bad, bool):
        assert repr(bad) in message


@pytest.mark.parametrize("kwargs, field", [
    (dict(kind="x"), "kind"),
    (dict(threshold=-0.1), "threshold"),
    (dict(threshold=float("nan")), "threshold"),
    (dict(threshold="0.1"), "threshold"),
    (dict(warmup_steps=-1), "warmup_steps"),
    (dict(final_steps=1.5), "final_steps"),
    (dict(max_consecutive_hits=0), "max_consecutive_hits"),
    (dict(coefficients=(1.0, 0.0)), "coefficients"),  # first_block takes none
    (dict(kind="teacache", coefficients=()), "coefficients"),
    (dict(kind="teacache", coefficients=("a",)), "coefficients"),
    (dict(options={"Fn_compute_blocks": 2}), "options"),  # cache_dit only
])
def test_cache_config_validation(kwargs, field):
    with pytest.raises(ValueError, match=rf"CacheConfig\.{field}"):
        CacheConfig(**kwargs)


def test_replace_revalidates_and_normalizes():
    config = AccelConfig(compile=True, cache="teacache")
    assert config.compile == "regional" and isinstance(config.cache, CacheConfig)
    assert not config.lossless
    with pytest.raises(ValueError, match="AccelConfig.quant"):
        dataclasses.replace(config, quant="nf4")
    assert AccelConfig(attention="SDPA_MATH").attention == "sdpa_math"
    assert not AccelConfig(attention="sageattention").lossless
    assert AccelConfig(compile=True, cuda_graphs=True).torch_compile_mode == "reduce-overhead"


def test_choice_fields_accept_any_case_and_normalize():
    """quant, cache kind and vae_mode take any case, as attention does, and keep the
    canonical lowercase name (what to_dict and the CLI show)."""
    from omni_diffusion.parallel.config import ParallelConfig

    config = AccelConfig(attention="SDPA_Math", quant="FP8", cache="TeaCache",
                         parallel=ParallelConfig(cfg=2, vae=2, vae_mode="Spatial"))
    assert (config.attention, config.quant, config.cache.kind, config.parallel.vae_mode) == \
        ("sdpa_math", "fp8", "teacache", "spatial")
    assert AccelConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match=r"ParallelConfig\.vae_mode: 'Diagonal' is not allowed; allowed: 'tile'"):
        ParallelConfig(vae_mode="Diagonal")
    with pytest.raises(ValueError, match=r"AccelConfig\.quant: 3 is not allowed; allowed: 'fp8'.*None"):
        AccelConfig(quant=3)


def test_dict_round_trip():
    config = AccelConfig(
        attention="omni_triton", quant="fp8", quant_skip=("*.proj_mlp",), quant_min_features=64,
        cache=CacheConfig("teacache", threshold=0.3, warmup_steps=2, max_consecutive_hits=3,
                          coefficients=(1.0, 0.5)),
        compile=True, compile_backend="aot_eager", compile_fullgraph=False,
    )
    data = config.to_dict()
    assert data["cache"]["coefficients"] == [1.0, 0.5] and data["quant_skip"] == ["*.proj_mlp"]
    assert AccelConfig.from_dict(data) == config
    assert hash(AccelConfig.from_dict(data)) == hash(config)  # usable as a dict key
    assert len({AccelConfig(quant="int8", quant_options={"clamp": 8.0}), AccelConfig(quant="int8")}) == 2
    assert AccelConfig.from_dict({"cache": "first_block"}).cache == CacheConfig("first_block")
    assert AccelConfig.from_dict({"cache": {"kind": "teacache", "threshold": 0}}).cache.threshold == 0.0
    with pytest.raises(ValueError, match="unknown field.*'cach'.*fields: attention"):
        AccelConfig.from_dict({"cach": "first_block"})
    with pytest.raises(ValueError, match="CacheConfig: unknown field.*'thresh'"):
        AccelConfig.from_dict({"cache": {"kind": "teacache", "thresh": 1}})
    with pytest.raises(ValueError, match="needs a mapping"):
        AccelConfig.from_dict(["attention"])


def test_attention_policy_field():
    from omni_diffusion.attention import FullPrecisionPolicy

    config = AccelConfig(attention_policy={"first_steps": 2, "full_precision_layers": [0, "blocks.3.*"]})
    assert config.attention_policy == FullPrecisionPolicy(first_steps=2, full_precision_layers=(0, "blocks.3.*"))
    assert not config.lossless and AccelConfig(attention_policy={}).attention_policy == FullPrecisionPolicy()
    data = config.to_dict()
    assert data["attention_policy"]["full_precision_layers"] == [0, "blocks.3.*"]
    assert AccelConfig.from_dict(json.loads(json.dumps(data))) == config
    with pytest.raises(ValueError, match="FullPrecisionPolicy: unknown field.*'first_step'"):
        AccelConfig(attention_policy={"first_step": 2})
    with pytest.raises(ValueError, match="first_steps must be an integer"):
        AccelConfig(attention_policy={"first_steps": -1})


def _parse(argv):
    parser = add_cli_arguments(argparse.ArgumentParser())
    return from_cli_args(parser.parse_args(argv))


def test_cli_flags():
    assert _parse([]) == AccelConfig()
    config = _parse([
        "--attention", "none", "--quant", "int8", "--quant-skip", "a.*", "--quant-skip", "b",
        "--cache", "teacache", "--cache-threshold", "0.4", "--cache-warmup-steps", "3",
        "--cache-max-consecutive-hits", "2", "--compile", "--compile-backend", "eager",
        "--compile-fullgraph", "off",
    ])
    assert config == AccelConfig(
        attention=None, quant="int8", quant_skip=("a.*", "b"),
        cache=CacheConfig("teacache", threshold=0.4, warmup_steps=3, max_consecutive_hits=2),
        compile=True, compile_backend="eager", compile_fullgraph=False,
    )
    with pytest.raises(ValueError, match="--cache-threshold need --cache"):
        _parse(["--cache-threshold", "0.1"])
    with pytest.raises(ValueError, match="AccelConfig.quant"):
        _parse(["--quant", "nf4"])
    with pytest.raises(ValueError, match="cuda_graphs"):
        _parse(["--cuda-graphs"])
    assert _parse(["--attention-policy", "auto"]).attention_policy is not None
    assert _parse(["--attention-policy", "none"]).attention_policy is None
    policy = _parse(["--attention-policy", '{"last_steps": 1, "full_precision_layers": [-1]}']).attention_policy
    assert policy.last_steps == 1 and policy.full_precision_layers == (-1,)
    for bad in ("{first_steps: 1}", "[1]"):
        with pytest.raises(SystemExit):
            _parse(["--attention-policy", bad])


# --------------------------------------------------------------------------- adapters


def test_adapter_registry_resolves_pipelines():
    diffusers = pytest.importorskip("diffusers")
    from omni_diffusion.adapters import adapter_for, adapter_for_transformer, supported_pipelines

    expected = {
        "FluxPipeline": "flux", "FluxKontextPipeline": "flux", "StableDiffusion3Pipeline": "sd3",
        "WanPipeline": "wan", "WanImageToVideoPipeline": "wan", "QwenImagePipeline": "qwen_image",
        "HunyuanVideoPipeline": "hunyuan_video",
    }
    for pipeline, family in expected.items():
        assert adapter_for(getattr(diffusers, pipeline)).name == family
        assert pipeline in supported_pipelines()
    assert adapter_for_transformer(diffusers.WanTransformer3DModel).name == "wan"

    class MyFlux(diffusers.FluxPipeline):  # subclasses resolve along the MRO
        pass

    assert adapter_for(MyFlux).name == "flux"
    with pytest.raises(ValueError) as info:
        adapter_for(diffusers.StableDiffusionPipeline)
    message = str(info.value)
    assert "StableDiffusionPipeline" in message
    assert all(name in message for name in expected)
    with pytest.raises(ValueError, match="no adapter for the transformer"):
        adapter_for_transformer(diffusers.UNet2DConditionModel)


def test_adapter_descriptions():
    pytest.importorskip("diffusers")
    from omni_diffusion.adapters import list_adapters

    adapters = {a.name: a for a in list_adapters()}
    assert set(adapters) >= {"flux", "sd3", "wan", "qwen_image", "hunyuan_video"}
    assert adapters["flux"].layout.text_position == "first"
    assert adapters["sd3"].layout.text_position == "last" and adapters["sd3"].cfg.mode == "batched"
    assert adapters["wan"].layout.attention == "cross" and adapters["wan"].transformer_attrs[-1] == "transformer_2"
    assert adapters["qwen_image"].layout.text_mask and adapters["hunyuan_video"].cfg.guidance_embedded
    for adapter in adapters.values():
        info = adapter.describe()
        assert info["block_lists"] and info["quant_skip"] and info["pipelines"]
