"""bench/pipeline_profile.py on the CPU: how kernel names are grouped, the markdown table, and the
clear refusal without a GPU (the profile itself runs on the device)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")


def _load():
    from bench import pipeline_profile

    return pipeline_profile


@pytest.mark.parametrize("name, group", [
    # names as torch.profiler reported them on the H200 (bench/results/pipeline-profile/pipeline-profile-flux_*)
    ("nvjet_sm90_qqtst_128x128_128x6_2x1_v_bz_ovscale_bias_TNT", "gemm fp8/int8"),
    ("nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_bias_TNN", "gemm bf16"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_4x1x1", "attention"),
    ("triton_red_fused__fused_rms_norm__scaled_dot_product_cudnn_attention__to_copy_add", "inductor triton"),
    ("triton_poi_fused__scaled_mm__to_copy_cat_clamp_gelu", "inductor triton"),
    ("_quantize_per_token_kernel", "omni quantization"),
    ("void at::native::vectorized_layer_norm_kernel<c10::BFloat16, float, true>", "other"),
])
def test_kernel_groups(name, group):
    assert _load().group_of(name) == group


def test_markdown_rows():
    bench = _load()
    groups = {g: float(i) for i, (g, _) in enumerate(bench.GROUPS)}
    rows = {"omni_fp8": dict(wall_ms=100.1, kernel_ms=99.0, groups=groups,
                             top_kernels=[dict(name="k", group="other", ms=1.5, calls=2)]),
            "eager": dict(error="skipped: why")}
    env = dict(device="NVIDIA H200", git_commit="abc", torch="2.11", cuda="13.0", packages={}, utc="now",
               command="python3 bench/pipeline_profile.py")
    text = bench.markdown(env, "flux", rows)
    assert "| (d) (c) + FP8 linears | 100.1 | 99.0 | 0.0 | 1.0 |" in text
    assert "| (a) diffusers eager | skipped: why |" in text and "- 1.50 ms x2 [other] `k`" in text


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="checks the refusal on a machine without an NVIDIA GPU; with one the bench profiles")
def test_refuses_without_a_gpu(capsys):
    assert _load().main(["--out-dir", "unused"]) == 2
    assert "no CUDA device" in capsys.readouterr().err
