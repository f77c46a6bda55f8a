"""omni_kernels._launch: when kernels launch as programmatic dependents (PDL), and OMNI_PDL.

The GPU side (outputs with PDL equal those without, eager and in a CUDA graph, with the
quantized buffers of one call reused by the next) is in test_quantized_attention_sm90.py."""

from __future__ import annotations

import pytest
import torch

from omni_kernels import _launch


def test_environment_values(monkeypatch):
    for value, expected in (("1", True), ("0", False), (" 0 ", False)):
        monkeypatch.setenv(_launch.ENV_PDL, value)
        assert _launch._pdl_from_environment() is expected
    monkeypatch.delenv(_launch.ENV_PDL)
    assert _launch._pdl_from_environment() is True  # on by default


@pytest.mark.parametrize("value", ["yes", "2", "", "off"])
def test_environment_rejects_other_values(monkeypatch, value):
    monkeypatch.setenv(_launch.ENV_PDL, value)
    with pytest.raises(ValueError, match=r"OMNI_PDL must be one of \('0', '1'\).*got " + repr(value.strip())):
        _launch._pdl_from_environment()


def test_never_off_cuda():
    assert _launch.programmatic_launch_enabled(torch.device("cpu")) is False


def test_needs_hopper_and_compiled_triton(monkeypatch):
    """Capability < 9.0 (no griddepcontrol), the interpreter or OMNI_PDL=0 turn it off; only
    a compiled-Triton Hopper device with it allowed turns it on."""
    monkeypatch.setattr(_launch, "_HAS_GDC", True)
    monkeypatch.setattr(_launch, "triton_interpreter_enabled", lambda: False)
    capability = {"value": (9, 0)}
    monkeypatch.setattr(_launch, "cuda_capability", lambda index: capability["value"])
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(_launch, "_PDL_ALLOWED", True)
    assert _launch.programmatic_launch_enabled(cuda) is True
    capability["value"] = (8, 9)
    assert _launch.programmatic_launch_enabled(cuda) is False
    capability["value"] = (10, 0)
    assert _launch.programmatic_launch_enabled(cuda) is True
    monkeypatch.setattr(_launch, "_PDL_ALLOWED", False)
    assert _launch.programmatic_launch_enabled(cuda) is False
    monkeypatch.setattr(_launch, "_PDL_ALLOWED", True)
    monkeypatch.setattr(_launch, "triton_interpreter_enabled", lambda: True)
    assert _launch.programmatic_launch_enabled(cuda) is False
    monkeypatch.setattr(_launch, "triton_interpreter_enabled", lambda: False)
    monkeypatch.setattr(_launch, "_HAS_GDC", False)
    assert _launch.programmatic_launch_enabled(cuda) is False

