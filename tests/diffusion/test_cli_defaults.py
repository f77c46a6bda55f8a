"""omni-generate on the embedded models: no MODEL means the embedded image model, unset size /
frames / prompt length are the model's trained ones, and MP4 is written by PyAV (no imageio)."""

from __future__ import annotations

import sys

import pytest

pytest.importorskip("diffusers")

from omni_diffusion.cli import main  # noqa: E402

FAST = ["--steps", "8", "--device", "cpu", "--no-progress"]


def test_no_model_uses_embedded_image_model_at_its_native_size(tmp_path):
    from PIL import Image

    from omni_diffusion.embedded.evaluate import digit_classifier

    out = tmp_path / "seven.png"
    assert main(["--prompt", "a handwritten digit seven", *FAST, "-o", str(out)]) == 0
    with Image.open(out) as image:
        assert image.size == (32, 32)
        assert digit_classifier().predict([image.convert("RGB")])[0] == 7


def test_embedded_video_folder_writes_mp4_with_pyav_without_imageio(tmp_path, monkeypatch):
    av = pytest.importorskip("av")
    from omni_diffusion.embedded import VIDEO_CALL_KWARGS, embedded_pipeline_path

    monkeypatch.setitem(sys.modules, "imageio", None)  # any `import imageio` fails
    monkeypatch.setitem(sys.modules, "imageio.v2", None)
    out = tmp_path / "three.mp4"
    rc = main([str(embedded_pipeline_path("video")), "--prompt",
               "a handwritten digit three moving right", "--steps", "4", "--device", "cpu",
               "--no-progress", "-o", str(out)])
    assert rc == 0 and out.is_file()
    with av.open(str(out)) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    assert len(frames) == VIDEO_CALL_KWARGS["num_frames"]
    assert frames[0].shape == (32, 32, 3)


def test_native_call_kwargs_only_for_embedded_models(tmp_path):
    from omni_diffusion.embedded import CALL_KWARGS, embedded_pipeline_path, native_call_kwargs

    assert native_call_kwargs(None) == CALL_KWARGS["image"]
    assert native_call_kwargs(embedded_pipeline_path("video")) == CALL_KWARGS["video"]
    assert native_call_kwargs(tmp_path) == {}
    assert native_call_kwargs("black-forest-labs/FLUX.1-dev") == {}
