"""Per-token quantization with several rows a program (``rows_per_program``, a tuning option of
:func:`omni_kernels.quant.triton_kernel.launch_quantize_per_token_triton`).

The multi-row kernel only schedules differently: every row gets the one-row kernel's arithmetic,
so its codes and scales must be bit-identical to the default launch's, and (like the default's)
equal to the reference without a norm, within one code in 1% of the values with one (the float32
sums run in another order than torch's). Row counts leave the last program a partial group of
rows; modulation groups start inside a program's rows.

CPU (CI): Triton's interpreter, float32/float16 in, INT8 out (the interpreter has no FP8 or
bfloat16); outputs are allocated filled with 0xFF bytes (int8 -1, float32 NaN), so an element
the kernel fails to write shows up even where the allocator hands back the memory of an earlier,
correct output. GPU (``-m gpu``): bfloat16 -> FP8/INT8 at Flux's 4608 x 3072 for the settings
bench/quant_per_token.py times.
"""

from __future__ import annotations

import pytest
import torch

from omni_kernels._triton import triton_interpreter_enabled
from omni_kernels.quant import FP8_DTYPE, quantize_per_token_reference
from omni_kernels.quant.dispatch import _NORM_CODES
from omni_kernels.quant.triton_kernel import launch_config, launch_quantize_per_token_triton

needs_interpreter_or_gpu = pytest.mark.skipif(
    not (triton_interpreter_enabled() or torch.cuda.is_available()),
    reason="the Triton kernel needs a GPU or TRITON_INTERPRET=1",
)

VARIANTS = ["plain", "rms", "layer_affine", "adaln_groups", "adaln_clamp"]


@pytest.fixture(autouse=True)
def _outputs_poisoned(poisoned_outputs):
    """Every tensor the kernels allocate here starts as 0xFF bytes (see conftest)."""
    with poisoned_outputs():
        yield


def _variant_options(inputs, variant: str, k: int, dtype: torch.dtype, device="cpu") -> tuple[int, dict]:
    """``(modulation groups, reference keyword arguments)`` for a fusion variant."""
    def small(shape):
        return 0.3 * inputs.activations(shape, dtype, device, outlier_channels=0)

    if variant == "plain":
        return 1, {}
    if variant == "rms":
        return 1, dict(norm="rms", norm_weight=inputs.weight(k, dtype, device), eps=1e-6)
    if variant == "layer_affine":
        return 1, dict(norm="layer", norm_weight=inputs.weight(k, torch.float32, device),
                       norm_bias=small((k,)), eps=1e-5)
    if variant == "adaln_groups":  # one modulation row per group of consecutive rows
        return 3, dict(norm="layer", eps=1e-6, mod_scale=small((3, k)),
                       mod_shift=inputs.activations((3, k), torch.float32, device, outlier_channels=0))
    if variant == "adaln_clamp":
        return 1, dict(norm="layer", eps=1e-6, clamp=2.0, mod_shift=small((1, k)))
    raise ValueError(variant)


def _launch(x, options: dict, out_dtype=torch.int8, **tuning):
    return launch_quantize_per_token_triton(
        x, options.get("norm_weight"), options.get("norm_bias"), options.get("mod_scale"),
        options.get("mod_shift"), _NORM_CODES[options.get("norm")], options.get("eps", 1e-6),
        options.get("clamp") or 0.0, out_dtype, **tuning,
    )


def _assert_bit_identical(q, scale, q_default, scale_default):
    assert torch.isfinite(scale).all(), "a row's scale was not written (NaN)"
    assert torch.equal(scale, scale_default)
    assert torch.equal(q.view(torch.uint8), q_default.view(torch.uint8))


def _assert_close_to_reference(q, scale, x, options, *, exact: bool):
    """Exactly the reference, or within one INT8 code in 1% of the values and scales within 1e-5."""
    q_ref, scale_ref = quantize_per_token_reference(x, torch.int8, **options)
    if exact:
        assert torch.equal(scale, scale_ref) and torch.equal(q, q_ref)
        return
    assert torch.allclose(scale, scale_ref, rtol=1e-5, atol=0)
    steps = (q.int() - q_ref.int()).abs()
    assert steps.max().item() <= 1 and (steps > 0).double().mean().item() <= 0.01


# ============================================================================ CPU (interpreter) or GPU


@needs_interpreter_or_gpu
@pytest.mark.parametrize("rows_per_program", [4, 8])
@pytest.mark.parametrize("k", [40, 200, 3072])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_rows_per_program_matches_the_default_launch(inputs, variant, dtype, k, rows_per_program):
    """37 rows (45 with three modulation groups of 15): the last program gets a partial group of
    rows, and with groups a program's rows straddle a group boundary."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    groups, options = _variant_options(inputs, variant, k, dtype, device)
    rows = 45 if groups == 3 else 37
    x = inputs.activations((rows, k), dtype, device)
    q_default, scale_default = _launch(x, options)
    q, scale = _launch(x, options, rows_per_program=rows_per_program)
    assert q.shape == (rows, k) and scale.shape == (rows, 1)
    _assert_bit_identical(q, scale, q_default, scale_default)
    _assert_close_to_reference(q, scale, x, options, exact=variant == "plain")


@needs_interpreter_or_gpu
@pytest.mark.parametrize("variant", ["plain", "adaln_groups"])
@pytest.mark.parametrize("rows,rows_per_program,num_warps", [
    (1, 2, None), (3, 8, None), (45, 2, 4), (45, 16, 8), (45, 1, 4), (30, 64, None),
])
def test_small_row_counts_and_warp_overrides(inputs, variant, rows, rows_per_program, num_warps):
    """Fewer rows than a program takes, the extreme tile heights, and num_warps overrides (a
    scheduling choice: the interpreter ignores it, the GPU must give the same values too)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    k = 72
    groups, options = _variant_options(inputs, variant, k, torch.float32, device)
    if rows % groups:
        groups, options = 1, {key: value[:1] if key.startswith("mod_") else value
                              for key, value in options.items()}
    x = inputs.activations((rows, k), torch.float32, device)
    q_default, scale_default = _launch(x, options)
    q, scale = _launch(x, options, rows_per_program=rows_per_program, num_warps=num_warps)
    _assert_bit_identical(q, scale, q_default, scale_default)
    _assert_close_to_reference(q, scale, x, options, exact=variant == "plain")


# ============================================================================ CPU: launch and arguments


class _RecordLaunch:
    """Stands in for a kernel object: keeps the grid and the launch options, runs nothing."""

    def __init__(self, name: str, launches: list):
        self.name, self.launches = name, launches

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((self.name, grid, kwargs))
        return launch


@pytest.mark.parametrize("k", [40, 3072, 15360])
def test_default_launch_is_the_one_row_kernel(monkeypatch, k):
    """rows_per_program=1 launches the one-row kernel as before (grid M, launch_config's warps);
    > 1 the multi-row kernel over ceil(M / rows) programs."""
    from omni_kernels.quant import triton_kernel

    launches = []
    for name in ("_quantize_per_token_kernel", "_quantize_rows_per_token_kernel"):
        monkeypatch.setattr(triton_kernel, name, _RecordLaunch(name, launches))
    monkeypatch.setattr(triton_kernel, "wrap_triton", lambda kernel: kernel)  # it takes @triton.jit kernels only
    x = torch.zeros(37, k)
    launch_quantize_per_token_triton(x, None, None, None, None, 0, 1e-6, 0.0, torch.int8)
    launch_quantize_per_token_triton(x, None, None, None, None, 0, 1e-6, 0.0, torch.int8, rows_per_program=8)
    launch_quantize_per_token_triton(x, None, None, None, None, 0, 1e-6, 0.0, torch.int8, num_warps=2)
    block, _, warps = launch_config(k, triton_kernel.MAX_TILE)
    (name0, grid0, kw0), (name1, grid1, kw1), (name2, grid2, kw2) = launches
    assert (name0, grid0, kw0["num_warps"], kw0["BLOCK_K"]) == ("_quantize_per_token_kernel", (37,), warps, block)
    assert "ROWS" not in kw0
    assert (name1, grid1, kw1["ROWS"], kw1["BLOCK_K"]) == ("_quantize_rows_per_token_kernel", (5,), 8, block)
    assert kw1["num_warps"] == triton_kernel.multi_row_warps(8, block)
    assert (name2, grid2, kw2["num_warps"]) == ("_quantize_per_token_kernel", (37,), 2)


BAD_TUNING = [
    ("rows_3", dict(rows_per_program=3), r"rows_per_program must be one of \(1, 2, 4, .*got 3"),
    ("rows_0", dict(rows_per_program=0), r"rows_per_program must be one of .*got 0"),
    ("rows_bool", dict(rows_per_program=True), r"rows_per_program must be one of .*got True"),
    ("rows_128", dict(rows_per_program=128), r"rows_per_program must be one of .*got 128"),
    ("warps_3", dict(num_warps=3), r"num_warps must be None or one of .*got 3"),
    ("warps_64", dict(num_warps=64), r"num_warps must be None or one of .*got 64"),
    ("chunked_rows", dict(rows_per_program=2, max_tile=16),
     r"rows_per_program=2 needs rows that fit one register tile \(K <= max_tile=16\); got K=40"),
]


@pytest.mark.parametrize("tuning,match", [pytest.param(t, m, id=n) for n, t, m in BAD_TUNING])
def test_bad_tuning_options_raise_value_error(tuning, match):
    with pytest.raises(ValueError, match=match):
        launch_quantize_per_token_triton(torch.ones(4, 40), None, None, None, None, 0, 1e-6, 0.0,
                                         torch.int8, **tuning)


# ============================================================================ GPU: Flux's widths, FP8


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [FP8_DTYPE, torch.int8], ids=["fp8", "int8"])
@pytest.mark.parametrize("variant", ["plain", "adaln_groups"])
def test_gpu_flux_width_settings_match_the_default(inputs, variant, out_dtype):
    """bfloat16 4608 x 3072 (Flux's attention/MLP-up input) for every setting the benchmark times.
    Without a norm, bit-identical (max and products are exact in any order); with LayerNorm the
    per-row sums may be reduced in another order at another warp count, so there the scales
    agree within 1e-5 and at most 1% of the codes differ."""
    k = 3072
    groups, options = _variant_options(inputs, variant, k, torch.bfloat16, "cuda")
    x = inputs.activations((4608, k), torch.bfloat16, "cuda")
    q_default, scale_default = _launch(x, options, out_dtype)
    for rows_per_program in (1, 2, 4, 8, 16):
        for num_warps in (4, 8):
            q, scale = _launch(x, options, out_dtype, rows_per_program=rows_per_program, num_warps=num_warps)
            assert torch.isfinite(scale).all() and not torch.isnan(q.float()).any()
            if variant == "plain":
                _assert_bit_identical(q, scale, q_default, scale_default)
                continue
            assert torch.allclose(scale, scale_default, rtol=1e-5, atol=0)
            codes_moved = (q.float() != q_default.float()).double().mean().item()
            assert codes_moved <= 0.01, f"r{rows_per_program}-w{num_warps}: {codes_moved:.2%} codes differ"
