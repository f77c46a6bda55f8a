"""omni-generate end to end on tiny pipelines saved with save_pretrained to a temp dir."""

from __future__ import annotations

import importlib.util
import json

import pytest

pytest.importorskip("diffusers")

from omni_diffusion.cli import main  # noqa: E402
from omni_diffusion.testing import tiny_pipeline  # noqa: E402

COMMON = ["--prompt", "a red fox", "--steps", "2", "--height", "32", "--width", "32",
          "--device", "cpu", "--no-progress", "--max-sequence-length", "16"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipelines")
    paths = {}
    for family in ("flux", "wan"):
        path = root / family
        tiny_pipeline(family).save_pretrained(path)
        paths[family] = path
    return paths


def test_image_with_cache_and_summary(saved, tmp_path, capsys):
    out = tmp_path / "fox.png"
    summary_path = tmp_path / "summary.json"
    rc = main([str(saved["flux"]), *COMMON, "--attention", "sdpa_math", "--cache", "first_block",
               "--cache-threshold", "1000", "-o", str(out), "--json", str(summary_path)])
    assert rc == 0
    from PIL import Image

    with Image.open(out) as image:
        assert image.size == (32, 32) and image.mode == "RGB"
    summary = json.loads(summary_path.read_text())
    assert summary["pipeline"] == "FluxPipeline" and summary["steps"] == 2
    assert summary["config"]["attention"] == "sdpa_math"
    assert summary["cache"]["passes"] == 2 and summary["cache"]["hits"] == 1
    printed = capsys.readouterr().out
    assert "FluxPipeline: 2 steps" in printed and "cache first_block: 1/2" in printed


def test_video_frames_or_mp4(saved, tmp_path, capsys):
    out = tmp_path / "fox.mp4"
    rc = main([str(saved["wan"]), *COMMON, "--num-frames", "5", "--guidance-scale", "1.0",
               "--attention", "none", "-o", str(out)])
    assert rc == 0
    has_av = importlib.util.find_spec("av") is not None
    frames_dir = tmp_path / "fox_frames"
    if has_av:
        assert out.stat().st_size > 0 and not frames_dir.exists()
    else:
        frames = sorted(frames_dir.glob("frame_*.png"))
        assert frames, "neither an MP4 nor PNG frames were written"
        assert "note: MP4 needs PyAV" in capsys.readouterr().out


def test_errors_are_clear(saved, tmp_path, capsys):
    rc = main(["nonexistent-org/nonexistent-model", *COMMON, "--local-files-only",
               "-o", str(tmp_path / "x.png")])
    assert rc == 2
    assert "could not load 'nonexistent-org/nonexistent-model'" in capsys.readouterr().err
    rc = main([str(tmp_path / "missing" / "dir"), *COMMON])
    assert rc == 2 and "is not a directory" in capsys.readouterr().err
    rc = main([str(saved["flux"]), *COMMON, "--num-frames", "5", "-o", str(tmp_path / "y.png")])
    assert rc == 2 and "no 'num_frames' argument" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main([str(saved["flux"]), *COMMON, "--quant", "nf4"])
    assert info.value.code == 2 and "AccelConfig.quant" in capsys.readouterr().err
