"""What :func:`omni_diffusion.accelerate` applies: :class:`AccelConfig` and :class:`CacheConfig`.

Both are frozen dataclasses that validate on construction: a bad value raises
``ValueError`` naming the field, the value and what is allowed. They are built
in Python, from a dict (:meth:`AccelConfig.from_dict`, e.g. a JSON request body
in omni-serve) or from command-line flags (:func:`add_cli_arguments` +
:func:`from_cli_args`, shared by ``omni-generate`` and omni-serve).
``dataclasses.replace(config, ...)`` validates the new copy again.

Lossless features: ``attention`` (omni's attention backends are exact up to
floating-point rounding, except the lossy ones such as ``"sageattention"``)
and ``compile``. Lossy ones: ``quant`` and ``cache``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from omni_diffusion._fields import choice, known_fields, not_allowed
from omni_kernels.quant import QUANT_METHODS

CACHE_KINDS = ("first_block", "teacache", "cache_dit")
COMPILE_MODES = (False, True, "regional")
ATTENTION_AUTO = "auto"

#: default residual / distance thresholds per cache kind
DEFAULT_THRESHOLDS = {"first_block": 0.08, "teacache": 0.25, "cache_dit": 0.08}
#: steps at the end of each generation that are always computed, per kind
DEFAULT_FINAL_STEPS = {"first_block": 0, "teacache": 1, "cache_dit": 0}


def _allowed(values: Sequence[Any]) -> str:
    return ", ".join(repr(v) for v in values)


def attention_backend_names() -> list[str]:
    """The omni attention backends ``AccelConfig.attention`` may name (plus ``"auto"``)."""
    from omni_kernels.attention import list_backends

    return list_backends()


def _check_int(cls: str, field: str, value: Any, minimum: int, optional: bool) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        allowed = f"an integer >= {minimum}" + (" or None" if optional else "")
        raise not_allowed(cls, field, value, allowed)


# --------------------------------------------------------------------------- cache


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """Caching across denoising steps.

    Args:
        kind: ``"first_block"`` (First-Block-Cache: run the first transformer
            block; when the relative L1 change of its output residual since the
            last fully computed step is below ``threshold``, skip the other
            blocks and reuse their cached residual), ``"teacache"`` (accumulate
            the rescaled relative L1 change of the first block's
            timestep-modulated input; skip the whole transformer while the sum
            stays below ``threshold``) or ``"cache_dit"`` (the cache-dit
            package's DBCache, when it is installed).
        threshold: see ``kind``; ``0`` never skips. Default per kind:
            first_block 0.08, teacache 0.25, cache_dit 0.08.
        warmup_steps: steps at the start of each generation that are always
            computed. Default: the model adapter's (1 for most; 5 for Wan's
            TeaCache, as calibrated).
        final_steps: steps at the end that are always computed (needs the
            step count, which the pipelines tell). Default: teacache 1, others 0.
        max_consecutive_hits: at most this many skipped steps in a row
            (None: no limit).
        coefficients: TeaCache's rescaling polynomial (highest power first),
            overriding the adapter's calibrated one; TeaCache only.
        options: extra ``cache_dit.DBCacheConfig`` fields; cache_dit only.
    """

    kind: str = "first_block"
    threshold: float | None = None
    warmup_steps: int | None = None
    final_steps: int | None = None
    max_consecutive_hits: int | None = None
    coefficients: tuple[float, ...] | None = None
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        name = "CacheConfig"
        object.__setattr__(self, "kind", choice(name, "kind", self.kind, CACHE_KINDS))
        threshold = self.threshold
        if threshold is None:
            threshold = DEFAULT_THRESHOLDS[self.kind]
        if (
            isinstance(threshold, bool)
            or not isinstance(threshold, (int, float))
            or not math.isfinite(threshold)
            or threshold < 0
        ):
            raise not_allowed(name, "threshold", self.threshold, "a finite number >= 0 or None")
        object.__setattr__(self, "threshold", float(threshold))
        _check_int(name, "warmup_steps", self.warmup_steps, 0, optional=True)
        final_steps = DEFAULT_FINAL_STEPS[self.kind] if self.final_steps is None else self.final_steps
        _check_int(name, "final_steps", final_steps, 0, optional=False)
        object.__setattr__(self, "final_steps", final_steps)
        _check_int(name, "max_consecutive_hits", self.max_consecutive_hits, 1, optional=True)
        if self.coefficients is not None:
            if self.kind != "teacache":
                raise not_allowed(name, "coefficients", self.coefficients,
                                  "None unless kind='teacache' (a TeaCache rescaling polynomial)")
            try:
                coeffs = tuple(float(c) for c in self.coefficients)
            except (TypeError, ValueError):
                coeffs = ()
            if not coeffs or not all(math.isfinite(c) for c in coeffs):
                raise not_allowed(name, "coefficients", self.coefficients,
                                  "a non-empty sequence of finite numbers (highest power first) or None")
            object.__setattr__(self, "coefficients", coeffs)
        if not isinstance(self.options, Mapping):
            raise not_allowed(name, "options", self.options, "a mapping of cache_dit.DBCacheConfig fields")
        if self.options and self.kind != "cache_dit":
            raise not_allowed(name, "options", dict(self.options), "{} unless kind='cache_dit'")
        object.__setattr__(self, "options", dict(self.options))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | str) -> CacheConfig:
        """From a mapping of field names (unknown keys raise) or a bare kind string."""
        if isinstance(data, str):
            return cls(kind=data)
        return cls(**known_fields(cls, data))

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        if out["coefficients"] is not None:
            out["coefficients"] = list(out["coefficients"])
        return out

    def __hash__(self) -> int:  # options is a dict: hash the canonical JSON form
        return hash(json.dumps(self.to_dict(), sort_keys=True, default=str))


# --------------------------------------------------------------------------- accel


@dataclasses.dataclass(frozen=True)
class AccelConfig:
    """What :func:`omni_diffusion.accelerate` applies to a pipeline.

    Args:
        attention: ``"auto"`` (omni picks the fastest lossless backend per GPU
            and shape), an omni backend name (``"omni_triton"``,
            ``"sdpa_cudnn"``, ``"flash_attn3"``, ``"sageattention"`` (lossy),
            ...; see ``omni_kernels.attention.list_backends()``), or None to
            leave attention as it is.
        quant: None, or a linear quantization method of
            :mod:`omni_diffusion.quantization`: ``"fp8"``, ``"int8"``
            (dynamic activations and weights), ``"fp8_weight_only"``,
            ``"int8_weight_only"``.
        quant_skip: extra fnmatch patterns (module names relative to the
            transformer) that stay unquantized, beside the adapter's own
            (embeddings, final projection, modulation layers).
        quant_min_features: linears with fewer in/out features stay unquantized
            (None: the quantization module's default).
        quant_options: further ``omni_diffusion.quantization.QuantConfig``
            fields (``backend``, ``activation_backend``, ``clamp``,
            ``fast_accum``), checked by ``QuantConfig`` when applied.
        cache: None, a :class:`CacheConfig`, a kind string, or a dict of its fields.
        compile: False, or True / ``"regional"``: ``torch.compile`` each repeated
            transformer block (regional compilation; diffusers'
            ``compile_repeated_blocks`` where the model declares its blocks).
        compile_backend: the ``torch.compile`` backend (``"inductor"``; tests
            use ``"eager"`` / ``"aot_eager"``).
        compile_mode: the ``torch.compile`` mode (None: default, or
            ``"reduce-overhead"`` with ``cuda_graphs``).
        compile_fullgraph: None (the adapter's choice, True for the supported
            families), True or False.
        compile_dynamic: passed to ``torch.compile`` (None: torch decides).
        cuda_graphs: capture the compiled blocks as CUDA graphs (compile mode
            ``"reduce-overhead"``); needs ``compile`` and a CUDA pipeline.
        fused_norm_rope: run each attention's QK RMSNorm and rotary embedding as one
            omni kernel (the family's adapter provides the processor: Flux, Wan...). None
            (default): on where the family has one and the transformer is on a CUDA
            device (logged); True: required (an error for a family without one);
            False: diffusers' own norms and RoPE.
        prompt_encoder: None, or an
            :class:`omni_diffusion.ar.config.PromptEncoderConfig` (or a dict of its
            fields, or an exported model folder): run the pipeline's LLM text
            encoder in vLLM, batching prompts across concurrent calls.
        prompt_enhancer: None, or an
            :class:`omni_diffusion.ar.config.PromptEnhancerConfig` (or a dict, or a
            chat model name): rewrite each prompt with an LLM first.
        parallel: None, or an ``omni_diffusion.ParallelConfig`` (or a dict of
            its fields): split each generation over the ranks of a
            ``torch.distributed`` job (torchrun); see :mod:`omni_diffusion.parallel`.
            Sequence parallelism does not combine with ``cache``.
        attention_policy: None, or an
            :class:`omni_diffusion.attention.FullPrecisionPolicy` (or a dict of
            its fields, ``{}`` for its defaults): let the attention calls run a lossy
            (quantized) backend, by default only where the GPU's auto table measured one
            faster, keeping the policy's layers and first/last denoising steps exact.
            Needs ``attention="auto"``; not with ``compile`` (the compiled blocks would keep
            the backend chosen when they were traced) or sequence parallelism.
    """

    attention: str | None = ATTENTION_AUTO
    quant: str | None = None
    quant_skip: tuple[str, ...] = ()
    quant_min_features: int | None = None
    quant_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    cache: CacheConfig | None = None
    compile: bool | str = False
    compile_backend: str = "inductor"
    compile_mode: str | None = None
    compile_fullgraph: bool | None = None
    compile_dynamic: bool | None = None
    cuda_graphs: bool = False
    fused_norm_rope: bool | None = None
    prompt_encoder: Any = None
    prompt_enhancer: Any = None
    parallel: Any = None
    attention_policy: Any = None

    def __post_init__(self) -> None:
        name = "AccelConfig"
        from omni_diffusion.ar.config import PromptEncoderConfig, PromptEnhancerConfig

        for field, cls in (("prompt_encoder", PromptEncoderConfig),
                           ("prompt_enhancer", PromptEnhancerConfig)):
            value = getattr(self, field)
            if isinstance(value, (str, Mapping)):
                value = cls.from_dict(value)
            if value is not None and not isinstance(value, cls):
                raise not_allowed(name, field, value, f"None, a {cls.__name__}, a dict of its fields or a model")
            object.__setattr__(self, field, value)
        if self.attention is not None:
            object.__setattr__(self, "attention", choice(
                name, "attention", self.attention, [ATTENTION_AUTO, *attention_backend_names()], ", None"))
        if self.quant is not None:
            object.__setattr__(self, "quant", choice(name, "quant", self.quant, QUANT_METHODS, ", None"))
        skip = self.quant_skip
        if isinstance(skip, str):
            skip = (skip,)
        if not isinstance(skip, (list, tuple)) or not all(isinstance(p, str) and p for p in skip):
            raise not_allowed(name, "quant_skip", self.quant_skip, "a sequence of fnmatch patterns")
        object.__setattr__(self, "quant_skip", tuple(skip))
        _check_int(name, "quant_min_features", self.quant_min_features, 0, optional=True)
        if not isinstance(self.quant_options, Mapping) or not all(
            isinstance(k, str) for k in self.quant_options
        ):
            raise not_allowed(name, "quant_options", self.quant_options, "a mapping of QuantConfig fields")
        reserved = sorted(set(self.quant_options) & {"method", "skip", "min_features"})
        if reserved:
            raise not_allowed(name, "quant_options", dict(self.quant_options),
                              f"QuantConfig fields other than {reserved} (set through quant, quant_skip, "
                              "quant_min_features)")
        object.__setattr__(self, "quant_options", dict(self.quant_options))
        if (self.quant_skip or self.quant_min_features is not None or self.quant_options) \
                and self.quant is None:
            raise not_allowed(name, "quant_skip/quant_min_features/quant_options",
                              (self.quant_skip, self.quant_min_features, self.quant_options),
                              "only with quant set")
        cache = self.cache
        if isinstance(cache, (str, Mapping)):
            cache = CacheConfig.from_dict(cache)
        if cache is not None and not isinstance(cache, CacheConfig):
            raise not_allowed(name, "cache", self.cache,
                              f"None, a CacheConfig, a dict of its fields or one of {_allowed(CACHE_KINDS)}")
        object.__setattr__(self, "cache", cache)
        if not (isinstance(self.compile, bool) or self.compile == "regional"):
            raise not_allowed(name, "compile", self.compile, _allowed(COMPILE_MODES))
        object.__setattr__(self, "compile", "regional" if self.compile else False)
        if not isinstance(self.compile_backend, str) or not self.compile_backend:
            raise not_allowed(name, "compile_backend", self.compile_backend,
                              "a torch.compile backend name ('inductor', 'aot_eager', 'eager', ...)")
        if self.compile_mode is not None and not isinstance(self.compile_mode, str):
            raise not_allowed(name, "compile_mode", self.compile_mode, "None or a torch.compile mode name")
        for field in ("compile_fullgraph", "compile_dynamic"):
            value = getattr(self, field)
            if value is not None and not isinstance(value, bool):
                raise not_allowed(name, field, value, "None, True or False")
        if self.parallel is not None:
            from omni_diffusion.parallel.config import ParallelConfig

            parallel = self.parallel
            if isinstance(parallel, Mapping):
                parallel = ParallelConfig.from_dict(dict(parallel))
            if not isinstance(parallel, ParallelConfig):
                raise not_allowed(name, "parallel", self.parallel, "None, a ParallelConfig or a dict of its fields")
            if parallel.sequence_degree > 1 and self.cache is not None:
                raise not_allowed(name, "cache", self.cache.kind,
                                  "None with sequence parallelism (ulysses/ring > 1): each rank sees "
                                  "part of the tokens, so cache decisions would differ between ranks")
            object.__setattr__(self, "parallel", parallel if parallel.enabled else None)
        if self.attention_policy is not None:
            from omni_diffusion.attention.policy import FullPrecisionPolicy

            policy = self.attention_policy
            if isinstance(policy, Mapping):
                policy = FullPrecisionPolicy.from_dict(dict(policy))
            if not isinstance(policy, FullPrecisionPolicy):
                raise not_allowed(name, "attention_policy", self.attention_policy,
                                  "None, a FullPrecisionPolicy or a dict of its fields")
            if self.attention != ATTENTION_AUTO:
                raise not_allowed(name, "attention", self.attention,
                                  "'auto' with attention_policy (the policy steers omni's per-call choice)")
            if self.compile:
                raise not_allowed(name, "compile", self.compile,
                                  "False with attention_policy (compiled blocks keep the attention backend "
                                  "chosen when they were traced)")
            if self.parallel is not None and self.parallel.sequence_degree > 1:
                raise not_allowed(name, "attention_policy", policy.to_dict(),
                                  "None with sequence parallelism (ulysses/ring > 1)")
            object.__setattr__(self, "attention_policy", policy)
        if not isinstance(self.cuda_graphs, bool):
            raise not_allowed(name, "cuda_graphs", self.cuda_graphs, "True or False")
        if self.fused_norm_rope is not None and not isinstance(self.fused_norm_rope, bool):
            raise not_allowed(name, "fused_norm_rope", self.fused_norm_rope, "None (auto), True or False")
        if self.cuda_graphs and not self.compile:
            raise not_allowed(name, "cuda_graphs", True, "True only with compile=True/'regional'")
        if self.cuda_graphs and self.compile_mode not in (None, "reduce-overhead"):
            raise not_allowed(name, "compile_mode", self.compile_mode,
                              "None or 'reduce-overhead' with cuda_graphs=True")

    @property
    def torch_compile_mode(self) -> str | None:
        """The mode handed to ``torch.compile``."""
        if self.cuda_graphs:
            return "reduce-overhead"
        return self.compile_mode

    @property
    def lossless(self) -> bool:
        """True when nothing in the config changes results beyond rounding."""
        lossy_attention = False
        if self.attention not in (None, ATTENTION_AUTO):
            from omni_kernels.attention import get_backend

            lossy_attention = get_backend(self.attention).lossy
        return (self.quant is None and self.cache is None and not lossy_attention
                and self.attention_policy is None)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> AccelConfig:
        """From a mapping of field names; ``cache`` may be a dict or a kind string.

        Unknown keys raise ``ValueError`` listing the fields.
        """
        if not isinstance(data, Mapping):
            raise ValueError(f"AccelConfig.from_dict needs a mapping, got {type(data).__name__}")
        fields = known_fields(cls, data)
        if isinstance(fields.get("quant_skip"), list):
            fields["quant_skip"] = tuple(fields["quant_skip"])
        return cls(**fields)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict that :meth:`from_dict` reads back."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["quant_skip"] = list(self.quant_skip)
        out["quant_options"] = dict(self.quant_options)
        out["cache"] = None if self.cache is None else self.cache.to_dict()
        for field in ("prompt_encoder", "prompt_enhancer", "parallel", "attention_policy"):
            value = getattr(self, field)
            out[field] = None if value is None else value.to_dict()
        return out

    def __hash__(self) -> int:  # quant_options is a dict: hash the canonical JSON form
        return hash(json.dumps(self.to_dict(), sort_keys=True, default=str))


# --------------------------------------------------------------------------- CLI


def _none_or(value: str) -> str | None:
    return None if value.lower() in ("none", "off", "") else value


def _on_off_auto(value: str) -> bool | None:
    value = value.lower()
    if value in ("auto", "default"):
        return None
    if value in ("on", "true", "1", "yes"):
        return True
    if value in ("off", "false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected auto, on or off; got {value!r}")


def _attention_policy(value: str) -> dict | None:
    if value.lower() in ("none", "off", ""):
        return None
    if value.lower() in ("auto", "on", "default"):
        return {}
    try:
        policy = json.loads(value)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"expected none, auto or a JSON object; got {value!r} ({exc})") from None
    if not isinstance(policy, dict):
        raise argparse.ArgumentTypeError(f"expected none, auto or a JSON object; got {value!r}")
    return policy


def add_cli_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the acceleration flags (an ``omni acceleration`` group) to ``parser``.

    :func:`from_cli_args` turns the parsed namespace into an :class:`AccelConfig`.
    Values are validated there, so errors name the config field.
    """
    g = parser.add_argument_group("omni acceleration")
    g.add_argument("--attention", default=ATTENTION_AUTO, type=_none_or,
                   help="'auto' (default), an omni attention backend (omni_triton, sdpa_cudnn, "
                        "flash_attn3, sageattention, ...) or 'none' to leave attention alone")
    g.add_argument("--quant", default=None, type=_none_or,
                   help=f"linear quantization: none (default), {', '.join(QUANT_METHODS)}")
    g.add_argument("--quant-skip", action="append", default=[], metavar="PATTERN",
                   help="extra fnmatch pattern of transformer modules to keep unquantized (repeatable)")
    g.add_argument("--quant-min-features", type=int, default=None, metavar="N")
    g.add_argument("--cache", default=None, type=_none_or,
                   help=f"step caching: none (default), {', '.join(CACHE_KINDS)}")
    g.add_argument("--cache-threshold", type=float, default=None, metavar="X")
    g.add_argument("--cache-warmup-steps", type=int, default=None, metavar="N")
    g.add_argument("--cache-final-steps", type=int, default=None, metavar="N")
    g.add_argument("--cache-max-consecutive-hits", type=int, default=None, metavar="N")
    g.add_argument("--compile", action="store_true",
                   help="regional torch.compile of the repeated transformer blocks")
    g.add_argument("--compile-backend", default="inductor")
    g.add_argument("--compile-mode", default=None)
    g.add_argument("--compile-fullgraph", type=_on_off_auto, default=None, metavar="auto|on|off")
    g.add_argument("--cuda-graphs", action="store_true",
                   help="CUDA graphs for the compiled blocks (implies mode reduce-overhead)")
    g.add_argument("--fused-norm-rope", type=_on_off_auto, default=None, metavar="auto|on|off",
                   help="QK RMSNorm + rotary embedding as one omni kernel (auto: on for families "
                        "with one, on CUDA)")
    g.add_argument("--attention-policy", default=None, type=_attention_policy, metavar="auto|JSON",
                   help="let attention run a quantized backend where the GPU's auto table measured "
                        "one faster: 'auto', or a JSON object of FullPrecisionPolicy fields keeping "
                        "layers/steps exact, e.g. '{\"first_steps\": 2, \"full_precision_layers\": [0, -1]}'")
    g.add_argument("--prompt-encoder", default=None, type=_none_or, metavar="auto|FOLDER",
                   help="run the pipeline's LLM text encoder in vLLM: 'auto' exports the "
                        "pipeline's own, or a folder written by omni_diffusion.ar.export")
    g.add_argument("--prompt-encoder-url", default=None, metavar="URL",
                   help="an OpenAI-compatible vLLM server serving the prompt encoder")
    g.add_argument("--prompt-enhancer", default=None, type=_none_or, metavar="MODEL",
                   help="rewrite prompts with this chat model in vLLM before encoding")
    g.add_argument("--prompt-enhancer-url", default=None, metavar="URL",
                   help="an OpenAI-compatible vLLM server serving the prompt enhancer")
    g.add_argument("--vllm-gpu-memory-utilization", type=float, default=0.3, metavar="X",
                   help="each vLLM stage's share of the GPU memory (default 0.3)")
    return parser


def from_cli_args(args: argparse.Namespace) -> AccelConfig:
    """The :class:`AccelConfig` that flags added by :func:`add_cli_arguments` describe."""
    cache = None
    if args.cache is not None:
        cache = CacheConfig(
            kind=args.cache,
            threshold=args.cache_threshold,
            warmup_steps=args.cache_warmup_steps,
            final_steps=args.cache_final_steps,
            max_consecutive_hits=args.cache_max_consecutive_hits,
        )
    else:
        given = [flag for flag, value in (
            ("--cache-threshold", args.cache_threshold),
            ("--cache-warmup-steps", args.cache_warmup_steps),
            ("--cache-final-steps", args.cache_final_steps),
            ("--cache-max-consecutive-hits", args.cache_max_consecutive_hits),
        ) if value is not None]
        if given:
            raise ValueError(f"{', '.join(given)} need --cache")
    prompt_stages = {}
    for stage, flag in (("prompt_encoder", "--prompt-encoder"), ("prompt_enhancer", "--prompt-enhancer")):
        model, url = getattr(args, stage, None), getattr(args, f"{stage}_url", None)
        if model is None and url is None:
            continue
        fields: dict[str, Any] = dict(gpu_memory_utilization=args.vllm_gpu_memory_utilization)
        if model is not None and model != "auto":
            fields["model"] = model
        if url is not None:
            fields.update(placement="server", url=url)
        if stage == "prompt_enhancer" and model is None:
            raise ValueError(f"{flag}-url needs {flag} MODEL (the served model)")
        prompt_stages[stage] = fields
    return AccelConfig(
        **prompt_stages,
        attention=args.attention,
        quant=args.quant,
        quant_skip=tuple(args.quant_skip),
        quant_min_features=args.quant_min_features,
        cache=cache,
        compile=bool(args.compile),
        compile_backend=args.compile_backend,
        compile_mode=args.compile_mode,
        compile_fullgraph=args.compile_fullgraph,
        cuda_graphs=bool(args.cuda_graphs),
        fused_norm_rope=getattr(args, "fused_norm_rope", None),
        attention_policy=getattr(args, "attention_policy", None),
    )


__all__ = [
    "CACHE_KINDS",
    "QUANT_METHODS",
    "AccelConfig",
    "CacheConfig",
    "add_cli_arguments",
    "attention_backend_names",
    "from_cli_args",
]
