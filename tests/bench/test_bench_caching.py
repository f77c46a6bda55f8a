"""bench/caching.py on the embedded image model, two images: the JSON it writes, and that a
threshold of 0 skips nothing and reproduces the uncached images bit for bit."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("diffusers")
pytest.importorskip("sklearn")

def _load():
    from bench import caching

    return caching


def test_two_images_threshold_zero_is_exact(tmp_path, capsys):
    from omni_diffusion.embedded import embedded_pipeline_path

    try:
        embedded_pipeline_path("image")
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    import torch

    bench = _load()
    threads = torch.get_num_threads()
    assert bench.main(["--n", "2", "--steps", "6", "--first-block", "0", "1.0", "--teacache", "0",
                       "--out-dir", str(tmp_path)]) == 0
    assert torch.get_num_threads() == threads  # the bench's 1 thread does not leak into the process
    (json_path,) = tmp_path.glob("caching_cpu_*.json")
    data = json.loads(json_path.read_text())
    env = data["environment"]
    assert env["images"] == 2 and env["steps"] == 6 and env["threads"] == 1 and env["git_commit"]
    assert env["command"].endswith("bench/caching.py --n 2 --steps 6 --first-block 0 1.0 --teacache 0 "
                                   f"--out-dir {tmp_path}")
    rows = data["results"]
    assert [(r["config"], r["threshold"]) for r in rows] == [
        ("reference", None), ("first_block", 0.0), ("first_block", 1.0), ("teacache", 0.0)]
    for row in rows:
        assert row["images"] == 2 and row["ms_per_image"] > 0 and row["speedup"] > 0
        assert 0.0 <= row["adherence"] <= 1.0 and 0.0 <= row["hit_rate"] <= 1.0
    for row in rows[1], rows[3]:  # threshold 0: never skips, the same images as without caching
        assert row["passes"] == 2 * 6 and row["hit_rate"] == 0.0 and row["blocks_skipped"] == 0.0
        assert row["identical"] and row["max_abs_diff"] == 0.0 and row["psnr_db"] is None
        assert row["ssim"] == pytest.approx(1.0)
    loose = rows[2]  # a huge First-Block-Cache threshold skips every pass after the warm-up step
    assert loose["hit_rate"] > 0.5 and 0.0 < loose["blocks_skipped"] < loose["hit_rate"]
    assert not loose["identical"] and loose["psnr_db"] is not None and loose["ssim"] < 1.0
    assert "| first_block | 0 |" in json_path.with_suffix(".md").read_text()
    assert "inf (identical)" in capsys.readouterr().out


def test_video_two_clips_threshold_zero_is_exact(tmp_path):
    from omni_diffusion.embedded import embedded_pipeline_path

    try:
        embedded_pipeline_path("video")
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    bench = _load()
    assert bench.main(["--kind", "video", "--n", "2", "--steps", "4", "--first-block", "0", "1.0",
                       "--teacache", "0", "--out-dir", str(tmp_path)]) == 0
    (json_path,) = tmp_path.glob("caching-video_cpu_*.json")
    data = json.loads(json_path.read_text())
    assert data["environment"]["kind"] == "video" and data["environment"]["images"] == 2
    rows = data["results"]
    for row in rows[1], rows[3]:  # threshold 0: never skips, the same clips as without caching
        assert row["passes"] > 0 and row["hit_rate"] == 0.0 and row["identical"] and row["psnr_db"] is None
    loose = rows[2]
    assert loose["hit_rate"] > 0.3 and not loose["identical"] and loose["ssim"] < 1.0
    assert "| cache | threshold | CPU ms/clip | speed-up | wall ms/clip |" in (tmp_path / json_path.name.replace(".json", ".md")).read_text()
