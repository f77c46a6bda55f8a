"""The embedded digit models: loading, the evaluation helpers, and prompt adherence."""

import math

import numpy as np
import pytest
import torch

pytest.importorskip("sklearn")

from omni_diffusion import embedded  # noqa: E402
from omni_diffusion.embedded import evaluate  # noqa: E402


def test_psnr_known_cases():
    a = torch.zeros(1, 3, 8, 8)
    assert evaluate.psnr(a, a) == math.inf
    # mse 0.25 over a range of 2: 10 log10(4 / 0.25) = 10 log10(16)
    assert evaluate.psnr(a, a + 0.5) == pytest.approx(10 * math.log10(16.0))
    assert evaluate.psnr(np.zeros((4, 4)), np.full((4, 4), 10.0), data_range=255.0) == pytest.approx(
        10 * math.log10(255.0**2 / 100.0))


def test_ssim_known_cases():
    g = torch.Generator().manual_seed(0)
    a = torch.rand(2, 3, 16, 16, generator=g) * 2 - 1
    assert evaluate.ssim(a, a) == pytest.approx(1.0)
    # constant images: variances and covariance vanish, SSIM = (2 mu_a mu_b + C1) / (mu_a^2 + mu_b^2 + C1)
    c1 = (0.01 * 2.0) ** 2
    zero, half = torch.zeros(16, 16), torch.full((16, 16), 0.5)
    assert evaluate.ssim(zero, half) == pytest.approx(c1 / (0.25 + c1))
    noisy = (a + 0.3 * torch.randn(a.shape, generator=g)).clamp(-1, 1)
    assert 0.0 < evaluate.ssim(noisy, a) < 0.9
    assert evaluate.ssim(noisy, a) < evaluate.ssim((a + noisy) / 2, a)


def test_classifier_accuracy():
    clf = evaluate.digit_classifier()
    assert clf.test_accuracy >= 0.97
    images, labels = evaluate.digit_images(32)
    # the classifier reads the training data form (32x32 in [-1, 1]) and [0, 1] images alike
    assert (clf.predict(images[:200]) == labels[:200]).mean() >= 0.97
    assert (clf.predict((images[:200] + 1) / 2) == labels[:200]).mean() >= 0.97


def test_embedded_path():
    with pytest.raises(ValueError):
        embedded.embedded_pipeline_path("audio")
    path = embedded.embedded_pipeline_path("image")
    assert (path / "model_index.json").is_file()
    weights = sorted(path.glob("*/*.safetensors"))
    assert len(weights) == 4
    assert sum(w.stat().st_size for w in weights) <= 8 * 2**20


@pytest.fixture(scope="module")
def image_pipe():
    import diffusers

    pipe = diffusers.FluxPipeline.from_pretrained(embedded.embedded_pipeline_path("image"),
                                                  local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_image_pipeline_generates(image_pipe):
    out = image_pipe("a handwritten digit seven", num_inference_steps=2, output_type="pt",
                     generator=torch.Generator().manual_seed(0), **embedded.IMAGE_CALL_KWARGS)
    assert out.images.shape == (1, 3, 32, 32)
    assert torch.isfinite(out.images).all()
    pipe = embedded.load_embedded_pipeline("image")
    assert type(pipe).__name__ == "FluxPipeline"


def test_image_adherence(image_pipe):
    # 10 images (the digits 0..9), default number of steps, seeded
    digits = list(range(10))
    images = evaluate.generate_digits(image_pipe, digits, seed=0)
    assert images.shape == (10, 3, 32, 32)
    assert evaluate.adherence(images, digits) >= 0.8
