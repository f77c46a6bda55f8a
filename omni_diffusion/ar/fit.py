"""Whether an LLM fits in vLLM's share of the GPU, and errors that say so."""

from __future__ import annotations

from pathlib import Path

import torch


def weight_bytes(model: str | Path) -> int | None:
    """Bytes of the ``*.safetensors`` / ``*.bin`` weights in a model folder (None: not a folder)."""
    path = Path(model)
    if not path.is_dir():
        return None
    return sum(f.stat().st_size for pattern in ("*.safetensors", "*.bin") for f in path.glob(pattern))


def check_fits(model: str | Path, gpu_memory_utilization: float) -> None:
    """Raise ValueError when a CUDA GPU is in use and the weights alone exceed vLLM's share.

    vLLM's share is ``gpu_memory_utilization`` of the GPU's total memory; the
    KV cache and activations need more on top, which vLLM itself checks.
    """
    if not isinstance(gpu_memory_utilization, (int, float)) or not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization: {gpu_memory_utilization!r} is not allowed; "
                         "allowed: a number in (0, 1]")
    size = weight_bytes(model)
    if size is None or not torch.cuda.is_available():
        return
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    share = gpu_memory_utilization * total
    if size >= share:
        raise ValueError(
            f"the LLM at {model} does not fit: its weights take {size / 2**30:.1f} GiB but "
            f"gpu_memory_utilization={gpu_memory_utilization} gives vLLM {share / 2**30:.1f} GiB "
            f"of {total / 2**30:.1f} GiB; raise gpu_memory_utilization (leaving less to the "
            f"diffusion model) or use placement='server' with vLLM on another GPU"
        )


def explain_startup_failure(exc: BaseException, model: str | Path,
                            gpu_memory_utilization: float) -> BaseException:
    """``exc`` from a vLLM start, as a ValueError naming the memory split when memory ran out."""
    text = f"{type(exc).__name__}: {exc}"
    if any(word in text.lower() for word in ("memory", "kv cache", "cache blocks", "out of")):
        size = weight_bytes(model)
        weights = "" if size is None else f" (weights {size / 2**30:.2f} GiB)"
        return ValueError(
            f"vLLM could not start {model}{weights} with gpu_memory_utilization="
            f"{gpu_memory_utilization}: {text}. Give vLLM a larger share, a shorter "
            "max_model_len (engine_args), or place it on another GPU (placement='server')"
        )
    return RuntimeError(f"vLLM could not start {model}: {text}")


__all__ = ["check_fits", "explain_startup_failure", "weight_bytes"]
