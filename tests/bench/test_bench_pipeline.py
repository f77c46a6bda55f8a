"""bench/pipeline.py's own logic, on tiny models on CPU (``--smoke``): it runs on a GPU only
in a later session, so this keeps the script from rotting meanwhile."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("diffusers")

def _load():
    from bench import pipeline

    return pipeline


def test_smoke_run_writes_results(tmp_path, capsys):
    bench = _load()
    rc = bench.main(["--smoke", "--models", "flux", "--variants", "omni_lossless", "omni_fp8_unfused",
                     "omni_fp8", "omni_fp8_kernel_quant", "fp8_sageattention", "omni_fp8_cuda_graphs",
                     "omni_fp8_int8_modulation_cuda_graphs", "--out-dir", str(tmp_path)])
    assert rc == 0
    (json_path,) = tmp_path.glob("pipeline-flux-smoke_*.json")
    data = json.loads(json_path.read_text())
    rows = {r["variant"]: r for r in data["results"]}
    assert list(rows) == ["eager", "omni_lossless", "omni_fp8_unfused", "omni_fp8", "omni_fp8_kernel_quant",
                          "fp8_sageattention", "omni_fp8_cuda_graphs", "omni_fp8_int8_modulation_cuda_graphs"]
    assert rows["eager"]["status"] == "ok" and rows["omni_lossless"]["status"] == "ok"
    assert rows["omni_lossless"]["rel_err"] < 1e-5 and rows["omni_lossless"]["forward_ms"] > 0
    assert rows["omni_fp8"]["status"] == "ok" or rows["omni_fp8"]["status"].startswith("skipped")
    # fusing q/k/v changes no number: (d0) and (d) give the same output
    assert rows["omni_fp8_unfused"]["status"] == rows["omni_fp8"]["status"]
    if rows["omni_fp8"]["status"] == "ok":
        assert abs(rows["omni_fp8_unfused"]["rel_err"] - rows["omni_fp8"]["rel_err"]) <= 1e-6
    assert rows["omni_fp8_kernel_quant"]["status"].startswith("skipped: omni's activation-quantization kernels need a GPU")
    assert rows["fp8_sageattention"]["status"].startswith("skipped: sageattention")
    for graphed in ("omni_fp8_cuda_graphs", "omni_fp8_int8_modulation_cuda_graphs"):
        assert rows[graphed]["status"] == "skipped: CUDA graphs need a CUDA device", rows[graphed]
    assert data["environment"]["smoke"] is True and data["models"][0]["auto_attention"]["backend"]
    assert "| flux-smoke | (c) omni attention + regional compile |" in capsys.readouterr().out
    assert json_path.with_suffix(".md").exists()


def test_targets_judge_each_cuda_graph_form_of_d():
    bench = _load()
    flux = bench.MODELS["flux"].name
    rows = [dict(model=flux, variant="omni_fp8", status="ok", step_ms=91.4, loop_step_ms=91.1),
            dict(model=flux, variant="omni_fp8_cuda_graphs", status="ok", step_ms=88.0, loop_step_ms=87.5),
            dict(model=flux, variant="omni_fp8_int8_modulation_cuda_graphs", status="error: boom")]
    lines = bench.targets(rows)
    assert "Flux (d) step 91.4 ms (each forward synchronized) vs target <= 90 ms: NOT MET" in lines
    assert "Flux (d4) step 88.0 ms (each forward synchronized) vs target <= 90 ms: MET" in lines
    assert "Flux (d4) step 87.5 ms (forwards back to back, as a denoising loop runs them) vs target <= 90 ms: MET" \
        in lines
    assert "Flux (d9): error: boom" in lines
