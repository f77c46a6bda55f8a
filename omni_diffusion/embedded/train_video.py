"""Train the embedded video model (a tiny WanPipeline) from scratch, seeded, on the CPU.

    python -m omni_diffusion.embedded.train --kind video --out DIR --seed 0

The data: :func:`~.evaluate_video.moving_digit_clips`, scikit-learn's digits crossing a 32x32
frame in 9 frames, to the left, right, up or down; prompts ``"a handwritten digit three
moving right"``. Two stages:

1. the VAE (AutoencoderKLWan: 2x spatial and 2x temporal compression, 4 latent channels) on
   5-frame windows of the clips (Wan's causal VAE reads the first frame alone, then chunks of 4
   frames with a cache of the chunk before: a window trains both paths at about half the cost
   of a whole clip): reconstruction + a small KL term;
1b. its decoder alone on whole clips (after 5-frame windows the third chunk, decoded with the
   cache of a non-first chunk, came out worse: 18 dB against 23, and 17% fewer digits read
   right); the encoder, hence the latents, stay as they are. Then ``latents_mean`` /
   ``latents_std`` are set per channel from the latents of all clips (9 frames -> 5 latent
   frames of 16x16);
2. the transformer (WanTransformer3DModel, patches 1x4x4: 80 tokens) and the UMT5 text encoder
   together (trained from the start: the image model showed that a random frozen encoder
   barely separates the prompts), rectified flow matching (target ``noise - latents``,
   timestep ``1000 * sigma``, as WanPipeline calls it) with the prompts encoded as
   WanPipeline encodes them; 10% empty prompts, so classifier-free guidance works.

``--init DIR`` skips stage 1 and takes the VAE (and the text encoder, transformer) of a saved
pipeline; ``--init DIR --steps 0 --decoder-steps N`` runs stage 1b alone on a saved pipeline. The result is saved with ``save_pretrained`` (safetensors) into ``--out``.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from .evaluate import psnr
from .evaluate_video import DIRECTIONS, moving_digit_clips, video_prompt
from .train import _seed, optimizer_step

#: UMT5 prompt length: "a handwritten digit three moving right" is 38 bytes + </s>
TEXT_LEN = 48
Z_DIM = 4
WINDOW = 5  #: frames of a stage-1 VAE training window


def build_video_pipeline():
    """The untrained video pipeline (float32, CPU)."""
    import diffusers
    from transformers import UMT5Config, UMT5EncoderModel

    from omni_diffusion.testing import VOCAB_SIZE, byte_tokenizer

    vae = diffusers.AutoencoderKLWan(
        base_dim=8, z_dim=Z_DIM, dim_mult=[1, 2], num_res_blocks=1,
        temperal_downsample=[True], latents_mean=[0.0] * Z_DIM, latents_std=[1.0] * Z_DIM,
        scale_factor_temporal=2, scale_factor_spatial=2,
    )
    text_encoder = UMT5EncoderModel(UMT5Config(
        vocab_size=VOCAB_SIZE, d_model=32, d_ff=64, d_kv=8, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, decoder_start_token_id=0, pad_token_id=0, eos_token_id=3,
    ))
    transformer = diffusers.WanTransformer3DModel(
        patch_size=(1, 4, 4), num_attention_heads=4, attention_head_dim=16, in_channels=Z_DIM,
        out_channels=Z_DIM, text_dim=32, freq_dim=64, ffn_dim=128, num_layers=3, rope_max_seq_len=32,
    )
    pipe = diffusers.WanPipeline(
        tokenizer=byte_tokenizer(TEXT_LEN), text_encoder=text_encoder, vae=vae,
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
    _seed(seed)  # as train_video seeds this stage
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
                       steps: int, batch: int, log, drop: float = 0.1) -> None:
    transformer, text_encoder = pipe.transformer, pipe.text_encoder
    # prompt index: digit * 4 + direction; the last one is the empty prompt
    prompts = [video_prompt(d, m) for d in range(10) for m in DIRECTIONS] + [""]
    cond_all = digits * len(DIRECTIONS) + dirs
    params = list(transformer.parameters()) + list(text_encoder.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=steps, pct_start=0.05)
    transformer.train()
    text_encoder.train()
    n = len(latents)
    device = transformer.proj_out.weight.device  # (random draws stay on the CPU)
    ema = None
    for step in range(steps):
        # the 41 prompts, encoded every step (the encoder learns) as WanPipeline encodes them
        embeds, _ = pipe.encode_prompt(prompts, do_classifier_free_guidance=False,
                                       max_sequence_length=TEXT_LEN, device=device)
        idx = torch.randint(0, n, (batch,))
        x0 = latents[idx]
        cond = cond_all[idx].clone()
        cond[torch.rand(batch) < drop] = len(prompts) - 1
        noise = torch.randn_like(x0)
        # logit-normal times mixed with uniform ones
        sigma = torch.where(torch.rand(batch) < 0.5, torch.sigmoid(torch.randn(batch)), torch.rand(batch))
        s = sigma[:, None, None, None, None]
        x0, noise, s, sigma = x0.to(device), noise.to(device), s.to(device), sigma.to(device)
        xt = (1 - s) * x0 + s * noise
        pred = transformer(hidden_states=xt, timestep=sigma * 1000,
                           encoder_hidden_states=embeds[cond.to(device)], return_dict=False)[0]
        loss = optimizer_step(opt, sched, torch.nn.functional.mse_loss(pred, noise - x0), params)
        ema = loss if ema is None else 0.98 * ema + 0.02 * loss
        if step % 100 == 0 or step == steps - 1:
            log(f"transformer step {step:5d}  loss {ema:.4f}")
    transformer.eval()
    text_encoder.eval()


def train_video(out: str | Path, seed: int = 0, vae_steps: int = 300, decoder_steps: int = 150,
                steps: int = 3000, batch: int = 32, vae_batch: int = 8,
                init: str | Path | None = None, device: str = "cpu", log=print):
    """Build (or load ``init``), train on ``device`` and save the video pipeline; returns it.
    The stages are reseeded each, so the shipped model's separate commands (see the README)
    give what one command gives."""
    import diffusers

    _seed(seed)
    start = time.time()
    clips, digits, dirs = moving_digit_clips(seed)
    if init is None:
        pipe = build_video_pipeline().to(device)
        _train_vae(pipe.vae, clips, vae_steps, vae_batch, log, window=WINDOW)
        if decoder_steps:
            _seed(seed)
            _train_vae(pipe.vae, clips, decoder_steps, vae_batch, log, decoder_only=True)
    else:
        pipe = diffusers.WanPipeline.from_pretrained(init).to(device)
        pipe.set_progress_bar_config(disable=True)
    t_vae = time.time() - start
    lat = encode_clips(pipe.vae, clips)
    if init is None:
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
    if steps:  # (0: stage 1 alone, to be continued with ``init``)
        _seed(seed)
        t0 = time.time()
        _train_transformer(pipe, latents, torch.from_numpy(digits), torch.from_numpy(dirs), steps,
                           batch, log)
        log(f"transformer trained in {time.time() - t0:.0f}s; total {time.time() - start:.0f}s")
    pipe.to("cpu").save_pretrained(out, safe_serialization=True)
    return pipe
