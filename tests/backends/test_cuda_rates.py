"""The CUDA cost model's measured rates (snrt/backends/cuda_rates.py): measured once per
device and kept, a damaged entry measured again, the plan's model the base with those rates.
The measurement itself needs a GPU (tests/backends/test_cuda_device.py)."""

import json

import pytest

from snrt.backends import cuda_rates
from snrt.scheduler import cost

RATES = {"flops_per_s": 50e12, "memory_bytes_per_s": 3e12, "copy_bytes_per_s": 40e9}


@pytest.fixture
def gpu(tmp_path, monkeypatch):
    """A stand-in device: its key and a measurement that counts its calls."""
    monkeypatch.setenv("SNRT_CACHE_DIR", str(tmp_path))
    measured = []
    monkeypatch.setattr(cuda_rates, "device_key", lambda: "GPU X sm_90 | driver 13000 | r1")
    monkeypatch.setattr(cuda_rates, "measure_rates", lambda: measured.append(1) or dict(RATES, seconds={}))
    return tmp_path / cuda_rates.RATES_FILE, measured


def test_the_rates_are_measured_once_then_kept_and_replace_only_the_rates(gpu):
    path, measured = gpu
    model = cuda_rates.measured_cost_model(cost.CUDA)
    assert (model.flops_per_s, model.memory_bytes_per_s, model.copy_bytes_per_s) == (50e12, 3e12, 40e9)
    assert model.step_overhead_s == cost.CUDA.step_overhead_s and model.link_bytes_per_s == cost.CUDA.link_bytes_per_s
    assert cuda_rates.measured_cost_model(cost.CUDA) == model and len(measured) == 1
    assert json.loads(path.read_text())["GPU X sm_90 | driver 13000 | r1"]["copy_bytes_per_s"] == 40e9


@pytest.mark.parametrize("entry", [{"flops_per_s": 1.0}, dict(RATES, copy_bytes_per_s=0),
                                   dict(RATES, flops_per_s="fast"), dict(RATES, memory_bytes_per_s=float("nan"))])
def test_an_incomplete_or_impossible_entry_is_measured_again(gpu, entry):
    path, measured = gpu
    path.write_text(json.dumps({"GPU X sm_90 | driver 13000 | r1": entry}))
    assert cuda_rates.measured_cost_model(cost.CUDA).copy_bytes_per_s == 40e9 and measured == [1]


def test_rates_that_cannot_be_measured_leave_the_base_model_and_keep_nothing(gpu, monkeypatch):
    path, _ = gpu

    def out_of_memory():
        raise MemoryError("no device memory to spare")

    monkeypatch.setattr(cuda_rates, "measure_rates", out_of_memory)
    assert cuda_rates.measured_cost_model(cost.CUDA) is cost.CUDA and not path.exists()
