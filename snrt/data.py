"""Training data: data sets held in memory, and the seeded batch stream the trainer reads.

`load_datasets` turns a DataConfig into a (train, held-out) pair of `Dataset`s of float32
images (N, C, H, W), not yet normalised, and int64 labels. `Batches` yields normalised,
augmented training batches forever; batch i is a pure function of (seed, i), so a run resumed
at iteration k sees exactly what an uninterrupted run sees, whatever the loader thread's timing:

- epoch e covers positions [e*N, (e+1)*N) of the stream; its order is
  ``np.random.default_rng([seed, e]).permutation(N)``, and batch i takes positions
  [i*B, (i+1)*B), so a batch spanning an epoch boundary takes the tail of one permutation and
  the head of the next;
- augmentation of batch i draws from ``np.random.default_rng([seed, i, 1])``: first the crop
  offsets (B, 2) in [0, 2p] when crop_padding p > 0, then the flips (B,) when flip is on.
  Images are zero-padded before normalisation (as torchvision's RandomCrop then Normalize do),
  so padded pixels come out as -mean/std.

Nothing is downloaded: CIFAR is read from a local folder, digits from scikit-learn's bundled copy.
"""

import math
import os
import pickle
import queue
import threading
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from snrt.errors import ConfigError

PATH_KEY, TYPE_KEY, HOLDOUT_KEY = "train.data.path", "train.data.type", "train.data.holdout"
_STATS_CHUNK = 1024  # samples per chunk when computing channel statistics
_STATS_LIMIT = {"folder": 2048}  # images decoded for an image folder's statistics (snrt/images.py)


@dataclass(frozen=True, eq=False)
class Dataset:
    """One split, in memory: x (N, C, H, W) float32, not normalised; y int64 in [0, classes),
    (N,) for one class per image or (N, H, W) for one per pixel."""

    x: np.ndarray
    y: np.ndarray
    classes: int
    name: str
    draws_per_sample = False  # whether `take` wants a random generator per sample (image folders' crops)
    decodes = False  # in memory: a thread prepares batches fast enough, no worker processes by default

    def __len__(self):
        return len(self.y)

    def take(self, idx, rngs=None):
        """(x (B, C, H, W), y) of samples `idx` (an index array or a slice)."""
        return self.x[idx], self.y[idx]

    @property
    def shape(self):
        """Per-sample shape (C, H, W)."""
        return tuple(self.x.shape[1:])


# ---- loading -------------------------------------------------------------------------------
def load_datasets(data, input_shape, classes, seed, per_pixel=False):
    """(train, held-out) Datasets for DataConfig `data`, checked against the network's input.

    `input_shape` is the per-sample (C, H, W) of the network file, `classes` its class count,
    `per_pixel` whether it takes a class per pixel (labels (N, H, W); synthetic and npz data).
    Sets without a test split (synthetic, npz without x_test, digits) hold out a stratified
    (by class, for per-image labels), seeded fraction `data.holdout` of their samples.
    """
    input_shape = tuple(int(s) for s in input_shape)
    loaders = {"synthetic": _load_synthetic, "npz": _load_npz, "cifar10": _load_cifar,
               "cifar100": _load_cifar, "digits": _load_digits, "folder": _load_folder}
    if data.type not in loaders:
        raise ConfigError("<data>", TYPE_KEY, f"unknown data set type {data.type!r}; known: {', '.join(loaders)}")
    if per_pixel and data.type not in ("synthetic", "npz"):
        raise ConfigError("<data>", TYPE_KEY, f"{data.type} has one class per image, but the network takes one per "
                                              "pixel (input.per_pixel); use synthetic or npz data")
    if per_pixel and data.crop_padding:
        raise ConfigError("<data>", "train.data.crop_padding", "random crops are not offered with per-pixel labels "
                                                               "(input.per_pixel); flip is; set crop_padding: 0")
    for key, on in (("crop_padding", data.crop_padding), ("flip", data.flip)):
        if on and len(input_shape) != 3:
            raise ConfigError("<data>", f"train.data.{key}", f"augments images (C, H, W), but input.shape is "
                                                             f"{list(input_shape)}; turn it off")
    if data.crop_padding > max(input_shape[1:], default=0):
        raise ConfigError("<data>", "train.data.crop_padding", f"expected at most the image's side "
                                                               f"({max(input_shape[1:])}), got {data.crop_padding}")
    if data.type in ("synthetic", "npz"):
        return loaders[data.type](data, input_shape, classes, seed, per_pixel)
    return loaders[data.type](data, input_shape, classes, seed)


def _load_synthetic(data, input_shape, classes, seed, per_pixel=False):
    """Learnable class-dependent images: a smooth random prototype per class plus noise (inputs
    of another rank than (C, H, W): a random one); with
    `per_pixel`, label maps of random class blocks and each pixel the colour of its class."""
    if data.samples < 2:
        raise ConfigError("<data>", "train.data.samples", f"the synthetic set needs at least 2 samples, got {data.samples}")
    _require_room_for_synthetic(data.samples, input_shape)
    rng = np.random.default_rng([seed, 7])
    if per_pixel:
        return _split_holdout(*_synthetic_label_maps(rng, data.samples, input_shape, classes), classes,
                              "synthetic", data, seed)
    if len(input_shape) != 3:  # vectors, sequences: a random prototype per class, plus noise
        y = rng.permutation(np.arange(data.samples) % classes).astype(np.int64)
        prototypes = 0.5 * rng.standard_normal((classes, *input_shape)).astype(np.float32)
        x = rng.standard_normal((data.samples, *input_shape), dtype=np.float32)
        x *= 0.25
        x += prototypes[y]
        return _split_holdout(x, y, classes, "synthetic", data, seed)
    c, h, w = input_shape
    low_h, low_w = _low_resolution(h), _low_resolution(w)
    low = 0.25 * rng.standard_normal((classes, c, low_h, low_w)).astype(np.float32)
    up_h, up_w = _interpolation_matrix(h, low_h), _interpolation_matrix(w, low_w)
    y = rng.permutation(np.arange(data.samples) % classes).astype(np.int64)
    x = rng.standard_normal((data.samples, c, h, w), dtype=np.float32)
    x *= 0.25
    for start in range(0, len(y), 256):  # prototypes per chunk: 1000 classes of 227x227 would not fit
        chunk = slice(start, start + 256)
        x[chunk] += np.einsum("hi,bcij,wj->bchw", up_h, low[y[chunk]], up_w, optimize=True)
    x += 0.5
    return _split_holdout(x, y, classes, "synthetic", data, seed)


def _require_room_for_synthetic(samples, input_shape):
    """A ConfigError at train.data.samples when the synthetic set's images (float32) and labels
    would not fit in this machine's memory: refused before NumPy is asked for them."""
    sample_bytes = 4 * math.prod(input_shape) + 8
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if samples * sample_bytes > physical:
        raise ConfigError("<data>", "train.data.samples", f"expected at most {physical // sample_bytes:,} synthetic "
                                                          f"samples of shape {list(input_shape)} (this machine's memory, "
                                                          f"{physical:,} bytes, holds no more), got {samples:,}")


def _synthetic_label_maps(rng, samples, input_shape, classes):
    """(x, y): y (N, H, W) a random class per cell of a coarse grid, blown up to whole pixels;
    x the class's random colour (C,) at each pixel, plus noise."""
    c, h, w = input_shape
    cells = rng.integers(0, classes, size=(samples, _low_resolution(h), _low_resolution(w)))
    rows = np.arange(h) * cells.shape[1] // h
    cols = np.arange(w) * cells.shape[2] // w
    y = cells[:, rows][:, :, cols].astype(np.int64)
    colours = rng.standard_normal((classes, c)).astype(np.float32)
    x = rng.standard_normal((samples, c, h, w), dtype=np.float32)
    x *= 0.25
    x += colours[y].transpose(0, 3, 1, 2)
    return x, y


def _low_resolution(size):
    """Side of the random grid a prototype is interpolated from: 1..8 cells."""
    return max(1, min(size, 8, (size + 3) // 4))


def _interpolation_matrix(size, low):
    """(size, low) matrix of linear interpolation weights from `low` grid points to `size` pixels."""
    if low == 1:
        return np.ones((size, 1), np.float32)
    pos = np.linspace(0, low - 1, size)
    left = np.minimum(np.floor(pos).astype(int), low - 2)
    frac = pos - left
    m = np.zeros((size, low), np.float32)
    m[np.arange(size), left] = 1 - frac
    m[np.arange(size), left + 1] = frac
    return m


def _load_npz(data, input_shape, classes, seed, per_pixel=False):
    """An .npz with x (N,C,H,W), (N,H,W,C) or (N,H,W) and y (N,) (per pixel: (N, H, W));
    optional x_test / y_test."""
    labels = "(N, H, W) of class indices per pixel" if per_pixel else "(N,) of class indices"
    expected = (f"a .npz file with arrays 'x' (N, C, H, W) or (N, H, W, C) and 'y' {labels}, optionally "
                "'x_test' and 'y_test'")
    label_shape = tuple(input_shape[1:]) if per_pixel else ()
    path = _existing_path(data, "npz", expected, want_dir=False)
    source = str(path)
    try:
        f = open(path, "rb")
    except OSError as e:  # the file may be whole: say why it cannot be read, not that it is corrupt
        raise ConfigError(source, PATH_KEY, f"cannot read the file ({e.strerror}); expected {expected}") from None
    try:
        with f:
            archive = np.load(f, allow_pickle=False)
            if not isinstance(archive, np.lib.npyio.NpzFile):
                raise ValueError("it holds a single array, not named arrays")
            arrays = {name: archive[name] for name in archive.files}
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile, zlib.error, NotImplementedError, RuntimeError,
            MemoryError) as e:  # damaged zip headers (a compression or encryption it does not have), array sizes
        raise ConfigError(source, PATH_KEY, f"cannot read the file as .npz (corrupt or truncated?): {e}; expected {expected}") from None
    for name in ("x", "y"):
        if name not in arrays:
            found = ", ".join(sorted(arrays)) or "no arrays"
            raise ConfigError(source, PATH_KEY, f"no array '{name}' in the file (found: {found}); expected {expected}")
    if ("x_test" in arrays) != ("y_test" in arrays):
        raise ConfigError(source, PATH_KEY, "the file has only one of 'x_test' and 'y_test'; give both or neither")
    x, y = _npz_split(source, arrays["x"], arrays["y"], "x", "y", input_shape, classes, label_shape)
    if not len(y):
        raise ConfigError(source, PATH_KEY, f"array 'x' holds no samples to train on; expected {expected}")
    if "x_test" not in arrays:
        return _split_holdout(x, y, classes, "npz", data, seed, source=source)
    x_test, y_test = _npz_split(source, arrays["x_test"], arrays["y_test"], "x_test", "y_test", input_shape, classes,
                                label_shape)
    if not len(y_test):
        raise ConfigError(source, PATH_KEY, "array 'x_test' holds no samples to evaluate on; leave 'x_test' and "
                                            "'y_test' out to hold out part of 'x' instead")
    return Dataset(x, y, classes, "npz/train"), Dataset(x_test, y_test, classes, "npz/test")


def _npz_split(source, x, y, x_name, y_name, input_shape, classes, label_shape=()):
    """Check one (x, y) pair from an npz and return it as float32 NCHW and int64 labels of
    per-sample shape `label_shape`."""
    if x.dtype.kind not in "uifb":
        raise ConfigError(source, PATH_KEY, f"array '{x_name}' holds {x.dtype}, expected numbers")
    x = _to_nchw(source, x, x_name, input_shape)
    y = _labels(source, y, y_name, len(x), label_shape)
    _check_labels(source, PATH_KEY, y, classes, y_name)
    with np.errstate(over="ignore"):  # a value beyond float32's range becomes infinite: counted below, no warning
        x = _to_float(x)
    bad = np.size(x) - np.count_nonzero(np.isfinite(x))
    if bad:
        raise ConfigError(source, PATH_KEY, f"array '{x_name}' holds {bad} NaN or infinite values (or values beyond "
                                            "float32's range, 3.4e38)")
    return x, y


def _to_nchw(source, x, name, input_shape):
    """x as (N, C, H, W): accepts NCHW, NHWC (detected by which matches), or (N, H, W) for 1 channel."""
    c, h, w = input_shape
    if x.ndim == 4 and x.shape[1:] == input_shape:
        return x
    if x.ndim == 4 and x.shape[1:] == (h, w, c):
        return np.ascontiguousarray(x.transpose(0, 3, 1, 2))
    if x.ndim == 3 and c == 1 and x.shape[1:] == (h, w):
        return x.reshape(len(x), 1, h, w)
    if x.ndim == 3:
        found = (1,) + x.shape[1:]
    elif x.ndim == 4 and x.shape[3] < x.shape[1]:
        found = (x.shape[3],) + x.shape[1:3]  # the smaller of the two candidate axes holds the channels
    elif x.ndim == 4:
        found = x.shape[1:]
    else:
        raise ConfigError(source, PATH_KEY, f"array '{name}' has shape {x.shape}; expected (N, C, H, W), (N, H, W, C) or (N, H, W)")
    _shape_mismatch(source, PATH_KEY, found, input_shape, f"array '{name}' of shape {x.shape}")


def _shape_mismatch(source, key, found, input_shape, what):
    """Raise the error for images of per-sample shape `found` (C, H, W) against the network's."""
    found, input_shape = tuple(int(s) for s in found), tuple(input_shape)
    message = f"{what} holds images of shape {found} (C, H, W) but the network's input.shape is {input_shape}"
    if found[0] == input_shape[0] and found[1:] != input_shape[1:]:
        if found[1] == found[2]:
            message += f"; only the image size differs: run with --image-size {found[1]} or set input.shape to {list(found)}"
        else:
            message += f"; only the image size differs: set input.shape to {list(found)}"
    elif found[0] != input_shape[0]:
        message += f"; the data has {found[0]} channel(s), the network expects {input_shape[0]}"
    raise ConfigError(source, key, message)


def _labels(source, y, name, n, label_shape=()):
    """y as (n, *label_shape) int64; integral floats are accepted, anything else is an error."""
    y = np.asarray(y)
    if not label_shape and y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if y.shape != (n, *label_shape):
        what = "one class index per image" if not label_shape else "one class index per pixel"
        raise ConfigError(source, PATH_KEY, f"array '{name}' has shape {y.shape}; expected {(n, *label_shape)}, {what}")
    if y.dtype.kind == "f" and np.all(np.isfinite(y)) and np.all(y == np.round(y)):
        y = y.astype(np.int64)
    if y.dtype.kind not in "ui":
        raise ConfigError(source, PATH_KEY, f"array '{name}' holds {y.dtype}; expected integer class indices")
    return y.astype(np.int64)


def _check_labels(source, key, y, classes, what="labels"):
    if len(y) and (y.min() < 0 or y.max() >= classes):
        raise ConfigError(source, key, f"{what} range over [{y.min()}, {y.max()}] but the network has {classes} "
                                       f"classes, so they must lie in [0, {classes - 1}] (input.classes)")


def _to_float(x):
    """float32 images; uint8 is scaled from [0, 255] to [0, 1]."""
    if x.dtype == np.uint8:
        return np.divide(x, np.float32(255), dtype=np.float32)
    return np.ascontiguousarray(x, dtype=np.float32)


def _existing_path(data, kind, expected, want_dir):
    """data.path as a Path that exists (a folder when want_dir), or a ConfigError saying what to give."""
    what = "folder" if want_dir else "file"
    if not data.path:
        raise ConfigError("<data>", PATH_KEY, f"data set type '{kind}' needs path: {expected}")
    path = Path(data.path).expanduser()
    if not path.exists():
        raise ConfigError(str(path), PATH_KEY, f"no such {what}; expected {expected}")
    if path.is_dir() != want_dir:
        raise ConfigError(str(path), PATH_KEY, f"this is a {'file' if want_dir else 'folder'}, not a {what}; expected {expected}")
    return path


# ---- CIFAR --------------------------------------------------------------------------------
_CIFAR = {  # type: (classes, [(folder, train files, test file, reader)])
    "cifar10": (10, [("cifar-10-batches-bin", [f"data_batch_{i}.bin" for i in range(1, 6)], "test_batch.bin", "bin10"),
                     ("cifar-10-batches-py", [f"data_batch_{i}" for i in range(1, 6)], "test_batch", "py10")]),
    "cifar100": (100, [("cifar-100-binary", ["train.bin"], "test.bin", "bin100"),
                       ("cifar-100-python", ["train"], "test", "py100")]),
}
_CIFAR_IMAGE = (3, 32, 32)
_CIFAR_PIXELS = 3 * 32 * 32


def _load_cifar(data, input_shape, classes, seed):
    """CIFAR-10 or CIFAR-100 from a local folder in the binary or the python format."""
    n_classes, layouts = _CIFAR[data.type]
    folders = " or ".join(f"{folder}/ ({', '.join(train + [test])})" for folder, train, test, _ in layouts)
    expected = f"the folder holding {folders}, or the folder that contains it (nothing is downloaded)"
    root = _existing_path(data, data.type, expected, want_dir=True)
    found = [(base, train_files, test_file, reader) for folder, train_files, test_file, reader in layouts
             for base in (root, root / folder) if all((base / f).is_file() for f in train_files + [test_file])]
    if not found:
        partial = [f"{base}: has {', '.join(present)}, lacks {', '.join(missing)}"
                   for folder, train_files, test_file, _ in layouts for base in (root, root / folder)
                   for present, missing in [_present_missing(base, train_files + [test_file])] if present]
        detail = f" ({'; '.join(partial)})" if partial else ""
        raise ConfigError(str(root), PATH_KEY, f"no {data.type} files found{detail}; expected {expected}")
    if classes != n_classes:
        raise ConfigError(str(root), TYPE_KEY, f"{data.type} has {n_classes} classes but the network's input.classes "
                                               f"is {classes}; set input.classes: {n_classes} "
                                               f"(or --classes {n_classes})")
    if input_shape != _CIFAR_IMAGE:
        _shape_mismatch(str(root), TYPE_KEY, _CIFAR_IMAGE, input_shape, data.type)
    base, train_files, test_file, reader = found[0]
    x, y = _read_cifar_files([base / f for f in train_files], reader, n_classes)
    x_test, y_test = _read_cifar_files([base / test_file], reader, n_classes)
    return (Dataset(x, y, n_classes, f"{data.type}/train"), Dataset(x_test, y_test, n_classes, f"{data.type}/test"))


def _present_missing(base, names):
    present = [n for n in names if (base / n).is_file()]
    return present, [n for n in names if n not in present]


def _read_cifar_files(paths, reader, n_classes):
    """Concatenated (x float32 (N, 3, 32, 32) in [0, 1], y int64) of CIFAR files in one format."""
    parts = [(_read_cifar_binary if reader.startswith("bin") else _read_cifar_pickle)(p, reader) for p in paths]
    pixels = np.concatenate([p[0] for p in parts])
    y = np.concatenate([p[1] for p in parts]).astype(np.int64)
    if len(y) and (y.min() < 0 or y.max() >= n_classes):
        raise ConfigError(str(paths[0].parent), PATH_KEY, f"labels from {y.min()} to {y.max()} in {len(paths)} "
                                                          f"file(s), but this data set has {n_classes} classes (0 to "
                                                          f"{n_classes - 1}): the files are corrupt or of another data set")
    return _to_float(pixels.reshape(-1, *_CIFAR_IMAGE)), y


def _read_cifar_binary(path, reader):
    """Records of label byte(s) then 3072 pixel bytes (R, G, B planes of 32x32)."""
    label_bytes = 1 if reader == "bin10" else 2  # CIFAR-100: coarse label, fine label
    record = label_bytes + _CIFAR_PIXELS
    raw = np.fromfile(path, dtype=np.uint8)
    if raw.size == 0 or raw.size % record:
        raise ConfigError(str(path), PATH_KEY, f"truncated or corrupt: {raw.size} bytes is not a whole number of "
                                               f"{record}-byte records ({label_bytes} label byte(s) + {_CIFAR_PIXELS} pixels)")
    records = raw.reshape(-1, record)
    return records[:, label_bytes:], records[:, label_bytes - 1]


class _CifarUnpickler(pickle.Unpickler):
    """Unpickles plain containers and numpy arrays only: a CIFAR file cannot run code."""

    ALLOWED = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
               ("numpy", "ndarray"), ("numpy", "dtype"),
               ("_codecs", "encode")}  # how Python 3 writes bytes at pickle protocol 2

    def find_class(self, module, name):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"unexpected object {module}.{name}")
        if module.startswith("numpy.core.") and int(np.__version__.split(".")[0]) >= 2:
            module = "numpy._core." + module[len("numpy.core."):]  # numpy 2 warns on the old name
        return super().find_class(module, name)


def _read_cifar_pickle(path, reader):
    """A pickled dict with b"data" (N, 3072) uint8 and b"labels" (CIFAR-10) or b"fine_labels"."""
    label_key = b"labels" if reader == "py10" else b"fine_labels"
    try:
        with open(path, "rb") as f:
            batch = _CifarUnpickler(f, encoding="bytes").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, ImportError, IndexError,
            OverflowError, MemoryError) as e:  # the last two: a damaged length asking for more than any file holds
        raise ConfigError(str(path), PATH_KEY, f"truncated or corrupt CIFAR python batch: "
                                               f"{str(e) or type(e).__name__}") from None
    if not isinstance(batch, dict) or b"data" not in batch or label_key not in batch:
        found = ", ".join(repr(k) for k in batch) if isinstance(batch, dict) else type(batch).__name__
        raise ConfigError(str(path), PATH_KEY, f"not a CIFAR python batch: expected a dict with b'data' and {label_key!r}, found {found}")
    pixels, y = np.asarray(batch[b"data"]), np.asarray(batch[label_key])
    if (pixels.dtype != np.uint8 or pixels.ndim != 2 or pixels.shape[1] != _CIFAR_PIXELS or y.shape != (len(pixels),)
            or y.dtype.kind not in "iu"):
        raise ConfigError(str(path), PATH_KEY, f"corrupt CIFAR python batch: data is {pixels.dtype} {pixels.shape} and "
                                               f"{len(y)} labels of {y.dtype}; expected uint8 (N, {_CIFAR_PIXELS}) and "
                                               "N integer labels")
    return pixels, y


# ---- digits -------------------------------------------------------------------------------
def _load_digits(data, input_shape, classes, seed):
    """scikit-learn's bundled 8x8 digits (1797 images, 10 classes), values 0..16 scaled to [0, 1]."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise ConfigError("<data>", TYPE_KEY, "data set type 'digits' needs scikit-learn: pip install scikit-learn") from None
    if classes != 10:
        raise ConfigError("<data>", TYPE_KEY, f"digits has 10 classes but the network's input.classes is {classes}; "
                          "set input.classes: 10 (or --classes 10)")
    if input_shape != (1, 8, 8):
        _shape_mismatch("<data>", TYPE_KEY, (1, 8, 8), input_shape, "digits")
    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    return _split_holdout(x, digits.target.astype(np.int64), 10, "digits", data, seed)


def _load_folder(data, input_shape, classes, seed):
    """An image folder (snrt/images.py), decoded when batches need it."""
    from snrt.images import load_folder  # Pillow only for image folders

    _existing_path(data, "folder", "a folder holding train/<class>/<image> (and val/<class>/<image>)", True)
    return load_folder(data, input_shape, classes, seed,
                       lambda y: _held_out(y, classes, data, seed, str(data.path)))


# ---- splits and statistics ------------------------------------------------------------------
def _split_holdout(x, y, classes, name, data, seed, source="<data>"):
    """(train, held-out): a seeded, stratified fraction `data.holdout` of every class is held out
    (of the whole set, for per-pixel labels, which give a sample no single class).

    Both splits keep the samples' original order.
    """
    held = _held_out(y, classes, data, seed, source)
    return (Dataset(x[~held], y[~held], classes, f"{name}/train"),
            Dataset(x[held], y[held], classes, f"{name}/holdout"))


def _held_out(y, classes, data, seed, source):
    """The held-out mask of labels `y` (see _split_holdout)."""
    if not 0 < data.holdout < 1:
        raise ConfigError(source, HOLDOUT_KEY, f"expected a fraction in (0, 1), got {data.holdout}")
    n = len(y)
    target = int(round(n * data.holdout))
    if not 0 < target < n:
        raise ConfigError(source, HOLDOUT_KEY, f"holding out {data.holdout} of {n} samples leaves {n - target} to "
                                               f"train on and {target} to evaluate; both must be non-empty")
    rng = np.random.default_rng([seed, 3])
    shuffled = rng.permutation(n)
    y = y if y.ndim == 1 else np.zeros(n, np.int64)  # the strata
    by_class = shuffled[np.argsort(y[shuffled], kind="stable")]  # random order within each class
    counts = np.bincount(y, minlength=classes)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    rank = np.empty(n, np.int64)
    rank[by_class] = np.arange(n) - starts[y[by_class]]
    # hold out the samples that come first within their class, relative to the class size, so
    # every class loses about the same fraction; ties (e.g. many tiny classes) are broken at random
    tiebreak = np.empty(n, np.int64)
    tiebreak[shuffled] = np.arange(n)
    held = np.zeros(n, bool)
    held[np.lexsort((tiebreak, rank / counts[y]))[:target]] = True
    return held


def channel_stats(dataset, limit=None):
    """(mean (C,), std (C,)) float32 per channel (the first axis of a sample: an image's
    channels, a vector's features) over all samples (the first `limit`) and positions; a (near)
    zero std becomes 1."""
    n = len(dataset) if limit is None else min(limit, len(dataset))

    def chunks():  # two passes, a chunk in memory at a time
        return (dataset.take(slice(s, min(s + _STATS_CHUNK, n)))[0] for s in range(0, n, _STATS_CHUNK))
    shape = dataset.shape
    axes = (0, *range(2, len(shape) + 1))  # all but the channels of a batch
    count = n * int(np.prod(shape[1:]))
    total = sum(x.sum(axis=axes, dtype=np.float64) for x in chunks())
    mean = total / count
    square = sum(((x - _by_channel(mean, shape)) ** 2).sum(axis=axes) for x in chunks())
    std = np.sqrt(square / count)
    std[std < 1e-6] = 1.0  # a constant channel is left as it is, not blown up
    return mean.astype(np.float32), std.astype(np.float32)


def normalization(data, dataset):
    """(mean, std) to normalise with: channel_stats of `dataset`, or (0, 1) when data.normalize is off."""
    if data.normalize:
        return channel_stats(dataset, limit=_STATS_LIMIT.get(data.type))
    c = dataset.shape[0]
    return np.zeros(c, np.float32), np.ones(c, np.float32)


def _by_channel(values, sample_shape):
    """(C,) `values` shaped to broadcast over a batch of samples of `sample_shape` (C, ...)."""
    return values.reshape(-1, *(1,) * (len(sample_shape) - 1))


def _normalize(x, mean, std):
    """x (float32 (B, C, ...), owned by the caller) normalised in place per channel."""
    x -= _by_channel(mean, x.shape[1:])
    x /= _by_channel(std, x.shape[1:])
    return x


def _channel_vector(values, c, name):
    v = np.asarray(values, dtype=np.float32).reshape(-1)
    if v.shape != (c,):
        raise ValueError(f"{name} must have one value per channel ({c}), got shape {np.shape(values)}")
    return v


def eval_batches(dataset, batch, mean, std):
    """(x, y) batches of `dataset` in order, normalised, not augmented; the last may be smaller."""
    c = dataset.shape[0]
    mean, std = _channel_vector(mean, c, "mean"), _channel_vector(std, c, "std")
    for start in range(0, len(dataset), batch):
        x, y = dataset.take(slice(start, start + batch))
        yield _normalize(np.array(x, dtype=np.float32), mean, std), np.array(y, dtype=np.int64)


# ---- augmentation ---------------------------------------------------------------------------
def augment(x, rng, crop_padding=0, flip=False, labels=None, within=None):
    """Random crop after zero padding by `crop_padding` pixels, then random horizontal flip.

    Per sample: offsets (B, 2) in [0, 2*crop_padding] are drawn from `rng` first (when
    crop_padding > 0), then flips (B,) (when `flip`). Returns a new contiguous (B, C, H, W)
    array, or (that array, labels) when per-pixel `labels` (B, H, W) are given: they flip with
    their images (crops are not offered for them). `within` = (start, total) says that `x`
    holds rows [start, start + B) of a batch of `total`: the draws are made for the whole
    batch and these rows' used, so the parts of a batch are augmented as the batch would be.
    """
    if labels is not None and crop_padding:
        raise ValueError("random crops are not offered with per-pixel labels")
    b, c, h, w = x.shape
    start, total = within or (0, b)
    out = x
    if crop_padding > 0:
        p = crop_padding
        offsets = rng.integers(0, 2 * p + 1, size=(total, 2))[start:start + b]
        padded = np.zeros((b, c, h + 2 * p, w + 2 * p), x.dtype)
        padded[:, :, p:p + h, p:p + w] = x
        windows = np.lib.stride_tricks.sliding_window_view(padded, (h, w), axis=(2, 3))  # (B, C, 2p+1, 2p+1, H, W)
        out = windows[np.arange(b), :, offsets[:, 0], offsets[:, 1]]  # advanced indices around a slice: (B, C, H, W)
    if flip:
        flipped = (rng.random(total) < 0.5)[start:start + b]
        if out is x:
            out = x.copy()
        out[flipped] = out[flipped][..., ::-1]
        if labels is not None:
            labels = labels.copy()
            labels[flipped] = labels[flipped][..., ::-1]
    return np.ascontiguousarray(out) if labels is None else (np.ascontiguousarray(out), labels)


# ---- training batches ---------------------------------------------------------------------------
class Batches:
    """The endless stream of training batches; batch i is a pure function of (seed, i).

    Batch i holds stream positions [i*batch, (i+1)*batch); position q is sample
    ``perm(q // N)[q % N]`` with ``perm(e) = default_rng([seed, e]).permutation(N)``.
    Augmentation of batch i uses ``default_rng([seed, i, 1])``. Iterating yields
    (x float32 (B, C, H, W) normalised and augmented, contiguous; y int64 (B,) or (B, H, W)) from batch
    `start` on. With `prefetch`, a daemon thread prepares the next two batches while the
    current one trains; `close()` (or leaving a `with` block) stops it.

    With `ranks` > 1 (data parallel) `batch` is the global batch and this stream yields
    rank `rank`'s part of each: rows [rank*b, (rank+1)*b) with b = batch / ranks, augmented
    as they are within the whole batch; the ranks' parts are disjoint and together are the
    batch one process would train on.
    """

    _POLL_S = 0.05  # how often a blocked producer or consumer looks at the stop flag

    def __init__(self, dataset, batch, seed, mean, std, crop_padding=0, flip=False, start=0, prefetch=True, rank=0,
                 ranks=1):
        if batch < 1 or start < 0 or crop_padding < 0 or seed < 0:
            raise ValueError(f"need batch >= 1, start >= 0, crop_padding >= 0 and seed >= 0; got "
                             f"batch={batch}, start={start}, crop_padding={crop_padding}, seed={seed}")
        if batch % ranks or not 0 <= rank < ranks:
            raise ValueError(f"batch {batch} does not split into {ranks} equal parts (rank {rank})")
        self.rank, self.ranks = rank, ranks
        if len(dataset) == 0:
            raise ValueError(f"data set {dataset.name} is empty")
        c = dataset.shape[0]
        self.dataset, self.batch, self.seed = dataset, int(batch), int(seed)
        self.mean, self.std = _channel_vector(mean, c, "mean"), _channel_vector(std, c, "std")
        self.crop_padding, self.flip, self.start, self.prefetch = int(crop_padding), bool(flip), int(start), prefetch
        self._perms, self._perms_lock = {}, threading.Lock()
        self._stop = threading.Event()
        self._threads = []

    def __getstate__(self):  # what a worker process needs (snrt/workers.py): the recipe, no threads
        state = dict(self.__dict__)
        del state["_perms_lock"], state["_stop"], state["_threads"]
        return state

    def __setstate__(self, state):
        self.__dict__.update(state, _perms_lock=threading.Lock(), _stop=threading.Event(), _threads=[])

    # -- pure functions of (seed, i)
    def permutation(self, epoch):
        """The sample order of `epoch` (a few recent ones are cached)."""
        with self._perms_lock:
            perm = self._perms.get(epoch)
            if perm is None:
                perm = np.random.default_rng([self.seed, epoch]).permutation(len(self.dataset))
                if len(self._perms) >= 4:
                    self._perms.pop(min(self._perms))
                self._perms[epoch] = perm
            return perm

    def indices(self, i):
        """Sample indices of batch i (tail of one epoch's permutation and head of the next at a boundary)."""
        n, q, end = len(self.dataset), i * self.batch, (i + 1) * self.batch
        parts = []
        while q < end:
            epoch, offset = divmod(q, n)
            take = min(n - offset, end - q)
            parts.append(self.permutation(epoch)[offset:offset + take])
            q += take
        return np.concatenate(parts)

    def get(self, i):
        """Batch i (this rank's part of it): (x, y), normalised and augmented."""
        part = self.batch // self.ranks
        start = self.rank * part
        idx = self.indices(i)[start:start + part]
        rngs = ([np.random.default_rng([self.seed, i, 2, start + k]) for k in range(part)]
                if self.dataset.draws_per_sample else None)
        x, y = self.dataset.take(idx, rngs)
        y = y.astype(np.int64)
        if self.crop_padding or self.flip:
            rng, within = np.random.default_rng([self.seed, i, 1]), (start, self.batch)
            if y.ndim > 1:  # per-pixel labels move with their pixels
                x, y = augment(x, rng, self.crop_padding, self.flip, labels=y, within=within)
            else:
                x = augment(x, rng, self.crop_padding, self.flip, within=within)
        x = np.ascontiguousarray(x, dtype=np.float32)
        return _normalize(x, self.mean, self.std), np.ascontiguousarray(y)

    # -- the stream
    def __iter__(self):
        if not self.prefetch:
            return self._serial()
        return self._prefetched()

    def _serial(self):
        i = self.start
        while not self._stop.is_set():
            yield self.get(i)
            i += 1

    def _prefetched(self):
        if self._stop.is_set():
            return
        ready = queue.Queue(maxsize=2)
        stop = threading.Event()  # this iteration's own flag; close() sets it through _threads
        thread = threading.Thread(target=self._produce, args=(ready, stop), name="snrt-batches", daemon=True)
        self._threads.append((thread, stop))
        thread.start()
        try:
            while not stop.is_set():
                try:
                    kind, value = ready.get(timeout=self._POLL_S)
                except queue.Empty:
                    if not thread.is_alive():
                        return
                    continue
                if stop.is_set():
                    return
                if kind == "error":
                    raise value
                yield value
        finally:
            stop.set()

    def _produce(self, ready, stop):
        i = self.start
        while not stop.is_set():
            try:
                item = ("batch", self.get(i))
            except Exception as e:  # handed to the consumer, which raises it
                item = ("error", e)
            while not stop.is_set():
                try:
                    ready.put(item, timeout=self._POLL_S)
                    break
                except queue.Full:
                    continue
            if item[0] == "error":
                return
            i += 1

    def close(self):
        """Stop the loader thread(s); returns within about one batch's preparation time."""
        self._stop.set()
        for thread, stop in self._threads:
            stop.set()
        for thread, _ in self._threads:
            thread.join()
        self._threads = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
