"""Which linear layers :func:`~omni_diffusion.quantization.quantize` quantizes, and how.

For each ``nn.Linear``, by name (:func:`plan_quantization`):

1. a ``skip`` pattern matches the layer or one of its parents (``fnmatch``,
   ``*`` crosses dots: ``"time_text_embed"`` keeps every linear under it,
   ``"*.proj_out"`` every block's ``proj_out``) -> kept in full precision;
2. ``include`` is given and no pattern matches it -> kept;
3. ``min(in_features, out_features) < min_features`` -> kept (too small to gain);
4. ``in_features`` or ``out_features`` not a multiple of 16 (what
   ``torch._scaled_mm`` and every 8-bit tensor-core GEMM here needs) -> kept,
   with the reason logged; an error instead when an ``include`` pattern names
   the layer (the caller asked for that very layer);
5. otherwise quantized, with the method of the first ``layer_methods`` pattern
   that matches the layer or one of its parents (same matching as ``skip``), else
   ``method`` (e.g. ``{"*.norm1.linear": "int8_weight_only"}`` for adaLN modulation
   linears, one input row per sample).

A pattern that matches nothing raises ``ValueError`` (a typo would otherwise silently
quantize a layer meant to stay bf16). There are no per-model defaults here: the family's
adapter passes its skip list.

FP8 needs FP8 tensor cores (CUDA compute capability >= 8.9): :func:`quantize`
raises ``RuntimeError`` for an FP8 method on a model that sits on an older GPU;
a model quantized on CPU and moved to such a GPU raises ``ValueError`` at its
first forward, with the same explanation. On CPU every method runs (torch's CPU
kernels: for tests and reference only).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from torch import nn

from omni_diffusion.quantization.config import QuantConfig, name_matches
from omni_kernels.quant import SCALED_MM_ALIGNMENT, fp8_unsupported_reason

logger = logging.getLogger("omni_diffusion.quantization")


@dataclass(frozen=True)
class LayerPlan:
    """What :func:`quantize` does with one ``nn.Linear``: ``action`` is ``"quantize"`` or ``"keep"``."""

    name: str
    action: str
    reason: str
    in_features: int
    out_features: int
    method: str | None = None  # the layer's method (QuantConfig.method_for) when quantized


def _unmatched(patterns, names) -> list[str]:
    return [p for p in patterns if not any(name_matches(n, p) for n in names)]


def _shape_problem(linear: nn.Linear) -> str | None:
    bad = [
        f"{what}={value}"
        for what, value in (("in_features", linear.in_features), ("out_features", linear.out_features))
        if value % SCALED_MM_ALIGNMENT
    ]
    if bad:
        return f"{' and '.join(bad)} not a multiple of {SCALED_MM_ALIGNMENT} (8-bit GEMMs need it)"
    return None


def plan_quantization(module: nn.Module, config: QuantConfig) -> list[LayerPlan]:
    """The decision for every ``nn.Linear`` of ``module``, in module order (see the module docstring).

    Raises:
        ValueError: a ``skip``/``include`` pattern matches no module, a ``layer_methods``
            pattern no linear layer, or an ``include``d layer has a shape the kernels cannot take.
    """
    config = QuantConfig.from_dict(config)
    all_names = [name for name, _ in module.named_modules()]
    linear_names = [name for name, child in module.named_modules() if isinstance(child, nn.Linear)]
    model = type(module).__name__
    for field_name, patterns, names, what in (
        ("skip", config.skip, all_names, "module"),
        ("include", config.include or (), all_names, "module"),
        ("layer_methods", [pattern for pattern, _ in config.layer_methods], linear_names, "linear layer"),
    ):
        missing = _unmatched(patterns, names)
        if missing:
            examples = ", ".join(repr(n) for n in names[1 if names is all_names else 0:][:5])
            raise ValueError(
                f"QuantConfig.{field_name} pattern(s) {missing} match no {what} of {model} "
                f"({what} names look like {examples}, ...)"
            )
    plans = []
    for name, child in module.named_modules():
        if not isinstance(child, nn.Linear):
            continue
        sizes = dict(in_features=child.in_features, out_features=child.out_features)
        skip = next((p for p in config.skip if name_matches(name, p)), None)
        if skip is not None:
            plans.append(LayerPlan(name, "keep", f"matches skip pattern {skip!r}", **sizes))
            continue
        included = None
        if config.include is not None:
            included = next((p for p in config.include if name_matches(name, p)), None)
            if included is None:
                plans.append(LayerPlan(name, "keep", "matches no include pattern", **sizes))
                continue
        smallest = min(child.in_features, child.out_features)
        if smallest < config.min_features:
            plans.append(LayerPlan(name, "keep", f"min(in, out) = {smallest} < min_features {config.min_features}", **sizes))
            continue
        problem = _shape_problem(child)
        if problem is not None:
            if included is not None:
                raise ValueError(
                    f"layer {name!r} of {model} (named by include pattern {included!r}) cannot be "
                    f"quantized: {problem}"
                )
            plans.append(LayerPlan(name, "keep", problem, **sizes))
            continue
        if not child.weight.is_floating_point():
            plans.append(LayerPlan(name, "keep", f"weight dtype {child.weight.dtype} is not floating point", **sizes))
            continue
        method = config.method_for(name)
        plans.append(LayerPlan(name, "quantize", method, **sizes, method=method))
    return plans


def warn_idle_layer_methods(plans: list[LayerPlan], config: QuantConfig) -> None:
    """Warn about ``layer_methods`` patterns whose layers are all kept in full precision (by
    ``skip``, say: a family adapter's skip list wins over the caller's methods)."""
    for pattern, method in config.layer_methods:
        named = [p for p in plans if name_matches(p.name, pattern)]
        if named and all(p.action == "keep" for p in named):
            logger.warning("quantize: QuantConfig.layer_methods pattern %r (%s) changes nothing: every layer it "
                           "names is kept in full precision (%s: %s)", pattern, method, named[0].name,
                           named[0].reason)


def check_hardware(module: nn.Module, plans: list[LayerPlan], config: QuantConfig) -> None:
    first_fp8 = {}  # device -> the first plan asking FP8 of a layer there
    for plan in plans:
        if plan.action == "quantize" and plan.method.startswith("fp8"):
            first_fp8.setdefault(module.get_submodule(plan.name).weight.device, plan)
    for device in sorted(first_fp8, key=str):
        reason = fp8_unsupported_reason(device)
        if reason is not None:
            plan = first_fp8[device]
            asked = (f"QuantConfig.method={config.method!r}" if plan.method == config.method else
                     f"QuantConfig.layer_methods gives {plan.name!r} {plan.method!r}")
            raise RuntimeError(f"{asked}: {reason}")
