"""Image folders (ImageNet's layout): DIR/train/<class>/* and DIR/val/<class>/*, JPEG, PNG or WebP.

Classes are the folders of DIR/train sorted by name (index 0 first), each holding its images at
any depth (DIR/train/<class>/<any folders>/*); without DIR/val a seeded,
stratified fraction train.data.holdout of train is held out. Images are decoded with Pillow
(the `data` extra) when a batch needs them, with torchvision's semantics:

- training: RandomResizedCrop to the input size (a crop of 8% to 100% of the image's area, of
  aspect ratio 3/4 to 4/3, ten tries, else the largest centered crop of a ratio in range;
  resized bilinearly), drawn per sample from ``default_rng([seed, i, 2, position in batch])``;
  train.data.flip then flips as for any data set;
- evaluation: the shorter side resized to the input size / 0.875 (256 for 224), then the
  center crop of the input size; JPEGs decode at the smallest DCT scale that is not smaller;
- pixels scaled to [0, 1] (16-bit gray images by their high byte, where Pillow's conversion,
  and so torchvision's loader, would clip them to white); per-channel normalization as for any
  data set (the training split's statistics, measured on up to STATS_SAMPLES images at the
  evaluation transform).

Bad data is found when the folder is read: a class folder with no image, a val folder with no
class folder, a class in val that train does not have, a file that is not an image (its
extension, or Pillow cannot identify it), a link to nothing, an image that cannot be decoded:
one line naming the file or folder. With train.data.skip_bad_images (`--skip-bad-images`) bad
files are counted and left out instead (every image is then decoded once to check it).
"""

import math
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from snrt.errors import ConfigError

EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp")
STATS_SAMPLES = 2048  # images the normalization statistics are measured on, at most
EVAL_RESIZE = 0.875  # input size / shorter side before the center crop (torchvision's 224 of 256)
SCALE, RATIO, TRIES = (0.08, 1.0), (3 / 4, 4 / 3), 10  # RandomResizedCrop's defaults
on_open = None  # called with each image's path before it is decoded (a worker process records it)


def _pillow():
    try:
        from PIL import Image
    except ImportError:
        raise ConfigError("<data>", "train.data.type", "image folders need Pillow: pip install 'snrt[data]'") from None
    # an image of 89 to 179 megapixels is one a data set may hold (above, Pillow's
    # DecompressionBombError makes it a bad file): decoded like any other, without a warning per read
    warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)
    return Image


@dataclass(frozen=True, eq=False)
class FolderDataset:
    """One split of an image folder: `files` (paths) and `y` (int64 labels) in a fixed order,
    decoded on demand to (C, H, W) = `shape`; `training` picks the random crops, else the
    center crops. `class_names[k]` is class k's folder name; `skipped` the bad files left out."""

    files: tuple
    y: np.ndarray
    classes: int
    name: str
    shape: tuple
    training: bool
    class_names: tuple = ()
    skipped: tuple = ()

    def __len__(self):
        return len(self.y)

    decodes = True  # each batch is read from files: worth worker processes (train.data.workers)

    @property
    def draws_per_sample(self):
        """Whether `take` wants a random generator per sample (the training crops)."""
        return self.training

    def take(self, idx, rngs=None):
        """(x float32 (B, C, H, W) in [0, 1], y int64 (B,)) of samples `idx` (indices or a
        slice); `rngs` (one numpy Generator per sample) draw the training crops."""
        if isinstance(idx, slice):
            idx = range(*idx.indices(len(self)))
        x = np.empty((len(idx), *self.shape), np.float32)
        for k, i in enumerate(idx):
            x[k] = self._decode(self.files[i], rngs[k] if self.training and rngs is not None else None)
        return x, self.y[np.asarray(idx, dtype=np.int64)]

    def _decode(self, path, rng):
        image_module = _pillow()
        c, h, w = self.shape
        if on_open is not None:
            on_open(path)
        try:
            with image_module.open(path) as image:
                if rng is None:
                    image.draft("RGB" if c == 3 else "L", _eval_resized(image.size, h, w))
                if image.mode.startswith("I"):  # 16-bit gray (a PNG's I;16): its high byte; convert would clip it
                    image = image_module.fromarray(np.clip(np.asarray(image) >> 8, 0, 255).astype(np.uint8))
                image = image.convert("RGB" if c == 3 else "L")
                image = _random_resized_crop(image, h, w, rng) if rng is not None else _center_crop(image, h, w)
        except OSError as e:
            raise ConfigError(str(path), "train.data.path", f"cannot decode this image ({e}); remove it or train "
                                                            "with --skip-bad-images") from None
        pixels = np.asarray(image, dtype=np.float32) / np.float32(255)
        return pixels[None] if c == 1 else pixels.transpose(2, 0, 1)


def _eval_resized(size, h, w):
    """(width, height) an image of `size` takes after evaluation's resize of its shorter side."""
    short = min(size)
    target = math.ceil(max(h, w) / EVAL_RESIZE)
    return max(1, round(size[0] * target / short)), max(1, round(size[1] * target / short))


def _center_crop(image, h, w):
    image = image.resize(_eval_resized(image.size, h, w), resample=2)  # 2: bilinear
    width, height = image.size
    left, top = (width - w) // 2, (height - h) // 2
    return image.crop((left, top, left + w, top + h))


def _random_resized_crop(image, h, w, rng):
    """torchvision's RandomResizedCrop: the crop box drawn from `rng`, resized to (h, w)."""
    width, height = image.size
    area = width * height
    for _ in range(TRIES):
        target = area * rng.uniform(*SCALE)
        ratio = math.exp(rng.uniform(math.log(RATIO[0]), math.log(RATIO[1])))
        cw, ch = round(math.sqrt(target * ratio)), round(math.sqrt(target / ratio))
        if 0 < cw <= width and 0 < ch <= height:
            left, top = int(rng.integers(0, width - cw + 1)), int(rng.integers(0, height - ch + 1))
            break
    else:  # the largest centered crop whose ratio is in range: the image's full height, or its full width
        ratio = width / height
        cw, ch = ((round(height * RATIO[1]), height) if ratio > RATIO[1] else
                  (width, round(width / RATIO[0])) if ratio < RATIO[0] else (width, height))
        left, top = (width - cw) // 2, (height - ch) // 2
    return image.resize((w, h), resample=2, box=(left, top, left + cw, top + ch))


def load_folder(data, input_shape, classes, seed, held_out):
    """(train, held-out) FolderDatasets of the image folder data.path for a network taking
    `input_shape` (C, H, W; C 1 or 3) and `classes` classes; `held_out(y)` gives the held-out
    mask of train when there is no val folder."""
    root = Path(data.path).expanduser()
    train_dir = root / "train"
    if not train_dir.is_dir():
        raise ConfigError(str(root), "train.data.path", "an image folder needs train/<class>/ (and val/<class>/, "
                                                        "or a held-out part of train)")
    if input_shape[0] not in (1, 3):
        raise ConfigError("<data>", "input.shape", f"images have 1 (gray) or 3 (RGB) channels, the network takes "
                                                   f"{input_shape[0]}")
    names = sorted(p.name for p in train_dir.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not names:
        raise ConfigError(str(train_dir), "train.data.path", "no class folders (expected train/<class>/<image>)")
    if len(names) != classes:
        raise ConfigError("<data>", "input.classes", f"{train_dir} has {len(names)} class folders, the network's "
                                                     f"input.classes is {classes}; set input.classes: {len(names)} "
                                                     f"(or --classes {len(names)})")
    skipped = []
    files, y = _listed(train_dir, names, data.skip_bad_images, skipped)
    shape = tuple(input_shape)

    def split(files, y, name, training):
        return FolderDataset(tuple(files), np.asarray(y, np.int64), classes, name, shape, training, tuple(names),
                             tuple(skipped))

    val_dir = root / "val"
    if val_dir.is_dir():
        extra = sorted(p.name for p in val_dir.iterdir() if p.is_dir() and not p.name.startswith(".")
                       and p.name not in names)
        if extra:
            raise ConfigError(str(val_dir / extra[0]), "train.data.path", "a class of val that train does not have")
        present = [n for n in names if (val_dir / n).is_dir()]
        if not present:  # evaluating on nothing would report a loss and an accuracy of 0
            raise ConfigError(str(val_dir), "train.data.path", "no class folders (expected val/<class>/<image>; "
                                                              "without a val folder part of train is held out)")
        val_files, val_y = _listed(val_dir, present, data.skip_bad_images, skipped,
                                   index={n: k for k, n in enumerate(names)})
        return split(files, y, f"{root.name}/train", True), split(val_files, val_y, f"{root.name}/val", False)
    held = held_out(np.asarray(y, np.int64))
    files, y = np.array(files, dtype=object), np.asarray(y, np.int64)
    return (split(files[~held], y[~held], f"{root.name}/train", True),
            split(files[held], y[held], f"{root.name}/holdout", False))


def _listed(folder, names, skip_bad, skipped, index=None):
    """(files, labels) of class folders `names` of `folder`, sorted by class and file name;
    bad files raise a ConfigError naming them, or with `skip_bad` go to `skipped`."""
    image_module = _pillow()
    index = index or {n: k for k, n in enumerate(names)}
    files, y = [], []
    for name in names:
        found = 0
        for path in _files_under(folder / name):
            problem = _problem(image_module, path, full=skip_bad)
            if problem is None:
                files.append(path)
                y.append(index[name])
                found += 1
            elif skip_bad:
                skipped.append(str(path))
            else:
                raise ConfigError(str(path), "train.data.path", f"{problem}; remove it or train with "
                                                                "--skip-bad-images")
        if not found:
            raise ConfigError(str(folder / name), "train.data.path", "a class folder with no image "
                                                                     f"({', '.join(EXTENSIONS)})")
    return files, y


def _files_under(folder):
    """The files in `folder` and its folders at any depth (as torchvision's ImageFolder reads a
    class), sorted by path; names starting with '.' left out; a linked folder is read once."""
    seen, files = set(), []
    for parent, folders, names in os.walk(folder, followlinks=True):
        real = os.path.realpath(parent)
        if real in seen:  # a link back up the tree, or a second link to one folder
            folders[:] = []
            continue
        seen.add(real)
        folders[:] = [f for f in folders if not f.startswith(".")]
        files += [Path(parent) / n for n in names if not n.startswith(".")]
    return sorted(files)


def _problem(image_module, path, full):
    """Why `path` is not a usable image (None when it is): a link to nothing, not a file, its
    extension, or Pillow cannot identify it, or (`full`) cannot decode it."""
    if not path.is_file():
        return f"a link to nothing ({path.readlink()})" if path.is_symlink() else "not a file (a pipe, socket or device)"
    if path.suffix.lower() not in EXTENSIONS:
        return f"not an image ({path.suffix or 'no extension'}; expected {', '.join(EXTENSIONS)})"
    try:
        with image_module.open(path) as image:
            if full:
                image.load()
            else:
                image.verify()
    except (OSError, SyntaxError, ValueError, image_module.DecompressionBombError) as e:  # the last: absurd sizes
        return f"not a readable image ({e})"
    return None
