"""Which attention calls may run a lossy (quantized) backend: keep chosen layers and steps exact.

Quantized attention (``omni_sage``, ``omni_sage_sm90``, ``sageattention``) is fastest on long
sequences but not exact. Its error matters most in the first denoising steps (they lay out the
image), the last ones (they set fine detail) and a few sensitive layers (often the first and
last blocks). :class:`FullPrecisionPolicy` says which calls stay in full precision;
:func:`apply_attention_policy` enforces it with forward hooks that enter
:func:`omni_kernels.attention.attention_backend` contexts:

* around each transformer call: the quantized backend, or the full-precision one during the
  first ``first_steps`` / last ``last_steps`` steps (the scheduler's ``step_index``; ``None``
  before the first ``scheduler.step()`` counts as step 0);
* around each attention module in ``full_precision_layers``: the full-precision backend,
  whatever the step (the inner context wins).

The hooks steer only attention that goes through omni without a pinned backend: the diffusers
backend ``"omni"`` (``AccelConfig(attention="auto")``, ``set_attention_backend(model, "omni")``)
or SDPA patched by :func:`omni_kernels.attention.patch_sdpa`.

Layers are the attention modules (with a ``processor`` and ``set_processor``) in
``named_modules()`` order: an ``int`` indexes them (negative from the end), a ``str`` is an
``fnmatch`` pattern on their names (``"transformer_blocks.0.*"``). Which layers to keep is a
model's fact: pass it here (or from that model's adapter), never by model name in shared code.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
from collections.abc import Sequence
from typing import Any

import torch

from omni_diffusion._fields import known_fields
from omni_kernels.attention import attention_backend, get_backend


@dataclasses.dataclass(frozen=True)
class FullPrecisionPolicy:
    """Which attention calls stay in full precision.

    Attributes:
        quantized_backend: the lossy backend for the other calls, or ``"auto"`` (the
            default): ``backend="auto"`` with lossy backends allowed, which takes a lossy
            backend only where the auto table lists one for the GPU and the call is past
            its measured sequence-length crossover, and otherwise the fastest exact backend;
            the choice is logged. Name a backend
            (``"omni_sage"``) to quantize every other call whatever the table says.
        full_precision_backend: a lossless backend name, or ``"auto"`` (lossless auto).
        full_precision_layers: attention modules kept exact: indices into the
            model's attention modules (negative from the end) or ``fnmatch``
            patterns on their names.
        first_steps: the first this many denoising steps run fully exact.
        last_steps: the last this many denoising steps run fully exact.
    """

    quantized_backend: str = "auto"
    full_precision_backend: str = "auto"
    full_precision_layers: tuple[int | str, ...] = ()
    first_steps: int = 0
    last_steps: int = 0

    def __post_init__(self) -> None:
        if self.quantized_backend != "auto" and not get_backend(self.quantized_backend).lossy:
            # (get_backend raises ValueError listing the names for an unknown one)
            raise ValueError(
                f"quantized_backend={self.quantized_backend!r} is lossless; the policy is for "
                "'auto' or a lossy backend (omni_sage_sm90, omni_sage, sageattention)"
            )
        if self.full_precision_backend != "auto" and get_backend(self.full_precision_backend).lossy:
            raise ValueError(
                f"full_precision_backend={self.full_precision_backend!r} is lossy; name a lossless "
                "backend or 'auto'"
            )
        for name in ("first_steps", "last_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0; got {value!r}")
        object.__setattr__(self, "full_precision_layers", tuple(self.full_precision_layers))
        for layer in self.full_precision_layers:
            if not isinstance(layer, (int, str)) or isinstance(layer, bool):
                raise ValueError(
                    f"full_precision_layers entries are ints (attention-module indices) or str "
                    f"(fnmatch patterns on module names); got {layer!r}"
                )

    @classmethod
    def from_dict(cls, data: Any) -> FullPrecisionPolicy:
        """From a mapping of field names (``full_precision_layers`` a list); unknown keys raise
        ``ValueError`` listing the fields."""
        if not isinstance(data, dict):
            raise ValueError(f"FullPrecisionPolicy.from_dict needs a dict; got {type(data).__name__}")
        fields = known_fields(cls, data)
        layers = fields.get("full_precision_layers")
        if isinstance(layers, list):
            fields["full_precision_layers"] = tuple(layers)
        elif isinstance(layers, (str, int)):
            fields["full_precision_layers"] = (layers,)
        return cls(**fields)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict that :meth:`from_dict` reads back."""
        out = dataclasses.asdict(self)
        out["full_precision_layers"] = list(self.full_precision_layers)
        return out

    def full_precision_step(self, step_index: int, num_steps: int) -> bool:
        """Whether denoising step ``step_index`` (0-based, of ``num_steps``) runs fully exact."""
        return step_index < self.first_steps or step_index >= num_steps - self.last_steps


def attention_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``(name, module)`` of the model's attention modules, in ``named_modules()`` order."""
    return [
        (name, m) for name, m in model.named_modules()
        if hasattr(m, "processor") and callable(getattr(m, "set_processor", None))
    ]


def _select_layers(model, layers: Sequence[int | str]) -> list[torch.nn.Module]:
    modules = attention_modules(model)
    chosen: dict[int, torch.nn.Module] = {}
    for layer in layers:
        if isinstance(layer, int):
            if not -len(modules) <= layer < len(modules):
                raise ValueError(
                    f"full_precision_layers index {layer} is out of range: the model has "
                    f"{len(modules)} attention modules"
                )
            m = modules[layer][1]
            chosen[id(m)] = m
            continue
        hits = [m for name, m in modules if fnmatch.fnmatchcase(name, layer)]
        if not hits:
            names = ", ".join(name for name, _ in modules[:4])
            raise ValueError(
                f"full_precision_layers pattern {layer!r} matches no attention module (they are "
                f"named like: {names}{', ...' if len(modules) > 4 else ''})"
            )
        for m in hits:
            chosen[id(m)] = m
    return list(chosen.values())


class AttentionPolicyHandle:
    """What :func:`apply_attention_policy` installed; :meth:`remove` takes it out."""

    def __init__(self) -> None:
        self._hooks: list[Any] = []

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()


def _context_hooks(handle: AttentionPolicyHandle, module: torch.nn.Module, make_context) -> None:
    """Enter ``make_context()`` before ``module``'s forward and leave it after (also on error)."""
    stack: list[contextlib.ExitStack] = []

    def pre(mod, args):
        exit_stack = contextlib.ExitStack()
        exit_stack.enter_context(make_context())
        stack.append(exit_stack)

    def post(mod, args, output):
        if stack:
            stack.pop().close()

    handle._hooks.append(module.register_forward_pre_hook(pre))
    handle._hooks.append(module.register_forward_hook(post, always_call=True))


def apply_attention_policy(
    target: Any, policy: FullPrecisionPolicy, *, scheduler: Any = None
) -> AttentionPolicyHandle:
    """Install ``policy`` on a pipeline (its ``transformer`` and ``transformer_2``) or a model.

    Args:
        target: a diffusers pipeline, or a transformer ``nn.Module``.
        policy: the :class:`FullPrecisionPolicy`.
        scheduler: the scheduler whose ``step_index`` / ``timesteps`` give the
            denoising step; default ``target.scheduler``. Needed when
            ``first_steps`` or ``last_steps`` is set.

    Returns:
        an :class:`AttentionPolicyHandle` (``.remove()`` undoes it).

    Raises:
        ValueError: no transformer found, a layer index/pattern that matches
        nothing, or step limits without a scheduler.
    """
    if isinstance(target, torch.nn.Module):
        models = [target]
    else:
        models = [m for m in (getattr(target, "transformer", None), getattr(target, "transformer_2", None))
                  if isinstance(m, torch.nn.Module)]
        if not models:
            raise ValueError(f"target must be a torch.nn.Module or a pipeline with a transformer; got {type(target).__name__}")
    scheduler = scheduler if scheduler is not None else getattr(target, "scheduler", None)
    if (policy.first_steps or policy.last_steps) and scheduler is None:
        raise ValueError(
            "first_steps/last_steps need the scheduler (its step_index): pass the pipeline or scheduler="
        )

    def step_context():
        if scheduler is not None and (policy.first_steps or policy.last_steps):
            num_steps = len(scheduler.timesteps)
            step = scheduler.step_index or 0
            if policy.full_precision_step(step, num_steps):
                return attention_backend(policy.full_precision_backend, allow_lossy=False)
        return attention_backend(policy.quantized_backend, allow_lossy=True)

    def exact_context():
        return attention_backend(policy.full_precision_backend, allow_lossy=False)

    handle = AttentionPolicyHandle()
    try:
        for model in models:
            layers = _select_layers(model, policy.full_precision_layers)
            _context_hooks(handle, model, step_context)
            for layer in layers:
                _context_hooks(handle, layer, exact_context)
    except Exception:
        handle.remove()
        raise
    return handle


__all__ = [
    "AttentionPolicyHandle",
    "FullPrecisionPolicy",
    "apply_attention_policy",
    "attention_modules",
]
