"""Backends: the only code that knows numpy from cupy (device arena, host store, streams,
kernels). The contract every backend meets is in base.py.

"cpu" (NumPy) always works; "cuda" (CuPy, cuDNN) needs the `gpu` extra and a CUDA device,
and asking for it without them is an error that says what is missing, never a quiet run on
the CPU. CuPy is imported only on the cuda path, so `import snrt` never touches it.
"""

from snrt.errors import SnrtError

BACKENDS = ("cpu", "cuda")
GPU_EXTRA = "pip install 'snrt[gpu]' (CUDA 12) or 'snrt[gpu-cuda13]' (CUDA 13)"


def cuda_unavailable_reason():
    """None when CuPy finds a CUDA device, else a sentence saying what is missing."""
    try:
        import cupy
    except ImportError as e:
        return f"CuPy is not installed ({e}); the cuda backend needs the gpu extra: {GPU_EXTRA}"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # CUDARuntimeError: no driver, or a driver older than the runtime
        return f"CuPy {cupy.__version__} is installed but cannot reach a CUDA device: {e}"
    if count < 1:
        return f"CuPy {cupy.__version__} is installed but finds no CUDA device"
    return None


def cuda_available():
    """True when CuPy is installed and finds at least one CUDA device."""
    return cuda_unavailable_reason() is None


def _require_cuda():
    reason = cuda_unavailable_reason()
    if reason is None:
        from snrt.backends.cupy_backend import device_unsupported_reason

        reason = device_unsupported_reason()
    if reason is not None:
        raise SnrtError(f"the cuda backend is not available: {reason}; use --backend cpu")


def default_backend():
    """"cuda" when CuPy finds a GPU, else "cpu"."""
    return "cuda" if cuda_available() else "cpu"


def backend_class(name):
    """The Backend subclass called `name` (see snrt/backends/base.py for the contract)."""
    if name == "cpu":
        from snrt.backends.numpy_backend import NumpyBackend

        return NumpyBackend
    if name == "cuda":
        _require_cuda()
        from snrt.backends.cupy_backend import CupyBackend

        return CupyBackend
    raise SnrtError(f"unknown backend {name!r}; expected one of {', '.join(BACKENDS)}")

