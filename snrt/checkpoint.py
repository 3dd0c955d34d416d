"""Checkpoints: one .npz holding parameters, optimizer state, persistent state and progress.

Writes are atomic: the file is written under a temporary name in the same folder, flushed
to disk, then renamed over the old one, so a crash mid-write leaves the old checkpoint whole.
"""

import json
import os
import tempfile
import zipfile
from pathlib import Path

import numpy as np

from snrt.errors import SnrtError

FORMAT = "snrt-checkpoint-1"


class CheckpointError(SnrtError):
    """A checkpoint cannot be read or does not fit the network."""


def save_checkpoint(path, arrays, meta):
    """Write `arrays` ({key: ndarray}) and `meta` (JSON-able dict) to `path` atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, __meta__=np.frombuffer(json.dumps({"format": FORMAT, **meta}).encode(), np.uint8), **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes the file private; give it the usual mode
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def load_checkpoint(path):
    """(arrays, meta) from a checkpoint; CheckpointError names the file and the problem."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: checkpoint not found")
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {k: data[k] for k in data.files}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
        raise CheckpointError(f"{path}: not a readable checkpoint ({e})") from None
    try:
        meta = json.loads(arrays.pop("__meta__").tobytes().decode())
    except (KeyError, ValueError):
        raise CheckpointError(f"{path}: not an snrt checkpoint (no metadata)") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: unknown checkpoint format {meta.get('format')!r}, expected {FORMAT}")
    return arrays, meta
