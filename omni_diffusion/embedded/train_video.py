"""Train the embedded video model (a tiny WanPipeline) from scratch, seeded.

    python -m omni_diffusion.embedded.train --kind video --out DIR --seed 0 --device cuda

The data: :func:`~.evaluate_video.moving_digit_clips` (digits crossing a 32x32 frame in 9
frames, left, right, up or down; prompts ``"a handwritten digit three moving right"``). Stages:

1. the VAE (AutoencoderKLWan: 2x spatial and 2x temporal compression, 4 latent channels) on
   5-frame windows (Wan's causal VAE reads the first frame alone, then chunks of 4 frames with
   a cache of the chunk before: a window trains both paths at half the cost of a whole clip):
   reconstruction + a small KL term;
1b. its decoder alone on whole clips (windows leave the third chunk, decoded with a non-first
   chunk's cache, worse); the latents stay as they are. Then ``latents_mean`` / ``latents_std``
   are set per channel from the latents of all clips (5 latent frames of 16x16);
2. the transformer (:data:`ARCHITECTURES`) and the UMT5 text encoder (:func:`word_tokenizer`)
   together: rectified flow matching (target ``noise - latents``, timestep ``1000 * sigma``, as
   WanPipeline calls it) on prompts encoded as WanPipeline encodes them; 10% empty prompts, so
   classifier-free guidance works.

``--vae-from DIR`` skips stage 1 and takes the VAE of a saved pipeline; ``--init DIR`` continues
a whole saved pipeline; ``--init DIR --steps 0 --decoder-steps N`` runs stage 1b alone. The result
is saved with ``save_pretrained`` (safetensors) into ``--out``. How the shipped model was trained:
``omni_diffusion/embedded/README.md``.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from .evaluate import psnr
from .evaluate_video import DIRECTIONS, moving_digit_clips, video_prompt
from .optim import optimizer_step, seed_everything

#: UMT5 prompt length: "a handwritten digit three moving right" is 6 words + </s>
TEXT_LEN = 16
Z_DIM = 4
WINDOW = 5  #: frames of a stage-1 VAE training window


#: The prompts' words: the word-level tokenizer's vocabulary after its special tokens.
PROMPT_WORDS = ("a", "handwritten", "digit", "zero", "one", "two", "three", "four", "five", "six",
                "seven", "eight", "nine", "moving", "left", "right", "up", "down")


def word_tokenizer(model_max_length: int = TEXT_LEN):
    """A word-level ``PreTrainedTokenizerFast`` over :data:`PROMPT_WORDS`, lower-cased, split on
    whitespace and punctuation: ``<pad>``=0, ``<unk>``=1 (any other word), ``<s>``=2, ``</s>``=3
    (appended), then the words. One token a word, so the text encoder need not assemble a digit's
    name from its bytes: the byte-level first model read the digit right ~12% of the time."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<unk>", "<s>", "</s>"]
    vocab = {token: i for i, token in enumerate(specials + list(PROMPT_WORDS))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A $B </s>", special_tokens=[("</s>", 3)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", bos_token="<s>",
        eos_token="</s>", model_max_length=model_max_length,
    )


#: Transformer and text-encoder sizes, by name (``--arch``). ``wide`` is the shipped one: it
#: followed the prompts best of the three (omni_diffusion/embedded/README.md).
ARCHITECTURES = {
    # patches 1x4x4 (80 tokens of 64 values), 192 wide (6 heads of 32), 4 layers
    "wide": dict(width=192, heads=6, layers=4, ffn=768, patch=(1, 4, 4), text_width=64),
    # 128 wide (4 heads of 32), patches 1x2x2: 5 x 8 x 8 = 320 tokens of 16 values, 4 layers
    "base": dict(width=128, heads=4, layers=4, ffn=512, patch=(1, 2, 2), text_width=64),
    # base at 6 layers
    "deep": dict(width=128, heads=4, layers=6, ffn=512, patch=(1, 2, 2), text_width=64),
}


def build_video_pipeline(arch: str = "wide", vae=None):
    """The untrained video pipeline (float32, CPU) of :data:`ARCHITECTURES` ``arch``; ``vae``
    (an ``AutoencoderKLWan``), when given, replaces the untrained one."""
    import diffusers
    from transformers import UMT5Config, UMT5EncoderModel

    if arch not in ARCHITECTURES:
        raise ValueError(f"arch={arch!r}: one of {', '.join(ARCHITECTURES)}")
    a = ARCHITECTURES[arch]
    if vae is None:
        vae = diffusers.AutoencoderKLWan(
            base_dim=8, z_dim=Z_DIM, dim_mult=[1, 2], num_res_blocks=1,
            temperal_downsample=[True], latents_mean=[0.0] * Z_DIM, latents_std=[1.0] * Z_DIM,
            scale_factor_temporal=2, scale_factor_spatial=2,
        )
    tokenizer = word_tokenizer(TEXT_LEN)
    text_encoder = UMT5EncoderModel(UMT5Config(
        vocab_size=len(tokenizer), d_model=a["text_width"], d_ff=2 * a["text_width"], d_kv=16,
        num_layers=2, num_heads=a["text_width"] // 16, relative_attention_num_buckets=8,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=3,
    ))
    transformer = diffusers.WanTransformer3DModel(
        patch_size=a["patch"], num_attention_heads=a["heads"], attention_head_dim=a["width"] // a["heads"],
        in_channels=Z_DIM, out_channels=Z_DIM, text_dim=a["text_width"], freq_dim=64, ffn_dim=a["ffn"],
        num_layers=a["layers"], rope_max_seq_len=32,
    )
    pipe = diffusers.WanPipeline(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=vae,
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=1.0), transformer=transformer,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _as_video(clips: torch.Tensor) -> torch.Tensor:
    """``(N, T, H, W)`` in [-1, 1] -> Wan's ``(N, 3, T, H, W)``."""
    return clips[:, None].expand(-1, 3, -1, -1, -1)


def _train_vae(vae, clips: torch.Tensor, steps: int, batch: int, log, window: int | None = None,
               decoder_only: bool = False) -> None:
    """Train ``vae`` on ``batch`` random clips a step, or on random ``window``-frame windows of
    them. ``decoder_only``: the encoder stays as it is (its latents, hence a transformer trained
    on them, stay valid), the decoder learns from posterior samples."""
    params = vae.decoder.parameters() if decoder_only else vae.parameters()
    params = list(params) + (list(vae.post_quant_conv.parameters()) if decoder_only else [])
    opt = torch.optim.AdamW(params, lr=2e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=2e-3, total_steps=steps, pct_start=0.1)
    vae.train()
    # The loss reads the decoder's raw output: AutoencoderKLWan.decode clamps to [-1, 1], and
    # a decoder that drifts below -1 everywhere (the background's value) gets no gradient
    # through the clamp and stays blank (seen: MSE stuck at the blank clip's for 300 steps).
    raw: list[torch.Tensor] = []
    hook = vae.decoder.register_forward_hook(lambda _m, _i, out: raw.append(out))
    n, frames = clips.shape[:2]
    window = window or frames
    device = vae.decoder.conv_in.weight.device  # (random draws stay on the CPU: same on any device)
    for step in range(steps):
        idx = torch.randint(0, n, (batch,))
        start = torch.randint(0, frames - window + 1, (batch,))
        x = _as_video(torch.stack([clips[i, s:s + window] for i, s in zip(idx, start)])).to(device)
        with torch.set_grad_enabled(not decoder_only):
            dist = vae.encode(x).latent_dist
        raw.clear()
        vae.decode(dist.sample())
        recon = torch.cat(raw, 2)  # the per-latent-frame decoder outputs, (B, 3, T, H, W)
        rec = torch.nn.functional.mse_loss(recon, x)
        kl = dist.kl().mean() / x[0].numel()
        optimizer_step(opt, sched, rec if decoder_only else rec + 1e-3 * kl)
        if step % 25 == 0 or step == steps - 1:
            log(f"vae{' decoder' if decoder_only else ''} step {step:5d}  mse {rec.item():.4f}  "
                f"kl {kl.item():.4f}")
    hook.remove()
    vae.eval()


def finetune_decoder(init: str | Path, out: str | Path, seed: int = 0, steps: int = 150,
                     batch: int = 8, device: str = "cpu", log=print):
    """Stage 1b alone: fine-tune the VAE decoder of the saved pipeline ``init`` on whole clips;
    the rest of the pipeline (a transformer trained on its latents too) is kept."""
    import diffusers


    start = time.time()
    pipe = diffusers.WanPipeline.from_pretrained(init).to(device)
    pipe.set_progress_bar_config(disable=True)
    clips, _, _ = moving_digit_clips(seed)
    seed_everything(seed)  # as train_video seeds this stage
    _train_vae(pipe.vae, clips, steps, batch, log, decoder_only=True)
    with torch.no_grad():
        lat = encode_clips(pipe.vae, clips[:64])
        recon = pipe.vae.decode(lat.to(device)).sample[:, 0].cpu()
    log(f"decoder fine-tuned in {time.time() - start:.0f}s; reconstruction PSNR "
        f"{psnr(recon, clips[:64]):.1f} dB")
    pipe.to("cpu").save_pretrained(out, safe_serialization=True)
    return pipe


@torch.no_grad()
def encode_clips(vae, clips: torch.Tensor, batch: int = 64) -> torch.Tensor:
    """The VAE's latent means ``(N, Z_DIM, 1 + (T - 1) // 2, H / 2, W / 2)``, on the CPU, of
    clips ``(N, T, H, W)``."""
    device = vae.decoder.conv_in.weight.device
    return torch.cat([vae.encode(_as_video(clips[i:i + batch]).to(device)).latent_dist.mode().cpu()
                      for i in range(0, len(clips), batch)])


def _train_transformer(pipe, latents: torch.Tensor, digits: torch.Tensor, dirs: torch.Tensor,
                       steps: int, batch: int, log, drop: float = 0.1, lr: float = 1e-3) -> None:
    transformer, text_encoder = pipe.transformer, pipe.text_encoder
    # prompt index: digit * 4 + direction; the last one is the empty prompt
    prompts = [video_prompt(d, m) for d in range(10) for m in DIRECTIONS] + [""]
    cond_all = digits * len(DIRECTIONS) + dirs
    params = list(transformer.parameters()) + list(text_encoder.parameters())
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.05)
    transformer.train()
    text_encoder.train()
    n = len(latents)
    device = transformer.proj_out.weight.device  # (random draws stay on the CPU)
    latents = latents.to(device)
    ema = None
    for step in range(steps):
        # the 41 prompts, encoded every step (the encoder learns) as WanPipeline encodes them
        embeds, _ = pipe.encode_prompt(prompts, do_classifier_free_guidance=False,
                                       max_sequence_length=TEXT_LEN, device=device)
        idx = torch.randint(0, n, (batch,))
        cond = cond_all[idx].clone()
        cond[torch.rand(batch) < drop] = len(prompts) - 1
        noise = torch.randn(batch, *latents.shape[1:])
        # logit-normal times mixed with uniform ones
        sigma = torch.where(torch.rand(batch) < 0.5, torch.sigmoid(torch.randn(batch)), torch.rand(batch))
        x0 = latents[idx.to(device)]
        noise, sigma = noise.to(device), sigma.to(device)
        s = sigma[:, None, None, None, None]
        xt = (1 - s) * x0 + s * noise
        pred = transformer(hidden_states=xt, timestep=sigma * 1000,
                           encoder_hidden_states=embeds[cond.to(device)], return_dict=False)[0]
        loss = optimizer_step(opt, sched, torch.nn.functional.mse_loss(pred, noise - x0), params)
        ema = loss if ema is None else 0.98 * ema + 0.02 * loss  # on the device: no sync a step
        if step % 100 == 0 or step == steps - 1:
            log(f"transformer step {step:5d}  loss {ema:.4f}")
    transformer.eval()
    text_encoder.eval()


def steps_for_budget(pipe, latents, digits, dirs, batch: int, seconds: float, log, probe: int = 30) -> int:
    """How many transformer steps of ``batch`` fit in ``seconds`` on the pipeline's device,
    timed on a copy of the pipeline (``probe`` steps after 5 warm-up ones); the pipeline itself is
    untouched, so a run given the returned count with ``--steps`` trains the same model."""
    import copy

    probe_pipe = copy.copy(pipe)
    probe_pipe.transformer = copy.deepcopy(pipe.transformer)
    probe_pipe.text_encoder = copy.deepcopy(pipe.text_encoder)
    device = pipe.transformer.proj_out.weight.device

    def run(n: int) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.time()
        _train_transformer(probe_pipe, latents, digits, dirs, n, batch, lambda _line: None)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.time() - t0

    state = torch.get_rng_state()
    run(5)
    per_step = run(probe) / probe
    torch.set_rng_state(state)
    steps = max(100, int(seconds / per_step))
    log(f"{per_step * 1e3:.1f} ms a step at batch {batch}: {steps} steps fit {seconds:.0f} s")
    return steps


def train_video(out: str | Path, seed: int = 0, vae_steps: int = 300, decoder_steps: int = 150,
                steps: int = 4490, batch: int = 256, vae_batch: int = 8,
                init: str | Path | None = None, vae_from: str | Path | None = None,
                arch: str = "wide", time_budget: float | None = None, lr: float = 1e-3,
                device: str = "cpu", log=print):
    """Build (or load ``init``), train on ``device`` and save the video pipeline; returns it.

    ``vae_from``: a saved video pipeline whose VAE (with its latent statistics) is taken as it
    is, skipping stage 1; the transformer and text encoder of ``arch`` start untrained.
    ``time_budget``: seconds for stage 2, turned into a step count (logged, replacing
    ``steps``) by :func:`steps_for_budget`. The stages are reseeded each, so the shipped
    model's separate commands (see the README) give what one command gives."""
    import diffusers

    if init is not None and vae_from is not None:
        raise ValueError("init and vae_from exclude each other: init continues a whole saved "
                         "pipeline, vae_from starts a new transformer on a saved VAE")
    if device.startswith("cuda"):
        # TF32 matmuls: the tiny model's training is launch-bound anyway, and they cost nothing
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    seed_everything(seed)
    start = time.time()
    clips, digits, dirs = moving_digit_clips(seed)
    trained_vae = False
    if init is not None:
        pipe = diffusers.WanPipeline.from_pretrained(init).to(device)
        pipe.set_progress_bar_config(disable=True)
    elif vae_from is not None:
        vae = diffusers.AutoencoderKLWan.from_pretrained(vae_from, subfolder="vae")
        pipe = build_video_pipeline(arch, vae=vae).to(device)
    else:
        pipe = build_video_pipeline(arch).to(device)
        _train_vae(pipe.vae, clips, vae_steps, vae_batch, log, window=WINDOW)
        if decoder_steps:
            seed_everything(seed)
            _train_vae(pipe.vae, clips, decoder_steps, vae_batch, log, decoder_only=True)
        trained_vae = True
    t_vae = time.time() - start
    lat = encode_clips(pipe.vae, clips)
    if trained_vae:
        mean, std = lat.mean((0, 2, 3, 4)), lat.std((0, 2, 3, 4))
        pipe.vae.register_to_config(latents_mean=[round(v, 4) for v in mean.tolist()],
                                    latents_std=[round(v, 4) for v in std.tolist()])
    cfg = pipe.vae.config
    mean = torch.tensor(cfg.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(cfg.latents_std).view(1, -1, 1, 1, 1)
    latents = (lat - mean) / std
    with torch.no_grad():
        recon = pipe.vae.decode(lat[:64].to(device)).sample[:, 0].cpu()
    log(f"vae stage {t_vae:.0f}s; latents {tuple(lat.shape[1:])}, mean {cfg.latents_mean}, "
        f"std {cfg.latents_std}; reconstruction PSNR "
        f"{psnr(recon, clips[:64]):.1f} dB; "
        f"encoded in {time.time() - start - t_vae:.0f}s")
    digits_t, dirs_t = torch.from_numpy(digits), torch.from_numpy(dirs)
    if time_budget:
        steps = steps_for_budget(pipe, latents, digits_t, dirs_t, batch, time_budget, log)
    if steps:  # (0: stage 1 alone, to be continued with ``init``)
        seed_everything(seed)
        t0 = time.time()
        _train_transformer(pipe, latents, digits_t, dirs_t, steps, batch, log, lr=lr)
        log(f"transformer trained in {time.time() - t0:.0f}s ({steps} steps of {batch}, arch "
            f"{arch!r}); total {time.time() - start:.0f}s")
    pipe.to("cpu").save_pretrained(out, safe_serialization=True)
    return pipe
