"""bench/gpu_telemetry.py on the CPU: nvidia-smi's output parsed and summarized, the context
manager without a GPU, and bench/attention.py's table of the samples."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def telemetry():
    from bench import gpu_telemetry

    return gpu_telemetry


# As nvidia-smi --query-gpu=clocks.sm,power.draw,clocks_event_reasons.active
# --format=csv,noheader,nounits prints them on an H200 (a capped run, then a header-less
# field the driver could not read)
LINES = [
    "1980, 120.55, 0x0000000000000000",
    "1905, 691.20, 0x0000000000000004",
    "1920, 692.80, 0x0000000000000004",
    "1890, 690.10, 0x0000000000000004",
    "1935, 688.00, 0x0000000000000000",
    "[N/A], 690.00, 0x0000000000000004",
    "garbage",
]


def test_parse_skips_malformed_lines(telemetry):
    samples = telemetry.parse_samples(LINES)
    assert samples[0] == (1980.0, 120.55, 0)
    assert samples[1] == (1905.0, 691.2, 4)
    assert len(samples) == 5  # the [N/A] line and the garbage line dropped


def test_summary_medians_and_cap_share(telemetry):
    summary = telemetry.summarize(telemetry.parse_samples(LINES)[1:])
    assert summary == dict(samples=4, sm_clock_mhz=1912.5, power_w=690.7, power_capped_share=0.75,
                           reasons=["SW power cap"])


def test_summary_needs_enough_samples(telemetry):
    samples = telemetry.parse_samples(LINES)[: telemetry.MIN_SAMPLES - 1]
    assert telemetry.summarize(samples) is None


def test_reasons_decode_every_bit_seen(telemetry):
    samples = [(1500.0, 650.0, 0x4 | 0x40), (1500.0, 650.0, 0x80), (1500.0, 650.0, 0x0)]
    assert telemetry.summarize(samples)["reasons"] == ["SW power cap", "HW thermal slowdown",
                                                       "HW power brake"]


def test_without_a_gpu_the_block_runs_and_nothing_is_sampled(telemetry):
    with telemetry.GpuTelemetry(torch.device("cpu")) as t:
        total = sum(range(10))
    assert total == 45 and t.summary() is None and t.error is None


def test_interval_below_nvidia_smi_floor_is_refused(telemetry):
    with pytest.raises(ValueError, match="interval_ms must be >= 10"):
        telemetry.GpuTelemetry(torch.device("cpu"), interval_ms=5)


def test_attention_bench_tables_the_sampled_rows():
    from bench import attention

    gpu = dict(samples=17, sm_clock_mhz=1905.0, power_w=691.2, power_capped_share=1.0,
               reasons=["SW power cap"])
    rows = [dict(shape="hunyuanvideo-720p", backend="sdpa_cudnn", status="ok", gpu=gpu),
            dict(shape="flux-1024", backend="sdpa_cudnn", status="ok")]  # too short to sample
    lines = attention._telemetry_lines(rows)
    assert lines[-1] == "| hunyuanvideo-720p | sdpa_cudnn | 1905 | 691 | 100% | 17 |"
    assert sum(1 for line in lines if line.startswith("| ") and "flux" in line) == 0
    assert attention._telemetry_lines([rows[1]]) == []
