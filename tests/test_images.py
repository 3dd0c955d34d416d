"""Image folders (snrt/images.py): DIR/train/<class>/* and DIR/val/<class>/* decoded on demand
with torchvision's crops, classes by folder name, and every kind of bad data one clear line
(or, with --skip-bad-images, counted and left out). The tests build their own folders."""

import json
import os
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

import snrt
from snrt.checkpoint import CheckpointError
from snrt.cli import main
from snrt.config import DataConfig
from snrt.data import Batches, eval_batches, load_datasets
from snrt.errors import ConfigError
from snrt.images import FolderDataset, _random_resized_crop
from snrt.threads import usable_cores

CLASSES = ("cat", "dog", "eel")


def make_folder(root, splits=(("train", 6), ("val", 2))):
    """Images of a flat color per class (class k: value 60 + 80 k), sizes and formats varied."""
    for split, n in splits:
        for k, name in enumerate(CLASSES):
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in range(n):
                pixels = np.full((30 + 3 * i, 40, 3), 60 + 80 * k, np.uint8)
                Image.fromarray(pixels).save(folder / f"{i}{('.png', '.jpg', '.webp')[i % 3]}")
    return root


def network(root, **data):
    return snrt.load_config({
        "name": "tiny", "input": {"shape": [3, 16, 16], "classes": 3},
        "train": {"batch": 4, "iterations": 3, "data": {"type": "folder", "path": str(root), **data}},
        "network": [{"type": "Conv2d", "out_channels": 4, "kernel": 3, "padding": 1}, {"type": "ReLU"},
                    {"type": "GlobalAvgPool"}, {"type": "Linear", "out_features": 3},
                    {"type": "SoftmaxCrossEntropy"}]})


def datasets(root, **data):
    return load_datasets(DataConfig(type="folder", path=str(root), **data), (3, 16, 16), 3, seed=0)


def test_classes_come_from_the_folder_names_and_images_decode_to_the_input_size(tmp_path):
    train, val = datasets(make_folder(tmp_path))
    assert train.class_names == CLASSES and (len(train), len(val)) == (18, 6)
    assert list(train.y) == [k for k in range(3) for _ in range(6)]
    x, y = val.take(slice(0, 6))
    assert x.shape == (6, 3, 16, 16) and x.dtype == np.float32
    np.testing.assert_allclose(x[:, 0, 8, 8], (60 + 80 * y) / 255, atol=3 / 255)  # JPEG is lossy, a little
    (batch,) = list(eval_batches(val, 6, np.zeros(3), np.ones(3)))  # evaluation: the same center crops
    np.testing.assert_array_equal(batch[0], x)


def test_a_16_bit_gray_image_decodes_to_its_gray_not_to_white(tmp_path):
    root = make_folder(tmp_path)
    Image.fromarray(np.full((30, 40), 30000, np.uint16)).save(root / "val" / "cat" / "0.png")  # 46% of 65535
    _, val = datasets(root)
    x, _ = val.take([0])
    np.testing.assert_array_equal(x, np.full((1, 3, 16, 16), (30000 >> 8) / 255, np.float32))


def test_training_crops_are_drawn_per_sample_and_the_same_for_the_same_seed_and_batch(tmp_path):
    train, _ = datasets(make_folder(tmp_path))
    assert train.draws_per_sample
    first = Batches(train, 4, seed=1, mean=np.zeros(3), std=np.ones(3), prefetch=False).get(5)
    again = Batches(train, 4, seed=1, mean=np.zeros(3), std=np.ones(3), prefetch=False).get(5)
    np.testing.assert_array_equal(first[0], again[0])
    halves = [Batches(train, 4, seed=1, mean=np.zeros(3), std=np.ones(3), prefetch=False, rank=r, ranks=2).get(5)
              for r in range(2)]
    np.testing.assert_array_equal(np.concatenate([h[0] for h in halves]), first[0])  # a rank's part is the batch's


def test_a_random_resized_crop_keeps_its_area_and_ratio_in_torchvisions_ranges():
    image = Image.fromarray(np.arange(200 * 100, dtype=np.uint32).reshape(100, 200).astype(np.uint8))
    boxes = []
    original = image.resize

    class Recording:  # records the box each crop asks for
        def __getattr__(self, name):
            return getattr(image, name)

        def resize(self, size, resample=None, box=None):
            boxes.append(box)
            return original(size, resample=resample, box=box)
    for seed in range(50):
        out = _random_resized_crop(Recording(), 16, 16, np.random.default_rng(seed))
        assert out.size == (16, 16)
    for left, top, right, bottom in boxes:
        w, h = right - left, bottom - top
        assert 0 <= left and right <= 200 and 0 <= top and bottom <= 100
        assert 0.08 * 0.9 <= w * h / 20000 <= 1.0 and 3 / 4 * 0.9 <= w / h <= 4 / 3 * 1.1


@pytest.mark.parametrize("size, box", [((1000, 10), (493, 0, 506, 10)), ((10, 1000), (0, 493, 10, 506))],
                         ids=["wide", "tall"])
def test_an_image_too_long_for_any_random_crop_takes_the_largest_centered_crop_in_range(size, box):
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, size[::-1], dtype=np.uint8))
    out = _random_resized_crop(image, 16, 16, np.random.default_rng(0))  # ten tries of >= 8% of the area fail
    expected = image.resize((16, 16), resample=2, box=box)  # torchvision's: the short side whole, at 4/3 or 3/4
    np.testing.assert_array_equal(np.asarray(out), np.asarray(expected))


def test_without_a_val_folder_a_stratified_part_of_train_is_held_out(tmp_path):
    train, held = datasets(make_folder(tmp_path, (("train", 5),)), holdout=0.2)
    assert len(train) + len(held) == 15 and np.bincount(held.y).tolist() == [1, 1, 1]
    assert not held.training and train.training


def test_a_run_trains_on_a_folder_and_writes_its_classes(tmp_path):
    root = make_folder(tmp_path / "images")
    out = tmp_path / "run"
    assert main(["train", str(tmp_path / "net.yaml"), "--out", str(out)]) == 2  # no such file yet: one line
    (tmp_path / "net.yaml").write_text(json.dumps({
        "name": "tiny", "input": {"shape": [3, 16, 16], "classes": 3},
        "train": {"batch": 4, "iterations": 2, "data": {"type": "folder", "path": str(root), "flip": True}},
        "network": [{"type": "Conv2d", "out_channels": 4, "kernel": 3, "padding": 1}, {"type": "ReLU"},
                    {"type": "GlobalAvgPool"}, {"type": "Linear", "out_features": 3},
                    {"type": "SoftmaxCrossEntropy"}]}))
    assert main(["train", str(tmp_path / "net.yaml"), "--out", str(out), "--no-progress"]) == 0
    assert json.loads((out / "classes.json").read_text()) == {"0": "cat", "1": "dog", "2": "eel"}
    assert json.loads((out / "summary.json").read_text())["data_workers"] == usable_cores()  # decoding: the default
    assert main(["train", str(tmp_path / "net.yaml"), "--out", str(tmp_path / "synthetic"), "--no-progress",
                 "--data", "synthetic"]) == 0
    assert json.loads((tmp_path / "synthetic" / "summary.json").read_text())["data_workers"] == 0  # in memory


def test_a_checkpoint_is_refused_on_a_folder_whose_classes_are_other_folders(tmp_path):
    root = make_folder(tmp_path / "images")
    trainer = snrt.Trainer(network(root, workers=0))
    trainer.fit(iterations=1)
    trainer.save(tmp_path / "checkpoint.npz")
    snrt.Trainer(network(root, workers=0)).restore(tmp_path / "checkpoint.npz")  # the same folders
    (root / "train" / "eel").rename(root / "train" / "emu")  # still index 2, another class
    (root / "val" / "eel").rename(root / "val" / "emu")
    with pytest.raises(CheckpointError,
                       match=r"trained on the classes \(image folders\) \['cat', 'dog', 'eel'\], this data's are "
                             r"\['cat', 'dog', 'emu'\]: a class index would name another folder"):
        snrt.Trainer(network(root, workers=0)).restore(tmp_path / "checkpoint.npz")


def test_ranks_on_one_host_share_its_cores_among_their_default_workers(tmp_path, monkeypatch):
    trainer = snrt.Trainer(network(make_folder(tmp_path)))
    monkeypatch.setattr(snrt.train, "usable_cores", lambda: 8)
    for variable, ranks, workers in (("MPI_LOCALNRANKS", "1", 8), ("MPI_LOCALNRANKS", "3", 2),
                                     ("OMPI_COMM_WORLD_LOCAL_SIZE", "16", 1)):
        monkeypatch.delenv("MPI_LOCALNRANKS", raising=False)
        monkeypatch.setenv(variable, ranks)
        assert trainer.workers == workers


def test_a_network_with_other_classes_is_told_the_folders_count(tmp_path, capsys):
    root = make_folder(tmp_path / "images")
    (tmp_path / "net.yaml").write_text(json.dumps({
        "name": "tiny", "input": {"shape": [3, 16, 16], "classes": 7},
        "train": {"batch": 4, "iterations": 1, "data": {"type": "folder", "path": str(root), "workers": 0}},
        "network": [{"type": "GlobalAvgPool"}, {"type": "Linear", "out_features": "$classes"}, {"type": "SoftmaxCrossEntropy"}]}))
    assert main(["train", str(tmp_path / "net.yaml"), "--out", str(tmp_path / "run"), "--no-progress"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "has 3 class folders, the network's input.classes is 7; set input.classes: 3 (or --classes 3)" in err
    assert main(["train", str(tmp_path / "net.yaml"), "--out", str(tmp_path / "run"), "--no-progress",
                 "--classes", "3"]) == 0


def huge_png(path):
    """A PNG that says it is 30000 x 30000 pixels, which Pillow refuses to open (a decompression bomb)."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 30000, 30000, 8, 0, 0, 0, 0))
                     + chunk(b"IEND", b""))


@pytest.mark.parametrize("damage, where, says", [
    (lambda r: (r / "train" / "dog" / "notes.txt").write_text("hello"), "train/dog/notes.txt", "not an image (.txt"),
    (lambda r: (r / "train" / "dog" / "0.png").write_bytes(b"not a png at all"), "train/dog/0.png",
     "not a readable image"),
    (lambda r: [p.unlink() for p in (r / "train" / "eel").iterdir()], "train/eel", "a class folder with no image"),
    (lambda r: (r / "val" / "fox").mkdir(), "val/fox", "a class of val that train does not have"),
    (lambda r: huge_png(r / "train" / "dog" / "big.png"), "train/dog/big.png",
     "not a readable image (Image size (900000000 pixels) exceeds limit"),
    (lambda r: (r / "train" / "dog" / "9.png").symlink_to(r / "elsewhere" / "9.png"), "train/dog/9.png",
     "a link to nothing ("),
    (lambda r: os.mkfifo(r / "train" / "dog" / "9.png"), "train/dog/9.png", "not a file (a pipe, socket or device)"),
    (lambda r: [p.rename(r / p.name) for p in (r / "val").iterdir()], "val", "no class folders (expected val/<class>/"),
], ids=["text file", "not an image", "empty class", "unknown val class", "absurd size", "broken link", "pipe",
        "empty val"])
def test_bad_data_is_one_line_naming_the_file_or_folder(tmp_path, damage, where, says):
    root = make_folder(tmp_path)
    damage(root)
    with pytest.raises(ConfigError) as error:
        datasets(root)
    assert str(root / where) in str(error.value) and says in str(error.value)


def test_images_in_folders_below_a_class_are_that_class_and_links_back_up_are_read_once(tmp_path):
    root = make_folder(tmp_path)
    deeper = root / "train" / "dog" / "2019" / "june"
    deeper.mkdir(parents=True)
    (root / "train" / "dog" / "0.png").rename(deeper / "0.png")
    (root / "train" / "dog" / ".cache").mkdir()
    (root / "train" / "dog" / ".cache" / "0.png").write_bytes(b"not read: a hidden folder")
    (root / "train" / "dog" / "again").symlink_to(root / "train" / "dog")  # a loop
    train, _ = datasets(root)
    assert len(train) == 18 and list(train.y).count(1) == 6
    assert deeper / "0.png" in train.files


def test_an_image_of_a_hundred_megapixels_is_decoded_without_a_warning(tmp_path, recwarn):
    root = make_folder(tmp_path)
    Image.new("L", (10_000, 10_000), 200).save(root / "train" / "dog" / "large.png")  # over Pillow's warning limit
    train, _ = datasets(root)
    x, y = train.take([list(train.files).index(root / "train" / "dog" / "large.png")],
                      [np.random.default_rng(0)])
    assert y.tolist() == [1] and np.allclose(x, 200 / 255)
    assert not [w for w in recwarn if "DecompressionBomb" in type(w.message).__name__]


def test_skip_bad_images_counts_and_leaves_out_what_cannot_be_decoded(tmp_path):
    root = make_folder(tmp_path)
    good = (root / "train" / "cat" / "1.jpg").read_bytes()
    (root / "train" / "cat" / "1.jpg").write_bytes(good[:len(good) // 2])  # truncated
    (root / "train" / "dog" / "readme.md").write_text("#")
    (root / "train" / "eel" / "moved.png").symlink_to(tmp_path / "nowhere.png")
    train, _ = datasets(root, skip_bad_images=True)
    assert len(train) == 17
    assert sorted(p.rsplit("/", 2)[-2:][1] for p in train.skipped) == ["1.jpg", "moved.png", "readme.md"]
    assert isinstance(train, FolderDataset)


def test_the_folder_must_match_the_network(tmp_path):
    root = make_folder(tmp_path)
    with pytest.raises(ConfigError, match="has 3 class folders, the network's input.classes is 4"):
        load_datasets(DataConfig(type="folder", path=str(root)), (3, 16, 16), 4, seed=0)
    with pytest.raises(ConfigError, match="train/<class>/"):
        load_datasets(DataConfig(type="folder", path=str(root / "train" / "cat")), (3, 16, 16), 3, seed=0)
