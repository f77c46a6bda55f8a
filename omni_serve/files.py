"""The store behind ``response_format="url"`` results (``GET /v1/files/{name}``)."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import re
import secrets
import shutil
import tempfile
import threading
import time

_FILE_NAME = re.compile(r"^[A-Za-z0-9_-]{16,64}\.(png|apng|jpeg|webp)$")


class FileStore:
    """Generated files in a server-owned directory, under random names, with a time limit.

    Lookups go through the in-memory index only: a name from a request is never
    turned into a path.
    """

    def __init__(self, ttl_seconds: float = 3600.0, directory: str | None = None) -> None:
        self.ttl = ttl_seconds
        self._dir = directory
        self._owned = directory is None
        self._index: dict[str, tuple[str, float, str]] = {}
        self._lock = threading.Lock()
        self._secret = secrets.token_bytes(32)  # per server: URLs die with the process

    @property
    def dir(self) -> str:
        """The directory, made (private to this user) at the first file."""
        with self._lock:
            if self._dir is None:
                self._dir = tempfile.mkdtemp(prefix="omni-serve-files-")
            return self._dir

    def put(self, data: bytes, suffix: str = "png", media_type: str = "image/png") -> str:
        name = f"{secrets.token_urlsafe(24)}.{suffix}"
        path = os.path.join(self.dir, name)
        with open(path, "wb") as f:
            f.write(data)
        with self._lock:
            self._index[name] = (path, time.time() + self.ttl, media_type)
        self.expire()
        return name

    def _signature(self, name: str, expires: str) -> str:
        message = f"{name}\n{expires}".encode()
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()

    def signed_query(self, name: str) -> str:
        """``expires=<unix time>&signature=<HMAC-SHA256>``: lets ``name`` be fetched without
        the API key (a browser's ``<img>``) until the file's time limit passes."""
        expires = str(int(time.time() + self.ttl))
        return f"expires={expires}&signature={self._signature(name, expires)}"

    def check_signature(self, name: str, expires: str, signature: str) -> str | None:
        """None when ``signature`` signs ``name`` until ``expires`` and that has not passed;
        else why not."""
        if not hmac.compare_digest(signature.encode(), self._signature(name, expires).encode()):
            return "the signature does not match this file and expiry"
        if int(expires) < time.time():  # signed by us, so an integer
            return "the signed URL has expired"
        return None

    def get(self, name: str) -> tuple[str, str] | None:
        if not _FILE_NAME.match(name):
            return None
        with self._lock:
            entry = self._index.get(name)
        if entry is None or entry[1] < time.time():
            return None
        return entry[0], entry[2]

    def expire(self) -> None:
        now = time.time()
        with self._lock:
            old = [n for n, (_, expiry, _) in self._index.items() if expiry < now]
            paths = [self._index.pop(n)[0] for n in old]
        for path in paths:
            with contextlib.suppress(OSError):
                os.remove(path)

    def close(self) -> None:
        with self._lock:
            self._index.clear()
            directory, self._dir = self._dir, None
        if directory is not None and self._owned:
            shutil.rmtree(directory, ignore_errors=True)
