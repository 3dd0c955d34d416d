"""Measured kernel choices kept on disk, so that the next run starts with them.

The CPU kernel chooser (cpu_choice.py) and the cuDNN engine chooser (cudnn_engines.py) each
keep one JSON file of {key: entry} in the cache folder: `$SNRT_CACHE_DIR`, else
`$XDG_CACHE_HOME/snrt`, else `~/.cache/snrt`. `remembered` reads a key's entry, or measures
it and adds it, while holding a lock on the file, so that processes that start together (the
ranks of a data-parallel job) take turns: the first measures, the others read its choice. A
file that is unreadable or damaged is measured over; one that cannot be written leaves the
choice in the process that measured it.
"""

import fcntl
import json
import os
from contextlib import contextmanager, suppress
from pathlib import Path


def cache_path(name):
    """The choices file `name` in the cache folder (see the module docstring)."""
    caches = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return Path(os.environ.get("SNRT_CACHE_DIR") or caches / "snrt") / name


def read(path):
    """The file's {key: entry}; {} when it is missing, unreadable or not such a mapping."""
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return entries if isinstance(entries, dict) else {}


def write(path, key, entry):
    """Add key: entry to the file (re-read first: another process may have added its own)."""
    entries = read(path)
    entries[key] = entry
    partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        partial.write_text(json.dumps(entries, indent=1, sort_keys=True))
        partial.replace(path)
    except OSError:  # the choice still holds in this process; a part written (a full disk) goes
        with suppress(OSError):
            partial.unlink(missing_ok=True)


@contextmanager
def locked(path):
    """Hold an exclusive lock on `path`'s lock file (none when it cannot be made)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_name(path.name + ".lock"), "a")
    except OSError:
        yield
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def remembered(path, key, usable, measure):
    """The entry of `key` in the file at `path` when `usable(entry)` says it still serves,
    else `measure()`'s entry (a JSON-able dict), added to the file unless it is None (nothing
    worth keeping); under the file's lock."""
    with locked(path):
        entry = read(path).get(key)
        if isinstance(entry, dict) and usable(entry):
            return entry
        entry = measure()
        if entry is not None:
            write(path, key, entry)
        return entry
