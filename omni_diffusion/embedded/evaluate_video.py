"""Data and scoring of the embedded video model: handwritten digits moving in a stated direction.

- :func:`moving_digit_clips` makes the clips the model is trained on: each of scikit-learn's
  1797 digits (16x16, bilinear from 8x8) crossing a 32x32 black canvas, 2 pixels a frame, to
  the ``"left"``, ``"right"``, ``"up"`` or ``"down"``; :func:`video_prompt` gives the prompt,
  ``"a handwritten digit three moving right"``.
- :func:`score_clips` reads each generated clip: the digit (:class:`FrameDigitClassifier` on
  the 16x16 window of most ink in each frame, majority vote over the frames) and the
  direction of motion (least-squares slope of the ink centroid over the frames).
  :func:`video_adherence` is the fraction of clips showing the prompted digit moving in the
  prompted direction.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F

from .digits import digit_images, digit_prompt, pooled_features

DIRECTIONS = ("left", "right", "up", "down")
#: (dx, dy) per direction, in pixels per frame (y grows downwards)
_STEP = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}

FRAMES = 9  #: frames of a training clip (Wan's VAE: 1 + a multiple of its temporal factor)
SIZE = 32  #: frame height and width
DIGIT = 16  #: digit height and width inside the frame
SPEED = 2  #: pixels a frame: the digit crosses the frame ((SIZE - DIGIT) / (FRAMES - 1))
#: slowest centroid speed (pixels a frame) read as motion, and how far the main axis' speed
#: must exceed the other's
MIN_SPEED = 0.5
AXIS_RATIO = 2.0


def video_prompt(digit: int, direction: str) -> str:
    """``"a handwritten digit three moving right"``."""
    if direction not in DIRECTIONS:
        raise ValueError(f"direction {direction!r}: one of {', '.join(DIRECTIONS)}")
    return f"{digit_prompt(digit)} moving {direction}"


def _positions(direction: str, offset: int, frames: int) -> list[tuple[int, int]]:
    """Top-left corners ``(x, y)`` of the digit in each frame: from one edge to the other along
    the motion, ``offset`` pixels from the top (left) across it."""
    dx, dy = _STEP[direction]
    span = SPEED * (frames - 1)
    start = 0 if dx + dy > 0 else span
    along = [start + (dx + dy) * SPEED * t for t in range(frames)]
    return [(a, offset) if dx else (offset, a) for a in along]


def render_clip(digit_image: torch.Tensor, direction: str, offset: int = (SIZE - DIGIT) // 2,
                frames: int = FRAMES) -> torch.Tensor:
    """One clip ``(frames, SIZE, SIZE)`` float32 in [-1, 1] (background -1): ``digit_image``
    ``(DIGIT, DIGIT)`` in [-1, 1] moving in ``direction``, ``offset`` pixels across the motion."""
    if SPEED * (frames - 1) > SIZE - DIGIT:
        raise ValueError(f"frames={frames}: at most {(SIZE - DIGIT) // SPEED + 1} fit the frame")
    if not 0 <= offset <= SIZE - DIGIT:
        raise ValueError(f"offset={offset}: 0..{SIZE - DIGIT}")
    clip = torch.full((frames, SIZE, SIZE), -1.0)
    for t, (x, y) in enumerate(_positions(direction, offset, frames)):
        clip[t, y:y + DIGIT, x:x + DIGIT] = digit_image
    return clip


def moving_digit_clips(seed: int = 0, frames: int = FRAMES, jitter: int = 2):
    """Every digit of ``load_digits`` in each of the 4 directions: clips ``(7188, frames, 32, 32)``
    float32 in [-1, 1], digit labels ``(7188,)`` int64 and direction indices into
    :data:`DIRECTIONS` ``(7188,)`` int64. The digit's place across the motion is the centre
    +- ``jitter`` pixels, drawn with ``seed``."""
    images, labels = digit_images(DIGIT)
    rng = np.random.default_rng(seed)
    centre = (SIZE - DIGIT) // 2
    clips, digits, dirs = [], [], []
    for d, direction in enumerate(DIRECTIONS):
        offsets = rng.integers(centre - jitter, centre + jitter + 1, size=len(images))
        for image, label, offset in zip(images[:, 0], labels, offsets):
            clips.append(render_clip(image, direction, int(offset), frames))
            digits.append(label)
            dirs.append(d)
    return torch.stack(clips), np.asarray(digits, dtype=np.int64), np.asarray(dirs, dtype=np.int64)


def to_clips(frames) -> torch.Tensor:
    """WanPipeline output as ``(N, T, H, W)`` float32 in [-1, 1]: ``output_type="pt"`` or ``"np"``
    (``(N, T, C, H, W)`` / ``(N, T, H, W, C)`` in [0, 1]) or a list of clips of PIL images."""
    if isinstance(frames, (list, tuple)) and frames and isinstance(frames[0], (list, tuple)):
        arr = np.stack([[np.asarray(im.convert("L"), dtype=np.float32) / 255.0 for im in clip]
                        for clip in frames])
        return torch.from_numpy(arr) * 2 - 1
    x = torch.as_tensor(np.asarray(frames) if not isinstance(frames, torch.Tensor) else frames)
    x = x.detach().float().cpu()
    if x.ndim != 5:
        raise ValueError(f"frames of shape {tuple(x.shape)}: expected (N, T, C, H, W) or (N, T, H, W, C)")
    if x.shape[2] not in (1, 3):
        x = x.permute(0, 1, 4, 2, 3)
    return (x.mean(2) * 2 - 1).clamp(-1, 1)


def ink_centroids(clips: torch.Tensor) -> torch.Tensor:
    """Ink-weighted centroids ``(N, T, 2)`` (x, y in pixels) of clips ``(N, T, H, W)`` in [-1, 1];
    ink is brightness above a fifth of the range, so a faint background does not pull the
    centroid to the middle. A frame without ink gives NaN."""
    ink = ((clips + 1) / 2 - 0.2).clamp(min=0)
    _, _, h, w = clips.shape
    total = ink.sum((2, 3))
    ys = torch.arange(h, dtype=ink.dtype)[:, None]
    xs = torch.arange(w, dtype=ink.dtype)[None, :]
    cx = (ink * xs).sum((2, 3)) / total
    cy = (ink * ys).sum((2, 3)) / total
    return torch.stack([cx, cy], -1).where(total[..., None] > 0, torch.nan)


def motion_direction(centroids: torch.Tensor) -> list[str | None]:
    """The direction of each trajectory ``(N, T, 2)``: the least-squares velocity's main axis and
    sign; None when it is slower than :data:`MIN_SPEED` pixels a frame, not :data:`AXIS_RATIO`
    times faster along that axis than across it, or a frame has no ink."""
    n, t, _ = centroids.shape
    times = torch.arange(t, dtype=centroids.dtype)
    times = times - times.mean()
    velocity = ((centroids - centroids.mean(1, keepdim=True)) * times[None, :, None]).sum(1) \
        / (times**2).sum()
    out: list[str | None] = []
    for (vx, vy), ok in zip(velocity.tolist(), torch.isfinite(centroids).all(2).all(1).tolist()):
        fast, slow = (abs(vx), abs(vy)) if abs(vx) >= abs(vy) else (abs(vy), abs(vx))
        if not ok or fast < MIN_SPEED or fast < AXIS_RATIO * slow:
            out.append(None)
        elif abs(vx) >= abs(vy):
            out.append("right" if vx > 0 else "left")
        else:
            out.append("down" if vy > 0 else "up")
    return out


def _window_crops(frames: torch.Tensor) -> torch.Tensor:
    """The ``DIGIT x DIGIT`` window holding the most ink of each frame ``(M, H, W)`` in [-1, 1]:
    ``(M, DIGIT, DIGIT)``."""
    ink = F.avg_pool2d((frames[:, None] + 1) / 2, DIGIT, stride=1)[:, 0]  # (M, H-15, W-15)
    best = ink.flatten(1).argmax(1)
    ys, xs = best // ink.shape[-1], best % ink.shape[-1]
    return torch.stack([f[y:y + DIGIT, x:x + DIGIT] for f, y, x in zip(frames, ys, xs)])


class FrameDigitClassifier:
    """An SVM (RBF kernel) reading the digit of one video frame, on the window of most ink
    (pooled to 8x8). It is trained on frames of rendered clips of the same 75% of ``load_digits``
    as :class:`~.evaluate.DigitClassifier` (one random direction and place per digit, 3 random
    frames each), so it knows how the window falls on a digit: the image classifier alone,
    shift-sensitive, reads 94% of such windows right. ``test_accuracy``: on frames of clips of
    the other 25%."""

    def __init__(self, seed: int = 0):
        from sklearn.model_selection import train_test_split
        from sklearn.svm import SVC

        images, labels = digit_images(DIGIT)
        index = np.arange(len(labels))
        train, test = train_test_split(index, test_size=0.25, random_state=seed, stratify=labels)
        rng = np.random.default_rng(seed)

        def frames_of(indices):
            crops, ys = [], []
            for i in indices:
                direction = DIRECTIONS[rng.integers(4)]
                offset = int(rng.integers(0, SIZE - DIGIT + 1))
                clip = render_clip(images[i, 0], direction, offset)
                crops.append(_window_crops(clip[rng.choice(FRAMES, 3, replace=False)]))
                ys += [labels[i]] * 3
            return pooled_features(torch.cat(crops)), np.asarray(ys)

        x_tr, y_tr = frames_of(train)
        x_te, y_te = frames_of(test)
        self.model = SVC(gamma="scale", C=10.0).fit(x_tr, y_tr)
        self.test_accuracy = float((self.model.predict(x_te) == y_te).mean())

    def predict(self, frames: torch.Tensor) -> np.ndarray:
        """The digit of each frame ``(M, H, W)`` in [-1, 1]: ``(M,)`` int64."""
        return self.model.predict(pooled_features(_window_crops(frames)))


@lru_cache(maxsize=2)
def frame_digit_classifier(seed: int = 0) -> FrameDigitClassifier:
    """A cached :class:`FrameDigitClassifier`."""
    return FrameDigitClassifier(seed)


def frame_digits(clips: torch.Tensor) -> np.ndarray:
    """The digit ``(N, T)`` of each frame of clips ``(N, T, H, W)`` in [-1, 1]."""
    n, t, h, w = clips.shape
    return frame_digit_classifier().predict(clips.reshape(n * t, h, w)).reshape(n, t)


def score_clips(clips) -> tuple[np.ndarray, list[str | None]]:
    """The digit (per-frame majority vote) ``(N,)`` and the direction of each clip (any form
    :func:`to_clips` takes, or ``(N, T, H, W)`` in [-1, 1])."""
    clips = clips if isinstance(clips, torch.Tensor) and clips.ndim == 4 else to_clips(clips)
    per_frame = frame_digits(clips)
    digits = np.array([np.bincount(row, minlength=10).argmax() for row in per_frame])
    return digits, motion_direction(ink_centroids(clips))


def video_hits(clips, digits, directions) -> tuple[np.ndarray, np.ndarray]:
    """Per clip, whether it reads as the prompted digit and whether it moves in the prompted
    direction: two boolean arrays ``(N,)``."""
    got_digits, got_dirs = score_clips(clips)
    digit_ok = np.asarray(got_digits) == np.asarray(digits)
    direction_ok = np.asarray([g == d for g, d in zip(got_dirs, directions)], dtype=bool)
    return digit_ok, direction_ok


def video_adherence(clips, digits, directions) -> float:
    """The fraction of clips read as the prompted digit moving in the prompted direction."""
    digit_ok, direction_ok = video_hits(clips, digits, directions)
    return float(np.mean(digit_ok & direction_ok))


def video_targets(n: int) -> tuple[list[int], list[str]]:
    """``n`` (digit, direction) targets covering the 40 pairs in turn: digits 0..9 cycling, the
    direction advancing every 10."""
    return [i % 10 for i in range(n)], [DIRECTIONS[(i // 10) % 4] for i in range(n)]


def generate_videos(pipe, digits, directions, steps: int | None = None, seed: int = 0,
                    batch: int = 20, **kwargs) -> torch.Tensor:
    """Clips ``(N, T, 32, 32)`` in [-1, 1] for the prompts of ``digits`` x ``directions``, one
    seeded generator per call. ``steps=None`` keeps the pipeline's default number of steps;
    the other call arguments default to :data:`~omni_diffusion.embedded.VIDEO_CALL_KWARGS`."""
    from . import VIDEO_CALL_KWARGS

    call = dict(VIDEO_CALL_KWARGS, output_type="pt")
    call.update(kwargs)
    if steps is not None:
        call["num_inference_steps"] = steps
    generator = torch.Generator().manual_seed(seed)
    prompts = [video_prompt(d, m) for d, m in zip(digits, directions)]
    out = []
    for i in range(0, len(prompts), batch):
        with torch.no_grad():
            out.append(to_clips(pipe(prompt=prompts[i:i + batch], generator=generator, **call).frames))
    return torch.cat(out)


def pipeline_video_adherence(pipe, n: int = 100, steps: int | None = None, seed: int = 0,
                             **kwargs) -> float:
    """Adherence of ``n`` generated clips (:func:`video_targets`)."""
    digits, directions = video_targets(n)
    clips = generate_videos(pipe, digits, directions, steps=steps, seed=seed, **kwargs)
    return video_adherence(clips, digits, directions)
