"""Per-generation cache state, scoped by a :class:`contextvars.ContextVar`.

Everything a cache remembers between denoising steps (reference residuals,
accumulated distances, cached block residuals, hit counts) lives in a
:class:`GenerationState`. One is created at the start of every call of an
accelerated pipeline (:func:`generation`) and dropped at its end, so

* nothing carries over from one call to the next (reset per call), and
* two calls running at once, in different threads or asyncio tasks, each see
  their own state even on the same pipeline and transformer: the hooks on the
  transformer hold no state themselves, they look the current generation up
  in the context variable.

Outside a generation (a transformer called directly, not through an
accelerated pipeline), the cache hooks run every block as usual. Custom
denoising loops open one with ``with omni_diffusion.cache.generation(): ...``.

Inside a generation, state is kept per denoiser and per *branch*: the name a
pipeline gives the call with diffusers' ``transformer.cache_context("cond")`` /
``("uncond")``; without one, the n-th call at the same timestep is branch
``"call<n>"`` (so separate-call CFG never mixes its conditional and
unconditional residuals).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import weakref
from collections.abc import Iterator
from typing import Any

import torch

_CURRENT: contextvars.ContextVar[GenerationState | None] = contextvars.ContextVar(
    "omni_diffusion_generation", default=None
)
#: (id(transformer) or None for any, branch name, cache_context kwargs), set by the
#: wrapped ``cache_context`` and by :func:`branch`
BRANCH: contextvars.ContextVar[tuple[int | None, str, dict] | None] = contextvars.ContextVar(
    "omni_diffusion_cache_branch", default=None
)
_SINKS: contextvars.ContextVar[tuple[list, ...]] = contextvars.ContextVar(
    "omni_diffusion_stats_sinks", default=()
)


@dataclasses.dataclass
class BranchState:
    """What one (denoiser, branch) remembers across the steps of a generation."""

    passes: int = 0
    hits: int = 0
    consecutive_hits: int = 0
    blocks_run: int = 0
    blocks_skipped: int = 0
    #: First-Block-Cache: the first block's residual at the last computed step;
    #: TeaCache: the previous step's modulated input
    reference: torch.Tensor | None = None
    accumulated: float = 0.0
    residual_hidden: torch.Tensor | None = None
    residual_encoder: torch.Tensor | None = None
    distances: list[float] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class PassState:
    """One transformer forward inside a generation."""

    branch: BranchState
    step: int
    total: int | None
    disabled: bool = False
    started: bool = False
    skipping: bool = False
    blocks_run: int = 0
    blocks_skipped: int = 0
    ref_hidden: torch.Tensor | None = None
    ref_encoder: torch.Tensor | None = None
    last_hidden: torch.Tensor | None = None
    last_encoder: torch.Tensor | None = None


@dataclasses.dataclass(frozen=True)
class CacheStats:
    """Hit statistics of one pipeline call.

    ``passes``: transformer forwards; ``hits``: forwards that skipped blocks;
    ``blocks_total`` / ``blocks_skipped``: block calls that would have run /
    that were skipped. ``branches`` has the same per ``"<denoiser>/<branch>"``
    (``"transformer/cond"``), with the measured distances per step.
    """

    kind: str | None
    passes: int = 0
    hits: int = 0
    blocks_total: int = 0
    blocks_skipped: int = 0
    branches: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.passes if self.passes else 0.0

    @property
    def skipped_fraction(self) -> float:
        return self.blocks_skipped / self.blocks_total if self.blocks_total else 0.0

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["hit_rate"] = self.hit_rate
        out["skipped_fraction"] = self.skipped_fraction
        return out


class GenerationState:
    """The cache state of one generation (one pipeline call)."""

    def __init__(self, pipe: Any = None, kind: str | None = None) -> None:
        self._pipe = None if pipe is None else weakref.ref(pipe)
        self.kind = kind
        self.branches: dict[tuple[str, str], BranchState] = {}
        self.passes: dict[int, PassState] = {}
        self.seen_timesteps: dict[tuple[int, float], int] = {}
        #: extra per-branch entries for the stats (a cache backend's own summary)
        self.extra: dict[str, dict[str, Any]] = {}
        #: the stats, set when the generation ends
        self.final_stats: CacheStats | None = None

    @property
    def pipe(self) -> Any:
        return None if self._pipe is None else self._pipe()

    def branch(self, denoiser: str, name: str) -> BranchState:
        key = (denoiser, name)
        state = self.branches.get(key)
        if state is None:
            state = self.branches[key] = BranchState()
        return state

    def stats(self) -> CacheStats:
        branches = {}
        totals = dict(passes=0, hits=0, blocks_total=0, blocks_skipped=0)
        for (denoiser, name), b in self.branches.items():
            entry = dict(
                passes=b.passes, hits=b.hits, blocks_total=b.blocks_run + b.blocks_skipped,
                blocks_skipped=b.blocks_skipped, distances=list(b.distances),
            )
            branches[f"{denoiser}/{name}"] = entry
            for key in totals:
                totals[key] += entry[key]
        branches.update(self.extra)
        return CacheStats(kind=self.kind, branches=branches, **totals)


def current_generation() -> GenerationState | None:
    """The generation running in this context, or None."""
    return _CURRENT.get()


@contextlib.contextmanager
def generation(pipe: Any = None, kind: str | None = None) -> Iterator[GenerationState]:
    """Run the block inside a fresh generation (cache state); yields it.

    Accelerated pipelines open one per call themselves; use this for custom
    denoising loops that call the transformer directly. On exit the stats go
    to any :func:`collect_stats` lists open in this context.
    """
    state = GenerationState(pipe, kind)
    token = _CURRENT.set(state)
    try:
        yield state
    finally:
        _CURRENT.reset(token)
        state.final_stats = state.stats()
        for sink in _SINKS.get():
            sink.append(state.final_stats)


@contextlib.contextmanager
def branch(name: str, transformer: Any = None, **info: Any) -> Iterator[None]:
    """Name the cache branch of the transformer calls inside the block, as a
    pipeline does with ``transformer.cache_context(name)`` (for models without
    diffusers' CacheMixin, or custom loops). ``transformer``: only that one
    (default: any). ``info``: ``step_index``, ``num_inference_steps``."""
    token = BRANCH.set((None if transformer is None else id(transformer), name, info))
    try:
        yield
    finally:
        BRANCH.reset(token)


@contextlib.contextmanager
def collect_stats() -> Iterator[list[CacheStats]]:
    """Collect the :class:`CacheStats` of every generation that ends inside the block.

    Per context (thread / asyncio task), so a server can attribute stats to
    its own request even when calls run concurrently::

        with omni_diffusion.collect_stats() as stats:
            pipe(prompt)
        stats[0].hits
    """
    sink: list[CacheStats] = []
    token = _SINKS.set((*_SINKS.get(), sink))
    try:
        yield sink
    finally:
        _SINKS.reset(token)


__all__ = [
    "BranchState",
    "branch",
    "CacheStats",
    "GenerationState",
    "PassState",
    "collect_stats",
    "current_generation",
    "generation",
]
