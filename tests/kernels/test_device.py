"""omni_kernels._device: the one cache of CUDA compute capabilities every dispatcher reads."""

from __future__ import annotations

import torch


def test_one_capability_cache_for_every_dispatcher(monkeypatch):
    """omni_kernels._device asks torch once a device; the attention registry and the quantized
    linear dispatch read that same cache (the latter without asking, while compiling)."""
    from omni_kernels import _device
    from omni_kernels.attention import spec
    from omni_kernels.quant import dispatch

    asked = []
    monkeypatch.setattr(_device, "_capabilities", {})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: asked.append(index) or (9, 0))
    device = torch.device("cuda", 3)
    assert _device.known_cuda_capability(3) is None
    assert dispatch.cached_device_capability(device) is None
    assert spec._arch_of(device) == ("sm90", (9, 0))
    assert dispatch.device_capability(device) == (9, 0) and _device.cuda_capability(3) == (9, 0)
    assert dispatch.cached_device_capability(device) == (9, 0)
    assert asked == [3]


def test_a_device_without_index_means_the_current_device(monkeypatch):
    """A bare ``cuda`` device reads the current device's entry, in eager code and while tracing
    alike (the traced lookup once read device 0's)."""
    from omni_kernels import _device
    from omni_kernels.quant import dispatch

    monkeypatch.setattr(_device, "_capabilities", {0: (8, 0), 2: (9, 0)})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    bare = torch.device("cuda")
    assert dispatch.device_capability(bare) == (9, 0)
    assert dispatch.cached_device_capability(bare) == (9, 0)
    assert dispatch.cached_device_capability(torch.device("cuda", 0)) == (8, 0)
