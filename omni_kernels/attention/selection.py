"""Which backend runs a call: eligibility reasons, the auto table, the lossy crossover.

Choosing a backend, first match wins: the ``backend=`` argument (``"auto"`` included); the
innermost :func:`attention_backend` context (a ``ContextVar``: per thread / asyncio task);
``$OMNI_ATTENTION_BACKEND``; ``"auto"``. A named backend that cannot take the call raises
``ValueError`` naming the constraint; it never silently falls back.

``"auto"`` walks the ranking for the device's architecture (``"sm90"``, ``"cpu"``, ...) in
``auto_table.json`` (``bench/attention.py --write-auto-table`` regenerates it) and takes the
first backend that can take the call. A lossy backend is a candidate only when the table
lists it for that architecture and the caller allows lossy backends (``allow_lossy=True``, the
context's, or ``OMNI_ATTENTION_ALLOW_LOSSY=1``), and only for ``min(Sq, Skv)`` at or past its
measured crossover (the arch entry's ``lossy_min_seq``): quantization costs time linear in the
sequence, attention quadratic. The choice is logged (INFO, logger ``omni_kernels.attention``)
once per ``(arch, dtype, head_dim, features)`` (and sequence lengths where a crossover
applies), never while ``torch.compile`` traces.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from omni_kernels.attention import registry
from omni_kernels.attention.registry import _REGISTRY, AUTO, _normalize_name
from omni_kernels.attention.spec import AttentionProblem, BackendSpec, _dtype_name, _tuple_str, describe_head_dims

logger = logging.getLogger("omni_kernels.attention")

ENV_BACKEND = "OMNI_ATTENTION_BACKEND"
ENV_ALLOW_LOSSY = "OMNI_ATTENTION_ALLOW_LOSSY"
ENV_AUTO_TABLE = "OMNI_ATTENTION_AUTO_TABLE"
AUTO_TABLE_PATH = Path(__file__).with_name("auto_table.json")


def ineligible_reason(
    spec: BackendSpec,
    problem: AttentionProblem,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
) -> str | None:
    """``None`` when ``spec``'s backend can take the call, else the violated constraint."""
    p = problem
    if p.device.type not in spec.devices:
        return f"cannot run on device {p.device.type}: runs on {_tuple_str(spec.devices)}"
    reason = _availability(spec, p.device)
    if reason is not None:
        return f"is not available: {reason}"
    if p.capability is not None:
        cc = f"{p.capability[0]}.{p.capability[1]}"
        if spec.min_capability is not None and p.capability < spec.min_capability:
            need = f"{spec.min_capability[0]}.{spec.min_capability[1]}"
            return f"needs compute capability >= {need}: the GPU has {cc} ({p.arch})"
        if spec.max_capability is not None and p.capability > spec.max_capability:
            top = f"{spec.max_capability[0]}.{spec.max_capability[1]}"
            return f"needs compute capability <= {top}: the GPU has {cc} ({p.arch})"
    if p.dtype not in spec.dtypes:
        names = "(" + ", ".join(_dtype_name(d) for d in spec.dtypes) + ")"
        return f"cannot take dtype={_dtype_name(p.dtype)}: supports {names}"
    if spec.head_dims is not None and p.head_dim not in spec.head_dims:
        return f"cannot take head_dim={p.head_dim}: supports {describe_head_dims(spec.head_dims)}"
    if p.causal and not spec.causal:
        return "cannot take causal=True"
    if p.causal and p.cross and not spec.causal_cross:
        return (
            f"cannot take causal=True with Sq ({p.seq_q}) != Skv ({p.seq_kv}): its causal "
            "mask is bottom-right aligned, omni's is top-left (as SDPA's is_causal)"
        )
    if p.gqa and not spec.gqa:
        return f"cannot take GQA (Hq={p.heads_q}, Hkv={p.heads_kv}): needs Hq == Hkv"
    if p.key_lengths and not spec.key_lengths:
        return "cannot take key_lengths (per-sample key lengths)"
    if p.key_padding_mask and not spec.key_padding_mask:
        return "cannot take a non-prefix key-padding mask (only key_lengths / prefix masks)"
    if p.return_lse and not spec.lse:
        return "cannot return lse (return_lse=True)"
    if p.requires_grad and not spec.backward:
        return "is forward-only: inputs require grad (use torch.no_grad() or another backend)"
    if spec.input_check is not None:
        reason = spec.input_check(p, q, k, v, key_padding_mask)
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
# (table path, arch, allow_lossy, registry generation): auto's order; cleared with the table
_RANKING_CACHE: dict[tuple[str, str, bool, int], tuple[str, ...]] = {}


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
    key = (str(auto_table_path()), arch, bool(allow_lossy), registry.generation())
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
        reason = ineligible_reason(spec, problem, q, k, v, mask)
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
