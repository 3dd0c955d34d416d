"""Checkpoints: one .npz holding parameters, optimizer state, persistent state and progress.

Writes are atomic: the file is written under a temporary name (`.NAME.*.tmp`) in the same
folder, flushed to disk, then renamed over the old one, so a crash mid-write leaves the old
checkpoint whole; a failed write removes its temporary file, and `remove_stale_temporaries`
removes those of writes that were killed. Writes stream: each tensor is fetched (copied to
the host, where it lives on a device), checked finite and written before the next is
fetched, so saving holds at most one tensor's copy in memory. A non-finite tensor (a
diverged run) stops the write and keeps the previous checkpoint.
"""

import json
import math
import os
import tempfile
import zipfile
import zlib
from pathlib import Path

import numpy as np

from snrt.errors import SnrtError
from snrt.units import is_count

FORMAT = "snrt-checkpoint-1"
META = "__meta__"
_NPY = b"\x93NUMPY"  # how an .npy file begins; an .npz, a zip archive, begins with "PK"


class CheckpointError(SnrtError):
    """A checkpoint cannot be read or written, or does not fit the network."""


class NonFiniteError(CheckpointError):
    """A tensor holds NaN or infinity: a diverged run, whose state must not replace a good one."""


def save_checkpoint(path, tensors, meta):
    """Write `tensors` (an iterable of (key, fetch), `fetch()` returning the host array) and
    `meta` (a JSON-able dict) to `path` atomically, one tensor in memory at a time.

    Raises NonFiniteError naming the first tensor with NaN or infinity, CheckpointError when
    the file cannot be written (no space, no permission); either way the previous checkpoint
    is kept and no partial file is left.
    """
    path = Path(path)
    kept = "the previous checkpoint is kept" if path.exists() else "there was no earlier checkpoint: nothing is kept"
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot write the checkpoint ({e.strerror}); {kept}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            with zipfile.ZipFile(f, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
                _write_array(archive, META, np.frombuffer(json.dumps({"format": FORMAT, **meta}).encode(), np.uint8))
                for key, fetch in tensors:
                    array = np.asarray(fetch())
                    if array.dtype.kind == "f" and not np.isfinite(array).all():
                        raise NonFiniteError(f"{path}: not written: {key} holds NaN or infinite values (the run "
                                             f"diverged); {kept}")
                    _write_array(archive, key, array)
                    del array
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes the file private; give it the usual mode
        os.replace(tmp, path)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise CheckpointError(f"{path}: cannot write the checkpoint ({e.strerror or e}); {kept}") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _write_array(archive, key, array):
    """One .npy member of the archive, streamed (what np.savez writes, without a copy)."""
    with archive.open(f"{key}.npy", "w", force_zip64=True) as member:
        np.lib.format.write_array(member, np.ascontiguousarray(array), allow_pickle=False)


def remove_stale_temporaries(path):
    """Remove the temporary files that killed writes of checkpoint `path` left beside it.
    Only safe while no other process writes that checkpoint (the run folder's lock)."""
    path = Path(path)
    for stale in path.parent.glob(f".{path.name}.*.tmp"):
        stale.unlink(missing_ok=True)


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
        with open(path, "rb") as f:
            head = f.read(len(_NPY))
        if not head.startswith(b"PK") and head != _NPY:  # numpy would take it for a pickle, and suggest loading it
            raise ValueError("not the .npz archive snrt train writes; a weights file (safetensors, a PyTorch state "
                             "dict) starts a run with --init-from")
        data = np.load(path, allow_pickle=False)
        if not isinstance(data, np.lib.npyio.NpzFile):
            raise ValueError("it holds a single array, not the named arrays snrt train writes")
        with data:
            arrays = {k: data[k] for k in data.files}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError, zlib.error, NotImplementedError, RuntimeError,
            MemoryError) as e:  # damaged zip headers (a compression or encryption it does not have), array sizes
        reason = e.strerror if isinstance(e, OSError) and e.strerror else e  # (Permission denied), not its errno
        raise CheckpointError(f"{path}: not a readable checkpoint ({reason})") from None
    try:
        meta = json.loads(arrays.pop(META).tobytes().decode())
    except (KeyError, ValueError):
        raise CheckpointError(f"{path}: not an snrt checkpoint (no metadata)") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else meta
        raise CheckpointError(f"{path}: unknown checkpoint format {found!r}, expected {FORMAT}")
    _check_meta(path, meta)
    for key, array in arrays.items():
        if array.dtype.kind != "f":  # every tensor a run saves is floating point: a value would be cast, or fail
            raise CheckpointError(f"{path}: {key} holds {array.dtype} values, not the floating-point numbers of a "
                                  "parameter, optimizer state or statistic (a damaged or hand-made checkpoint?)")
        if not np.isfinite(array).all():
            raise NonFiniteError(f"{path}: {key} holds NaN or infinite values (written by a run that diverged?)")
    return arrays, meta


# what save_checkpoint writes of the numbers a run computes with: (key, smallest value, required)
_COUNTS = (("iteration", 0, True), ("batch", 1, False), ("seed", 0, False))


def _check_meta(path, meta):
    """CheckpointError naming the first metadata value that is not what a run writes (a
    damaged or hand-edited checkpoint), before a run computes with it."""
    for key, least, required in _COUNTS:
        if (required or key in meta) and not is_count(meta.get(key), least):
            raise CheckpointError(f"{path}: the metadata's {key} is {meta.get(key)!r}, expected an int >= {least}")
    scale = meta.get("loss_scale", {})
    if not (isinstance(scale, dict) and _positive(scale.get("scale", 1.0)) and is_count(scale.get("good", 0), 0)
            and is_count(scale.get("growth_interval", 1))):
        raise CheckpointError(f"{path}: the metadata's loss_scale is {scale!r}, expected a positive finite scale and "
                              "counts of iterations")


def _positive(value):
    """Whether `value` is a finite number (not a bool) above 0."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < math.inf


def is_checkpoint(path):
    """Whether the file `path` looks like a checkpoint snrt train writes (an archive with its
    metadata), to tell a user who gives one where a weights file is expected what to do."""
    try:
        with zipfile.ZipFile(path) as archive:
            return f"{META}.npy" in archive.namelist()
    except (OSError, zipfile.BadZipFile):
        return False


def describe_changes(meta, batch, seed, precision):
    """What changes when a run saved with `meta` resumes at `batch` with `seed` in `precision`
    (None when none differs from the checkpoint's): the batches are functions of the first two,
    the rounding of every step of the last."""
    changes = []
    if meta.get("batch") not in (None, batch):
        changes.append(f"trained at batch {meta['batch']}, resuming at batch {batch}: "
                       f"{batch / meta['batch']:.3g}x as many samples per iteration")
    if meta.get("seed") not in (None, seed):
        changes.append(f"trained with seed {meta['seed']}, resuming with seed {seed}: another order of the data, "
                       "other augmentation and dropout")
    batches = " different batches from here on," if changes else ""
    if meta.get("precision") not in (None, precision):
        changes.append(f"trained in {meta['precision']}, resuming in {precision}: other rounding")
    if not changes:
        return None
    return f"the checkpoint was {'; and '.join(changes)},{batches} and a result that differs from an uninterrupted run"
