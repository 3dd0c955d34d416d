"""Every test process keeps its measured CPU kernel choices (snrt/backends/cpu_choice.py) in a
folder of its own, not in the user's cache, removed when the tests end. The commands the tests
start inherit it. snrt is imported before numpy, as the `snrt` command does (snrt/__init__.py)."""

import atexit
import os
import shutil
import tempfile

import snrt  # noqa: F401  before any test module imports numpy: OpenBLAS's threads then sleep soon after a GEMM

if "SNRT_CACHE_DIR" not in os.environ:
    os.environ["SNRT_CACHE_DIR"] = tempfile.mkdtemp(prefix="snrt-test-cache-")
    atexit.register(shutil.rmtree, os.environ["SNRT_CACHE_DIR"], ignore_errors=True)
