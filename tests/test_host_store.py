"""The host store as a file on disk (memory.host_store, CPU): data survives giving pages back,
nothing is left in the folder, and training through it is bit-identical."""

import os

import numpy as np
import pytest

import snrt
from snrt.config import with_settings
from snrt.memory.host import HostStore
from snrt.scheduler.plan import Buffer
from snrt.train import Trainer


def test_a_store_on_disk_keeps_its_data_when_it_gives_its_pages_back(tmp_path):
    store = HostStore.on_disk(3 * 4096 + 100, tmp_path)
    assert os.listdir(tmp_path) == []  # the file is gone from the folder; the mapping holds its space
    buffer = Buffer(0, "w", (3 * 1024 + 25,), "float32", 3 * 4096 + 100, "parameter", host_slot=0)
    values = np.arange(3 * 1024 + 25, dtype=np.float32)
    store.slot(buffer).view(np.float32)[:] = values
    store.settle(buffer)
    np.testing.assert_array_equal(store.slot(buffer).view(np.float32), values)


def test_a_folder_that_cannot_hold_the_store_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(OSError):
        HostStore.on_disk(4096, blocker)


def test_streamed_training_through_a_store_on_disk_is_bit_identical(tmp_path):
    config = snrt.load_config("configs/cifar_resnet20.yaml", {"train.batch": 4, "input.shape": [3, 16, 16]})
    reference = Trainer(config)
    reference.fit(iterations=2)
    disk = Trainer(with_settings(config, memory={"policy": "superneurons", "stream_parameters": True,
                                                 "host_store": str(tmp_path / "store")}), check=True)
    disk.fit(iterations=2)
    assert disk.backend.host.mapping is not None
    expected, got = reference.host_arrays(), disk.host_arrays()
    for key, value in expected.items():
        assert np.array_equal(got[key], value), key
    assert os.listdir(tmp_path / "store") == []


def test_a_disk_too_small_for_the_store_is_an_error_naming_the_folder(tmp_path, monkeypatch):
    def full(fd, offset, length):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(OSError, match="cannot hold a host store of 8192 bytes") as caught:
        HostStore.on_disk(8192, tmp_path)
    assert caught.value.filename == str(tmp_path)
    assert os.listdir(tmp_path) == []
