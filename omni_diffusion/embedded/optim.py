"""Training steps shared by the embedded models' trainers (:mod:`.train`, :mod:`.train_video`)."""

from __future__ import annotations

import random

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's generators with ``seed``."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def optimizer_step(opt, sched, loss: torch.Tensor, clip_params=None) -> torch.Tensor:
    """Backpropagate ``loss``, clip the gradients of ``clip_params`` to norm 1 (when given),
    step the optimizer and its schedule; returns the loss, detached, on its device (reading
    it as a number every step would synchronize a GPU; format it when logging)."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if clip_params is not None:
        torch.nn.utils.clip_grad_norm_(clip_params, 1.0)
    opt.step()
    sched.step()
    return loss.detach()
