"""Evaluation of the embedded digit models: prompt adherence, PSNR and SSIM (the video
model's clips and motion scoring: :mod:`.evaluate_video`).

The data are scikit-learn's handwritten digits (``sklearn.datasets.load_digits``:
1797 grey 8x8 images, values 0..16), shipped inside the scikit-learn package.

- :func:`digit_images` gives them as 32x32 images in [-1, 1] (bilinear upsampling),
  the form the embedded models are trained on; :func:`digit_prompt` the prompt of a digit.
- :class:`DigitClassifier` is an SVM trained on the same digits (seeded train/test
  split); it classifies generated images, after pooling them back to 8x8, and
  :func:`adherence` is the fraction classified as the prompted digit.
- :func:`psnr` and :func:`ssim` compare an output with a reference output (for
  caching and quantization: how far an accelerated run strays from the plain one).
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F

from .digits import DIGIT_WORDS, digit_images, digit_prompt, pooled_features  # noqa: F401


def to_gray(images) -> torch.Tensor:
    """``(N, C, H, W)`` / ``(N, H, W, C)`` tensors or arrays, or PIL images, as ``(N, H, W)``
    float32 in [-1, 1]. Arrays in [0, 1] (diffusers' ``"pt"``/``"np"`` outputs) and PIL images
    (0..255) are mapped to [-1, 1]; tensors with negative values are taken as already in [-1, 1]."""
    if isinstance(images, (list, tuple)) and images and hasattr(images[0], "convert"):
        arr = np.stack([np.asarray(im.convert("L"), dtype=np.float32) / 255.0 for im in images])
        return torch.from_numpy(arr) * 2 - 1
    x = torch.as_tensor(np.asarray(images) if not isinstance(images, torch.Tensor) else images)
    x = x.detach().float().cpu()
    if x.ndim == 3:
        x = x[:, None]
    if x.shape[1] not in (1, 3) and x.shape[-1] in (1, 3):
        x = x.permute(0, 3, 1, 2)
    if x.min() >= 0:
        x = x * 2 - 1
    return x.mean(1).clamp(-1, 1)


class DigitClassifier:
    """An SVM (RBF kernel) on 8x8 digits, trained on a seeded 75% split of load_digits (upsampled
    to 32x32 and pooled back, as generated images are); ``test_accuracy`` is its accuracy on
    the remaining 25%."""

    def __init__(self, seed: int = 0):
        from sklearn.model_selection import train_test_split
        from sklearn.svm import SVC

        images, labels = digit_images(32)
        feats = pooled_features(images[:, 0])
        x_tr, x_te, y_tr, y_te = train_test_split(feats, labels, test_size=0.25,
                                                  random_state=seed, stratify=labels)
        self.model = SVC(gamma="scale", C=10.0).fit(x_tr, y_tr)
        self.test_accuracy = float((self.model.predict(x_te) == y_te).mean())

    def predict(self, images) -> np.ndarray:
        """The digit of each image (any form :func:`to_gray` takes)."""
        return self.model.predict(pooled_features(to_gray(images)))


@lru_cache(maxsize=2)
def digit_classifier(seed: int = 0) -> DigitClassifier:
    """A cached :class:`DigitClassifier`."""
    return DigitClassifier(seed)


def adherence(images, digits) -> float:
    """The fraction of ``images`` that the classifier reads as the prompted ``digits``."""
    pred = digit_classifier().predict(images)
    return float((pred == np.asarray(digits)).mean())


def psnr(output, reference, data_range: float = 2.0) -> float:
    """Peak signal-to-noise ratio in dB (``inf`` for identical inputs); ``data_range`` is the
    span of the values (2.0 for [-1, 1], 1.0 for [0, 1], 255 for bytes)."""
    a = torch.as_tensor(np.asarray(output) if not isinstance(output, torch.Tensor) else output)
    b = torch.as_tensor(np.asarray(reference) if not isinstance(reference, torch.Tensor) else reference)
    mse = float(((a.double() - b.double()) ** 2).mean())
    if mse == 0:
        return math.inf
    return 10 * math.log10(data_range**2 / mse)


def _gaussian_window(size: int, sigma: float) -> torch.Tensor:
    x = torch.arange(size, dtype=torch.float64) - (size - 1) / 2
    g = torch.exp(-(x**2) / (2 * sigma**2))
    return g / g.sum()


def ssim(output, reference, data_range: float = 2.0, window: int = 7, sigma: float = 1.5) -> float:
    """Mean structural similarity (Wang et al. 2004: Gaussian window, K1=0.01, K2=0.03) of two
    images or batches ``(H, W)``, ``(C, H, W)`` or ``(N, C, H, W)``; 1.0 for identical inputs.
    The window shrinks to the image size for small images; borders are left out ("valid")."""
    a = torch.as_tensor(np.asarray(output) if not isinstance(output, torch.Tensor) else output)
    b = torch.as_tensor(np.asarray(reference) if not isinstance(reference, torch.Tensor) else reference)
    a, b = a.double(), b.double()
    while a.ndim < 4:
        a, b = a[None], b[None]
    n, c, h, w = a.shape
    a, b = a.reshape(n * c, 1, h, w), b.reshape(n * c, 1, h, w)
    size = min(window, h, w)
    g = _gaussian_window(size, sigma)
    kernel = (g[:, None] * g[None, :])[None, None]

    def blur(x):
        return F.conv2d(x, kernel)

    mu_a, mu_b = blur(a), blur(b)
    var_a = blur(a * a) - mu_a**2
    var_b = blur(b * b) - mu_b**2
    cov = blur(a * b) - mu_a * mu_b
    c1, c2 = (0.01 * data_range) ** 2, (0.03 * data_range) ** 2
    s = ((2 * mu_a * mu_b + c1) * (2 * cov + c2)) / ((mu_a**2 + mu_b**2 + c1) * (var_a + var_b + c2))
    return float(s.mean())


def generate_digits(pipe, digits, steps: int | None = None, seed: int = 0, batch: int = 50,
                    **kwargs) -> torch.Tensor:
    """Images ``(N, 3, 32, 32)`` in [0, 1] for the prompts of ``digits``, from one seeded
    generator per batch. ``steps=None`` keeps the pipeline's default number of steps."""
    from . import IMAGE_CALL_KWARGS

    call = dict(IMAGE_CALL_KWARGS, output_type="pt")
    call.update(kwargs)
    if steps is not None:
        call["num_inference_steps"] = steps
    generator = torch.Generator().manual_seed(seed)
    digits = list(digits)
    out = []
    for i in range(0, len(digits), batch):
        prompts = [digit_prompt(d) for d in digits[i:i + batch]]
        with torch.no_grad():
            out.append(pipe(prompt=prompts, generator=generator, **call).images)
    return torch.cat(out)


def image_adherence(pipe, n: int = 100, steps: int | None = None, seed: int = 0, **kwargs) -> float:
    """Adherence of ``n`` images, the digits 0..9 in turn."""
    digits = [i % 10 for i in range(n)]
    return adherence(generate_digits(pipe, digits, steps=steps, seed=seed, **kwargs), digits)


def main(argv=None) -> None:
    import argparse

    import diffusers

    from . import _PIPELINES, load_embedded_pipeline

    parser = argparse.ArgumentParser(description="score an embedded model's prompt adherence")
    parser.add_argument("--kind", choices=("image", "video"), default="image")
    parser.add_argument("--n", type=int, default=100)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--path", default=None, help="a model folder other than the embedded one")
    parser.add_argument("--device", default="cpu", help="where the pipeline runs (cpu, cuda)")
    args = parser.parse_args(argv)
    if args.path:
        pipe = getattr(diffusers, _PIPELINES[args.kind]).from_pretrained(args.path).to(args.device)
        pipe.set_progress_bar_config(disable=True)
    else:
        pipe = load_embedded_pipeline(args.kind, device=args.device)
    if args.kind == "image":
        print(f"classifier test accuracy: {digit_classifier().test_accuracy:.4f}")
        print(f"adherence over {args.n}: {image_adherence(pipe, args.n, args.steps, args.seed):.3f}")
        return
    from .evaluate_video import frame_digit_classifier, generate_videos, video_hits, video_targets

    print(f"frame classifier test accuracy: {frame_digit_classifier().test_accuracy:.4f}")
    digits, directions = video_targets(args.n)
    clips = generate_videos(pipe, digits, directions, steps=args.steps, seed=args.seed)
    digit_ok, direction_ok = video_hits(clips, digits, directions)
    print(f"video adherence over {args.n} (digit and direction): {np.mean(digit_ok & direction_ok):.3f} "
          f"(digit {digit_ok.mean():.3f}, direction {direction_ok.mean():.3f})")


if __name__ == "__main__":
    main()
