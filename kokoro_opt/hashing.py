"""Content hashes: what artifact keys, manifests and locks are made of."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any


def content_key(*parts: Any) -> str:
    """16 hex digits over JSON-serialised parts (sorted keys): the same inputs give the same key anywhere."""
    payload = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def text_sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
