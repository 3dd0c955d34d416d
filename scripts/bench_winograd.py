"""Winograd's F(2x2, 3x3) against the CPU backend's 3x3 convolutions: is it worth a kernel?

Times the forward of a 3x3, stride-1, padding-1 convolution three ways at the shapes of the
CIFAR ResNets and ResNet-50, each with the kernel threads of this machine:

- im2col and GEMM (the layer's own code) and the direct kernel (snrt/backends/cpu_conv.py),
  as the kernel chooser times them (snrt.backends.cpu_choice.best_seconds);
- Winograd F(2x2, 3x3) (Lavin and Gray, 2016), written here: the weights transformed to
  U = G g G^T (16, O, C) by one GEMM, each 4x4 input tile to V = B^T d B (16, C, tiles) by a
  compiled kernel (input channels split among the kernel threads), M = U V as 16 GEMMs
  (OpenBLAS, one batched matmul), and the 2x2 outputs A^T M A by a compiled kernel. 2.25x
  fewer multiplications than the direct convolution; the question is what the transforms
  and sixteen smaller GEMMs cost.

Prints and writes results/winograd.{json,md} (the parts of Winograd's time too). Not a kernel
of the backend: it ships only if it wins here.

    python scripts/bench_winograd.py [--rounds 7]
"""

import snrt  # noqa: F401  (before numpy: it shortens OpenBLAS's spin, results/blas_timeout.md)
import argparse  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
from numba import njit  # noqa: E402
from reproduce_common import RESULTS, machine, meta_line, save_json, save_markdown, table  # noqa: E402

from snrt.backends.cpu_choice import best_seconds  # noqa: E402
from snrt.backends.cpu_common import THREADED  # noqa: E402
from snrt.backends.cpu_parallel import run_split  # noqa: E402
from snrt.backends.cpu_conv import DirectConv2d  # noqa: E402
from snrt.layers.base import FORWARD, KernelContext  # noqa: E402
from snrt.layers.conv import Conv2d  # noqa: E402
from snrt.threads import kernel_threads  # noqa: E402

# (channels in = out, map size, batch): CIFAR ResNets' stages, ResNet-50's at 112x112 and 224x224
SHAPES = [(16, 32, 32), (32, 16, 32), (64, 8, 32), (64, 28, 8), (128, 14, 8), (256, 7, 8), (512, 4, 8), (256, 14, 8)]
G = np.array([[1, 0, 0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0, 0, 1]], np.float32)
WEIGHT_TRANSFORM = np.einsum("ai,bj->abij", G, G).reshape(16, 9)  # U[a*4 + b] = sum G[a,i] G[b,j] g[i,j]


@njit(**THREADED)
def input_tiles(x, tiles_h, tiles_w, v, c0, c1, padded, db):
    """v[4*xi + nu, c, (n*tiles_h + ty)*tiles_w + tx] = (B^T d B)[xi, nu] for the 4x4 patch d of
    x (N, C, H, W), zero-padded by 1, at rows 2ty - 1 ... and columns 2tx - 1 ..., for the
    channels c0 <= c < c1; padded (4, 2*tiles_w + 2) and db (4, 4, tiles_w) scratch: the
    patches' 4 rows, zero-padded, and their d B."""
    n, _, h, w = x.shape
    for c in range(c0, c1):
        for s in range(n):
            for ty in range(tiles_h):
                first = (s * tiles_h + ty) * tiles_w
                for r in range(4):
                    row = padded[r]
                    row[:] = 0
                    if 0 <= 2 * ty - 1 + r < h:
                        row[1:1 + w] = x[s, c, 2 * ty - 1 + r]
                    for tx in range(tiles_w):
                        d0, d1, d2, d3 = row[2 * tx], row[2 * tx + 1], row[2 * tx + 2], row[2 * tx + 3]
                        db[r, 0, tx], db[r, 1, tx], db[r, 2, tx], db[r, 3, tx] = d0 - d2, d1 + d2, d2 - d1, d1 - d3
                for nu in range(4):
                    for tx in range(tiles_w):
                        t0, t1, t2, t3 = db[0, nu, tx], db[1, nu, tx], db[2, nu, tx], db[3, nu, tx]
                        v[nu, c, first + tx] = t0 - t2
                        v[4 + nu, c, first + tx] = t1 + t2
                        v[8 + nu, c, first + tx] = t2 - t1
                        v[12 + nu, c, first + tx] = t1 - t3


@njit(**THREADED)
def output_tiles(m, tiles_h, tiles_w, y, o0, o1):
    """y[n, o, 2ty:2ty+2, 2tx:2tx+2] = A^T M A of the tile's 4x4 m[:, o, tile], for the outputs
    o0 <= o < o1 (a last row or column past y's edge left out)."""
    n, _, h, w = y.shape
    for o in range(o0, o1):
        for s in range(n):
            for ty in range(tiles_h):
                for tx in range(tiles_w):
                    t = (s * tiles_h + ty) * tiles_w + tx
                    a0, a1, a2, a3 = m[0, o, t], m[1, o, t], m[2, o, t], m[3, o, t]
                    b0, b1, b2, b3 = m[4, o, t], m[5, o, t], m[6, o, t], m[7, o, t]
                    c0, c1, c2, c3 = m[8, o, t], m[9, o, t], m[10, o, t], m[11, o, t]
                    d0, d1, d2, d3 = m[12, o, t], m[13, o, t], m[14, o, t], m[15, o, t]
                    top = (a0 + b0 + c0, a1 + b1 + c1, a2 + b2 + c2, a3 + b3 + c3)  # A^T's first row
                    low = (b0 - c0 - d0, b1 - c1 - d1, b2 - c2 - d2, b3 - c3 - d3)  # its second
                    for a, row in enumerate((top, low)):
                        if 2 * ty + a < h:
                            y[s, o, 2 * ty + a, 2 * tx] = row[0] + row[1] + row[2]
                            if 2 * tx + 1 < w:
                                y[s, o, 2 * ty + a, 2 * tx + 1] = row[1] - row[2] - row[3]


def winograd(x, weight, y, u, v, m, rows):
    """y = the 3x3 convolution of x padded by 1 with weight; returns each part's seconds."""
    n, c, h, w = x.shape
    o = weight.shape[0]
    tiles_h, tiles_w = (h + 1) // 2, (w + 1) // 2
    marks = [time.perf_counter()]
    np.matmul(WEIGHT_TRANSFORM, weight.reshape(o * c, 9).T, out=u.reshape(16, o * c))
    marks.append(time.perf_counter())
    run_split(input_tiles, 0, c, len(rows[0]), (x, tiles_h, tiles_w, v), rows)
    marks.append(time.perf_counter())
    np.matmul(u, v, out=m)
    marks.append(time.perf_counter())
    run_split(output_tiles, 0, o, len(rows[0]), (m, tiles_h, tiles_w, y))
    marks.append(time.perf_counter())
    return [b - a for a, b in zip(marks, marks[1:])]


def measure(channels, size, batch, rounds):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, channels, size, size), dtype=np.float32)
    weight = (rng.standard_normal((channels, channels, 3, 3)) * 0.1).astype(np.float32)
    tiles_w = (size + 1) // 2
    tiles = batch * tiles_w ** 2
    u = np.empty((16, channels, channels), np.float32)
    v, m = np.empty((16, channels, tiles), np.float32), np.empty((16, channels, tiles), np.float32)
    rows = (np.zeros((kernel_threads(), 4, 2 * tiles_w + 2), np.float32),
            np.zeros((kernel_threads(), 4, 4, tiles_w), np.float32))  # each thread's scratch
    y = np.empty_like(x)
    winograd(x, weight, y, u, v, m, rows)  # compiles
    layer = Conv2d(out_channels=channels, kernel=3, padding=1, bias=False)
    expected, direct = np.empty_like(y), DirectConv2d(layer)
    workspace = np.empty(direct.workspace_bytes([x.shape], FORWARD), np.uint8)
    direct.forward(KernelContext(np, workspace=workspace), [x], {"weight": weight}, {}, expected, {})
    error = float(np.abs(y - expected).max() / np.abs(expected).max())
    best, parts = float("inf"), None
    for _ in range(rounds):
        start = time.perf_counter()
        round_parts = winograd(x, weight, y, u, v, m, rows)
        seconds = time.perf_counter() - start
        if seconds < best:
            best, parts = seconds, round_parts
    others = best_seconds({"im2col": layer, "direct": direct}, layer, [x.shape], FORWARD)
    return {"channels": channels, "size": size, "batch": batch, "winograd_ms": best * 1e3,
            "winograd_parts_ms": [p * 1e3 for p in parts], "im2col_ms": others["im2col"] * 1e3,
            "direct_ms": others["direct"] * 1e3, "max_error_relative_to_max": error}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    meta = machine()
    rows = []
    for shape in SHAPES:
        row = measure(*shape, args.rounds)
        row["best_other_ms"] = min(row["im2col_ms"], row["direct_ms"])
        rows.append(row)
        print(f"{row['channels']}@{row['size']} b{row['batch']}: winograd {row['winograd_ms']:.2f} ms "
              f"(weights, inputs, GEMMs, outputs: {' '.join(f'{p:.2f}' for p in row['winograd_parts_ms'])}), "
              f"im2col {row['im2col_ms']:.2f}, direct {row['direct_ms']:.2f} "
              f"(error {row['max_error_relative_to_max']:.1e})", flush=True)
    save_json(RESULTS, "winograd", {"meta": meta, "rounds": args.rounds, "rows": rows})
    save_markdown(RESULTS, "winograd", [
        "# Winograd F(2x2, 3x3) against the CPU backend's 3x3 convolutions (forward)", "",
        meta_line(meta, False), "",
        f"`python scripts/bench_winograd.py --rounds {args.rounds}`: best of {args.rounds}, ms, "
        f"{kernel_threads()} kernel threads; im2col and direct as the kernel chooser times them. Winograd's "
        "parts: the weight transform, the input tiles, the 16 GEMMs, the output tiles. Error: Winograd's largest "
        "difference from the direct kernel over the largest output.", "",
        *table(["3x3 conv", "Winograd ms", "weights / inputs / GEMMs / outputs", "im2col ms", "direct ms",
                "Winograd / best of the others", "error"],
               [[f"{r['channels']}@{r['size']} b{r['batch']}", f"{r['winograd_ms']:.2f}",
                 " / ".join(f"{p:.2f}" for p in r["winograd_parts_ms"]), f"{r['im2col_ms']:.2f}",
                 f"{r['direct_ms']:.2f}", f"{r['winograd_ms'] / r['best_other_ms']:.2f}x",
                 f"{r['max_error_relative_to_max']:.1e}"] for r in rows])])


if __name__ == "__main__":
    main()
