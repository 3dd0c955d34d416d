"""numba's cache of the compiled kernels, emptied where a compiled source changed
(snrt/backends/compiled_cache.py)."""

import os

import numba

from snrt.backends import compiled_cache
from snrt.backends.compiled_cache import FINGERPRINT_FILE, cache_folder, empty_if_stale, fingerprint


def test_a_folder_cached_under_another_fingerprint_loses_numbas_files_and_nothing_else(tmp_path):
    for name in ("kernel.f-12.py311.nbi", "kernel.f-12.py311.1.nbc", "module.cpython-311.pyc"):
        (tmp_path / name).write_text("x")
    empty_if_stale(tmp_path, "first")  # no fingerprint yet: written under an unknown one
    assert sorted(p.name for p in tmp_path.iterdir()) == ["module.cpython-311.pyc", FINGERPRINT_FILE]
    assert (tmp_path / FINGERPRINT_FILE).read_text() == "first"
    (tmp_path / "kernel.f-12.py311.nbi").write_text("compiled under first")
    empty_if_stale(tmp_path, "first")
    assert (tmp_path / "kernel.f-12.py311.nbi").exists()
    empty_if_stale(tmp_path, "second")
    assert not (tmp_path / "kernel.f-12.py311.nbi").exists()
    assert (tmp_path / FINGERPRINT_FILE).read_text() == "second"


def test_a_missing_folder_is_left_alone(tmp_path):
    empty_if_stale(tmp_path / "absent", "first")
    assert not (tmp_path / "absent").exists()


def test_the_fingerprint_follows_each_sources_size_and_time(tmp_path):
    sources = [tmp_path / "cpu_a.py", tmp_path / "cpu_b.py"]
    for path in sources:
        path.write_text("pass\n")
    os.utime(sources[1], ns=(10**18, 10**18))
    before = fingerprint(sources, tmp_path)
    assert fingerprint(sources, tmp_path) == before
    os.utime(sources[1], ns=(10**18 + 1, 10**18 + 1))  # touched: numba would keep a caller's code
    assert fingerprint(sources, tmp_path) != before
    os.utime(sources[1], ns=(10**18, 10**18))
    sources[0].write_text("pass  \n")
    os.utime(sources[0], ns=(sources[0].stat().st_mtime_ns,) * 2)
    assert fingerprint(sources, tmp_path) != before  # another size


def test_the_compiled_sources_and_their_cache_folders_are_numbas():
    names = {path.name for path in compiled_cache.compiled_sources()}
    assert {"cpu_tiles.py", "cpu_depthwise.py", "cpu_parallel.py", "optim.py"} <= names
    source = compiled_cache.PACKAGE / "backends" / "cpu_tiles.py"
    from snrt.backends.cpu_copy import pad_plane  # a cached kernel of that folder

    assert cache_folder(source) == cache_folder(compiled_cache.PACKAGE / "backends" / "cpu_copy.py")
    assert str(cache_folder(source)) == pad_plane._cache._cache_path


def test_a_user_given_numba_cache_folder_is_the_one_emptied(tmp_path, monkeypatch):
    monkeypatch.setattr(numba.config, "CACHE_DIR", str(tmp_path))
    folder = cache_folder(compiled_cache.PACKAGE / "optim.py")
    assert folder is not None and folder.parent == tmp_path
