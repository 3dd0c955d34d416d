"""Write results/README.md: every reproduce_* result against the papers' published numbers.

Reads results/{peak_memory,deepest_resnet,largest_batch,speed,timeline}.json (written by the
other reproduce_* scripts; run it last) and states where snrt is ahead, level or behind. The
papers' numbers are citations (constants below, with their source); every snrt number is read
from the result files.

    python scripts/reproduce_summary.py [--out results]
"""

import json
from pathlib import Path

from reproduce_common import BUDGET, GIB, parse_args
from reproduce_speed import PERTURBATION, TORCH_LAYOUTS

GB = 1e9
# Published numbers (citations, not measurements):
SUPERNEURONS = ("Wang et al., SuperNeurons: Dynamic GPU Memory Management for Training Deep Neural "
                "Networks, PPoPP 2018")
SUPERNEURONS_DEPTH, SUPERNEURONS_BATCH, SUPERNEURONS_GPU_GB = 2500, 16, 12  # ResNet2500 trained on a 12 GB GPU
VDNN = "Rhu et al., vDNN: Virtualized Deep Neural Networks for Scalable, Memory-Efficient Neural Network Design, MICRO 2016"
VDNN_BATCH, VDNN_BASELINE_GB, VDNN_GPU_GB = 256, 28, 12  # VGG-16 (256) needs 28 GB; trained on a 12 GB Titan X
CHEN = "Chen et al., Training Deep Nets with Sublinear Memory Cost, arXiv:1604.06174, 2016"
CHEN_BEFORE_GB, CHEN_AFTER_GB = 48, 7  # 1,000-layer ResNet: 48 GB -> 7 GB


def verdict(ours, theirs, higher_is_better=True, tolerance=0.05):
    """ahead / level / behind of snrt's `ours` against the paper's `theirs`."""
    if abs(ours - theirs) <= tolerance * abs(theirs):
        return "level"
    return "ahead" if (ours > theirs) == higher_is_better else "behind"


def where(d):
    """The machine a result file was produced on, as its `meta` recorded it."""
    return f"{d['meta']['platform']}, {d['meta']['cores']} cores" if d else "-"


def versions(d):
    return f"Python {d['meta']['python']}, NumPy {d['meta']['numpy']}, PyTorch {d['meta']['torch']}" if d else "-"


def load_note(d):
    """How busy the machine was when a result file's run started (its recorded load average)."""
    load = d["meta"].get("load_average")
    return f"load average {load[0]:.2f} over the minute before the run started" if load else "load not recorded"


def load(out, name):
    path = Path(out) / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def heading(d, title, name, plot=None):
    """A section's first lines: its title with links to the table and plot, or a note that it is missing."""
    if not d:
        return [f"## {title}", "", f"(results/{name}.json missing: run scripts/reproduce_{name}.py)"]
    return [f"## {title} ([table]({name}.md), [plot]({plot or name + '.png'}))", ""]


def section_peak(d):
    lines = heading(d, "Peak memory by technique", "peak_memory")
    if not d:
        return lines
    for r in d["plans"]:
        p = r["policies"]
        over_floor = p["superneurons"]["peak_bytes"] / r["floor_bytes"]
        lines.append(f"- {r['network']} ({r['image']}, batch {r['batch']}): "
                     + ", ".join(f"{k} {v['peak_bytes'] / GIB:.2f}" for k, v in p.items())
                     + f" GiB; superneurons = {over_floor:.2f}x the floor ({r['floor_bytes'] / GIB:.2f} GiB), "
                     f"{p['none']['peak_bytes'] / p['superneurons']['peak_bytes']:.1f}x below none: "
                     f"**{verdict(over_floor, 1.0, higher_is_better=False)}**")
    equal = sum(r["equal"] for r in d["measured"])
    lines += ["", f"Measured runs: {equal} of {len(d['measured'])} (network, policy) runs measured exactly the planned "
              "peak bytes. SuperNeurons' claim is a peak at the largest layer's working set (the floor); snrt's "
              "superneurons peak over the floor above says how close it comes: "
              + ", ".join(f"{r['network']} {r['policies']['superneurons']['peak_bytes'] / r['floor_bytes']:.2f}x"
                          for r in d["plans"]) + " (1.00x = level with the paper's claim)."]
    smallest = [r for r in d["plans"] if "smallest" in r]
    if smallest:
        worst = max(r["smallest"]["peak_bytes"] / r["floor_bytes"] for r in smallest)
        lines += ["", "At the smallest budget (just-in-time copies, idle tensors spilled), superneurons peaks at "
                  + ", ".join(f"{r['network']} {r['smallest']['peak_bytes'] / r['floor_bytes']:.3f}x"
                              for r in smallest)
                  + f" the floor: **{verdict(worst, 1.0, higher_is_better=False)}** with the claim."]
    return lines


def section_deepest(d):
    lines = heading(d, "Deepest ResNet in 12 GiB", "deepest_resnet")
    if not d:
        return lines
    lines += [f"Paper: ResNet2500 ({SUPERNEURONS_DEPTH} layers) trained at batch {SUPERNEURONS_BATCH} on a "
             f"{SUPERNEURONS_GPU_GB} GB GPU ({SUPERNEURONS}).", ""]
    for r in d["rows"]:
        if r["depth"]:
            resident = r.get("resident_bytes")
            deepest = f"deepest {r['depth']} layers (stages {tuple(r['stages'])}" + (
                f"; {resident / GIB:.2f} GiB of its arena are parameters, momentum and BatchNorm state)"
                if resident else ")")
        else:
            smallest = r["probes"].get("1")
            deepest = "no depth fits" + (f" (even k = 1 needs {smallest / GIB:.2f} GiB)" if smallest else "")
        lines.append(f"- batch {r['batch']}, {r['policy']}: {deepest}; ResNet2500's arena "
                     f"{r['resnet2500_arena_bytes'] / GIB:.2f} GiB ({'fits' if r['resnet2500_fits'] else 'does not fit'} 12 GiB).")
    sn = next((r for r in d["rows"] if r["policy"] == "superneurons" and r["batch"] == SUPERNEURONS_BATCH), None)
    if sn:
        lines += ["", f"**Verdict: {verdict(sn['depth'] or 0, SUPERNEURONS_DEPTH)}** of the paper: at batch "
                  f"{SUPERNEURONS_BATCH} snrt's superneurons plans ResNet2500 in "
                  f"{sn['resnet2500_arena_bytes'] / GIB:.2f} GiB and fits up to {sn['depth']} layers in 12 GiB "
                  f"against the paper's {SUPERNEURONS_DEPTH} (planned with the CPU kernels' workspaces, not cuDNN's; not trained on a GPU here)."]
    streamed = [r for r in d.get("streamed", []) if r["arena_bytes"] <= d["budget_bytes"]]
    if streamed:
        deepest = max(streamed, key=lambda r: r["depth"])
        lines += ["", f"With parameters and momentum streamed from the host store: up to {deepest['depth']:,} layers "
                  f"planned at batch 16 in {deepest['arena_bytes'] / GIB:.2f} GiB ({deepest['policy']}), with a "
                  f"{deepest['host_bytes'] / GIB:.0f} GiB host store; the device no longer bounds depth, the host "
                  "store and planning time do."]
    chen = d.get("chen_1000_layer")
    if chen:
        p = chen["policies"]
        best = min(p, key=lambda k: p[k]["peak_bytes"])
        lines += ["", f"Chen et al.'s case ({CHEN}): a 1,000-layer ResNet from {CHEN_BEFORE_GB} GB to "
                  f"{CHEN_AFTER_GB} GB ({CHEN_BEFORE_GB / CHEN_AFTER_GB:.1f}x) with recomputation. snrt, "
                  f"ResNet-{chen['depth']} (bottleneck {tuple(chen['stages'])}, {chen['image']}x{chen['image']}, "
                  f"batch {chen['batch']}): none {p['none']['peak_bytes'] / GB:.1f} GB, "
                  + (f"recompute {p['recompute']['peak_bytes'] / GB:.1f} GB "
                     f"({p['none']['peak_bytes'] / p['recompute']['peak_bytes']:.1f}x), " if "recompute" in p else "")
                  + f"best ({best}) {p[best]['peak_bytes'] / GB:.1f} GB ({p['none']['peak_bytes'] / p[best]['peak_bytes']:.1f}x). "
                  f"**Verdict on the reduction factor: {verdict(p['none']['peak_bytes'] / p[best]['peak_bytes'], CHEN_BEFORE_GB / CHEN_AFTER_GB)}** "
                  + ("(recomputation alone: "
                     f"{verdict(p['none']['peak_bytes'] / p['recompute']['peak_bytes'], CHEN_BEFORE_GB / CHEN_AFTER_GB)}). "
                     if "recompute" in p else "")
                  + "The networks are not identical (the paper's batch and MXNet's baseline differ; snrt's `none` "
                  "keeps every tensor, gradients included), so the factor is the comparable quantity, not the GB."]
    return lines


def section_batch(d):
    lines = heading(d, "Largest batch in 12 GiB", "largest_batch")
    if not d:
        return lines
    for r in d["rows"]:
        lines.append(f"- {r['network']}: " + ", ".join(f"{p} {v['batch']}" for p, v in r["policies"].items()))
    v = d["vdnn_vgg16_256"]
    fitting = [p for p, x in v.items() if x["fits"]]
    lines += ["", f"vDNN ({VDNN}): VGG-16 at batch {VDNN_BATCH} needs {VDNN_BASELINE_GB} GB naively and was trained "
              f"in {VDNN_GPU_GB} GB. snrt: `none` peaks at {v['none']['peak_bytes'] / GB:.1f} GB (every tensor and "
              f"gradient kept, no memory sharing, so larger than vDNN's baseline), liveness {v['liveness']['peak_bytes'] / GB:.1f} GB; "
              + "; ".join(f"{p} {'fits in ' + format(x['budget_arena_bytes'] / GIB, '.2f') + ' GiB' if x['fits'] else 'does not fit (needs ' + format(x['smallest_budget_bytes'] / GIB, '.2f') + ' GiB; largest batch ' + str(x['largest_batch']) + ')'}"
                          for p, x in v.items() if p in ("offload", "superneurons")) + ". "
              f"**Verdict: {'level' if fitting else 'behind'}** (policies that fit 12 GiB: {', '.join(fitting) or 'none'}"
              + ("; superneurons itself is behind offload here" if "offload" in fitting and "superneurons" not in fitting else "")
              + ")."]
    return lines


def section_speed(d):
    lines = heading(d, "Speed on this CPU against PyTorch", "speed")
    if not d:
        return lines
    for key in dict.fromkeys((r["network"], r["image"], r["batch"]) for r in d["rows"]):
        rows = {f"{r['framework']} {r['variant']}": r for r in d["rows"] if (r["network"], r["image"], r["batch"]) == key}
        parts = [f"{k} {r['images_per_s']:.2f} img/s, {r['peak_bytes'] / 2**20:.0f} MiB" for k, r in rows.items()
                 if "images_per_s" in r and k != "torch perturbed"]
        lines.append(f"- {key[0]} {key[1]}x{key[1]} batch {key[2]}: " + "; ".join(parts))
        for ours, theirs in (("snrt none", TORCH_LAYOUTS), ("snrt superneurons", ("checkpoint",))):
            a = rows.get(ours, {})
            ran = [v for v in theirs if "images_per_s" in rows.get(f"torch {v}", {})]
            if "images_per_s" in a and ran:
                best = max(ran, key=lambda v: rows[f"torch {v}"]["images_per_s"])  # the faster PyTorch layout
                ratio = a["images_per_s"] / rows[f"torch {best}"]["images_per_s"]
                lines.append(f"  - {ours} vs torch {best}: {ratio:.2f}x the throughput: **{verdict(ratio, 1.0)}**")
        ref, ours, moved = (rows.get(k, {}).get("losses") for k in ("torch plain", "snrt none", "torch perturbed"))
        if ref and ours and moved:
            def gap(run, i):
                return abs(run[i] - ref[i]) / abs(ref[i])
            lines.append(f"  - same training: the first loss of snrt and PyTorch differs by {gap(ours, 0):.0e} "
                         f"(relative); the last by {gap(ours, -1):.0e}, where PyTorch against itself from "
                         f"parameters perturbed by a relative {PERTURBATION:g} differs by {gap(moved, -1):.0e}")
        ck, sn = rows.get("torch checkpoint", {}), rows.get("snrt superneurons", {})
        if "peak_bytes" in ck and "peak_bytes" in sn:
            lines.append(f"  - memory: snrt superneurons' device arena peaks at {sn['peak_bytes'] / 2**20:.0f} MiB against "
                         f"at most {ck['peak_bytes'] / 2**20:.0f} MiB of tensors for torch checkpoint (its RSS growth): "
                         f"**{verdict(ck['peak_bytes'], sn['peak_bytes'])}** for snrt on device memory; the whole "
                         f"process grows by {sn['rss_growth_bytes'] / 2**20:.0f} MiB against "
                         f"{ck['rss_growth_bytes'] / 2**20:.0f} MiB: **{verdict(ck['rss_growth_bytes'], sn['rss_growth_bytes'])}** "
                         "for snrt on total memory (on the CPU the offloaded tensors stay in the same RAM)")
    lines += ["", "PyTorch's memory is its resident high-water mark (ru_maxrss) after the iterations minus its "
              "resident bytes before them, allocator slack included; snrt's device memory is its arena's exact "
              "peak, and its RSS growth is measured as PyTorch's is (on the CPU offloaded tensors stay in the same "
              f"RAM). Speed: median of {d.get('rounds', 1)} round(s) of {d['iterations']} timed iteration(s) per configuration, the rounds going over every configuration in turn, on this {d['meta']['cores']}-core CPU "
              f"({load_note(d)}); the papers' speed claims are for GPUs and are not reproduced here."]
    return lines


def section_timeline(d):
    lines = heading(d, "Predicted against measured", "timeline", "timeline_resnet50_superneurons.png")
    if not d:
        return lines
    for r in d["rows"]:
        lines.append(f"- {r['policy']}: {r['steps_equal']}/{r['steps']} steps with measured bytes = predicted; "
                     f"time predicted {r['predicted_s']:.2f} s, measured {r['measured_s']:.2f} s ({r['ratio']:.2f}x)")
    return lines


def main():
    args = parse_args(__doc__).parse_args()
    out = args.out
    data = {n: load(out, n) for n in ("peak_memory", "deepest_resnet", "largest_batch", "speed", "timeline")}
    modes = {n: ("quick" if d["quick"] else "full") if d else "missing" for n, d in data.items()}
    dates = {n: d["meta"]["date"] if d else "-" for n, d in data.items()}
    lines = ["# Reproducing SuperNeurons, vDNN and Chen et al. with snrt", "",
             "Generated by `scripts/reproduce_summary.py` from the result files of `scripts/reproduce_*.py` "
             "(`bash scripts/reproduce_all.sh [--quick]`). Every snrt number below is read from those files; "
             "the papers' numbers are citations. Memory numbers come from plans (exact for any device, here "
             f"against a {BUDGET / GIB:.0f} GiB budget, the papers' K40c / Titan X) and are confirmed by measured "
             "runs on the CPU at small sizes; no GPU was used.", "",
             "| result | mode | generated | machine | versions |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {n} | {modes[n]} | {dates[n]} | {where(d)} | {versions(d)} |" for n, d in data.items()]
    lines += [""]
    for section in (section_peak(data["peak_memory"]), section_deepest(data["deepest_resnet"]),
                    section_batch(data["largest_batch"]), section_speed(data["speed"]),
                    section_timeline(data["timeline"])):
        lines += section + [""]
    lines += ["## Sources", "", f"- {SUPERNEURONS}", f"- {VDNN}", f"- {CHEN}"]
    Path(out, "README.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
