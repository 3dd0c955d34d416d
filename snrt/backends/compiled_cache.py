"""numba's on-disk cache of snrt's compiled kernels, emptied when any compiled source changed.

numba keeps each `cache=True` function's machine code in a folder of its cache (`__pycache__`
beside the source, or where NUMBA_CACHE_DIR says) and reuses it while that function's own
source file keeps its size and modification time. A kernel inlines what it calls from other
modules (cpu_depthwise's kernels take cpu_tiles' vector code, every kernel on the kernel
threads is inlined into cpu_parallel's launcher), so after a change to one of those modules
alone, as a `git pull` into an editable install can bring, the cached kernel would run the old
code. So the first import of a compiled module fingerprints the compiled sources (COMPILED:
every module that defines or calls compiled code, by path, size and modification time) and
empties each folder whose cache was written under another fingerprint (its `FINGERPRINT_FILE`
says which): numba then compiles afresh. A folder that cannot be written is left to numba,
which then caches elsewhere (its user-wide folder) or not at all.
"""

import hashlib
import os
from pathlib import Path

from numba.core.caching import CacheImpl

PACKAGE = Path(__file__).resolve().parent.parent
COMPILED = ("backends/cpu_*.py", "optim.py")  # relative to the package
FINGERPRINT_FILE = "snrt-compiled-sources"
CACHE_SUFFIXES = (".nbi", ".nbc")  # numba's index and object files


def compiled_sources():
    """The compiled sources, sorted (module docstring)."""
    return sorted(path for pattern in COMPILED for path in PACKAGE.glob(pattern))


def fingerprint(paths, root=PACKAGE):
    """A digest of the files' paths (relative to `root`), sizes and modification times."""
    digest = hashlib.sha256()
    for path in paths:
        stat = path.stat()
        digest.update(f"{path.relative_to(root)}:{stat.st_size}:{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def cache_folder(source):
    """Where numba caches the compiled functions of module file `source` (its locators, in
    numba's order: the same for every module of a folder), or None where it would not cache
    them."""
    for locator_class in CacheImpl._locator_classes:
        locator = locator_class.from_function(cache_folder, str(source))
        if locator is not None:
            return Path(locator.get_cache_path())
    return None


def empty_if_stale(folder, current):
    """Remove numba's cache files from `folder` unless its fingerprint file says `current`,
    then write `current` there; a folder that cannot be read or written is left as it is."""
    marker = folder / FINGERPRINT_FILE
    try:
        if marker.read_text() == current:
            return
    except OSError:
        pass  # none yet, or unreadable: written below where the folder allows
    try:
        for path in folder.iterdir():
            if path.suffix in CACHE_SUFFIXES:
                path.unlink(missing_ok=True)
        written = folder / f"{FINGERPRINT_FILE}.{os.getpid()}"
        written.write_text(current)
        written.replace(marker)
    except OSError:
        return


def refresh():
    """Empty every cache folder of the compiled sources written under another fingerprint."""
    sources = compiled_sources()
    current = fingerprint(sources)
    one_per_folder = {source.parent: source for source in sources}.values()
    for folder in {cache_folder(source) for source in one_per_folder} - {None}:
        empty_if_stale(folder, current)


refresh()
