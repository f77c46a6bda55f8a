"""Tensor parallelism: column/row sharded attention projections and MLPs.

The adapter's :class:`~omni_diffusion.adapters.base.TensorParallelPlan` names
the layers. A **colwise** ``nn.Linear`` is replaced by a smaller ``nn.Linear``
holding this rank's rows of the weight (output features ``[r*o/t, (r+1)*o/t)``:
whole heads, so the attention module's ``heads``, and its projection widths
``inner_dim`` / ``inner_kv_dim`` / ``kv_inner_dim`` where it has them, are
divided by ``t``: the module describes its shard, and processors that derive
the head size from ``inner_dim // heads`` keep the right one). A
**rowwise** one becomes a :class:`RowParallelLinear`: an ``nn.Linear`` with this
rank's input columns and no bias, one all-reduce (sum) of its output, then the
bias. So each attention and each MLP costs one all-reduce; Flux's single-stream
blocks, whose attention and MLP feed one packed projection, one per block.

Quantization compatibility: sharding happens on the float weights, before
:func:`omni_diffusion.quantization.quantize` (``accelerate()`` orders it so).
The shards are ordinary ``nn.Linear`` modules, and so is the inner ``linear`` of
a :class:`RowParallelLinear`, so quantization swaps them like any other layer
and computes its scales per shard (per output row of the shard, which for
colwise shards are exactly the unsharded model's rows). Layers that are already
quantized are refused.

Degrees must divide heads and MLP widths evenly (checked before anything
changes; uneven head counts are the sequence-parallel strategies' job).
"""

from __future__ import annotations

import fnmatch

import torch
from torch import nn

from omni_diffusion.adapters.base import ModelAdapter
from omni_diffusion.parallel.comm import all_reduce_sum

#: attention-module widths that scale with the heads (divided with them)
HEAD_WIDTH_ATTRS = ("inner_dim", "inner_kv_dim", "kv_inner_dim")


class RowParallelLinear(nn.Module):
    """This rank's input columns of a linear layer; outputs summed over the group.

    ``linear``: ``nn.Linear(in/t, out, bias=False)``; ``bias``: the full bias or
    None. Input ``[..., in/t]`` (the column-split activations), output ``[..., out]``.
    """

    def __init__(self, linear: nn.Module, bias: torch.Tensor | None, group) -> None:
        super().__init__()
        self.linear = linear
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = all_reduce_sum(self.linear(x), self.group)
        return out if self.bias is None else out + self.bias.to(out.dtype)


class ShardedRMSNorm(nn.Module):
    """RMSNorm over features split across the group: the mean square is all-reduced.

    Input ``[..., d/t]`` (this rank's features); ``weight``: this rank's ``d/t`` entries.
    """

    def __init__(self, weight: torch.Tensor | None, eps: float, full_dim: int, group) -> None:
        super().__init__()
        self.weight = None if weight is None else nn.Parameter(weight, requires_grad=False)
        self.eps = eps
        self.full_dim = full_dim
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        square = x.float().pow(2).sum(dim=-1, keepdim=True)
        mean = all_reduce_sum(square, self.group) / self.full_dim
        out = (x.float() * torch.rsqrt(mean + self.eps)).to(x.dtype)
        return out if self.weight is None else out * self.weight.to(x.dtype)


def _matching(transformer: nn.Module, patterns: tuple[str, ...]) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in transformer.named_modules()
            if n and any(fnmatch.fnmatchcase(n, p) for p in patterns)]


def _linear(name: str, module: nn.Module) -> nn.Linear:
    if type(module) is not nn.Linear:
        raise ValueError(
            f"tensor parallelism shards float nn.Linear layers; {name} is {type(module).__name__} "
            "(apply tensor parallelism before quantization: accelerate() does)"
        )
    return module


def _chunk(t: torch.Tensor | None, dim: int, size: int, rank: int) -> torch.Tensor | None:
    return None if t is None else t.chunk(size, dim=dim)[rank].clone()


def _new_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    out = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None,
                    device=weight.device, dtype=weight.dtype)
    out.weight.data.copy_(weight)
    if bias is not None:
        out.bias.data.copy_(bias)
    return out.requires_grad_(False)


def plan_tensor_parallel(transformer: nn.Module, adapter: ModelAdapter, size: int) -> dict:
    """Check that ``adapter``'s plan can shard ``transformer`` ``size`` ways; raise
    ``ValueError`` naming the layer otherwise. Returns the layers by style."""
    plan = adapter.tensor_parallel
    if plan is None:
        raise ValueError(f"tensor parallelism is not available for the {adapter.name} family: "
                         "its adapter declares no TensorParallelPlan")
    layers = {
        "colwise": _matching(transformer, plan.colwise),
        "rowwise": _matching(transformer, plan.rowwise),
        "packed": _matching(transformer, plan.packed_rowwise),
        "norms": _matching(transformer, plan.sharded_norms),
    }
    if not layers["colwise"] or not (layers["rowwise"] or layers["packed"]):
        raise ValueError(f"{type(transformer).__name__}: the {adapter.name} tensor-parallel plan "
                         "matches no column/row layers")
    colwise = {name for name, _ in layers["colwise"]}
    for name, module in transformer.named_modules():
        heads = getattr(module, "heads", None)
        if f"{name}.to_q" in colwise and isinstance(heads, int):
            if heads % size:
                raise ValueError(f"tp={size} does not divide the {heads} heads of {name}")
            for attr, width in _head_widths(module):
                if width % size:
                    raise ValueError(f"tp={size} does not divide {name}.{attr} = {width}")
    for name, module in layers["colwise"]:
        if _linear(name, module).out_features % size:
            raise ValueError(f"tp={size} does not divide {name}'s {module.out_features} output features")
    for name, module in layers["rowwise"]:
        if _linear(name, module).in_features % size:
            raise ValueError(f"tp={size} does not divide {name}'s {module.in_features} input features")
    for name, module in layers["packed"]:
        parts = adapter.tp_packed_sizes(transformer, name, _linear(name, module))
        if sum(parts) != module.in_features or any(p % size for p in parts):
            raise ValueError(f"tp={size} cannot split {name}'s packed input parts {parts}")
    for name, module in layers["norms"]:
        weight = getattr(module, "weight", None)
        if weight is None or weight.dim() != 1 or weight.numel() % size:
            raise ValueError(f"tp={size}: {name} is not an RMSNorm with a weight divisible by {size}")
    return layers


def _head_widths(module: nn.Module) -> list[tuple[str, int]]:
    return [(attr, getattr(module, attr)) for attr in HEAD_WIDTH_ATTRS
            if type(getattr(module, attr, None)) is int]


def enable_tensor_parallel(transformer: nn.Module, adapter: ModelAdapter, group, rank: int,
                           size: int):
    """Shard ``transformer`` over ``group`` (this rank is ``rank`` of ``size``); returns the undo.

    The replaced modules are kept for undo; their tensors move to CPU memory
    meanwhile when they were elsewhere.
    """
    layers = plan_tensor_parallel(transformer, adapter, size)
    modules = dict(transformer.named_modules())
    swaps: list[tuple[str, nn.Module, nn.Module]] = []  # name, old, new
    for name, old in layers["colwise"]:
        swaps.append((name, old, _new_linear(_chunk(old.weight, 0, size, rank),
                                              _chunk(old.bias, 0, size, rank))))
    for name, old in layers["rowwise"]:
        inner = _new_linear(_chunk(old.weight, 1, size, rank), None)
        bias = None if old.bias is None else old.bias.detach().clone()
        swaps.append((name, old, RowParallelLinear(inner, bias, group)))
    for name, old in layers["packed"]:
        parts = adapter.tp_packed_sizes(transformer, name, old)
        columns = [_chunk(piece, 1, size, rank) for piece in old.weight.split(parts, dim=1)]
        inner = _new_linear(torch.cat(columns, dim=1), None)
        bias = None if old.bias is None else old.bias.detach().clone()
        swaps.append((name, old, RowParallelLinear(inner, bias, group)))
    for name, old in layers["norms"]:
        eps = old.eps if old.eps is not None else torch.finfo(old.weight.dtype).eps
        swaps.append((name, old, ShardedRMSNorm(_chunk(old.weight, 0, size, rank), eps,
                                                old.weight.numel(), group)))
    colwise = {name for name, _ in layers["colwise"]}
    sharded_attention = [m for n, m in modules.items()
                         if f"{n}.to_q" in colwise and isinstance(getattr(m, "heads", None), int)]
    # (module, attribute, unsharded value): heads and the widths that scale with them
    counts = [(m, attr, value) for m in sharded_attention
              for attr, value in [("heads", m.heads), *_head_widths(m)]]

    placed = []
    moved: list[tuple[torch.Tensor, torch.device]] = []
    for name, old, new in swaps:
        parent_name, _, attr = name.rpartition(".")
        parent = modules[parent_name] if parent_name else transformer
        setattr(parent, attr, new)
        placed.append((parent, attr, old))
        for t in old.parameters():
            if t.device.type != "cpu":
                moved.append((t, t.device))
                t.data = t.data.to("cpu")
    for module, attr, value in counts:
        setattr(module, attr, value // size)

    def undo() -> None:
        for module, attr, value in counts:
            setattr(module, attr, value)
        for t, device in moved:
            t.data = t.data.to(device)
        for parent, attr, old in placed:
            setattr(parent, attr, old)

    return undo


__all__ = ["RowParallelLinear", "ShardedRMSNorm", "enable_tensor_parallel", "plan_tensor_parallel"]
