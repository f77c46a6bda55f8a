"""Attention backends: what each one takes, and which one runs a call.

Every backend is a :class:`BackendSpec`, registered once at import by its module
in :mod:`omni_kernels.attention.backends`. A spec *declares* what the backend
takes (devices, dtypes, head dims, native layouts, causal, GQA, key lengths,
key-padding masks, log-sum-exp, autograd, compute capability, lossy or not)
and how to tell whether it can run at all here (:meth:`BackendSpec.unavailable_reason`:
package missing, no CUDA, wrong GPU, extension that fails to load). Nothing is
imported from a third-party package until a backend is asked about.

Choosing a backend for :func:`attention`, first match wins:

1. the ``backend=`` argument (``"auto"`` included);
2. the innermost :func:`attention_backend` context (per thread / asyncio task:
   a :class:`contextvars.ContextVar`);
3. the environment variable ``OMNI_ATTENTION_BACKEND``;
4. ``"auto"``.

A named backend that cannot take the call raises ``ValueError`` naming the
backend and the constraint it violates; it never silently falls back.
``"auto"`` walks the ranking for the device's architecture (``"sm90"``,
``"sm100"``, ... from ``torch.cuda.get_device_capability``; ``"cpu"``) in
``auto_table.json`` (``bench/attention.py --write-auto-table`` regenerates it)
and takes the first backend that can take the call. Lossy backends (quantized
attention such as SageAttention) are candidates only when the table lists them
for that architecture *and* the caller allows lossy backends (``allow_lossy=True``,
``attention_backend(..., allow_lossy=True)`` or ``OMNI_ATTENTION_ALLOW_LOSSY=1``).
A lossy backend may also carry a measured crossover (the arch entry's
``lossy_min_seq``, written by ``bench/attention.py --lossy-sweep``): ``"auto"``
skips it for calls with ``min(Sq, Skv)`` below it, where the lossless first
choice was faster (quantization costs time linear in the sequence, attention
quadratic). The choice is logged (``logging.INFO``, logger
``omni_kernels.attention``) once per ``(arch, dtype, head_dim, features)`` (and
sequence lengths, where a crossover applies), never while ``torch.compile`` traces.

Masks: ``key_lengths`` (integer ``[B]``: keys ``j >= key_lengths[b]`` are
ignored) is the mask form backends take natively. A boolean key-padding mask
``attn_mask`` (``[B, Skv]`` or ``[B, 1, 1, Skv]``, True = attend) is accepted
too: an all-True mask is dropped; when every row is a prefix
(``True...True False...False``) it is turned into ``key_lengths``. Both checks
read the mask (one device-to-host sync per call; under ``torch.compile`` they
are skipped and the mask is kept as a mask). Any other mask can run only on
backends that take arbitrary key-padding masks (``sdpa_cudnn``,
``sdpa_efficient``, ``sdpa_math``).
Other masks (per query, additive, per head) are not accepted: call torch's SDPA.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import json
import logging
import math
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from omni_kernels._device import cuda_capability, cuda_index

logger = logging.getLogger("omni_kernels.attention")

AUTO = "auto"
LAYOUTS = ("bhsd", "bshd")
ENV_BACKEND = "OMNI_ATTENTION_BACKEND"
ENV_ALLOW_LOSSY = "OMNI_ATTENTION_ALLOW_LOSSY"
ENV_AUTO_TABLE = "OMNI_ATTENTION_AUTO_TABLE"
AUTO_TABLE_PATH = Path(__file__).with_name("auto_table.json")

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

    def ineligible_reason(
        self,
        problem: AttentionProblem,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key_padding_mask: torch.Tensor | None,
    ) -> str | None:
        """``None`` when this backend can take the call, else the violated constraint."""
        p = problem
        if p.device.type not in self.devices:
            return f"cannot run on device {p.device.type}: runs on {_tuple_str(self.devices)}"
        reason = _availability(self, p.device)
        if reason is not None:
            return f"is not available: {reason}"
        if p.capability is not None:
            cc = f"{p.capability[0]}.{p.capability[1]}"
            if self.min_capability is not None and p.capability < self.min_capability:
                need = f"{self.min_capability[0]}.{self.min_capability[1]}"
                return f"needs compute capability >= {need}: the GPU has {cc} ({p.arch})"
            if self.max_capability is not None and p.capability > self.max_capability:
                top = f"{self.max_capability[0]}.{self.max_capability[1]}"
                return f"needs compute capability <= {top}: the GPU has {cc} ({p.arch})"
        if p.dtype not in self.dtypes:
            names = "(" + ", ".join(_dtype_name(d) for d in self.dtypes) + ")"
            return f"cannot take dtype={_dtype_name(p.dtype)}: supports {names}"
        if self.head_dims is not None and p.head_dim not in self.head_dims:
            return f"cannot take head_dim={p.head_dim}: supports {describe_head_dims(self.head_dims)}"
        if p.causal and not self.causal:
            return "cannot take causal=True"
        if p.causal and p.cross and not self.causal_cross:
            return (
                f"cannot take causal=True with Sq ({p.seq_q}) != Skv ({p.seq_kv}): its causal "
                "mask is bottom-right aligned, omni's is top-left (as SDPA's is_causal)"
            )
        if p.gqa and not self.gqa:
            return f"cannot take GQA (Hq={p.heads_q}, Hkv={p.heads_kv}): needs Hq == Hkv"
        if p.key_lengths and not self.key_lengths:
            return "cannot take key_lengths (per-sample key lengths)"
        if p.key_padding_mask and not self.key_padding_mask:
            return "cannot take a non-prefix key-padding mask (only key_lengths / prefix masks)"
        if p.return_lse and not self.lse:
            return "cannot return lse (return_lse=True)"
        if p.requires_grad and not self.backward:
            return "is forward-only: inputs require grad (use torch.no_grad() or another backend)"
        if self.input_check is not None:
            reason = self.input_check(p, q, k, v, key_padding_mask)
            if reason is not None:
                return reason
        return None


def _availability(spec: BackendSpec, device: torch.device) -> str | None:
    if torch.compiler.is_compiling():
        index = -1 if device.index is None else device.index
        return _availability_while_tracing(spec.name, device.type, index)
    return spec.availability(device)


@torch.compiler.assume_constant_result
def _availability_while_tracing(name: str, device_type: str, index: int) -> str | None:
    # Availability is a property of the process (imports, CUDA), not of the
    # inputs: torch.compile runs this once at trace time and keeps the result
    # as a constant, instead of tracing the lazy imports inside.
    device = torch.device(device_type) if index < 0 else torch.device(device_type, index)
    return _REGISTRY[name].availability(device)


def _tuple_str(items: Sequence[str]) -> str:
    return ", ".join(items)


_REGISTRY: dict[str, BackendSpec] = {}


def register_backend(spec: BackendSpec, *, replace: bool = False) -> BackendSpec:
    """Add ``spec`` to the registry (``replace=True`` to overwrite a name)."""
    name = spec.name
    if name == AUTO or not name or name != name.lower():
        raise ValueError(f"backend names are lower-case and not {AUTO!r}; got {name!r}")
    if name in _REGISTRY and not replace:
        raise ValueError(f"attention backend {name!r} is already registered")
    for layout in spec.layouts:
        if layout not in LAYOUTS:
            raise ValueError(f"backend {name!r}: layout {layout!r} is not one of {LAYOUTS}")
    _REGISTRY[name] = spec
    _RANKING_CACHE.clear()
    return spec


def unregister_backend(name: str) -> None:
    """Remove a registered backend (for tests and plug-ins)."""
    _REGISTRY.pop(name, None)
    _RANKING_CACHE.clear()


def _ensure_builtin_backends() -> None:
    if not _BUILTINS_LOADED:
        _load_builtins()


_BUILTINS_LOADED = False


def _load_builtins() -> None:
    global _BUILTINS_LOADED
    _BUILTINS_LOADED = True
    import omni_kernels.attention.backends  # noqa: F401  (registers each backend)


def list_backends() -> list[str]:
    """Registered backend names, in registration order (``"auto"`` not included)."""
    _ensure_builtin_backends()
    return list(_REGISTRY)


def get_backend(name: str) -> BackendSpec:
    """The spec of a registered backend; ``ValueError`` listing the names otherwise."""
    _ensure_builtin_backends()
    key = _normalize_name(name)
    if key == AUTO:
        raise ValueError("'auto' is a policy, not a backend; pass a backend name")
    return _REGISTRY[key]


def _normalize_name(name: Any, source: str = "argument") -> str:
    if not isinstance(name, str):
        raise ValueError(f"attention backend must be a string; got {type(name).__name__} ({source})")
    key = name.strip().lower()
    if key != AUTO and key not in _REGISTRY:
        names = ", ".join([AUTO, *_REGISTRY])
        where = "" if source == "argument" else f" (from {source})"
        raise ValueError(f"unknown attention backend {name!r}{where}; choose one of: {names}")
    return key


def backend_status(device: torch.device | str | None = None) -> dict[str, str | None]:
    """For each registered backend: ``None`` if it can run here, else why not.

    ``device`` defaults to the current CUDA device when there is one, else CPU.
    """
    _ensure_builtin_backends()
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    status = {}
    for name, spec in _REGISTRY.items():
        reason = spec.unavailable_reason(device)
        if reason is None and device.type == "cuda":
            _, cap = _arch_of(device)
            if spec.min_capability is not None and cap < spec.min_capability:
                reason = f"needs compute capability >= {spec.min_capability}, GPU has {cap}"
            elif spec.max_capability is not None and cap > spec.max_capability:
                reason = f"needs compute capability <= {spec.max_capability}, GPU has {cap}"
        status[name] = reason
    return status


# --------------------------------------------------------------------------- selection state

_CONTEXT: contextvars.ContextVar[tuple[str, bool | None] | None] = contextvars.ContextVar(
    "omni_attention_backend", default=None
)


@contextlib.contextmanager
def attention_backend(name: str = AUTO, *, allow_lossy: bool | None = None) -> Iterator[None]:
    """Use backend ``name`` for :func:`attention` calls that do not pass ``backend=``.

    Thread- and task-local (a ``ContextVar``); nests (the innermost wins) and
    restores the previous choice on exit. ``allow_lossy`` applies to ``"auto"``
    inside the block. Unknown names raise ``ValueError`` on entry. Code compiled
    by ``torch.compile`` keeps the choice in effect when it was traced: a
    different context entered after a trace logs a warning (once per choice).
    """
    _ensure_builtin_backends()
    key = _normalize_name(name, "attention_backend()")
    _warn_if_traced_under_another((key, allow_lossy))
    token = _CONTEXT.set((key, allow_lossy))
    try:
        yield
    finally:
        _CONTEXT.reset(token)


# The attention_backend() choices (None: no context) that compiled graphs were traced under,
# and the later contexts already warned about.
_TRACED_CHOICES: set = set()
_WARNED_CHOICES: set = set()


@torch._dynamo.assume_constant_result
def _context_choice() -> tuple[str, bool | None] | None:
    """The innermost :func:`attention_backend` choice, or None.

    Under ``torch.compile`` this is read once, when the graph is traced (Dynamo
    cannot trace ``ContextVar.get``): a compiled region keeps the backend that
    was in effect then. Eager calls read it on every call.
    """
    choice = _CONTEXT.get()
    if torch.compiler.is_compiling():  # runs as plain Python while Dynamo traces
        _TRACED_CHOICES.add(choice)
    return choice


def _warn_if_traced_under_another(choice: tuple[str, bool | None]) -> None:
    """Warn once per choice when compiled attention was traced under other contexts only:
    the compiled code will not see this one."""
    if not _TRACED_CHOICES or choice in _TRACED_CHOICES or choice in _WARNED_CHOICES:
        return
    if torch.compiler.is_compiling():
        return
    _WARNED_CHOICES.add(choice)
    traced = ", ".join("no context" if c is None else f"attention_backend({c[0]!r}, allow_lossy={c[1]!r})"
                       for c in sorted(_TRACED_CHOICES, key=str))
    logger.warning(
        "attention_backend(%r, allow_lossy=%r): torch.compile traced omni attention under %s; "
        "compiled code keeps the backend chosen then, so this context reaches eager calls only "
        "(torch._dynamo.reset() and a new trace would take it)", choice[0], choice[1], traced,
    )


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def resolve_backend_request(
    backend: str | None = None, allow_lossy: bool | None = None
) -> tuple[str, bool, str]:
    """``(name, allow_lossy, source)`` after precedence: argument > context > env > auto."""
    _ensure_builtin_backends()
    ctx = _context_choice()
    if backend is not None:
        name, source = _normalize_name(backend), "argument"
    elif ctx is not None:
        name, source = ctx[0], "attention_backend() context"
    else:
        env = os.environ.get(ENV_BACKEND, "").strip()
        if env:
            name, source = _normalize_name(env, ENV_BACKEND), ENV_BACKEND
        else:
            name, source = AUTO, "default"
    if allow_lossy is None:
        if ctx is not None and ctx[1] is not None:
            allow_lossy = ctx[1]
        else:
            allow_lossy = _env_flag(ENV_ALLOW_LOSSY)
    return name, bool(allow_lossy), source


# --------------------------------------------------------------------------- auto table

_TABLE_CACHE: dict[str, dict] = {}
_MIN_SEQ_CACHE: dict[tuple[str, str], dict[str, int]] = {}  # (table path, arch): lossy_min_seq
# (table path, arch, allow_lossy): auto's order; cleared with the table and on (un)registration
_RANKING_CACHE: dict[tuple[str, str, bool], tuple[str, ...]] = {}


def auto_table_path() -> Path:
    override = os.environ.get(ENV_AUTO_TABLE, "").strip()
    return Path(override) if override else AUTO_TABLE_PATH


def load_auto_table(path: str | Path | None = None) -> dict:
    """The ranking table (``auto_table.json``, or ``$OMNI_ATTENTION_AUTO_TABLE``), cached."""
    path = Path(path) if path is not None else auto_table_path()
    key = str(path)
    table = _TABLE_CACHE.get(key)
    if table is None:
        try:
            table = json.loads(path.read_text())
        except FileNotFoundError:
            logger.warning("attention auto table %s not found; ranking by registration order", path)
            table = {}
        _TABLE_CACHE[key] = table
    return table


def reload_auto_table() -> None:
    """Forget the cached table (after ``bench/attention.py --write-auto-table``)."""
    _TABLE_CACHE.clear()
    _MIN_SEQ_CACHE.clear()
    _RANKING_CACHE.clear()


def _arch_entry(arch: str) -> dict:
    archs = load_auto_table().get("archs", {})
    entry = archs.get(arch)
    if entry is None and arch.startswith("sm"):
        entry = archs.get("cuda_default")
    if entry is None:
        entry = archs.get("default", {})
    return entry


def lossy_min_seq(arch: str) -> dict[str, int]:
    """``{lossy backend: shortest min(Sq, Skv) at which "auto" may pick it}`` on ``arch``.

    From the arch entry's ``lossy_min_seq`` in the auto table (measured by
    ``bench/attention.py --lossy-sweep``); empty when the entry has none.
    Raises ``ValueError`` on a malformed entry (the table is data, checked when read).
    """
    key = (str(auto_table_path()), arch)
    cached = _MIN_SEQ_CACHE.get(key)
    if cached is not None:
        return dict(cached)  # a copy: the cache stays as read
    raw = _arch_entry(arch).get("lossy_min_seq", {})
    if not isinstance(raw, dict):
        raise ValueError(f"auto table: lossy_min_seq for {arch!r} must be an object; got {raw!r}")
    out = {}
    for name, value in raw.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(
                f"auto table: lossy_min_seq[{name!r}] for {arch!r} must be an integer >= 1; got {value!r}"
            )
        out[name] = value
    _MIN_SEQ_CACHE[key] = out  # read on every eager "auto" call with lossy allowed
    return dict(out)


def auto_ranking(arch: str, *, allow_lossy: bool = False) -> list[str]:
    """The order in which ``"auto"`` tries backends on ``arch`` (``"sm90"``, ``"cpu"``, ...).

    The table's ranking for ``arch`` (else ``"cuda_default"`` for an unlisted
    GPU, else ``"default"``), then every other registered *lossless* backend
    in registration order. A lossy backend appears only when the table lists
    it for the arch and ``allow_lossy`` is true.
    """
    _ensure_builtin_backends()
    key = (str(auto_table_path()), arch, bool(allow_lossy))
    cached = _RANKING_CACHE.get(key)
    if cached is None:
        cached = _RANKING_CACHE[key] = tuple(_build_ranking(arch, allow_lossy))
    return list(cached)


def _build_ranking(arch: str, allow_lossy: bool) -> list[str]:
    entry = _arch_entry(arch)
    order = []
    for name in entry.get("ranking", []):
        spec = _REGISTRY.get(name)
        if spec is None or name in order:
            continue
        if spec.lossy and not allow_lossy:
            continue
        order.append(name)
    for name, spec in _REGISTRY.items():
        if name not in order and not spec.lossy:
            order.append(name)
    return order


_LOGGED_CHOICES: set[tuple] = set()


@torch.compiler.assume_constant_result
def _ranking_while_tracing(arch: str, allow_lossy: bool) -> tuple[str, ...]:
    # The table is read from disk: torch.compile evaluates this once at trace
    # time and keeps the ranking as a constant.
    return tuple(auto_ranking(arch, allow_lossy=allow_lossy))


def _ranking(arch: str, allow_lossy: bool):
    if torch.compiler.is_compiling():
        return _ranking_while_tracing(arch, allow_lossy)
    return auto_ranking(arch, allow_lossy=allow_lossy)


@torch.compiler.assume_constant_result
def _lossy_min_seq_while_tracing(arch: str) -> tuple[tuple[str, int], ...]:
    return tuple(sorted(lossy_min_seq(arch).items()))


def _lossy_thresholds(arch: str, allow_lossy: bool) -> dict[str, int]:
    if not allow_lossy:
        return {}
    if torch.compiler.is_compiling():
        return dict(_lossy_min_seq_while_tracing(arch))
    return lossy_min_seq(arch)


def _choose_auto(problem, q, k, v, mask, allow_lossy) -> BackendSpec:
    skipped = []
    thresholds = _lossy_thresholds(problem.arch, allow_lossy)
    shortest = min(problem.seq_q, problem.seq_kv)
    for name in _ranking(problem.arch, allow_lossy):
        spec = _REGISTRY[name]
        threshold = thresholds.get(name)
        if threshold is not None and shortest < threshold:
            skipped.append((name, f"min(Sq, Skv)={shortest} is below its measured crossover {threshold} "
                                  f"on {problem.arch} (auto table lossy_min_seq)"))
            continue
        reason = spec.ineligible_reason(problem, q, k, v, mask)
        if reason is None:
            _log_choice(problem, spec, skipped, bool(thresholds))
            return spec
        skipped.append((name, reason))
    detail = "; ".join(f"{n}: {r}" for n, r in skipped)
    raise ValueError(
        f"backend='auto' found no attention backend for {problem.arch} {_dtype_name(problem.dtype)} "
        f"head_dim={problem.head_dim} features={list(problem.features())}: {detail}"
    )


def _log_choice(problem: AttentionProblem, spec: BackendSpec, skipped, length_rule: bool = False) -> None:
    if torch.compiler.is_compiling():
        return
    key = (problem.arch, problem.dtype, problem.head_dim, problem.features())
    if length_rule:  # the choice depends on the sequence lengths too
        key += (problem.seq_q, problem.seq_kv)
    if key in _LOGGED_CHOICES:
        return
    _LOGGED_CHOICES.add(key)
    extra = ""
    if skipped:
        extra = " (skipped " + "; ".join(f"{n}: {r}" for n, r in skipped) + ")"
    logger.info(
        "omni attention backend='auto' chose %r for %s %s head_dim=%d features=%s%s",
        spec.name, problem.arch, _dtype_name(problem.dtype), problem.head_dim,
        list(problem.features()), extra,
    )


# --------------------------------------------------------------------------- masks


def normalize_key_padding_mask(attn_mask: torch.Tensor, batch: int, seq_kv: int) -> torch.Tensor:
    """``attn_mask`` as a bool ``[B, Skv]`` key-padding mask (True = attend), or ``ValueError``.

    Accepts ``[B, Skv]``, and the SDPA-broadcastable ``[B, 1, 1, Skv]`` / ``[B, 1, Skv]``.
    """
    if not isinstance(attn_mask, torch.Tensor) or attn_mask.dtype != torch.bool:
        kind = attn_mask.dtype if isinstance(attn_mask, torch.Tensor) else type(attn_mask).__name__
        raise ValueError(
            f"attn_mask must be a boolean key-padding mask [B, Skv] (True = attend); got {kind}. "
            "Additive or per-query masks are not supported here: use torch SDPA."
        )
    shape = tuple(attn_mask.shape)
    if len(shape) >= 2 and all(s == 1 for s in shape[1:-1]):
        mask = attn_mask.reshape(shape[0], shape[-1])
        if mask.shape[0] == batch and mask.shape[1] == seq_kv:
            return mask
    raise ValueError(
        f"attn_mask must be a boolean key-padding mask of shape [B, Skv] = [{batch}, {seq_kv}] "
        f"(or [B, 1, 1, Skv]); got {shape}. Per-query or per-head masks are not supported here: "
        "use torch SDPA."
    )


def key_padding_mask_to_lengths(mask: torch.Tensor) -> torch.Tensor | None:
    """int32 ``[B]`` key lengths when every row of the bool ``[B, Skv]`` mask is a prefix, else None.

    Syncs with the device once (the check reads the mask's values).
    """
    lengths, _ = _mask_lengths(mask)
    return lengths


def _mask_lengths(mask: torch.Tensor) -> tuple[torch.Tensor | None, bool]:
    """``(lengths or None, all keys kept)`` for a bool ``[B, Skv]`` mask, in one host sync."""
    lengths = mask.sum(dim=-1, dtype=torch.int32)
    positions = torch.arange(mask.shape[-1], device=mask.device)
    prefix = torch.eq(mask, positions[None, :] < lengths[:, None]).all()
    full = mask.all()
    is_prefix, is_full = torch.stack([prefix, full]).tolist()
    return (lengths if is_prefix else None), bool(is_full)


# --------------------------------------------------------------------------- attention


def _validate(q, k, v, layout, key_lengths):
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}; got {layout!r}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a 4-D tensor in layout {layout!r}; got {shape}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be floating point; got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k and v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must share a device; got {q.device}, {k.device}, {v.device}")
    if layout == "bhsd":
        batch, hq, sq, d = q.shape
        bk, hkv, skv, dk = k.shape
        bv, hv, sv, dv = v.shape
    else:
        batch, sq, hq, d = q.shape
        bk, skv, hkv, dk = k.shape
        bv, sv, hv, dv = v.shape
    if not (batch == bk == bv):
        raise ValueError(f"q, k and v must share the batch size; got {batch}, {bk}, {bv}")
    if (hkv, skv) != (hv, sv):
        raise ValueError(f"k and v must have the same heads and length; got {tuple(k.shape)}, {tuple(v.shape)}")
    if not (d == dk == dv):
        raise ValueError(f"q, k and v must share head_dim; got {d}, {dk}, {dv}")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    if key_lengths is not None:
        if (
            not isinstance(key_lengths, torch.Tensor)
            or key_lengths.dtype.is_floating_point
            or key_lengths.dtype == torch.bool
            or tuple(key_lengths.shape) != (batch,)
        ):
            raise ValueError(f"key_lengths must be an integer tensor of shape [B] = [{batch}]")
    return batch, hq, hkv, sq, skv, d


def _swap(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2)


def _plan(q, k, v, backend, layout, causal, key_lengths, attn_mask, return_lse, allow_lossy):
    """``(spec, key_lengths, key_padding_mask)`` for a call, or ``ValueError``."""
    batch, hq, hkv, sq, skv, d = _validate(q, k, v, layout, key_lengths)
    name, lossy_ok, source = resolve_backend_request(backend, allow_lossy)

    mask = None
    if attn_mask is not None:
        if key_lengths is not None:
            raise ValueError("pass key_lengths or attn_mask, not both")
        mask = normalize_key_padding_mask(attn_mask, batch, skv)
        if mask.device != q.device:
            mask = mask.to(q.device)
        if not torch.compiler.is_compiling():
            lengths, full = _mask_lengths(mask)
            if full:  # nothing masked: drop the mask
                mask = None
            elif lengths is not None:
                key_lengths, mask = lengths, None
    if key_lengths is not None and (
        key_lengths.dtype != torch.int32 or key_lengths.device != q.device
    ):
        key_lengths = key_lengths.to(device=q.device, dtype=torch.int32)

    arch, capability = _arch_of(q.device)
    problem = AttentionProblem(
        device=q.device, arch=arch, capability=capability, dtype=q.dtype, layout=layout,
        batch=batch, heads_q=hq, heads_kv=hkv, seq_q=sq, seq_kv=skv, head_dim=d,
        causal=bool(causal), key_lengths=key_lengths is not None,
        key_padding_mask=mask is not None, return_lse=bool(return_lse),
        requires_grad=torch.is_grad_enabled()
        and (q.requires_grad or k.requires_grad or v.requires_grad),
    )
    if name == AUTO:
        spec = _choose_auto(problem, q, k, v, mask, lossy_ok)
    else:
        spec = _REGISTRY[name]
        reason = spec.ineligible_reason(problem, q, k, v, mask)
        if reason is not None:
            where = "" if source == "argument" else f" (from {source})"
            raise ValueError(f"backend={name!r}{where} {reason}")
    return spec, key_lengths, mask


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    backend: str | None = None,
    layout: str = "bhsd",
    causal: bool = False,
    scale: float | None = None,
    key_lengths: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
    return_lse: bool = False,
    allow_lossy: bool | None = None,
):
    """Scaled dot-product attention (forward) through the best or the named backend.

    Args:
        q, k, v: ``layout="bhsd"``: ``[B, Hq, Sq, D]`` and ``[B, Hkv, Skv, D]``;
            ``layout="bshd"`` (diffusers): ``[B, Sq, Hq, D]`` and ``[B, Skv, Hkv, D]``.
            Same dtype and device; ``Hq % Hkv == 0`` (GQA/MQA).
        backend: a registered name (:func:`list_backends`), ``"auto"``, or None:
            the :func:`attention_backend` context, else ``$OMNI_ATTENTION_BACKEND``,
            else ``"auto"``.
        causal: top-left aligned, as SDPA's ``is_causal``: query ``i`` sees keys ``j <= i``.
        scale: default ``1 / sqrt(D)``.
        key_lengths: integer ``[B]``; keys ``j >= key_lengths[b]`` are ignored.
            Rows with no key give 0 on omni_triton and NaN on the SDPA backends.
        attn_mask: bool key-padding mask ``[B, Skv]`` (or ``[B, 1, 1, Skv]``),
            True = attend; see the module docstring. Not with ``key_lengths``.
        return_lse: also return the natural-log log-sum-exp, float32 ``[B, Hq, Sq]``.
        allow_lossy: let ``"auto"`` pick a lossy (quantized) backend where the
            table ranks one; None: the context's or ``$OMNI_ATTENTION_ALLOW_LOSSY``.

    Returns:
        ``out`` in ``q``'s layout, shape and dtype (possibly a transposed view),
        or ``(out, lse)``.

    Raises:
        ValueError: bad arguments; an unknown backend name (the message lists
        them); a named backend that cannot take the call (the message names the
        constraint); no backend for ``"auto"``.
    """
    spec, key_lengths, mask = _plan(
        q, k, v, backend, layout, causal, key_lengths, attn_mask, return_lse, allow_lossy
    )
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    return run_backend(
        spec, q, k, v, layout=layout, causal=bool(causal), scale=float(scale),
        key_lengths=key_lengths, key_padding_mask=mask, return_lse=bool(return_lse),
    )


def run_backend(
    spec: BackendSpec, q, k, v, *, layout, causal, scale, key_lengths, key_padding_mask, return_lse
):
    """Run ``spec`` unchecked, converting layouts by transposed views."""
    native = layout if layout in spec.layouts else spec.layouts[0]
    if native != layout:
        q, k, v = _swap(q), _swap(k), _swap(v)
    result = spec.run(
        q, k, v, layout=native, causal=causal, scale=scale, key_lengths=key_lengths,
        key_padding_mask=key_padding_mask, return_lse=return_lse,
    )
    if return_lse:
        out, lse = result
    else:
        out, lse = result, None
    if native != layout:
        out = _swap(out)
    return (out, lse) if return_lse else out


def select_backend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    backend: str | None = None,
    layout: str = "bhsd",
    causal: bool = False,
    key_lengths: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
    return_lse: bool = False,
    allow_lossy: bool | None = None,
) -> tuple[str | None, str | None]:
    """Which backend :func:`attention` would run: ``(name, None)``, or ``(None, reason)``
    when it would raise. Nothing is computed (a mask may be inspected)."""
    try:
        spec, _, _ = _plan(
            q, k, v, backend, layout, causal, key_lengths, attn_mask, return_lse, allow_lossy
        )
    except ValueError as exc:
        return None, str(exc)
    return spec.name, None
