"""What the torchrun tests of bench/ share: this checkout on the children's path, a free port.

pytest puts this folder on ``sys.path`` for the test modules in it (it has no ``__init__.py``),
so they import this module by its name.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def pythonpath() -> str:
    """The repository first, so that the script imports this checkout's omni packages."""
    return os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))


def free_port() -> int:
    """A TCP port on 127.0.0.1 nothing listens on now (torchrun's rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
