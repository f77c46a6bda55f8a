"""omni_diffusion.ar without vLLM: prompt formats, export, collation, batching, configs.

The export is checked through transformers (omni_diffusion.ar.reference), which
isolates it from vLLM; tests/ar/test_vllm.py runs the same paths through vLLM.
"""

from __future__ import annotations

import threading

import pytest
import torch

from omni_diffusion.ar import PromptEncoder, PromptFormat, RequestBatcher, collate, prompt_encoding_of
from omni_diffusion.ar.config import PromptEncoderConfig, PromptEnhancerConfig
from omni_diffusion.ar.export import export_pipeline_text_encoder
from omni_diffusion.ar.reference import TransformersBackend
from omni_diffusion.config import AccelConfig
from tests.ar.tiny import BUILDERS, call_kwargs

PROMPTS = ["a red fox in the snow", "a cat", "an astronaut riding a horse on the moon, oil painting"]


def own_embeds(pipe, family: str, prompts, kwargs):
    """The pipeline's own LLM encoder output for ``prompts``."""
    with torch.no_grad():
        if family == "qwen_image":
            return pipe._get_qwen_prompt_embeds(prompts, device="cpu")
        return pipe._get_llama_prompt_embeds(prompts, kwargs["prompt_template"], device="cpu",
                                             max_sequence_length=kwargs["max_sequence_length"])


@pytest.mark.parametrize("family", ["qwen_image", "hunyuan_video"])
def test_export_reproduces_the_pipeline_encoder(family, tmp_path):
    pipe = BUILDERS[family]()
    kwargs = call_kwargs(family)
    _, fmt = prompt_encoding_of(pipe, None, kwargs)
    folder = export_pipeline_text_encoder(pipe, tmp_path / "enc", call_kwargs=kwargs)
    encoder = PromptEncoder(TransformersBackend(folder))
    try:
        (embeds, mask), = encoder.encode(pipe.tokenizer, [PROMPTS], fmt)
    finally:
        encoder.close()
    ref_embeds, ref_mask = own_embeds(pipe, family, PROMPTS, kwargs)
    assert embeds.shape == ref_embeds.shape and torch.equal(mask, ref_mask.long())
    valid = mask.bool()
    err = (embeds - ref_embeds)[valid].norm() / ref_embeds[valid].norm()
    assert err < 1e-5, err
    assert (embeds[~valid] == 0).all()


def test_hunyuan_reads_a_layer_below_the_last(tmp_path):
    """Layer -3 (unnormed) is not the final normed output: the export keeps that apart."""
    pipe = BUILDERS["hunyuan_video"]()
    kwargs = call_kwargs("hunyuan_video")
    _, fmt = prompt_encoding_of(pipe, None, kwargs)
    assert fmt.hidden_layer == -3 and fmt.drop_tokens == 27 and fmt.pad_to == 48
    import json

    folder = export_pipeline_text_encoder(pipe, tmp_path / "enc", call_kwargs=kwargs)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["OmniHiddenStateLlamaForCausalLM"]
    assert config["omni_hidden_layer"] == 2 and config["num_hidden_layers"] == 3
    ids = pipe.tokenizer(["abc"])["input_ids"]
    with torch.no_grad():
        last = pipe.text_encoder(input_ids=torch.tensor(ids)).last_hidden_state[0]
    got = TransformersBackend(folder).embed(ids)[0]
    assert not torch.allclose(got, last, atol=1e-3)


def test_collate_pads_as_each_pipeline_does():
    hidden = [torch.randn(7, 4), torch.randn(5, 4)]
    longest = PromptFormat("x{}", drop_tokens=2, hidden_layer=-1, max_tokens=10)
    embeds, mask = collate(hidden, longest)
    assert embeds.shape == (2, 5, 4) and mask.tolist() == [[1] * 5, [1, 1, 1, 0, 0]]
    assert torch.equal(embeds[1, :3], hidden[1][2:]) and (embeds[1, 3:] == 0).all()
    fixed = PromptFormat("x{}", drop_tokens=2, hidden_layer=-3, max_tokens=10, pad_to=8)
    embeds, mask = collate(hidden, fixed, dtype=torch.float16)
    assert embeds.shape == (2, 8, 4) and embeds.dtype == torch.float16 and mask.sum().item() == 8


def test_batcher_joins_concurrent_submissions():
    calls = []
    gate = threading.Event()

    def run(key, items):
        gate.wait(5)  # hold the first batch so that the rest queue up behind it
        calls.append(list(items))
        return [item * 10 for item in items]

    batcher = RequestBatcher(run, window_s=0.05, max_items=100)
    results = {}

    def caller(i):
        results[i] = batcher.submit("k", [i, i + 100])

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    gate.set()
    for t in threads:
        t.join(10)
    batcher.close()
    assert results == {i: [10 * i, 10 * (i + 100)] for i in range(8)}
    assert batcher.stats.submissions == 8 and batcher.stats.items == 16
    assert batcher.stats.batches == len(calls) <= 3, calls
    for batch in calls:  # a submission is never split across batches
        assert all((i + 100 in batch) for i in batch if i < 100)


def test_batcher_hands_errors_to_every_caller_of_the_batch():
    def run(key, items):
        raise RuntimeError("backend down")

    batcher = RequestBatcher(run, window_s=0)
    with pytest.raises(RuntimeError, match="backend down"):
        batcher.submit("k", ["a"])
    batcher.close()
    with pytest.raises(RuntimeError, match="closed"):
        batcher.submit("k", ["a"])


def test_configs_validate_and_round_trip():
    config = AccelConfig(attention=None, prompt_encoder={"model": "/m", "placement": "server",
                                                         "url": "http://127.0.0.1:1"},
                         prompt_enhancer="chat-model")
    assert isinstance(config.prompt_encoder, PromptEncoderConfig)
    assert config.prompt_enhancer == PromptEnhancerConfig(model="chat-model")
    assert AccelConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match="placement"):
        PromptEncoderConfig(placement="gpu")
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        PromptEncoderConfig(gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="url"):
        PromptEncoderConfig(url="http://x")  # needs placement='server'
    with pytest.raises(ValueError, match="model"):
        PromptEnhancerConfig()
    with pytest.raises(ValueError, match="unknown field"):
        PromptEncoderConfig.from_dict({"modle": "x"})


def test_cli_flags_build_the_stages():
    import argparse

    from omni_diffusion.config import add_cli_arguments, from_cli_args

    parser = add_cli_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--attention", "none", "--prompt-encoder", "auto",
                              "--prompt-enhancer", "Qwen/Qwen2.5-1.5B-Instruct",
                              "--vllm-gpu-memory-utilization", "0.2"])
    config = from_cli_args(args)
    assert config.prompt_encoder == PromptEncoderConfig(gpu_memory_utilization=0.2)
    assert config.prompt_enhancer.model == "Qwen/Qwen2.5-1.5B-Instruct"
    assert config.prompt_enhancer.gpu_memory_utilization == 0.2


def test_family_without_llm_encoder_is_refused():
    from omni_diffusion.testing import tiny_pipeline

    with pytest.raises(ValueError, match="no LLM prompt encoder"):
        prompt_encoding_of(tiny_pipeline("flux"))


def test_engine_placement_without_vllm_names_what_is_missing(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_vllm(name, *args, **kwargs):
        if name == "vllm" or name.startswith("vllm."):
            raise ImportError("No module named 'vllm'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_vllm)
    from omni_diffusion.ar.vllm_engine import VLLMEngine

    with pytest.raises(ImportError, match="needs vLLM"):
        VLLMEngine("/nowhere", runner="pooling", gpu_memory_utilization=0.3)
