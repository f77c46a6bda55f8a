"""The embedded video model: its training clips, the motion-direction scorer, loading, adherence."""

import numpy as np
import pytest
import torch

pytest.importorskip("sklearn")

from omni_diffusion import embedded  # noqa: E402
from omni_diffusion.embedded import evaluate_video as ev  # noqa: E402


def _held_out_digits(n: int, seed: int = 1):
    """``n`` digit images (16x16) and labels drawn from the frame classifier's test split."""
    from sklearn.model_selection import train_test_split

    images, labels = ev.digit_images(ev.DIGIT)
    _, test = train_test_split(np.arange(len(labels)), test_size=0.25, random_state=0, stratify=labels)
    pick = np.random.default_rng(seed).choice(test, n, replace=False)
    return images[pick, 0], labels[pick]


def test_prompts_and_clip_geometry():
    assert ev.video_prompt(3, "right") == "a handwritten digit three moving right"
    with pytest.raises(ValueError, match="direction 'sideways'"):
        ev.video_prompt(3, "sideways")
    digit = torch.ones(ev.DIGIT, ev.DIGIT)
    with pytest.raises(ValueError, match="offset=20"):
        ev.render_clip(digit, "up", offset=20)
    with pytest.raises(ValueError, match="frames=12"):
        ev.render_clip(digit, "up", frames=12)
    clip = ev.render_clip(digit, "right", offset=5)
    assert clip.shape == (ev.FRAMES, ev.SIZE, ev.SIZE)
    # a solid square: its centroid moves 2 pixels a frame to the right, 5 + 7.5 from the top
    cent = ev.ink_centroids(clip[None])[0]
    assert torch.allclose(cent[:, 0], torch.arange(ev.FRAMES) * 2.0 + 7.5)
    assert torch.allclose(cent[:, 1], torch.full((ev.FRAMES,), 12.5))
    down = ev.ink_centroids(ev.render_clip(digit, "down")[None])[0]
    assert torch.allclose(down[:, 1], torch.arange(ev.FRAMES) * 2.0 + 7.5)


def test_training_clips():
    clips, digits, dirs = ev.moving_digit_clips(seed=0)
    assert clips.shape == (4 * 1797, ev.FRAMES, ev.SIZE, ev.SIZE) and clips.dtype == torch.float32
    assert clips.min() >= -1 and clips.max() <= 1
    assert np.bincount(dirs).tolist() == [1797] * 4
    assert ev.motion_direction(ev.ink_centroids(clips[::97])) == [ev.DIRECTIONS[d] for d in dirs[::97]]
    again, _, _ = ev.moving_digit_clips(seed=0)
    assert torch.equal(clips[::500], again[::500])


def test_direction_reads_motion_and_refuses_stillness():
    images, _ = _held_out_digits(8)
    for direction, opposite in (("left", "right"), ("up", "down")):
        clips = torch.stack([ev.render_clip(im, direction) for im in images])
        assert ev.motion_direction(ev.ink_centroids(clips)) == [direction] * 8
        assert ev.motion_direction(ev.ink_centroids(clips.flip(1))) == [opposite] * 8
    still = torch.stack([ev.render_clip(im, "left")[:1].expand(ev.FRAMES, -1, -1) for im in images])
    assert ev.motion_direction(ev.ink_centroids(still)) == [None] * 8
    # diagonal motion (as fast across as along) is not one of the four directions
    diag = torch.full((1, ev.FRAMES, ev.SIZE, ev.SIZE), -1.0)
    for t in range(ev.FRAMES):
        diag[0, t, 2 * t:2 * t + 8, 2 * t:2 * t + 8] = 1.0
    assert ev.motion_direction(ev.ink_centroids(diag)) == [None]
    blank = torch.full((1, ev.FRAMES, ev.SIZE, ev.SIZE), -1.0)
    assert ev.motion_direction(ev.ink_centroids(blank)) == [None]


def test_scorer_on_held_out_clips():
    clf = ev.frame_digit_classifier()
    assert clf.test_accuracy >= 0.95
    images, labels = _held_out_digits(40)
    dirs = [ev.DIRECTIONS[i % 4] for i in range(40)]
    clips = torch.stack([ev.render_clip(im, m, offset=6 + i % 5)
                         for i, (im, m) in enumerate(zip(images, dirs))])
    assert ev.video_adherence(clips, labels, dirs) >= 0.9
    # the scorer reads diffusers' output forms alike: (N, T, C, H, W) in [0, 1] and PIL frames
    pt = ((clips[:4, :, None] + 1) / 2).expand(-1, -1, 3, -1, -1)
    assert torch.allclose(ev.to_clips(pt), clips[:4], atol=1e-6)
    from PIL import Image

    pil = [[Image.fromarray((f.numpy() * 255).round().astype(np.uint8)) for f in clip[:, 0]]
           for clip in pt]
    assert torch.allclose(ev.to_clips(pil), clips[:4], atol=2 / 255)  # 8-bit rounding
    # the wrong digit or direction in the prompt is caught
    assert ev.video_adherence(clips, (labels + 1) % 10, dirs) <= 0.1
    assert ev.video_adherence(clips.flip(1), labels, dirs) == 0.0


def test_embedded_video_path_and_size():
    path = embedded.embedded_pipeline_path("video")
    assert (path / "model_index.json").is_file()
    assert len(sorted(path.glob("*/*.safetensors"))) == 3  # vae, text encoder, transformer
    models = path.parent
    total = sum(f.stat().st_size for f in models.rglob("*") if f.is_file())
    assert total <= 20 * 2**20  # image + video, in the repository


@pytest.fixture(scope="module")
def video_pipe():
    return embedded.load_embedded_pipeline("video")  # WanPipeline.from_pretrained(its folder)


def test_video_pipeline_generates(video_pipe):
    assert type(video_pipe.vae).__name__ == "AutoencoderKLWan"
    assert type(video_pipe.transformer).__name__ == "WanTransformer3DModel"
    out = video_pipe("a handwritten digit seven moving up", num_inference_steps=2, output_type="pt",
                     generator=torch.Generator().manual_seed(0), **embedded.VIDEO_CALL_KWARGS)
    assert out.frames.shape == (1, 9, 3, 32, 32)
    assert torch.isfinite(out.frames).all()
    assert type(video_pipe).__name__ == "WanPipeline"


def test_video_adherence(video_pipe):
    # 16 clips, each digit-direction pair different, at the default number of steps, seeded
    # (over 100 clips the shipped model reads right 95%: omni_diffusion/embedded/README.md)
    digits = [i % 10 for i in range(16)]
    directions = [ev.DIRECTIONS[i % 4] for i in range(16)]
    clips = ev.generate_videos(video_pipe, digits, directions, seed=0)
    assert clips.shape == (16, 9, 32, 32)
    assert ev.video_adherence(clips, digits, directions) >= 0.8
    # the prompt steers it: the same seeds with every prompt's digit shifted by one read wrong
    wrong = [(d + 1) % 10 for d in digits]
    assert ev.video_adherence(clips, wrong, directions) <= 0.2


def test_word_tokenizer_and_architectures():
    from omni_diffusion.embedded import train_video as tv

    tok = tv.word_tokenizer()
    ids = tok("A handwritten digit THREE moving right, sideways").input_ids
    words = ["a", "handwritten", "digit", "three", "moving", "right"]
    assert ids == [4 + tv.PROMPT_WORDS.index(w) for w in words] + [1, 1, 3]  # ',' and 'sideways' unknown, </s>
    padded = tok("a digit", padding="max_length", max_length=tv.TEXT_LEN).input_ids
    assert len(padded) == tv.TEXT_LEN and padded[3:] == [0] * (tv.TEXT_LEN - 3)
    with pytest.raises(ValueError, match="arch='huge': one of wide, base, deep"):
        tv.build_video_pipeline("huge")
    with pytest.raises(ValueError, match="init and vae_from exclude each other"):
        tv.train_video("unused", init="a", vae_from="b")


def test_serve_worker_uses_the_trained_frame_count(video_pipe):
    """omni-serve's worker fills what a request leaves unset from the embedded model's
    call arguments: 9 frames, not WanPipeline's 81."""
    worker = pytest.importorskip("omni_serve.worker")
    params = dict(prompt="a handwritten digit two moving left", height=32, width=32, seed=0, n=1,
                  negative_prompt=None, num_inference_steps=None, guidance_scale=None, num_frames=None)
    defaults = embedded.CALL_KWARGS["video"]
    kwargs = worker._call_kwargs(video_pipe, "video", [("job", params)], None, defaults)
    assert kwargs["num_frames"] == 9 and kwargs["max_sequence_length"] == 16
    params["num_frames"] = 5
    assert worker._call_kwargs(video_pipe, "video", [("job", params)], None, defaults)["num_frames"] == 5


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_training_stages_run_and_learn(device):
    """Each training stage on 16 clips: the VAE's and the transformer's losses fall, the latents
    have the pipeline's shape. (The full run: python -m omni_diffusion.embedded.train --kind video.)"""
    from omni_diffusion.embedded import train_video as tv

    torch.manual_seed(0)
    images, labels = _held_out_digits(16)
    clips = torch.stack([ev.render_clip(im, ev.DIRECTIONS[i % 4]) for i, im in enumerate(images)])
    pipe = tv.build_video_pipeline().to(device)
    losses = []
    tv._train_vae(pipe.vae, clips, 12, 4, losses.append, window=tv.WINDOW)
    tv._train_vae(pipe.vae, clips, 2, 4, losses.append, decoder_only=True)
    mse = [float(line.split("mse")[1].split()[0]) for line in losses]
    assert mse[-3] < 0.7 * mse[0]
    lat = tv.encode_clips(pipe.vae, clips)
    assert lat.shape == (16, tv.Z_DIM, 5, 16, 16) and lat.device.type == "cpu"
    lat = (lat - lat.mean()) / lat.std()
    log = []
    dirs = torch.tensor([i % 4 for i in range(16)])
    tv._train_transformer(pipe, lat, torch.from_numpy(labels), dirs, 30, 8, log.append)
    first, last = (float(line.split("loss")[1]) for line in (log[0], log[-1]))
    assert last < first
