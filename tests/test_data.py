"""The data pipeline: loaders for every set type, their errors, and the seeded batch stream."""

import pickle
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import yaml

from snrt.data import (Batches, Dataset, augment, channel_stats, eval_batches, load_datasets,
                       normalization)
from snrt.errors import ConfigError


@dataclass
class Data:
    """Stand-in for snrt.config.DataConfig."""

    type: str = "synthetic"
    path: str = None
    crop_padding: int = 0
    flip: bool = False
    normalize: bool = True
    holdout: float = 0.2
    samples: int = 2048


def numbered(n, shape=(1, 2, 2)):
    """A Dataset whose sample k is the constant image k (so a batch tells which samples it holds)."""
    x = np.broadcast_to(np.arange(n, dtype=np.float32)[:, None, None, None], (n,) + shape).copy()
    return Dataset(x, np.arange(n) % 3, 3, "numbered")


def ids(x):
    return x[:, 0, 0, 0].astype(int)


def stream(batches, count):
    it = iter(batches)
    out = [next(it) for _ in range(count)]
    batches.close()
    return out


def assert_same(a, b):
    assert len(a) == len(b)
    for (xa, ya), (xb, yb) in zip(a, b):
        np.testing.assert_array_equal(xa, xb)
        np.testing.assert_array_equal(ya, yb)


def images(n=40, shape=(3, 8, 8), seed=0):
    rng = np.random.default_rng(seed)
    return Dataset(rng.random((n,) + shape, dtype=np.float32), rng.integers(0, 4, n), 4, "random")


ZERO, ONE = np.zeros(1, np.float32), np.ones(1, np.float32)


# ---- the batch stream -------------------------------------------------------------------------
def test_same_seed_same_batches_other_seed_other_batches():
    ds = images()
    mean, std = channel_stats(ds)
    make = lambda seed: stream(Batches(ds, 8, seed, mean, std, crop_padding=2, flip=True), 7)
    assert_same(make(3), make(3))
    assert not np.array_equal(make(3)[0][0], make(4)[0][0])


@pytest.mark.parametrize("prefetch", [True, False])
def test_resumed_stream_equals_uninterrupted_one(prefetch):
    ds = images(n=10)  # batch 4: batch 2 spans the first epoch boundary, batch 7 the fourth
    mean, std = channel_stats(ds)
    full = stream(Batches(ds, 4, 1, mean, std, crop_padding=1, flip=True, prefetch=prefetch), 10)
    for k in (1, 2, 7):
        resumed = stream(Batches(ds, 4, 1, mean, std, crop_padding=1, flip=True, start=k, prefetch=prefetch), 10 - k)
        assert_same(resumed, full[k:])


def test_every_epoch_visits_every_sample_once():
    n, batch = 10, 4
    got = np.concatenate([ids(x) for x, _ in stream(Batches(numbered(n), batch, 0, ZERO, ONE), 15)])
    epochs = got.reshape(-1, n)  # 60 positions = 6 epochs
    for e, order in enumerate(epochs):
        assert sorted(order) == list(range(n))
        np.testing.assert_array_equal(order, np.random.default_rng([0, e]).permutation(n))
    assert len({tuple(o) for o in epochs}) == len(epochs)  # a new order every epoch


def test_batch_larger_than_the_data_set_spans_several_epochs():
    b = Batches(numbered(3), 7, 5, ZERO, ONE, prefetch=False)
    x, y = b.get(1)  # positions 7..13: epochs 2, 3 and 4
    expected = np.concatenate([np.random.default_rng([5, e]).permutation(3) for e in range(5)])[7:14]
    np.testing.assert_array_equal(ids(x), expected)
    np.testing.assert_array_equal(y, expected % 3)


def test_prefetch_on_and_off_give_identical_batches():
    ds = images()
    mean, std = channel_stats(ds)
    on = stream(Batches(ds, 6, 2, mean, std, crop_padding=3, flip=True, prefetch=True), 12)
    off = stream(Batches(ds, 6, 2, mean, std, crop_padding=3, flip=True, prefetch=False), 12)
    assert_same(on, off)


def loader_threads():
    return [t for t in threading.enumerate() if t.name == "snrt-batches"]


def test_close_stops_the_loader_promptly():
    before = len(loader_threads())
    b = Batches(images(), 4, 0, np.zeros(3), np.ones(3))
    it = iter(b)
    next(it)
    time.sleep(0.05)  # let the loader fill its queue and block
    t0 = time.perf_counter()
    b.close()
    assert time.perf_counter() - t0 < 1.0
    assert len(loader_threads()) == before
    assert list(it) == []  # a closed stream ends
    Batches(images(), 4, 0, np.zeros(3), np.ones(3)).close()  # never iterated: nothing to stop


def test_context_manager_and_abandoned_iterator_stop_the_loader():
    before = len(loader_threads())
    with Batches(images(), 4, 0, np.zeros(3), np.ones(3)) as b:
        x, y = next(iter(b))
        assert x.shape == (4, 3, 8, 8) and x.dtype == np.float32 and x.flags.c_contiguous and y.dtype == np.int64
    it = iter(Batches(images(), 4, 0, np.zeros(3), np.ones(3)))
    next(it)
    it.close()  # what garbage collection does to an iterator nobody reads any more
    deadline = time.perf_counter() + 1.0
    while len(loader_threads()) > before and time.perf_counter() < deadline:
        time.sleep(0.01)
    assert len(loader_threads()) == before


def test_loader_errors_reach_the_consumer(monkeypatch):
    b = Batches(images(), 4, 0, np.zeros(3), np.ones(3))
    real_get = b.get
    monkeypatch.setattr(b, "get", lambda i: real_get(i) if i < 2 else 1 / 0)
    it = iter(b)
    next(it), next(it)
    with pytest.raises(ZeroDivisionError):
        next(it)
    b.close()


# ---- normalisation --------------------------------------------------------------------------
def test_normalised_batches_have_zero_mean_unit_std():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((64, 3, 6, 6)) * [[[2.0]], [[0.5]], [[3.0]]] + [[[5.0]], [[-1.0]], [[0.0]]]).astype(np.float32)
    ds = Dataset(x, np.zeros(64, np.int64), 2, "shifted")
    mean, std = channel_stats(ds)
    assert mean.dtype == std.dtype == np.float32 and mean.shape == std.shape == (3,)
    np.testing.assert_allclose(mean, x.mean(axis=(0, 2, 3)), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(std, x.std(axis=(0, 2, 3)), rtol=1e-5)
    for xs in (np.concatenate([xb for xb, _ in eval_batches(ds, 10, mean, std)]),
               np.concatenate([xb for xb, _ in stream(Batches(ds, 16, 0, mean, std), 4)])):  # one whole epoch
        np.testing.assert_allclose(xs.mean(axis=(0, 2, 3)), 0, atol=1e-5)
        np.testing.assert_allclose(xs.std(axis=(0, 2, 3)), 1, atol=1e-5)


def test_normalize_off_means_zero_mean_unit_std_and_constant_channels_keep_std_one():
    ds = Dataset(np.full((4, 2, 3, 3), 7, np.float32), np.zeros(4, np.int64), 2, "flat")
    mean, std = normalization(Data(normalize=False), ds)
    np.testing.assert_array_equal(mean, [0, 0]), np.testing.assert_array_equal(std, [1, 1])
    mean, std = normalization(Data(normalize=True), ds)
    np.testing.assert_array_equal(mean, [7, 7]), np.testing.assert_array_equal(std, [1, 1])


def test_eval_batches_in_order_without_augmentation():
    ds = numbered(10)
    got = list(eval_batches(ds, 4, [1.0], [2.0]))
    assert [len(y) for _, y in got] == [4, 4, 2]
    np.testing.assert_array_equal(np.concatenate([x[:, 0, 0, 0] for x, _ in got]), (np.arange(10) - 1) / 2)
    np.testing.assert_array_equal(np.concatenate([y for _, y in got]), ds.y)


# ---- augmentation -------------------------------------------------------------------------------
class FixedDraws:
    """Stands in for a numpy Generator: returns the given crop offsets and flip draws."""

    def __init__(self, offsets=None, flips=None):
        self.offsets, self.flips = offsets, flips

    def integers(self, low, high, size):
        assert (low, high) == (0, 3) and size == np.shape(self.offsets)
        return np.array(self.offsets)

    def random(self, size):
        return np.array(self.flips, dtype=float)


IMAGE = np.arange(1, 10, dtype=np.float32).reshape(1, 1, 3, 3)  # [[1 2 3] [4 5 6] [7 8 9]]


def test_crop_after_zero_padding_by_hand():
    x = np.concatenate([IMAGE, IMAGE, IMAGE])
    out = augment(x, FixedDraws(offsets=[[0, 0], [1, 1], [2, 1]]), crop_padding=1)
    np.testing.assert_array_equal(out[0, 0], [[0, 0, 0], [0, 1, 2], [0, 4, 5]])  # shifted down-right
    np.testing.assert_array_equal(out[1, 0], IMAGE[0, 0])  # centre crop: unchanged
    np.testing.assert_array_equal(out[2, 0], [[4, 5, 6], [7, 8, 9], [0, 0, 0]])  # shifted up
    assert out.flags.c_contiguous


def test_flip_by_hand_and_flip_after_crop():
    x = np.concatenate([IMAGE, IMAGE])
    out = augment(x, FixedDraws(flips=[0.2, 0.9]), flip=True)  # < 0.5 flips
    np.testing.assert_array_equal(out[0, 0], [[3, 2, 1], [6, 5, 4], [9, 8, 7]])
    np.testing.assert_array_equal(out[1, 0], IMAGE[0, 0])
    np.testing.assert_array_equal(x[0], IMAGE[0])  # the input is left alone
    out = augment(IMAGE, FixedDraws(offsets=[[0, 2]], flips=[0.1]), crop_padding=1, flip=True)
    np.testing.assert_array_equal(out[0, 0], [[0, 0, 0], [0, 3, 2], [0, 6, 5]])  # crop [[0 0 0] [2 3 0] [5 6 0]], flipped


def test_batches_augment_with_the_rng_of_the_batch():
    ds = images(n=12)
    b = Batches(ds, 5, 9, np.zeros(3), np.ones(3), crop_padding=2, flip=True, prefetch=False)
    x, _ = b.get(3)
    expected = augment(ds.x[b.indices(3)], np.random.default_rng([9, 3, 1]), crop_padding=2, flip=True)
    np.testing.assert_array_equal(x, expected)
    assert (x == 0).any() and not (ds.x == 0).any()  # some padding made it in


# ---- synthetic ----------------------------------------------------------------------------------
def test_synthetic_is_seeded_balanced_and_learnable():
    train, held = load_datasets(Data(samples=500, holdout=0.2), (3, 16, 16), 5, seed=1)
    assert (len(train), len(held)) == (400, 100)
    assert train.x.shape == (400, 3, 16, 16) and train.x.dtype == np.float32 and train.y.dtype == np.int64
    assert np.bincount(held.y).tolist() == [20] * 5 and np.bincount(train.y).tolist() == [80] * 5
    again, _ = load_datasets(Data(samples=500, holdout=0.2), (3, 16, 16), 5, seed=1)
    np.testing.assert_array_equal(train.x, again.x)
    other, _ = load_datasets(Data(samples=500, holdout=0.2), (3, 16, 16), 5, seed=2)
    assert not np.array_equal(train.x, other.x)
    means = np.stack([train.x[train.y == c].mean(axis=0) for c in range(5)])  # nearest class mean
    guess = ((held.x[:, None] - means[None]) ** 2).sum(axis=(2, 3, 4)).argmin(axis=1)
    assert (guess == held.y).mean() > 0.9


def test_holdout_of_many_small_classes_is_not_empty():
    train, held = load_datasets(Data(samples=300, holdout=0.1), (1, 4, 4), 200, seed=0)
    assert (len(train), len(held)) == (270, 30)


# ---- npz ----------------------------------------------------------------------------------------
def write_npz(tmp_path, **arrays):
    path = tmp_path / "set.npz"
    np.savez(path, **arrays)
    return str(path)


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_npz_in_both_layouts(tmp_path, layout):
    x = np.random.default_rng(0).integers(0, 256, (20, 3, 4, 5), dtype=np.uint8)
    stored = x if layout == "nchw" else x.transpose(0, 2, 3, 1)
    path = write_npz(tmp_path, x=stored, y=np.arange(20) % 4)
    train, held = load_datasets(Data("npz", path, holdout=0.25), (3, 4, 5), 4, seed=0)
    assert (len(train), len(held)) == (15, 5) and train.x.dtype == np.float32
    both = np.concatenate([train.x, held.x])
    expected = x.astype(np.float32) / np.float32(255)
    assert {tuple(img.ravel()) for img in both} == {tuple(img.ravel()) for img in expected}
    assert both.min() >= 0 and both.max() <= 1


def test_npz_with_test_split_and_one_channel_without_channel_axis(tmp_path):
    rng = np.random.default_rng(0)
    x, x_test = rng.random((10, 6, 6)), rng.random((4, 6, 6))
    path = write_npz(tmp_path, x=x, y=np.arange(10) % 2, x_test=x_test, y_test=[0, 1, 1, 0])
    train, test = load_datasets(Data("npz", path), (1, 6, 6), 2, seed=0)
    np.testing.assert_allclose(train.x[:, 0], x, rtol=1e-6)
    np.testing.assert_allclose(test.x[:, 0], x_test, rtol=1e-6)
    assert test.y.tolist() == [0, 1, 1, 0] and test.y.dtype == np.int64 and train.name == "npz/train"


# ---- CIFAR --------------------------------------------------------------------------------------
def fake_pixels(n, seed):
    return np.random.default_rng(seed).integers(0, 256, (n, 3072), dtype=np.uint8)


def write_cifar10_bin(folder, n=3):
    folder.mkdir(parents=True)
    for i, name in enumerate([f"data_batch_{k}.bin" for k in range(1, 6)] + ["test_batch.bin"]):
        labels = (np.arange(n) + i) % 10
        (folder / name).write_bytes(np.hstack([labels[:, None].astype(np.uint8), fake_pixels(n, i)]).tobytes())


def write_cifar_py(folder, names, label_key, n=3, old_numpy=False):
    """Pickled batches; `old_numpy` writes them as the published files are: protocol 2, numpy.core names."""
    folder.mkdir(parents=True)
    for i, name in enumerate(names):
        batch = {b"batch_label": b"fake", b"data": fake_pixels(n, i), label_key: [int(v) for v in (np.arange(n) + i) % 10]}
        raw = pickle.dumps(batch, protocol=2 if old_numpy else pickle.DEFAULT_PROTOCOL)
        if old_numpy:
            raw = raw.replace(b"numpy._core.multiarray", b"numpy.core.multiarray")
        (folder / name).write_bytes(raw)


CIFAR10_PY = [f"data_batch_{k}" for k in range(1, 6)] + ["test_batch"]


def check_cifar(train, test, n_train, n_test, classes):
    assert train.x.shape == (n_train, 3, 32, 32) and test.x.shape == (n_test, 3, 32, 32)
    assert train.classes == classes and train.x.dtype == np.float32 and train.y.dtype == np.int64
    np.testing.assert_array_equal(train.x[:3], fake_pixels(3, 0).reshape(3, 3, 32, 32) / np.float32(255))
    assert train.y[:3].tolist() == [0, 1, 2]


@pytest.mark.parametrize("point_at", ["folder", "parent"])
def test_cifar10_binary(tmp_path, point_at):
    write_cifar10_bin(tmp_path / "cifar-10-batches-bin")
    path = tmp_path / "cifar-10-batches-bin" if point_at == "folder" else tmp_path
    train, test = load_datasets(Data("cifar10", str(path)), (3, 32, 32), 10, seed=0)
    check_cifar(train, test, 15, 3, 10)
    assert test.y.tolist() == [5, 6, 7]


@pytest.mark.parametrize("old_numpy", [False, True])
def test_cifar10_python(tmp_path, old_numpy):
    write_cifar_py(tmp_path / "cifar-10-batches-py", CIFAR10_PY, b"labels", old_numpy=old_numpy)
    train, test = load_datasets(Data("cifar10", str(tmp_path)), (3, 32, 32), 10, seed=0)
    check_cifar(train, test, 15, 3, 10)


def test_cifar100_binary_uses_fine_labels_and_python(tmp_path):
    folder = tmp_path / "bin" / "cifar-100-binary"
    folder.mkdir(parents=True)
    for i, name in enumerate(["train.bin", "test.bin"]):
        coarse, fine = np.full(3, 19, np.uint8), np.array([0, 1, 2], np.uint8) + 97 * i
        (folder / name).write_bytes(np.hstack([coarse[:, None], fine[:, None], fake_pixels(3, i)]).tobytes())
    train, test = load_datasets(Data("cifar100", str(folder)), (3, 32, 32), 100, seed=0)
    check_cifar(train, test, 3, 3, 100)
    assert test.y.tolist() == [97, 98, 99]
    write_cifar_py(tmp_path / "py" / "cifar-100-python", ["train", "test"], b"fine_labels")
    train, test = load_datasets(Data("cifar100", str(tmp_path / "py")), (3, 32, 32), 100, seed=0)
    check_cifar(train, test, 3, 3, 100)


# ---- digits -------------------------------------------------------------------------------------
def test_digits():
    pytest.importorskip("sklearn")
    train, held = load_datasets(Data("digits", holdout=0.25), (1, 8, 8), 10, seed=0)
    assert len(train) + len(held) == 1797 and abs(len(held) - 0.25 * 1797) <= 1
    assert train.x.shape[1:] == (1, 8, 8) and train.x.min() == 0 and train.x.max() == 1
    assert sorted(set(held.y.tolist())) == list(range(10))


def test_digits_without_scikit_learn(monkeypatch):
    monkeypatch.setitem(sys.modules, "sklearn", None)
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    with pytest.raises(ConfigError, match="pip install scikit-learn") as e:
        load_datasets(Data("digits"), (1, 8, 8), 10, seed=0)
    assert e.value.key == "train.data.type"


# ---- errors -------------------------------------------------------------------------------------
def error(data, shape=(3, 32, 32), classes=10):
    with pytest.raises(ConfigError) as e:
        load_datasets(data, shape, classes, seed=0)
    return e.value


def test_missing_files_say_what_was_expected(tmp_path):
    e = error(Data("cifar10", str(tmp_path / "nowhere")))
    assert e.key == "train.data.path" and "nowhere" in e.source and "no such folder" in e.message
    assert "cifar-10-batches-bin/" in e.message and "data_batch_1.bin" in e.message and "cifar-10-batches-py/" in e.message
    e = error(Data("cifar100", None))
    assert e.source == "<data>" and "needs path" in e.message and "cifar-100-binary/ (train.bin, test.bin)" in e.message
    (tmp_path / "cifar-10-batches-bin").mkdir()
    (tmp_path / "cifar-10-batches-bin" / "data_batch_1.bin").write_bytes(b"")
    e = error(Data("cifar10", str(tmp_path)))
    assert "no cifar10 files found" in e.message and "lacks data_batch_2.bin" in e.message
    e = error(Data("npz", str(tmp_path / "set.npz")), (1, 4, 4))
    assert "no such file" in e.message and "'x'" in e.message and "'y'" in e.message
    e = error(Data("npz", None))
    assert "needs path" in e.message


def test_image_shape_mismatch_names_both_shapes(tmp_path):
    path = write_npz(tmp_path, x=np.zeros((4, 28, 28, 3), np.uint8), y=np.zeros(4, int))
    e = error(Data("npz", path), (3, 32, 32))
    assert "(3, 28, 28)" in e.message and "(3, 32, 32)" in e.message and "--image-size 28" in e.message
    e = error(Data("npz", path), (1, 28, 28))
    assert "3 channel(s), the network expects 1" in e.message and "--image-size" not in e.message
    write_cifar10_bin(tmp_path / "cifar-10-batches-bin")
    e = error(Data("cifar10", str(tmp_path)), (3, 224, 224))
    assert "(3, 32, 32)" in e.message and "(3, 224, 224)" in e.message and "--image-size 32" in e.message
    e = error(Data("digits"), (1, 28, 28))
    assert "(1, 8, 8)" in e.message and "--image-size 8" in e.message


def test_labels_out_of_range_say_the_range_found(tmp_path):
    path = write_npz(tmp_path, x=np.zeros((4, 1, 2, 2)), y=[0, 3, 12, 1])
    e = error(Data("npz", path), (1, 2, 2), classes=10)
    assert e.key == "train.data.path" and "[0, 12]" in e.message and "[0, 9]" in e.message
    path = write_npz(tmp_path, x=np.zeros((4, 1, 2, 2)), y=[0, -1, 1, 1])
    assert "[-1, 1]" in error(Data("npz", path), (1, 2, 2)).message
    path = write_npz(tmp_path, x=np.zeros((4, 1, 2, 2)), y=[0.5, 1, 1, 1])
    assert "integer class indices" in error(Data("npz", path), (1, 2, 2)).message


def test_class_count_mismatch(tmp_path):
    write_cifar_py(tmp_path / "cifar-100-python", ["train", "test"], b"fine_labels")
    e = error(Data("cifar100", str(tmp_path)), classes=10)
    assert e.key == "train.data.type" and "100 classes" in e.message and "input.classes is 10" in e.message
    assert "10 classes" in error(Data("digits"), (1, 8, 8), classes=100).message


DAMAGED_ZIP_HEADERS = ((10, 99), (8, 1))  # a compression method zipfile does not know; the encrypted flag


def damage_zip_header(path, offset, value):
    """Overwrite the 2-byte field at `offset` of the first member's central directory entry."""
    data = bytearray(Path(path).read_bytes())
    entry = data.index(b"PK\x01\x02")
    data[entry + offset:entry + offset + 2] = value.to_bytes(2, "little")
    Path(path).write_bytes(bytes(data))


def test_corrupt_and_truncated_files(tmp_path):
    write_cifar10_bin(tmp_path / "cifar-10-batches-bin")
    victim = tmp_path / "cifar-10-batches-bin" / "data_batch_3.bin"
    victim.write_bytes(victim.read_bytes()[:-100])
    e = error(Data("cifar10", str(tmp_path)))
    assert "data_batch_3.bin" in e.source and "truncated" in e.message and "3073-byte records" in e.message

    write_cifar_py(tmp_path / "py" / "cifar-10-batches-py", CIFAR10_PY, b"labels")
    victim = tmp_path / "py" / "cifar-10-batches-py" / "test_batch"
    victim.write_bytes(victim.read_bytes()[:500])
    e = error(Data("cifar10", str(tmp_path / "py")))
    assert "test_batch" in e.source and "truncated or corrupt" in e.message
    victim.write_bytes(pickle.dumps({b"data": [1, 2]}))
    assert "expected a dict with b'data' and b'labels'" in error(Data("cifar10", str(tmp_path / "py"))).message
    victim.write_bytes(pickle.dumps(threading.Thread))  # no code from a data file
    assert "unexpected object" in error(Data("cifar10", str(tmp_path / "py"))).message
    for labels, says in (([-1, 3, 4], "labels from -1 to 4 in 1 file(s), but this data set has 10 classes (0 to 9)"),
                         (["a", "b", "c"], "3 labels of <U1; expected uint8 (N, 3072) and N integer labels")):
        victim.write_bytes(pickle.dumps({b"data": fake_pixels(3, 0), b"labels": labels}))
        assert says in error(Data("cifar10", str(tmp_path / "py"))).message
    for length in (2**63 + 5, 2**45):  # a damaged length of bytes: more than Python can hold, more than memory
        victim.write_bytes(b"\x80\x04\x8e" + length.to_bytes(8, "little"))
        e = error(Data("cifar10", str(tmp_path / "py")))
        assert "test_batch" in e.source and "truncated or corrupt CIFAR python batch" in e.message

    path = write_npz(tmp_path, x=np.zeros((4, 1, 2, 2)), y=np.zeros(4, int))
    with open(path, "r+b") as f:
        f.truncate(100)
    assert "cannot read the file as .npz" in error(Data("npz", path), (1, 2, 2)).message
    (tmp_path / "junk.npz").write_bytes(b"not a zip at all" * 10)
    assert "cannot read the file as .npz" in error(Data("npz", str(tmp_path / "junk.npz")), (1, 2, 2)).message
    for offset, value in DAMAGED_ZIP_HEADERS:
        path = write_npz(tmp_path, x=np.zeros((4, 1, 2, 2)), y=np.zeros(4, int))
        damage_zip_header(path, offset, value)
        assert "cannot read the file as .npz" in error(Data("npz", path), (1, 2, 2)).message
    with open(tmp_path / "one.npz", "wb") as f:
        np.save(f, np.zeros(3))
    assert "single array, not named arrays" in error(Data("npz", str(tmp_path / "one.npz")), (1, 2, 2)).message
    path = write_npz(tmp_path, x=np.zeros((4, 1, 2, 2)))
    e = error(Data("npz", path), (1, 2, 2))
    assert "no array 'y'" in e.message and "found: x" in e.message
    path = write_npz(tmp_path, x=np.full((4, 1, 2, 2), np.nan), y=np.zeros(4, int))
    assert "16 NaN or infinite" in error(Data("npz", path), (1, 2, 2)).message
    path = write_npz(tmp_path, x=np.full((4, 1, 2, 2), 1e39), y=np.zeros(4, int))  # finite, but not in float32
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no raw NumPy warning beside the error
        assert "16 NaN or infinite values (or values beyond float32's range" in error(Data("npz", path),
                                                                                     (1, 2, 2)).message


def test_unknown_type_and_bad_holdout():
    e = error(Data("imagenet"))
    assert e.key == "train.data.type" and "cifar10" in e.message
    e = error(Data(samples=10, holdout=0.01), (1, 4, 4))
    assert e.key == "train.data.holdout" and "both must be non-empty" in e.message


@pytest.mark.parametrize("samples", [10**14, 10**30])
def test_a_synthetic_set_larger_than_memory_is_refused_before_numpy_is_asked(samples):
    e = error(Data(samples=samples), (3, 8, 8))
    assert e.key == "train.data.samples" and "synthetic samples of shape [3, 8, 8] (this machine's memory" in e.message
    assert e.message.startswith("expected at most ") and e.message.endswith(f"got {samples:,}")


# ---- per-pixel labels ---------------------------------------------------------------------------
def test_per_pixel_labels_flip_with_their_images():
    rng = np.random.default_rng(4)
    y = rng.integers(0, 5, (12, 4, 6))
    ds = Dataset(np.stack([y, -y]).transpose(1, 0, 2, 3).astype(np.float32), y, 5, "maps")  # channel 0 is the label
    b = Batches(ds, 6, 2, np.zeros(2), np.ones(2), flip=True, prefetch=False)
    flipped = 0
    for i in range(4):
        x, labels = b.get(i)
        assert labels.shape == (6, 4, 6) and labels.dtype == np.int64
        np.testing.assert_array_equal(x[:, 0], labels)
        flipped += int((labels != ds.y[b.indices(i)]).any(axis=(1, 2)).sum())
    assert flipped > 0
    with pytest.raises(ValueError, match="crops are not offered"):
        augment(ds.x[:2], rng, crop_padding=1, labels=y[:2])


def test_synthetic_label_maps_are_seeded_and_learnable_per_pixel():
    train, held = load_datasets(Data(samples=50, holdout=0.2), (3, 16, 12), 4, seed=1, per_pixel=True)
    assert (len(train), len(held)) == (40, 10) and train.y.shape == (40, 16, 12) and train.y.dtype == np.int64
    assert set(np.unique(train.y)) == {0, 1, 2, 3}
    again, _ = load_datasets(Data(samples=50, holdout=0.2), (3, 16, 12), 4, seed=1, per_pixel=True)
    np.testing.assert_array_equal(train.y, again.y)
    colours = np.stack([train.x.transpose(0, 2, 3, 1)[train.y == c].mean(axis=0) for c in range(4)])
    guess = ((held.x.transpose(0, 2, 3, 1)[..., None, :] - colours) ** 2).sum(axis=-1).argmin(axis=-1)
    assert (guess == held.y).mean() > 0.9  # nearest class colour, pixel by pixel


def test_per_pixel_labels_from_npz_and_what_is_refused(tmp_path):
    x = np.random.default_rng(0).random((8, 1, 4, 4)).astype(np.float32)
    path = write_npz(tmp_path, x=x, y=np.zeros((8, 4, 4), np.int64))
    train, held = load_datasets(Data("npz", path, holdout=0.25), (1, 4, 4), 2, seed=0, per_pixel=True)
    assert train.y.shape == (6, 4, 4) and held.y.shape == (2, 4, 4)
    with pytest.raises(ConfigError, match="expected \\(8, 4, 4\\), one class index per pixel"):
        load_datasets(Data("npz", write_npz(tmp_path, x=x, y=np.zeros(8, np.int64))), (1, 4, 4), 2, 0, per_pixel=True)
    with pytest.raises(ConfigError, match="one class per image, but the network takes one per pixel"):
        load_datasets(Data("digits"), (1, 8, 8), 10, 0, per_pixel=True)
    with pytest.raises(ConfigError, match="crop_padding"):
        load_datasets(Data(crop_padding=2), (1, 8, 8), 2, 0, per_pixel=True)


VECTOR_NET = {
    "name": "vectors",
    "input": {"shape": [12], "classes": 3},
    "train": {"batch": 4, "iterations": 3, "data": {"samples": 24}},
    "network": [{"type": "Linear", "out_features": 8}, {"type": "ReLU"},
                {"type": "Linear", "out_features": "$classes"}, {"type": "SoftmaxCrossEntropy"}],
}


def test_a_network_of_vectors_trains_on_synthetic_data_normalised_per_feature():
    import snrt
    from snrt.train import Trainer

    trainer = Trainer(snrt.load_config(VECTOR_NET))
    assert trainer.train_set.shape == (12,) and trainer.mean.shape == trainer.std.shape == (12,)
    x = trainer.train_set.take(slice(0, len(trainer.train_set)))[0]
    np.testing.assert_allclose(trainer.mean, x.mean(axis=0), rtol=1e-5, atol=1e-6)
    losses = [m.loss for m in trainer.fit()]
    assert len(losses) == 3 and all(np.isfinite(losses))


@pytest.mark.parametrize("key, value", [("crop_padding", 2), ("flip", True)])
def test_image_augmentation_of_inputs_that_are_not_images_is_a_config_error(tmp_path, key, value):
    import snrt
    from snrt.train import Trainer

    path = tmp_path / "vectors.yaml"
    doc = {**VECTOR_NET, "train": {**VECTOR_NET["train"], "data": {"samples": 24, key: value}}}
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(ConfigError) as caught:
        Trainer(snrt.load_config(path))
    assert caught.value.source == str(path) and caught.value.key == f"train.data.{key}"  # the file, not "<data>"
    assert "augments images (C, H, W), but input.shape is [12]" in caught.value.message


def test_a_crop_padding_wider_than_the_image_is_a_config_error():
    import snrt
    from snrt.train import Trainer

    with pytest.raises(ConfigError, match="crop_padding: expected at most the image's side \\(8\\), got 1000000"):
        Trainer(snrt.load_config("configs/lenet.yaml", {"train.data": {"type": "digits", "crop_padding": 1000000}}))


def test_a_folder_without_cifar_files_says_so_before_it_compares_shapes(tmp_path):
    data = Data(type="cifar10", path=str(tmp_path))
    with pytest.raises(ConfigError, match="no cifar10 files found"):  # not the network's 1x8x8 input
        load_datasets(data, (1, 8, 8), 3, 0)
