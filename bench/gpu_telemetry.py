"""The GPU's SM clock, power draw and clock-event reasons while a benchmark times something.

An H200 running a long attention kernel sits at its power limit (700 W): the driver lowers the SM
clock until the draw fits, so the same kernel's TFLOP/s depends on how much energy each unit of
work costs, not only on its schedule, and a speed ratio between two kernels that both run capped
is a ratio of energies. Recording the clock and the power beside each timing makes that visible.

``nvidia-smi`` samples the device every ``interval_ms`` in a child process while the block runs::

    with GpuTelemetry(torch.device("cuda", 0)) as telemetry:
        ms = triton.testing.do_bench(fn)
    telemetry.summary()  # {"samples": 17, "sm_clock_mhz": 1905.0, "power_w": 691.2, ...} or None

No ``nvidia-smi`` (or no GPU) gives ``summary() is None``; so do blocks too short for
``MIN_SAMPLES`` samples (a Flux-sized call is timed in ~0.1 s).
"""

from __future__ import annotations

import shutil
import statistics
import subprocess

import torch

QUERY = "clocks.sm,power.draw,clocks_event_reasons.active"
MIN_SAMPLES = 3
# clocks_event_reasons bits (nvidia-smi's "Clocks Event Reasons"; NVML's nvmlClocksEventReason*)
REASONS = {
    0x1: "idle",
    0x2: "application clocks setting",
    0x4: "SW power cap",
    0x8: "HW slowdown",
    0x10: "sync boost",
    0x20: "SW thermal slowdown",
    0x40: "HW thermal slowdown",
    0x80: "HW power brake",
    0x100: "display clock setting",
}
POWER_CAP = 0x4


def parse_samples(lines: list[str]) -> list[tuple[float, float, int]]:
    """``(sm_clock_mhz, power_w, reasons_bitmask)`` of each well-formed ``QUERY`` line of
    ``nvidia-smi --format=csv,noheader,nounits`` (others, e.g. ``[N/A]`` fields, are skipped)."""
    samples = []
    for line in lines:
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 3:
            continue
        try:
            samples.append((float(fields[0]), float(fields[1]), int(fields[2], 16)))
        except ValueError:
            continue
    return samples


def summarize(samples: list[tuple[float, float, int]]) -> dict | None:
    """Medians of the clock and the power, the share of samples under the power cap, and the
    clock-event reasons seen; None with fewer than ``MIN_SAMPLES`` samples."""
    if len(samples) < MIN_SAMPLES:
        return None
    seen = 0
    for _, _, bits in samples:
        seen |= bits
    return dict(
        samples=len(samples),
        sm_clock_mhz=statistics.median(s[0] for s in samples),
        power_w=round(statistics.median(s[1] for s in samples), 1),
        power_capped_share=round(sum(1 for s in samples if s[2] & POWER_CAP) / len(samples), 2),
        reasons=[name for bit, name in REASONS.items() if seen & bit],
    )


def _smi_id(device: torch.device) -> str:
    """The device as ``nvidia-smi -i`` names it: its PCI address (CUDA_VISIBLE_DEVICES renumbers
    torch's indices, not the bus)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    return f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"


class GpuTelemetry:
    """Context manager: samples ``device`` with ``nvidia-smi`` while the block runs."""

    def __init__(self, device: torch.device, interval_ms: int = 100):
        if interval_ms < 10:
            raise ValueError(f"GpuTelemetry: interval_ms must be >= 10 (nvidia-smi's floor); got {interval_ms}")
        self.device = device
        self.interval_ms = interval_ms
        self._process: subprocess.Popen | None = None
        self._samples: list[tuple[float, float, int]] = []
        self.error: str | None = None  # why nothing was sampled, when nvidia-smi failed

    def __enter__(self) -> GpuTelemetry:
        smi = shutil.which("nvidia-smi")
        if smi is None or self.device.type != "cuda" or not torch.cuda.is_available():
            return self
        self._process = subprocess.Popen(
            [smi, "-i", _smi_id(self.device), f"--query-gpu={QUERY}", "--format=csv,noheader,nounits",
             "-lms", str(self.interval_ms)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )
        return self

    def __exit__(self, *exc) -> None:
        if self._process is None:
            return
        self._process.terminate()
        try:
            out, _ = self._process.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            self._process.kill()
            out, _ = self._process.communicate()
        if self._process.returncode not in (0, -15) and not out.strip():  # -15: our SIGTERM
            self.error = f"nvidia-smi exited with {self._process.returncode}"
        # the first sample can predate the block's work and the last can follow it
        self._samples = parse_samples(out.splitlines())[1:-1]
        self._process = None

    def summary(self) -> dict | None:
        return summarize(self._samples)


__all__ = ["GpuTelemetry", "MIN_SAMPLES", "parse_samples", "summarize"]
