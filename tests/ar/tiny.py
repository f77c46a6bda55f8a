"""Tiny Qwen-Image and HunyuanVideo pipelines whose LLM text encoders vLLM can run.

omni_diffusion.testing's tiny pipelines have 8-wide attention heads; vLLM's CPU
attention needs a head size of at least 32, so these swap in text encoders of
two 32-wide heads (hidden size 64) and transformers that read 64-wide text.
Everything is seeded, float32, on CPU, with the byte-level tokenizers of
omni_diffusion.testing; the pipelines' real templates are kept (the byte
tokenizer turns them into more tokens than the real ones, which changes
nothing here).
"""

from __future__ import annotations

import torch

from omni_diffusion.testing import VOCAB_SIZE, tiny_pipeline

TEXT_WIDTH = 64


def qwen_image_pipeline(seed: int = 0):
    """A QwenImagePipeline with a 3-layer Qwen2.5-VL text encoder (text width 64)."""
    import diffusers
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    pipe = tiny_pipeline("qwen_image", seed=seed)
    torch.manual_seed(seed + 1)
    config = Qwen2_5_VLConfig(
        text_config=dict(
            hidden_size=TEXT_WIDTH, intermediate_size=96, num_hidden_layers=3,
            num_attention_heads=2, num_key_value_heads=1, vocab_size=VOCAB_SIZE,
            max_position_embeddings=2048, rms_norm_eps=1e-6,
            rope_scaling={"mrope_section": [4, 6, 6], "rope_type": "default", "type": "default"},
            rope_theta=1000000.0, bos_token_id=2, eos_token_id=3, pad_token_id=0,
        ),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2,
                           out_hidden_size=TEXT_WIDTH),
        vocab_size=VOCAB_SIZE, image_token_id=VOCAB_SIZE - 1, video_token_id=VOCAB_SIZE - 1,
        vision_start_token_id=VOCAB_SIZE - 2, vision_end_token_id=VOCAB_SIZE - 3,
        vision_token_id=VOCAB_SIZE - 4,
    )
    encoder = Qwen2_5_VLForConditionalGeneration(config).eval()
    transformer = diffusers.QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=TEXT_WIDTH, guidance_embeds=False,
        axes_dims_rope=(8, 4, 4),
    ).eval()
    pipe.register_modules(text_encoder=encoder, transformer=transformer)
    return pipe


def hunyuan_video_pipeline(seed: int = 0):
    """A HunyuanVideoPipeline with a 4-layer Llama text encoder (width 64; the pipeline reads
    layer 2, two below the last)."""
    import diffusers
    from transformers import LlamaConfig, LlamaModel

    pipe = tiny_pipeline("hunyuan_video", seed=seed)
    torch.manual_seed(seed + 1)
    encoder = LlamaModel(LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=TEXT_WIDTH, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512,
        pad_token_id=0, bos_token_id=2, eos_token_id=3, rms_norm_eps=1e-5,
    )).eval()
    transformer = diffusers.HunyuanVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=2,
        num_single_layers=2, num_refiner_layers=1, patch_size=1, patch_size_t=1,
        guidance_embeds=True, text_embed_dim=TEXT_WIDTH, pooled_projection_dim=8,
        rope_axes_dim=(4, 6, 6),
    ).eval()
    pipe.register_modules(text_encoder=encoder, transformer=transformer)
    return pipe


def call_kwargs(family: str, **overrides) -> dict:
    """A small deterministic call (2 steps, 32x32, CFG with a negative prompt)."""
    kwargs = dict(prompt="a red fox in the snow", negative_prompt="blurry", num_inference_steps=2,
                  height=32, width=32, generator=torch.Generator().manual_seed(0),
                  output_type="latent")
    if family == "qwen_image":
        kwargs.update(true_cfg_scale=4.0, max_sequence_length=64)
    else:
        kwargs.update(num_frames=5, guidance_scale=6.0, true_cfg_scale=2.0, max_sequence_length=48,
                      prompt_template={"template": "<sys>describe the video</sys><user>{}</user>",
                                       "crop_start": 27})
    kwargs.update(overrides)
    return kwargs


BUILDERS = {"qwen_image": qwen_image_pipeline, "hunyuan_video": hunyuan_video_pipeline}


def ascii_tokenizer(model_max_length: int = 256):
    """A character-level tokenizer over printable ASCII (plus 4 specials and a chat
    template), so that any generated token decodes to the same text everywhere."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<unk>", "<s>", "</s>"]
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {token: i for i, token in enumerate(specials + chars)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", bos_token="<s>",
        eos_token="</s>", model_max_length=model_max_length,
    )
    wrapped.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    return wrapped


def chat_model(out_dir, seed: int = 0):
    """Save a tiny random Llama chat model (ASCII tokenizer, 2 heads of 32) to ``out_dir``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = ascii_tokenizer()
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512,
        pad_token_id=0, bos_token_id=2, eos_token_id=3, tie_word_embeddings=False,
    )).eval()
    with torch.no_grad():  # larger logits than the default init: no near-ties in greedy decoding
        model.lm_head.weight.mul_(50)
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    return model, tokenizer
