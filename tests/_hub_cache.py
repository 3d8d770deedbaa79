"""A model directory laid out as the Hugging Face hub cache lays out a download.

``cache/models--org--name/blobs/<sha256>`` holds each file's bytes and
``cache/models--org--name/snapshots/<revision>/<file name>`` is a relative symlink
``../../blobs/<sha256>`` to it (what ``huggingface_hub.snapshot_download`` returns).
"""

from __future__ import annotations

import hashlib
from pathlib import Path


def hub_cache_layout(model_dir: Path, cache: Path, repo: str = "models--org--tiny", revision: str = "0123abcd") -> Path:
    """Copy the files of ``model_dir`` into ``cache`` in the hub cache's layout; returns the snapshot directory."""
    root = cache / repo
    snapshot = root / "snapshots" / revision
    (root / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in sorted(model_dir.iterdir()):
        if f.is_file():
            data = f.read_bytes()
            sha = hashlib.sha256(data).hexdigest()
            (root / "blobs" / sha).write_bytes(data)
            (snapshot / f.name).symlink_to(Path("..") / ".." / "blobs" / sha)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(revision)
    return snapshot
