"""The data of the embedded models: scikit-learn's handwritten digits and their prompts.

``sklearn.datasets.load_digits``: 1797 grey 8x8 images, values 0..16, shipped inside the
scikit-learn package. :func:`digit_images` gives them upsampled, :func:`digit_prompt` the
prompt of a digit, :func:`pooled_features` the 8x8 features the digit classifiers read.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


def digit_prompt(digit: int) -> str:
    """The image prompt of ``digit``: ``"a handwritten digit seven"``."""
    return f"a handwritten digit {DIGIT_WORDS[digit]}"


def digit_images(size: int = 32) -> tuple[torch.Tensor, np.ndarray]:
    """All 1797 digits as ``(N, 1, size, size)`` float32 in [-1, 1] (ink bright), and their labels."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.from_numpy(data.images.astype(np.float32) / 16.0)[:, None]
    if size != 8:
        x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
    return (x * 2 - 1).clamp(-1, 1), data.target.astype(np.int64)


def pooled_features(gray: torch.Tensor) -> np.ndarray:
    """``(N, H, W)`` in [-1, 1] -> ``(N, 64)`` in load_digits' 0..16 scale (average-pooled to 8x8)."""
    x = gray[:, None]
    if x.shape[-1] != 8:
        x = F.adaptive_avg_pool2d(x, 8)
    return ((x + 1) * 8).reshape(len(x), 64).numpy().astype(np.float64)
