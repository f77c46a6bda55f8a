"""Run inside vLLM's virtual environment by tests/ar/test_vllm.py: the ``"engine"`` placement.

Builds the tiny HunyuanVideo pipeline (its Llama encoder read two layers below
the last), generates once with its own encoder and once through
``accelerate(prompt_encoder=PromptEncoderConfig(placement="engine"))``
(``model=None``: the pipeline's encoder is exported and loaded by a
``vllm.LLM`` started here), encodes prompts from 8 threads at once, and
writes the measurements as JSON to ``argv[1]`` for the test to judge.
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path


def main(out_path: str) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import torch

    import omni_diffusion as od
    from omni_diffusion.ar import PromptEncoderConfig, prompt_encoding_of
    from omni_diffusion.testing import output_tensor
    from tests.ar.tiny import call_kwargs, hunyuan_video_pipeline

    family = "hunyuan_video"
    own = hunyuan_video_pipeline()
    kwargs = call_kwargs(family)
    with torch.no_grad():
        own_video = output_tensor(own(**call_kwargs(family)))
    pipe = hunyuan_video_pipeline()
    od.accelerate(pipe, od.AccelConfig(attention=None, prompt_encoder=PromptEncoderConfig(
        placement="engine", dtype="float32", batch_window_ms=50,
        engine_args={"enforce_eager": True, "max_model_len": 512})))
    try:
        with torch.no_grad():
            bridge_video = output_tensor(pipe(**call_kwargs(family)))
        stage = pipe.__dict__["_omni_accel"].prompt_stage
        _, fmt = prompt_encoding_of(pipe, None, kwargs)
        prompts = ["a red fox in the snow", "a cat", "a city street at night in the rain"]
        (embeds, mask), = stage.encoder.encode(pipe.tokenizer, [prompts], fmt)
        with torch.no_grad():
            ref, ref_mask = own._get_llama_prompt_embeds(
                prompts, kwargs["prompt_template"], device="cpu",
                max_sequence_length=kwargs["max_sequence_length"])
        valid = ref_mask.bool()
        before = stage.encoder.stats.batches
        results = [None] * 8

        def caller(i: int) -> None:
            results[i] = stage.encoder.encode(pipe.tokenizer, [[f"prompt {i}"], ["blurry"]], fmt)

        threads = [threading.Thread(target=caller, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        single = stage.encoder.encode(pipe.tokenizer, [["prompt 5"], ["blurry"]], fmt)
        report = dict(
            shape_equal=list(embeds.shape) == list(ref.shape),
            mask_equal=bool(torch.equal(mask, ref_mask.long())),
            rel_err=float((embeds - ref)[valid].norm() / ref[valid].norm()),
            video_max_abs_diff=float((bridge_video - own_video).abs().max()),
            video_scale=float(own_video.abs().max()),
            concurrent_batches=stage.encoder.stats.batches - before - 1,
            concurrent_same_as_single=bool(torch.equal(results[5][0][0], single[0][0])),
        )
    finally:
        od.undo(pipe)
    Path(out_path).write_text(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1])
