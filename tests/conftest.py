"""Every test process keeps its measured CPU kernel choices (snrt/backends/cpu_choice.py) in a
folder of its own, not in the user's cache."""

import os
import tempfile

os.environ.setdefault("SNRT_CACHE_DIR", tempfile.mkdtemp(prefix="snrt-test-cache-"))
