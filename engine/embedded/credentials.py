"""Secrets of a one-machine deployment, generated once into its state folder (mode 0600).

``onepiece up`` keeps the web platform's ``SECRET_KEY``, the Proxy's shared
secret and the embedded Redis's password here, so they survive restarts
(signed URLs and sessions stay valid) and differ between installations: no
secret is ever a constant in the code. The folder is created 0700.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def secret(folder: Path, name: str, nbytes: int = 32) -> str:
    """The secret stored as ``folder/name``, created (URL-safe, ``nbytes`` random bytes) on first use.

    Created with ``O_EXCL`` and mode 0600, so it is never readable by others, not even for an instant,
    and two concurrent first runs cannot write different values."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    folder.chmod(0o700)
    path = folder / name
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        path.chmod(0o600)
        value = path.read_text().strip()
        if value:
            return value
        path.unlink()
        return secret(folder, name, nbytes)
    value = secrets.token_urlsafe(nbytes)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
    return value
