"""Which JPEG decoder an image folder should use: images/s of the evaluation transform (decode,
shorter side to 256, center crop 224) on one core, for Pillow (full decode, and `draft`, which
decodes at a reduced DCT scale) and simplejpeg (full, and `min_height/min_width`, its reduced
scale), at two photo sizes: 500x375 (about ImageNet's median) and 1600x1200 (a camera's).

Writes results/decode.{md,json}.

    python scripts/bench_decode.py [--repeats 200]
"""

import argparse
import io
import time

import snrt  # noqa: F401  (before numpy: it sets OpenBLAS's thread timeout, as the `snrt` command does)
import numpy as np
from PIL import Image
from reproduce_common import RESULTS, machine, meta_line, save_json, save_markdown, table

SIZES = ((500, 375), (1600, 1200))
SHORT, CROP = 256, 224


def photo(width, height):
    """JPEG bytes (quality 90) of a smooth, noisy test picture."""
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:height, 0:width]
    pixels = np.stack([(xx * 0.5 + yy * 0.2) % 256, (yy * 0.6) % 256, (xx * 0.3 + 40) % 256], -1)
    pixels = (pixels + rng.normal(0, 12, pixels.shape)).clip(0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "JPEG", quality=90)
    return out.getvalue()


def center(image):
    """The evaluation transform of a PIL image: shorter side to SHORT, center CROP."""
    w, h = image.size
    image = image.resize((round(w * SHORT / min(w, h)), round(h * SHORT / min(w, h))), resample=2)
    w, h = image.size
    left, top = (w - CROP) // 2, (h - CROP) // 2
    return np.asarray(image.crop((left, top, left + CROP, top + CROP)))


def decoders(width, height):
    """{name: decode(bytes) -> (224, 224, 3) uint8}."""
    target = (round(width * SHORT / min(width, height)), round(height * SHORT / min(width, height)))

    def pillow(data):
        with Image.open(io.BytesIO(data)) as image:
            return center(image.convert("RGB"))

    def pillow_draft(data):
        with Image.open(io.BytesIO(data)) as image:
            image.draft("RGB", target)
            return center(image.convert("RGB"))
    found = {"Pillow": pillow, "Pillow draft": pillow_draft}
    try:
        import simplejpeg
    except ImportError:
        return found
    found["simplejpeg"] = lambda data: center(Image.fromarray(simplejpeg.decode_jpeg(data, colorspace="RGB")))
    found["simplejpeg reduced"] = lambda data: center(Image.fromarray(simplejpeg.decode_jpeg(
        data, colorspace="RGB", min_width=target[0], min_height=target[1])))
    return found


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    meta, rows = machine(), []
    for width, height in SIZES:
        data = photo(width, height)
        for name, decode in decoders(width, height).items():
            decode(data)
            start = time.perf_counter()
            for _ in range(args.repeats):
                decode(data)
            rate = args.repeats / (time.perf_counter() - start)
            rows.append({"size": f"{width}x{height}", "decoder": name, "images_per_s": rate})
            print(f"{width}x{height} {name:20s} {rate:7.0f} images/s", flush=True)
    save_json(RESULTS, "decode", {"meta": meta, "rows": rows})
    save_markdown(RESULTS, "decode", [
        "# JPEG decoding for image folders: images/s of the evaluation transform on one core", "",
        meta_line(meta, False), "", f"`python scripts/bench_decode.py --repeats {args.repeats}`: decode, shorter "
        f"side to {SHORT}, center crop {CROP}; each decoder on the same JPEG (quality 90).", "",
        *table(["image", "decoder", "images/s"], [[r["size"], r["decoder"], f"{r['images_per_s']:.0f}"] for r in rows])])


if __name__ == "__main__":
    main()
