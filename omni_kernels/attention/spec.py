"""What an attention backend declares it can take, and what one call asks for.

:class:`BackendSpec` declares a backend's constraints (devices, dtypes, head dims, native
layouts, causal, GQA, key lengths, key-padding masks, log-sum-exp, autograd, compute
capability, lossy or not) and how to tell whether it can run here at all
(:meth:`BackendSpec.unavailable_reason`). :class:`AttentionProblem` is one call, as backends
are checked against it (:func:`omni_kernels.attention.selection.ineligible_reason`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from omni_kernels._device import cuda_capability, cuda_index

LAYOUTS = ("bhsd", "bshd")

_DTYPE_NAMES = {
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
    torch.float64: "float64",
}


def _dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def describe_head_dims(head_dims: Sequence[int] | None) -> str:
    """``(64, 128)``, ``8..256``, ``multiples of 8 from 8 to 256`` or ``any``."""
    if head_dims is None:
        return "any"
    if isinstance(head_dims, range):
        last = head_dims[-1]
        if head_dims.step == 1:
            return f"{head_dims.start}..{last}"
        return f"multiples of {head_dims.step} from {head_dims.start} to {last}"
    return "(" + ", ".join(str(d) for d in head_dims) + ")"


def _arch_of(device: torch.device) -> tuple[str, tuple[int, int] | None]:
    """(``"sm90"``-style key, capability) for CUDA; (device type, None) otherwise."""
    if device.type != "cuda":
        return device.type, None
    capability = cuda_capability(cuda_index(device))
    return f"sm{capability[0]}{capability[1]}", capability


# --------------------------------------------------------------------------- problem


@dataclasses.dataclass(frozen=True)
class AttentionProblem:
    """What one :func:`attention` call asks for, as backends are checked against it."""

    device: torch.device
    arch: str
    capability: tuple[int, int] | None
    dtype: torch.dtype
    layout: str
    batch: int
    heads_q: int
    heads_kv: int
    seq_q: int
    seq_kv: int
    head_dim: int
    causal: bool
    key_lengths: bool
    key_padding_mask: bool
    return_lse: bool
    requires_grad: bool

    @property
    def gqa(self) -> bool:
        return self.heads_q != self.heads_kv

    @property
    def cross(self) -> bool:
        return self.seq_q != self.seq_kv

    def features(self) -> tuple[str, ...]:
        names = []
        for flag, name in (
            (self.causal, "causal"),
            (self.gqa, "gqa"),
            (self.cross, "sq!=skv"),
            (self.key_lengths, "key_lengths"),
            (self.key_padding_mask, "key_padding_mask"),
            (self.return_lse, "lse"),
            (self.requires_grad, "grad"),
        ):
            if flag:
                names.append(name)
        return tuple(names)



# --------------------------------------------------------------------------- spec


def _always_available(device: torch.device | None) -> str | None:
    return None


RunFn = Callable[..., Any]
InputCheck = Callable[..., "str | None"]


@dataclasses.dataclass(frozen=True)
class BackendSpec:
    """What a backend takes, and how to run it.

    ``run(q, k, v, *, layout, causal, scale, key_lengths, key_padding_mask,
    return_lse)`` gets tensors in ``layout`` (one of :attr:`layouts`; others are
    handed over as transposed views), ``scale`` as a float, ``key_lengths`` as
    int32 ``[B]`` or None, ``key_padding_mask`` as bool ``[B, Skv]`` or None, and
    returns ``out`` in ``layout`` or ``(out, lse)`` with ``lse`` float32
    ``[B, Hq, Sq]`` (natural log).
    """

    name: str
    run: RunFn
    description: str = ""
    #: device types (``"cuda"``, ``"cpu"``)
    devices: tuple[str, ...] = ("cuda",)
    dtypes: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)
    #: a tuple of head dims, a ``range``, or None for any
    head_dims: Sequence[int] | None = range(8, 257, 8)
    #: layouts read without a transpose: SDPA takes bhsd, flash-attn bshd
    layouts: tuple[str, ...] = ("bhsd",)
    causal: bool = True
    #: causal also when Sq != Skv, top-left aligned like SDPA's is_causal
    #: (flash-attn and FlashInfer align bottom-right there, so they say False)
    causal_cross: bool = True
    gqa: bool = True
    key_lengths: bool = False
    #: arbitrary (non-prefix) boolean key-padding masks
    key_padding_mask: bool = False
    lse: bool = False
    #: autograd (a backward) through this backend
    backward: bool = False
    min_capability: tuple[int, int] | None = None
    max_capability: tuple[int, int] | None = None
    #: quantized / approximate: never chosen by auto unless allowed
    lossy: bool = False
    #: pip name, for messages
    package: str | None = None
    #: ``(device or None) -> None | reason``; imports lazily, caches what it can
    availability: Callable[[torch.device | None], str | None] = _always_available
    #: finer checks: ``(problem, q, k, v, key_padding_mask) -> None | reason``,
    #: with q/k/v in the caller's layout; reasons read "cannot take ..." /
    #: "needs ..."
    input_check: InputCheck | None = None

    def unavailable_reason(self, device: torch.device | str | None = None) -> str | None:
        """``None`` when the backend can run here (on ``device``), else why not."""
        if device is not None:
            device = torch.device(device)
            if device.type not in self.devices:
                return f"runs on {_tuple_str(self.devices)} only, not {device.type}"
        return self.availability(device)

    def is_available(self, device: torch.device | str | None = None) -> bool:
        """Whether :meth:`unavailable_reason` is ``None``."""
        return self.unavailable_reason(device) is None


def _tuple_str(items: Sequence[str]) -> str:
    return ", ".join(items)
