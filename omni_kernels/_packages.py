"""Optional packages: is one importable, at which version, with which symbols.

:class:`OptionalPackage` names a module, the pip distribution that provides it and how to
install it. Every question returns a reason string rather than raising, so a caller can say
why it cannot run: not installed; installed but failing to load (e.g. a compiled extension
built for another torch / CUDA); too old to have a symbol. Imports are lazy and cached.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
from types import ModuleType

import torch

_IMPORTS: dict[str, tuple[ModuleType | None, str | None]] = {}


def package_version(dist: str) -> str | None:
    """The installed version of the distribution ``dist``, or None."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def lazy_import(module: str, dist: str, hint: str) -> tuple[ModuleType | None, str | None]:
    """``(module, None)``, or ``(None, reason)``: not installed, or failed to load
    (e.g. a compiled extension built for another torch / CUDA). Cached."""
    cached = _IMPORTS.get(module)
    if cached is not None:
        return cached
    try:
        mod = importlib.import_module(module)
        result = (mod, None)
    except ModuleNotFoundError as exc:
        if exc.name and module.split(".")[0] == exc.name.split(".")[0]:
            reason = f"the {dist!r} package is not installed ({hint})"
        else:
            reason = _load_failure(module, dist, exc)
        result = (None, reason)
    except Exception as exc:  # ImportError (undefined symbol), OSError, RuntimeError, ...
        result = (None, _load_failure(module, dist, exc))
    _IMPORTS[module] = result
    return result


def _load_failure(module: str, dist: str, exc: BaseException) -> str:
    version = package_version(dist)
    installed = f"{dist} {version}" if version else dist
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return (
        f"{installed} is installed but {module!r} failed to load ({type(exc).__name__}: "
        f"{message[:300]}); it may be built for another torch/CUDA than torch "
        f"{torch.__version__} (CUDA {torch.version.cuda})"
    )


@dataclasses.dataclass(frozen=True)
class OptionalPackage:
    """A module from an optional distribution: ``module`` is imported, ``dist`` is the pip name
    (for the version and messages), ``hint`` says how to install it."""

    module: str
    dist: str
    hint: str

    def load(self) -> tuple[ModuleType | None, str | None]:
        """``(module, None)`` or ``(None, why it cannot be imported)``; see :func:`lazy_import`."""
        return lazy_import(self.module, self.dist, self.hint)

    def version(self) -> str | None:
        """The installed distribution's version, or None."""
        return _cached_version(self.dist)

    def major_version(self) -> int | None:
        """The installed version's leading number, or None (not installed, or not a number)."""
        version = self.version()
        try:
            return int(version.split(".")[0]) if version else None
        except ValueError:
            return None

    def missing_reason(self, *symbols: str) -> str | None:
        """None when the module imports and has every one of ``symbols``, else why not."""
        module, reason = self.load()
        if reason is not None:
            return reason
        for symbol in symbols:
            if not hasattr(module, symbol):
                return f"{module.__name__} has no {symbol} (unsupported version)"
        return None


@functools.cache
def _cached_version(dist: str) -> str | None:
    return package_version(dist)
