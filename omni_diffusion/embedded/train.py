"""Train the embedded digit models from scratch, seeded, on the CPU.

    python -m omni_diffusion.embedded.train --kind image --out DIR --seed 0

``--kind image`` builds a tiny FluxPipeline and trains it in three stages on scikit-learn's
handwritten digits (upsampled to 32x32):

1. the VAE (AutoencoderKL, 4x spatial downsampling, 4 latent channels): reconstruction +
   a small KL term; then its ``shift_factor``/``scaling_factor`` are set from the latents'
   mean and standard deviation;
2. the transformer (FluxTransformer2DModel, patch 1 on 2x2-packed latents: 16 tokens):
   rectified flow matching (target ``noise - latents``) on the VAE's latents, conditioned
   on the prompts ``"a handwritten digit <word>"`` (10% empty prompts, so true CFG works)
   as FluxPipeline encodes them: 2000 steps with the (random) text encoders frozen,
3. then 1000 steps with the text encoders trained too (the frozen random encoders' outputs
   differ too little between prompts: after stage 2 alone adherence was ~15%).

The shipped weights were made in two commands, stage 3 as a fine-tune of a saved stage-2
model (``--finetune-steps 0``, then ``--init STAGE2_DIR --steps 1000``); the
single command runs the same stages in one process (reseeded before stage 3).

Then it saves the pipeline with ``save_pretrained`` (safetensors) into ``--out``. To refresh
the embedded model: ``--out omni_diffusion/embedded/models/digits-image``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from .digits import digit_images, digit_prompt
from .optim import optimizer_step, seed_everything

TEXT_LEN = 32


def build_image_pipeline():
    """The untrained image pipeline (float32, CPU)."""
    import diffusers
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    from omni_diffusion.testing import VOCAB_SIZE, byte_tokenizer

    vae = diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3, block_out_channels=(16, 32, 32),
        layers_per_block=1, latent_channels=4, norm_num_groups=8, sample_size=32,
        mid_block_add_attention=False, use_quant_conv=False, use_post_quant_conv=False,
        shift_factor=0.0, scaling_factor=1.0,
    )
    clip = CLIPTextModel(CLIPTextConfig(
        vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, max_position_embeddings=TEXT_LEN, projection_dim=32,
        bos_token_id=2, eos_token_id=3, pad_token_id=0,
    ))
    t5 = T5EncoderModel(T5Config(
        vocab_size=VOCAB_SIZE, d_model=32, d_ff=64, d_kv=8, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, decoder_start_token_id=0, pad_token_id=0, eos_token_id=3,
    ))
    transformer = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=32,
        num_attention_heads=3, joint_attention_dim=32, pooled_projection_dim=32,
        guidance_embeds=False, axes_dims_rope=(8, 12, 12),
    )
    pipe = diffusers.FluxPipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=clip,
        tokenizer=byte_tokenizer(TEXT_LEN), text_encoder_2=t5, tokenizer_2=byte_tokenizer(TEXT_LEN),
        transformer=transformer,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _train_vae(vae, images: torch.Tensor, steps: int, batch: int, log) -> None:
    opt = torch.optim.AdamW(vae.parameters(), lr=2e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=2e-3, total_steps=steps, pct_start=0.1)
    vae.train()
    for step in range(steps):
        idx = torch.randint(0, len(images), (batch,))
        x = images[idx].expand(-1, 3, -1, -1)
        dist = vae.encode(x).latent_dist
        recon = vae.decode(dist.sample()).sample
        rec = torch.nn.functional.mse_loss(recon, x)
        kl = dist.kl().mean() / x[0].numel()
        optimizer_step(opt, sched, rec + 1e-3 * kl)
        if step % 100 == 0 or step == steps - 1:
            log(f"vae step {step:5d}  mse {rec.item():.4f}  kl {kl.item():.4f}")
    vae.eval()


def _train_transformer(pipe, latents: torch.Tensor, labels: torch.Tensor, steps: int, batch: int,
                       log, drop: float = 0.1, train_text: bool = False) -> None:
    transformer = pipe.transformer
    prompts = [digit_prompt(d) for d in range(10)] + [""]
    with torch.no_grad():
        embeds, pooled, text_ids = pipe.encode_prompt(prompts, prompt_2=None,
                                                      max_sequence_length=TEXT_LEN)
    params = list(transformer.parameters())
    if train_text:  # the text encoders learn too (only 11 prompts: encoded every step)
        params += list(pipe.text_encoder.parameters()) + list(pipe.text_encoder_2.parameters())
        pipe.text_encoder.train()
        pipe.text_encoder_2.train()
    n, c, h, w = latents.shape
    img_ids = pipe._prepare_latent_image_ids(n, h // 2, w // 2, "cpu", torch.float32)
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=steps, pct_start=0.05)
    transformer.train()
    ema = None
    for step in range(steps):
        if train_text:
            embeds, pooled, _ = pipe.encode_prompt(prompts, prompt_2=None, max_sequence_length=TEXT_LEN)
        idx = torch.randint(0, n, (batch,))
        x0 = latents[idx]
        cond = labels[idx].clone()
        cond[torch.rand(batch) < drop] = 10
        noise = torch.randn_like(x0)
        # logit-normal times mixed with uniform ones
        sigma = torch.where(torch.rand(batch) < 0.5, torch.sigmoid(torch.randn(batch)),
                            torch.rand(batch))
        xt = (1 - sigma[:, None, None, None]) * x0 + sigma[:, None, None, None] * noise
        packed = pipe._pack_latents(xt, batch, c, h, w)
        target = pipe._pack_latents(noise - x0, batch, c, h, w)
        pred = transformer(hidden_states=packed, timestep=sigma, pooled_projections=pooled[cond],
                           encoder_hidden_states=embeds[cond], txt_ids=text_ids, img_ids=img_ids,
                           return_dict=False)[0]
        loss = optimizer_step(opt, sched, torch.nn.functional.mse_loss(pred, target), params)
        ema = loss if ema is None else 0.98 * ema + 0.02 * loss
        if step % 200 == 0 or step == steps - 1:
            log(f"transformer step {step:5d}  loss {ema:.4f}")
    transformer.eval()
    pipe.text_encoder.eval()
    pipe.text_encoder_2.eval()


def finetune_image(init: str | Path, out: str | Path, seed: int = 0, steps: int = 1000,
                   batch: int = 128, log=print):
    """Continue training a saved image pipeline with the text encoders trainable."""
    import diffusers

    seed_everything(seed)
    start = time.time()
    pipe = diffusers.FluxPipeline.from_pretrained(init)
    pipe.set_progress_bar_config(disable=True)
    images, labels = digit_images(32)
    with torch.no_grad():
        lat = torch.cat([pipe.vae.encode(images[i:i + 256].expand(-1, 3, -1, -1)).latent_dist.mode()
                         for i in range(0, len(images), 256)])
    latents = (lat - pipe.vae.config.shift_factor) * pipe.vae.config.scaling_factor
    _train_transformer(pipe, latents, torch.from_numpy(labels), steps, batch, log, train_text=True)
    log(f"fine-tuned in {time.time() - start:.0f}s")
    pipe.save_pretrained(out, safe_serialization=True)
    return pipe


def train_image(out: str | Path, seed: int = 0, vae_steps: int = 300, steps: int = 2000,
                batch: int = 128, finetune_steps: int = 1000, log=print):
    """Build, train and save the image pipeline; returns it. After ``steps`` with the text
    encoders frozen, ``finetune_steps`` more train them too (reseeded, a fresh schedule), as
    :func:`finetune_image` does: with frozen random encoders alone the transformer did not
    learn to tell the prompts apart."""
    seed_everything(seed)
    start = time.time()
    pipe = build_image_pipeline()
    images, labels = digit_images(32)
    _train_vae(pipe.vae, images, vae_steps, 64, log)
    t_vae = time.time() - start
    with torch.no_grad():
        lat = torch.cat([pipe.vae.encode(images[i:i + 256].expand(-1, 3, -1, -1)).latent_dist.mode()
                         for i in range(0, len(images), 256)])
    shift, std = lat.mean().item(), lat.std().item()
    pipe.vae.register_to_config(shift_factor=round(shift, 4), scaling_factor=round(1 / std, 4))
    latents = (lat - pipe.vae.config.shift_factor) * pipe.vae.config.scaling_factor
    log(f"vae trained in {t_vae:.0f}s; latents {tuple(lat.shape[1:])}, shift {shift:.4f}, std {std:.4f}")
    _train_transformer(pipe, latents, torch.from_numpy(labels), steps, batch, log)
    if finetune_steps:
        seed_everything(seed)
        _train_transformer(pipe, latents, torch.from_numpy(labels), finetune_steps, batch, log,
                           train_text=True)
    log(f"transformer trained in {time.time() - start - t_vae:.0f}s; total {time.time() - start:.0f}s")
    pipe.save_pretrained(out, safe_serialization=True)
    return pipe


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kind", choices=("image", "video"), default="image")
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=None, help="transformer steps (default: the shipped run's)")
    parser.add_argument("--vae-steps", type=int, default=None)
    parser.add_argument("--finetune-steps", type=int, default=None,
                        help="stage-3 steps, text encoders trainable (default 1000; 0: none)")
    parser.add_argument("--decoder-steps", type=int, default=None,
                        help="video: stage-1b steps, the VAE decoder on whole clips (default 150)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cpu", help="video: cpu or cuda")
    parser.add_argument("--batch", type=int, default=None, help="video: transformer batch (default 256)")
    parser.add_argument("--init", default=None,
                        help="fine-tune this saved pipeline (text encoders trainable) instead")
    parser.add_argument("--vae-from", default=None,
                        help="video: take the VAE of this saved pipeline, train a new transformer")
    parser.add_argument("--arch", default=None, help="video: transformer size (train_video.ARCHITECTURES)")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="video: seconds for the transformer stage (sets --steps from a timed probe)")
    parser.add_argument("--lr", type=float, default=None, help="video: transformer learning rate (1e-3)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.kind == "video":
        from .train_video import finetune_decoder, train_video

        if args.init and args.steps == 0 and args.decoder_steps:
            finetune_decoder(args.init, args.out, seed=args.seed, steps=args.decoder_steps,
                             device=args.device)
            return
        kw = {k: v for k, v in (("steps", args.steps), ("vae_steps", args.vae_steps),
                                ("decoder_steps", args.decoder_steps), ("batch", args.batch),
                                ("vae_from", args.vae_from), ("arch", args.arch),
                                ("time_budget", args.time_budget), ("lr", args.lr))
              if v is not None}
        train_video(args.out, seed=args.seed, init=args.init, device=args.device, **kw)
        return
    if args.init:
        finetune_image(args.init, args.out, seed=args.seed,
                       **({"steps": args.steps} if args.steps else {}))
        return
    kw = {}
    if args.steps is not None:
        kw["steps"] = args.steps
    if args.vae_steps is not None:
        kw["vae_steps"] = args.vae_steps
    if args.finetune_steps is not None:
        kw["finetune_steps"] = args.finetune_steps
    train_image(args.out, seed=args.seed, **kw)


if __name__ == "__main__":
    main()
