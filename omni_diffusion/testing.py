"""Tiny diffusers pipelines with random weights, built locally (no downloads).

For tests and examples: :func:`tiny_pipeline` builds a pipeline of one family
(``"flux"``, ``"flux_kontext"``, ``"sd3"``, ``"wan"``, ``"wan22"`` (two
experts), ``"wan_i2v"`` (Wan 2.2-style image-to-video), ``"qwen_image"``, ``"hunyuan_video"``) from small configs, seeded, in
float32 on CPU: a few blocks a few dozen channels wide, so a 2-step
generation at 32x32 takes well under a second. The tokenizers are byte-level
BPE tokenizers without merges built with the ``tokenizers`` library (every
byte one token), wrapped as ``PreTrainedTokenizerFast``; they save and load
with ``save_pretrained`` / ``from_pretrained`` like any other.

:func:`tiny_call_kwargs` gives call arguments that keep a run small.
"""

from __future__ import annotations

from typing import Any

import torch

FAMILIES = ("flux", "flux_kontext", "sd3", "wan", "wan22", "wan_i2v", "qwen_image", "hunyuan_video")

#: the text encoders' vocabulary: 4 special tokens + 256 byte symbols
VOCAB_SIZE = 260


def byte_tokenizer(model_max_length: int = 16, eos: bool = True):
    """A byte-level ``PreTrainedTokenizerFast``: ``<pad>``=0, ``<unk>``=1,
    ``<s>``=2, ``</s>``=3 (appended when ``eos``), then the 256 byte symbols."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<unk>", "<s>", "</s>"]
    vocab = {token: i for i, token in enumerate(specials + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    if eos:
        tok.post_processor = processors.TemplateProcessing(
            single="$A </s>", pair="$A $B </s>", special_tokens=[("</s>", 3)]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", bos_token="<s>",
        eos_token="</s>", model_max_length=model_max_length,
    )


def _clip(hidden: int = 32, projection: bool = False, max_len: int = 16):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = CLIPTextConfig(
        vocab_size=VOCAB_SIZE, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=2, max_position_embeddings=max_len, projection_dim=hidden,
        bos_token_id=2, eos_token_id=3, pad_token_id=0,
    )
    return (CLIPTextModelWithProjection if projection else CLIPTextModel)(config)


def _t5(d_model: int = 32, umt5: bool = False):
    from transformers import T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel

    fields = dict(vocab_size=VOCAB_SIZE, d_model=d_model, d_ff=2 * d_model, d_kv=8, num_layers=2,
                  num_heads=4, relative_attention_num_buckets=8, decoder_start_token_id=0,
                  pad_token_id=0, eos_token_id=3)
    if umt5:
        return UMT5EncoderModel(UMT5Config(**fields))
    return T5EncoderModel(T5Config(**fields))


def _image_vae(latent_channels: int, shift: float | None = None):
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"), block_out_channels=(4, 8),
        layers_per_block=1, latent_channels=latent_channels, norm_num_groups=4, sample_size=32,
        use_quant_conv=False, use_post_quant_conv=False, shift_factor=shift, scaling_factor=1.0,
    )


def _flux(kontext: bool = False):
    import diffusers

    transformer = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
        guidance_embeds=True, axes_dims_rope=(4, 6, 6),
    )
    cls = diffusers.FluxKontextPipeline if kontext else diffusers.FluxPipeline
    return cls(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=_image_vae(4, shift=0.0),
        text_encoder=_clip(), tokenizer=byte_tokenizer(16), text_encoder_2=_t5(),
        tokenizer_2=byte_tokenizer(16), transformer=transformer,
    )


def _sd3():
    import diffusers

    transformer = diffusers.SD3Transformer2DModel(
        sample_size=32, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8,
        num_attention_heads=4, joint_attention_dim=32, caption_projection_dim=32,
        pooled_projection_dim=64, out_channels=4, qk_norm="rms_norm",
        dual_attention_layers=(0,),  # SD3.5 Medium's second, image-only attention
    )
    return diffusers.StableDiffusion3Pipeline(
        transformer=transformer, scheduler=diffusers.FlowMatchEulerDiscreteScheduler(),
        vae=_image_vae(4, shift=0.0), text_encoder=_clip(projection=True), tokenizer=byte_tokenizer(16),
        text_encoder_2=_clip(projection=True), tokenizer_2=byte_tokenizer(16),
        text_encoder_3=_t5(), tokenizer_3=byte_tokenizer(16),
    )


def _wan_transformer(in_channels: int = 4):
    import diffusers

    return diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=in_channels,
        out_channels=4, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2, rope_max_seq_len=32,
    )


def _wan_vae(full_structure: bool = False):
    import diffusers

    if full_structure:  # Wan's 8x spatial / 4x temporal structure, tiny widths
        return diffusers.AutoencoderKLWan(
            base_dim=3, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
            temperal_downsample=[False, True, True], latents_mean=[0.0] * 4, latents_std=[1.0] * 4,
        )
    return diffusers.AutoencoderKLWan(
        base_dim=4, z_dim=4, dim_mult=[1, 1], num_res_blocks=1, temperal_downsample=[True],
        latents_mean=[0.0] * 4, latents_std=[1.0] * 4,
    )


def _wan_i2v():
    """Wan 2.2 A14B-style image-to-video: two experts, no CLIP image encoder; the
    transformer input is latents (4) + first-frame mask (4, the temporal factor) +
    image latents (4)."""
    import diffusers

    return diffusers.WanImageToVideoPipeline(
        tokenizer=byte_tokenizer(16), text_encoder=_t5(umt5=True), vae=_wan_vae(full_structure=True),
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0), image_processor=None,
        image_encoder=None, transformer=_wan_transformer(in_channels=12),
        transformer_2=_wan_transformer(in_channels=12), boundary_ratio=0.5,
    )


def _wan(two_experts: bool = False):
    import diffusers

    vae = _wan_vae()
    extra: dict[str, Any] = {}
    if two_experts:
        extra = dict(transformer_2=_wan_transformer(), boundary_ratio=0.5)
    return diffusers.WanPipeline(
        tokenizer=byte_tokenizer(16), text_encoder=_t5(umt5=True), vae=vae,
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0),
        transformer=_wan_transformer(), **extra,
    )


def _qwen_image():
    import diffusers
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    transformer = diffusers.QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=16, guidance_embeds=False, axes_dims_rope=(8, 4, 4),
    )
    vae = diffusers.AutoencoderKLQwenImage(
        base_dim=4 * 6, z_dim=4, dim_mult=[1, 2, 4], num_res_blocks=1,
        temperal_downsample=[False, True], latents_mean=[0.0] * 4, latents_std=[1.0] * 4,
    )
    config = Qwen2_5_VLConfig(
        text_config=dict(
            hidden_size=16, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=2, vocab_size=VOCAB_SIZE,
            rope_scaling={"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
            rope_theta=1000000.0,
        ),
        vision_config=dict(depth=2, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=16),
        hidden_size=16, vocab_size=VOCAB_SIZE, image_token_id=VOCAB_SIZE - 1,
        video_token_id=VOCAB_SIZE - 1, vision_start_token_id=VOCAB_SIZE - 2,
        vision_end_token_id=VOCAB_SIZE - 3, vision_token_id=VOCAB_SIZE - 4,
    )
    text_encoder = Qwen2_5_VLForConditionalGeneration(config)
    return diffusers.QwenImagePipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=text_encoder,
        tokenizer=byte_tokenizer(64, eos=False), transformer=transformer,
    )


def _hunyuan_video():
    import diffusers
    from transformers import LlamaConfig, LlamaModel

    transformer = diffusers.HunyuanVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=2,
        num_single_layers=2, num_refiner_layers=1, patch_size=1, patch_size_t=1,
        guidance_embeds=True, text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(4, 6, 6),
    )
    vae = diffusers.AutoencoderKLHunyuanVideo(
        in_channels=3, out_channels=3, latent_channels=4,
        down_block_types=("HunyuanVideoDownBlock3D",) * 3, up_block_types=("HunyuanVideoUpBlock3D",) * 3,
        block_out_channels=(8, 8, 8), layers_per_block=1, norm_num_groups=4,
        spatial_compression_ratio=4, temporal_compression_ratio=4, mid_block_add_attention=False,
    )
    llama = LlamaModel(LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128,
        pad_token_id=0, bos_token_id=2, eos_token_id=3,
    ))
    return diffusers.HunyuanVideoPipeline(
        text_encoder=llama, tokenizer=byte_tokenizer(64, eos=False), transformer=transformer, vae=vae,
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), text_encoder_2=_clip(hidden=8, max_len=77),
        tokenizer_2=byte_tokenizer(77),
    )


_BUILDERS = {
    "flux": _flux,
    "flux_kontext": lambda: _flux(kontext=True),
    "sd3": _sd3,
    "wan": _wan,
    "wan22": lambda: _wan(two_experts=True),
    "wan_i2v": _wan_i2v,
    "qwen_image": _qwen_image,
    "hunyuan_video": _hunyuan_video,
}


def full_size_flux_transformer(device: str | torch.device = "cuda", dtype: torch.dtype = torch.bfloat16):
    """FluxTransformer2DModel at its default (FLUX.1) widths, built on ``device`` with seeded random
    weights: linears in nn.Linear's default range, norm weights 1 and biases 0; eval mode."""
    from diffusers import FluxTransformer2DModel
    from torch import nn

    with torch.device("meta"):
        model = FluxTransformer2DModel()
    model = model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear):
                bound = module.in_features ** -0.5
                module.weight.uniform_(-bound, bound, generator=gen)
                if module.bias is not None:
                    module.bias.uniform_(-bound, bound, generator=gen)
        for name, param in model.named_parameters():
            if not isinstance(model.get_submodule(name.rpartition(".")[0]), nn.Linear):
                param.fill_(1.0 if name.endswith("weight") else 0.0)
    return model.to(dtype).eval()


def full_size_flux_inputs(device: str | torch.device = "cuda", height: int = 64, width: int = 64,
                          text: int = 512, seed: int = 1) -> dict:
    """Seeded bf16 keyword inputs for :func:`full_size_flux_transformer`: ``height * width`` packed
    image tokens [1, H*W, 64], T5 text [1, text, 4096], pooled CLIP [1, 768], 3-axis image ids."""
    gen = torch.Generator(device=device).manual_seed(seed)
    rows = torch.arange(height, device=device).repeat_interleave(width)
    cols = torch.arange(width, device=device).repeat(height)
    return dict(
        hidden_states=torch.randn(1, height * width, 64, device=device, generator=gen, dtype=torch.bfloat16),
        encoder_hidden_states=torch.randn(1, text, 4096, device=device, generator=gen, dtype=torch.bfloat16),
        pooled_projections=torch.randn(1, 768, device=device, generator=gen, dtype=torch.bfloat16),
        timestep=torch.tensor([0.5], device=device, dtype=torch.bfloat16),
        img_ids=torch.stack((torch.zeros_like(rows), rows, cols), dim=-1).float(),
        txt_ids=torch.zeros(text, 3, device=device),
        return_dict=False,
    )


def tiny_flux_transformer():
    """A 1+1-block FluxTransformer2DModel (fp32, eval) and keyword inputs for one forward.

    hidden_states [1, 16, 16] (16 packed image tokens), encoder_hidden_states [1, 8, 32];
    seeded, so two calls build identical models and inputs.
    """
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    model = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(4, 6, 6),
    ).eval()
    gen = torch.Generator().manual_seed(1)
    inputs = dict(
        hidden_states=torch.randn(1, 16, 16, generator=gen),
        encoder_hidden_states=torch.randn(1, 8, 32, generator=gen),
        pooled_projections=torch.randn(1, 32, generator=gen),
        timestep=torch.tensor([0.5]),
        img_ids=torch.randn(16, 3, generator=gen),
        txt_ids=torch.zeros(8, 3),
        return_dict=False,
    )
    return model, inputs


def _text_mask(lengths: tuple[int, ...], text: int) -> torch.Tensor:
    """Bool ``[B, text]``: sample ``b``'s first ``lengths[b]`` tokens real, the rest padding."""
    if any(not 1 <= n <= text for n in lengths):
        raise ValueError(f"text_lengths {lengths}: each must be in [1, text={text}]")
    return torch.arange(text)[None, :] < torch.tensor(lengths)[:, None]


def tiny_transformer(family: str, *, heads: int = 2, grid: tuple[int, int, int] = (1, 4, 4),
                     text: int = 8, text_lengths: tuple[int, ...] = (8,), seed: int = 0, **config):
    """A small random-weight transformer of ``family`` (fp32, CPU, eval) and keyword
    inputs for one forward (``return_dict=False``); seeded, so two calls build
    identical models and inputs.

    Families: ``"qwen_image"`` (``QwenImageTransformer2DModel``, 2 blocks) and
    ``"hunyuan_video"`` (``HunyuanVideoTransformer3DModel``, 2 dual + 2 single
    blocks, 1 token-refiner block); head size 16, ``heads`` heads.

    Args:
        grid: the latent token grid after patching, ``(frames, height, width)``:
            ``frames * height * width`` image tokens (Qwen-Image: ``frames`` must be 1).
        text: text tokens per sample; ``text_lengths`` (one per sample: the batch
            size) how many of them are real. A padded sample gets a text mask
            (Qwen-Image ``encoder_hidden_states_mask``, HunyuanVideo
            ``encoder_attention_mask``, bool ``[B, text]``); none is padded: no mask
            for Qwen-Image, an all-True one for HunyuanVideo (it requires one).
        config: transformer config overrides (``zero_cond_t=True`` for Qwen-Image:
            a second, condition image of the same grid is appended to the image
            tokens; ``image_condition_type="token_replace"`` for HunyuanVideo).
    """
    import diffusers

    frames, height, width = grid
    batch = len(text_lengths)
    mask = _text_mask(tuple(text_lengths), text)
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    if family == "qwen_image":
        if frames != 1:
            raise ValueError(f"grid {grid}: Qwen-Image takes one frame")
        fields = dict(patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
                      num_attention_heads=heads, joint_attention_dim=16, axes_dims_rope=(8, 4, 4))
        model = diffusers.QwenImageTransformer2DModel(**{**fields, **config}).eval()
        shapes = [(1, height, width)] * (2 if config.get("zero_cond_t") else 1)
        tokens = sum(f * h * w for f, h, w in shapes)
        inputs = dict(
            hidden_states=torch.randn(batch, tokens, 16, generator=gen),
            encoder_hidden_states=torch.randn(batch, text, 16, generator=gen),
            encoder_hidden_states_mask=None if bool(mask.all()) else mask,
            timestep=torch.full((batch,), 0.6), img_shapes=[shapes] * batch, return_dict=False,
        )
    elif family == "hunyuan_video":
        fields = dict(in_channels=4, out_channels=4, num_attention_heads=heads, attention_head_dim=16,
                      num_layers=2, num_single_layers=2, num_refiner_layers=1, patch_size=1,
                      patch_size_t=1, guidance_embeds=True, text_embed_dim=16,
                      pooled_projection_dim=8, rope_axes_dim=(4, 6, 6))
        model = diffusers.HunyuanVideoTransformer3DModel(**{**fields, **config}).eval()
        inputs = dict(
            hidden_states=torch.randn(batch, 4, frames, height, width, generator=gen),
            timestep=torch.full((batch,), 600.0),
            encoder_hidden_states=torch.randn(batch, text, 16, generator=gen),
            encoder_attention_mask=mask, pooled_projections=torch.randn(batch, 8, generator=gen),
            guidance=torch.full((batch,), 6000.0), return_dict=False,
        )
    else:
        raise ValueError(f"tiny_transformer: family {family!r} is not one of 'qwen_image', 'hunyuan_video'")
    return model.requires_grad_(False), inputs


def tiny_pipeline(family: str, seed: int = 0):
    """A tiny pipeline of ``family`` (see :data:`FAMILIES`), float32, on CPU, eval mode."""
    if family not in _BUILDERS:
        raise ValueError(f"unknown family {family!r}; one of {', '.join(FAMILIES)}")
    torch.manual_seed(seed)
    pipe = _BUILDERS[family]()
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            component.eval()
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _t5_embeds(pipe, text: str, length: int = 16) -> torch.Tensor:
    """Text embeddings as Wan's pipelines make them, without their ftfy-based prompt cleaning."""
    ids = pipe.tokenizer(text, padding="max_length", max_length=length, truncation=True,
                         add_special_tokens=True, return_attention_mask=True, return_tensors="pt")
    with torch.no_grad():
        return pipe.text_encoder(ids.input_ids, ids.attention_mask).last_hidden_state


#: tiny_call_kwargs overrides for a 16x16 call (a quarter of the default 32x32's image tokens), for
#: tests whose kernels run in Triton's interpreter one token a program (the fused QK-norm + RoPE):
#: at 32x32 a tiny HunyuanVideo's took ~100 s of a 2-core CI machine, a Flux's ~50 s
SMALL_CALL = {"height": 16, "width": 16}


def tiny_call_kwargs(family: str, steps: int = 3, seed: int = 0, cfg: bool = True, pipe: Any = None,
                     **overrides) -> dict:
    """Arguments for a small, deterministic call of a :func:`tiny_pipeline`.

    ``cfg=True`` makes the families that can run classifier-free guidance run
    it (SD3 batched, Wan / Qwen-Image / Flux / HunyuanVideo as separate calls
    with a negative prompt), so caching sees more than one branch. ``pipe``:
    for ``"wan_i2v"`` without the ``ftfy`` package (which Wan's image-to-video
    prompt cleaning needs), the prompts are encoded here with its text encoder.
    """
    kwargs: dict[str, Any] = dict(
        prompt="a red fox in the snow", num_inference_steps=steps, height=32, width=32,
        generator=torch.Generator().manual_seed(seed), output_type="latent",
    )
    if family in ("flux", "flux_kontext"):
        kwargs.update(max_sequence_length=16, guidance_scale=3.5)
        if cfg:
            kwargs.update(negative_prompt="blurry", true_cfg_scale=2.0)
        if family == "flux_kontext":
            from PIL import Image

            kwargs.update(image=Image.new("RGB", (32, 32), (120, 60, 30)), max_area=32 * 32,
                          _auto_resize=False)
    elif family == "sd3":
        kwargs.update(max_sequence_length=16, guidance_scale=5.0 if cfg else 1.0,
                      negative_prompt="blurry")
    elif family in ("wan", "wan22", "wan_i2v"):
        kwargs.update(num_frames=5, max_sequence_length=16, guidance_scale=4.0 if cfg else 1.0,
                      negative_prompt="blurry")
        if family in ("wan22", "wan_i2v"):
            kwargs.update(guidance_scale_2=3.0 if cfg else 1.0)
        if family == "wan_i2v":
            import importlib.util

            from PIL import Image

            kwargs.update(image=Image.new("RGB", (32, 32), (40, 90, 160)))
            if importlib.util.find_spec("ftfy") is None:
                if pipe is None:
                    raise ValueError("wan_i2v without ftfy: pass pipe= to encode the prompts")
                prompt = overrides.pop("prompt", kwargs.pop("prompt"))
                kwargs.update(prompt_embeds=_t5_embeds(pipe, prompt),
                              negative_prompt_embeds=_t5_embeds(pipe, kwargs.pop("negative_prompt")))
    elif family == "qwen_image":
        kwargs.update(max_sequence_length=16, true_cfg_scale=4.0 if cfg else 1.0,
                      negative_prompt="blurry")
    elif family == "hunyuan_video":
        kwargs.update(num_frames=5, max_sequence_length=16, guidance_scale=6.0,
                      prompt_template={"template": "{}", "crop_start": 0})
        if cfg:
            kwargs.update(negative_prompt="blurry", true_cfg_scale=2.0)
    kwargs.update(overrides)
    return kwargs


def output_tensor(result: Any) -> torch.Tensor:
    """The images/frames tensor of a pipeline output (``output_type="latent"``/``"pt"``)."""
    for name in ("images", "frames"):
        value = getattr(result, name, None)
        if value is not None:
            return value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
    raise TypeError(f"no images/frames in {type(result).__name__}")


__all__ = ["FAMILIES", "byte_tokenizer", "output_tensor", "tiny_call_kwargs", "tiny_pipeline",
           "tiny_transformer"]
