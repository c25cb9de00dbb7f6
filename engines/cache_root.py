"""Where the data plane caches what it derives once per machine (tokenizer exports, the dtype choice,
served weights): `$BULLET_CACHE_DIR`, else `~/.cache/bullet`."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("BULLET_CACHE_DIR", Path.home() / ".cache" / "bullet"))
