"""The CUDA cost model's rates, measured on this GPU once and then kept.

snrt/scheduler/cost.py's CUDA model has rates for no GPU in particular (8 TFLOP/s, 500 GB/s of
device memory, 12 GB/s over the host link); an H100 runs kernels several times faster and its
link is faster too, so plans made with them misjudge how long a prefetch has to hide behind
compute. `measured_cost_model` replaces the three rates with this GPU's, timed with CUDA
events on buffers from a memory pool of their own (emptied after), best of ROUNDS after an
untimed call:

- `memory_bytes_per_s`: a device-to-device copy of MEASURED_BYTES (bytes read and written);
- `copy_bytes_per_s`: the slower direction of a copy of MEASURED_BYTES between pinned host
  memory and the device;
- `flops_per_s`: an fp32 GEMM of GEMM_SIZE^3 by cuBLAS (for the layers whose kernels are not
  timed themselves: cuDNN's engines are, snrt/backends/cudnn_engines.py).

They are kept in cuda-rates.json in the cache folder (snrt/backends/choice_file.py), keyed by
the device, its driver and REVISION, so a later run plans with the same rates and measures
nothing. Measuring happens when a CUDA plan is first made in the process, before any arena.
"""

import math
from dataclasses import replace

import numpy as np

from snrt.backends import choice_file
from snrt.backends.cuda_source import best_seconds, on_own_pool

RATES_FILE = "cuda-rates.json"
FIELDS = ("flops_per_s", "memory_bytes_per_s", "copy_bytes_per_s")
MEASURED_BYTES = 256 * 2 ** 20
GEMM_SIZE = 4096
ROUNDS = 3
REVISION = 1  # of what is measured: raised when a measurement changes


def device_key():
    """The current device, its compute capability and the driver, for the rates file."""
    import cupy

    from snrt.backends.cuda_source import device_name

    return (f"{device_name()} sm_{cupy.cuda.Device().compute_capability} | "
            f"driver {cupy.cuda.runtime.driverGetVersion()} | r{REVISION}")


def measured_cost_model(base):
    """CostModel `base` with this GPU's rates (the module docstring): the kept ones, else
    measured now and kept; `base` itself when they cannot be measured (no device memory to
    spare), so that planning never fails for want of them."""
    try:
        entry = choice_file.remembered(choice_file.cache_path(RATES_FILE), device_key(), _usable, measure_rates)
    except Exception:  # cupy's OutOfMemoryError or CUDARuntimeError: plan with the base rates
        return base
    return replace(base, **{field: float(entry[field]) for field in FIELDS})


def _usable(entry):
    return all(isinstance(entry.get(field), (int, float)) and math.isfinite(entry[field]) and entry[field] > 0
               for field in FIELDS)


def measure_rates():
    """{field: rate} of this GPU (FIELDS), each measured as the module docstring says."""
    seconds = on_own_pool(_timed_calls)
    if seconds is None:
        raise MemoryError("no device memory to spare for measuring the rates")
    return {"memory_bytes_per_s": 2 * MEASURED_BYTES / seconds["memory"],
            "copy_bytes_per_s": MEASURED_BYTES / max(seconds["to_device"], seconds["to_host"]),
            "flops_per_s": 2 * GEMM_SIZE ** 3 / seconds["gemm"], "seconds": seconds}


def _timed_calls(cupy, stream):
    import cupyx

    values = MEASURED_BYTES // 4
    source, target = cupy.ones(values, np.float32), cupy.empty(values, np.float32)
    pinned = cupyx.empty_pinned(values, np.float32)
    a, product = cupy.ones((GEMM_SIZE, GEMM_SIZE), np.float32), cupy.empty((GEMM_SIZE, GEMM_SIZE), np.float32)
    return {"memory": best_seconds(stream, lambda: cupy.copyto(target, source), ROUNDS),
            "to_device": best_seconds(stream, lambda: target.set(pinned, stream=stream), ROUNDS),
            "to_host": best_seconds(stream, lambda: target.get(stream=stream, out=pinned, blocking=False), ROUNDS),
            "gemm": best_seconds(stream, lambda: cupy.matmul(a, a, out=product), ROUNDS)}
