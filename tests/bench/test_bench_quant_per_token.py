"""bench/quant_per_token.py on the CPU: the shapes, the Triton settings, the check against the
default launch, the table, and the refusal without a GPU (the timings themselves need one)."""

from __future__ import annotations


import pytest
import torch



@pytest.fixture(scope="module")
def tune():
    from bench import quant_per_token

    return quant_per_token


def test_shapes_fit_the_cuda_kernel(tune):
    # csrc/quant reads rows in 16-byte vectors (8 values) and keeps at most 32768 values a row.
    assert set(tune.DEFAULT_SHAPES) <= set(tune.SHAPES)
    assert all(s.cols % 8 == 0 and s.cols <= 32768 for s in tune.SHAPES.values())


def test_triton_settings_are_launcher_options(tune):
    import inspect

    from omni_kernels.quant.triton_kernel import launch_quantize_per_token_triton

    settings = tune.triton_settings()
    labels = [label for label, _ in settings]
    assert len(labels) == len(set(labels)) and ("triton-launcher", {}) in settings
    allowed = set(inspect.signature(launch_quantize_per_token_triton).parameters)
    assert all(set(options) <= allowed for _, options in settings)
    swept = {(o.get("rows_per_program"), o.get("num_warps")) for _, o in settings}
    assert {(r, w) for r in (2, 4, 8, 16) for w in (4, 8)} <= swept
    assert all(label == f"triton-r{o.get('rows_per_program', 1)}-w{o['num_warps']}"
               for label, o in settings if "num_warps" in o)


def test_values_per_thread(tune):
    # 3072 columns take a 4096-wide tile (launch_config's default: 4 warps); 15360 a 16384-wide one.
    assert tune.values_per_thread(3072, {}) == 4096 // 128
    assert tune.values_per_thread(3072, dict(rows_per_program=16, num_warps=4)) == 16 * 4096 // 128
    assert tune.values_per_thread(15360, dict(num_warps=4)) == 16384 // 128
    assert tune.values_per_thread(200, dict(rows_per_program=4)) == 4 * 256 // (32 * 2)


def test_compare_with_default(tune):
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(-127, 128, (64, 40), generator=gen, dtype=torch.int8)
    scale = torch.rand(64, 1, generator=gen) + 0.5
    assert tune.compare_with_default(q.clone(), scale.clone(), q, scale, fused=False) == (True, "ok")
    one_code = q.clone()
    one_code[3, 7] += 1  # 1 of 2560 codes: within the cross-kernel tolerance
    rounded = scale * (1 + 1e-6)
    same, status = tune.compare_with_default(one_code, rounded, q, scale, fused=True)
    assert not same and status.startswith("ok, not bit-identical") and "0.039% of the codes" in status
    same, status = tune.compare_with_default(one_code, scale, q, scale, fused=False)
    assert not same and status.startswith("differs from the default")
    same, status = tune.compare_with_default(q, scale * 1.01, q, scale, fused=True)
    assert not same and status.startswith("differs from the default") and "1.00e-02 relative" in status


def test_markdown_table(tune):
    env = dict(device="NVIDIA H200", torch="2.11", cuda="13.0", packages={"triton": "3.6"}, git_commit="abc",
               utc="now", command="python3 bench/quant_per_token.py")
    shape = tune.SHAPES["tiny"]
    rows = [dict(shape="tiny", kind="plain", setting="cuda", us=10.0, gbps=100.0, same_as_default=None, status="ok"),
            dict(shape="tiny", kind="plain", setting="triton", us=8.0, gbps=125.0, same_as_default=True, status="ok"),
            dict(shape="tiny", kind="plain", setting="triton-r4-w8", us=5.0, gbps=200.0, same_as_default=True,
                 status="ok"),
            dict(shape="tiny", kind="plain", setting="triton-r16-w4", us=None, gbps=None, same_as_default=None,
                 status="skipped: 512 values a thread"),
            dict(shape="tiny", kind="layernorm+adaln", setting="cuda", us=20.0, gbps=50.0, same_as_default=None,
                 status="ok")]
    table = tune.markdown(env, [shape], rows, "bf16")
    assert "| triton | 8.0 | 125 | 1.25x | 1.00x | yes | ok |" in table
    assert "| triton-r4-w8 | 5.0 | 200 | 2.00x | 1.60x | yes | ok |" in table
    assert "| triton-r16-w4 | - | - | - | - | - | skipped: 512 values a thread |" in table
    assert "## tiny (layernorm+adaln)" in table
    assert "| cuda | 20.0 | 50 | 1.00x | - | - | ok |" in table


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_refuses_without_a_gpu(tune):
    assert tune.main(["--shapes", "tiny"]) == 2
