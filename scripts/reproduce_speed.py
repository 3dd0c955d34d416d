"""Speed and memory on this CPU: snrt under every policy against PyTorch on the same networks.

For each network (full mode: CIFAR ResNet-110 and ResNet-164 at 32x32, ResNet-50 at
224x224; quick mode: CIFAR ResNet-110 and ResNet-50 at 112x112, smaller batches) and batch,
in one run, one fresh subprocess per (framework, variant) and round; the rounds go over
every variant in turn (full mode 3 rounds of 2 timed iterations, quick 1 of 1), so a drift
of the machine's speed during the run slows every variant alike:

- snrt: `Trainer(config).step(x, y, total)` with memory.policy P under none / liveness / recompute /
  offload / superneurons; peak memory is the arena's measured peak
  (`trainer.backend.arena.peak_bytes`, equal to the plan's peak_bytes);
- PyTorch "plain": `snrt.torch_reference.TorchNet` built from the same graph and the Trainer's
  initial parameters, trained with torch.optim.SGD (same lr, momentum, weight decay on every
  parameter but BatchNorm's and biases, as snrt; the Trainer's learning-rate schedule);
- PyTorch "channels_last": "plain" with its 4-D parameters and every batch in the channels-last
  memory format (often faster on CPUs); the anchor for snrt is the faster of the two layouts;
- PyTorch "checkpoint": the same TorchNet, its forward cut into a chain of single-tensor pieces
  (`chain_pieces`: cut wherever exactly one tensor crosses, i.e. between residual blocks) run
  by `torch.utils.checkpoint.checkpoint_sequential` with round(sqrt(pieces)) segments
  (use_reentrant=False; the recomputed forward of a BatchNorm updates its running statistics
  a second time, which does not change the speed);
- PyTorch "perturbed": "plain" from initial parameters scaled by (1 + PERTURBATION * N(0, 1)):
  how far these short runs' losses drift by themselves (left out of the plot).

All see the same synthetic batches (the Trainer's stream, `Batches.get(i)`), after `warmup`
untimed iterations per process. images/s = batch / median wall seconds of one whole
iteration over every round. Losses and memory are the first round's (every round repeats
the same computation).

PyTorch has no arena to read, so its memory is the growth of the process's resident set:
its high-water mark (`ru_maxrss`) after the last iteration minus the resident bytes
(/proc/self/statm) just before the first, with the model, optimizer and data already built: what its allocator had to take from the OS for activations, gradients,
momentum and workspaces (this is why every run has its own process: ru_maxrss never goes
down). It also counts allocator slack and temporaries, so it is an upper bound of the
tensors' bytes, not the same quantity as snrt's arena peak; snrt's RSS growth is shown too.

Writes results/speed.{md,json,png}.

    python scripts/reproduce_speed.py [--quick]
"""

import timing  # first: it sets the BLAS thread counts before numpy loads

import math
import statistics
import time

from reproduce_common import (MIB, POLICIES, grouped_bars, machine, meta_line, parse_args, save_json,
                              save_markdown, synthetic_config, table)

CASES = [("cifar_resnet110", 32, 32), ("cifar_resnet164", 32, 16), ("resnet50", 224, 8)]  # (config, image, batch)
QUICK_CASES = [("cifar_resnet110", 32, 8), ("resnet50", 112, 4)]
VARIANTS = [("snrt", p) for p in POLICIES] + [("torch", "plain"), ("torch", "channels_last"), ("torch", "checkpoint"),
                                               ("torch", "perturbed")]
TORCH_LAYOUTS = ("plain", "channels_last")  # snrt's anchor is the faster of these
PERTURBATION = 1e-6  # "perturbed": plain PyTorch from initial parameters scaled by (1 + 1e-6 * N(0, 1))


def chain_pieces(net, graph):
    """TorchNet's forward up to the logits as a list of single-tensor functions, cut wherever
    exactly one tensor is live."""
    from snrt.torch_reference import OPS

    nodes = [n for n in graph.nodes.values() if n.layer.type_name not in ("Input", "SoftmaxCrossEntropy")]
    position = {n.name: i for i, n in enumerate(nodes)}
    last_use = {}
    for i, n in enumerate(nodes):
        for name in n.inputs:
            last_use[name] = i
    produced = ["data"]
    cuts = []
    for i, n in enumerate(nodes):
        produced.append(n.name)
        live = {p for p in produced if last_use.get(p, -1) > i}
        if live == {n.name} or i == len(nodes) - 1:
            cuts.append(i)

    def evaluate(node, values):
        layer = node.layer
        p = {k: net.param(node.name, k) for k in layer.param_specs(graph.in_shapes(node.name, 1))}
        s = {k: v for (owner, k), v in net.state.items() if owner == node.name}
        return OPS[layer.type_name](layer, [values[i] for i in node.inputs], p, s, net.training)

    def piece(members, source):
        def run(x):
            values = {source: x}
            for node in members:
                values[node.name] = evaluate(node, values)
            return values[members[-1].name]
        return run

    pieces, start, source = [], 0, "data"
    for end in cuts:
        members = nodes[start:end + 1]
        assert all(i == source or position.get(i, -1) >= start for m in members for i in m.inputs)
        pieces.append(piece(members, source))
        start, source = end + 1, nodes[end].name
    return pieces


def segments_of(pieces):
    """checkpoint_sequential's segments: about sqrt(pieces)."""
    return max(1, min(len(pieces), round(math.sqrt(len(pieces)))))


def checkpointed(net, graph):
    """The loss function of the "checkpoint" variant: the chain of pieces under checkpoint_sequential."""
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint_sequential

    pieces = chain_pieces(net, graph)
    segments = segments_of(pieces)
    return lambda x, y: F.cross_entropy(checkpoint_sequential(pieces, segments, x, use_reentrant=False), y)


def channels_last(net, graph):
    """The loss function of the "channels_last" variant: the net's 4-D parameters converted
    once (in place, so the optimizer keeps them), every batch converted as it comes in."""
    import torch

    net.to(memory_format=torch.channels_last)
    return lambda x, y: net({"data": x.contiguous(memory_format=torch.channels_last), "label": y}).mean()


def perturbed(params):
    """The initial parameters scaled by (1 + PERTURBATION * N(0, 1))."""
    import numpy as np

    rng = np.random.default_rng(0)
    return {k: (v * (1 + PERTURBATION * rng.standard_normal(v.shape))).astype(v.dtype) for k, v in params.items()}


def run_snrt(name, size, batch, variant, warmup, iterations):
    run = timing.time_snrt(synthetic_config(name, size, batch, variant), warmup, iterations)
    trainer = run.subject
    return {"seconds": run.seconds, "losses": run.losses, "loss": run.losses[-1],
            "peak_bytes": trainer.backend.arena.peak_bytes, "planned_peak_bytes": trainer.plan.peak_bytes,
            "predicted_s": trainer.plan.predicted_s, "rss_growth_bytes": run.rss_growth_bytes,
            "new_high_water": run.new_high_water, "rss_growth_with_build_bytes": run.rss_max_after - run.rss_start}


def run_torch(name, size, batch, variant, warmup, iterations):
    import torch

    config = synthetic_config(name, size, batch)
    run = timing.time_torch(config, warmup, iterations, schedule=True,  # the Trainer's learning-rate schedule
                            adjust=perturbed if variant == "perturbed" else None,
                            forward={"checkpoint": checkpointed, "channels_last": channels_last}.get(variant),
                            keep_initial=True)
    pieces = chain_pieces(run.subject[0], config.graph)
    return {"seconds": run.seconds, "losses": run.losses, "loss": run.losses[-1], "peak_bytes": run.rss_growth_bytes,
            "rss_growth_bytes": run.rss_growth_bytes, "new_high_water": run.new_high_water, "pieces": len(pieces),
            "segments": segments_of(pieces) if variant == "checkpoint" else None, "threads": torch.get_num_threads()}


def main():
    if timing.serve({"snrt": run_snrt, "torch": run_torch}):
        return
    parser = parse_args(__doc__)
    parser.add_argument("--iterations", type=int, default=None, help="timed iterations per round (quick 1, full 2)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds over every variant (quick 1, full 3)")
    args = parser.parse_args()
    iterations = args.iterations or (1 if args.quick else 2)
    rounds = args.rounds or (1 if args.quick else 3)
    warmup = 1
    meta = machine()
    runs = {}  # (network, framework, variant) -> its first round's result, with every round's seconds
    for round_ in range(rounds):  # round-robin, so a machine whose speed drifts slows every variant alike
        for name, size, batch in (QUICK_CASES if args.quick else CASES):
            for framework, variant in VARIANTS:
                start = time.perf_counter()
                r = timing.spawn(__file__, framework, echo=False, name=name, size=size, batch=batch,
                                 variant=variant, warmup=warmup, iterations=iterations)
                r.update({"network": name, "image": size, "batch": batch, "framework": framework, "variant": variant,
                          "wall_s": time.perf_counter() - start})
                merged = runs.setdefault((name, framework, variant), r)
                if merged is not r and "seconds" in merged:
                    merged["wall_s"] += r["wall_s"]
                    if "seconds" in r:
                        merged["seconds"] = merged["seconds"] + r["seconds"]
                    else:  # a failed round fails the whole row
                        del merged["seconds"]
                        merged["error"] = r["error"]
                if "seconds" in r:
                    print(f"round {round_ + 1}/{rounds} {name} b{batch} {framework} {variant}: "
                          f"{batch / statistics.median(r['seconds']):.1f} img/s, peak {r['peak_bytes'] / MIB:.0f} MiB, "
                          f"loss {r['loss']:.4f}", flush=True)
                else:
                    print(f"round {round_ + 1}/{rounds} {name} b{batch} {framework} {variant}: FAILED {r['error']}",
                          flush=True)
    rows = list(runs.values())
    for r in rows:
        if "seconds" in r:
            r["seconds_median"] = statistics.median(r["seconds"])
            r["images_per_s"] = r["batch"] / r["seconds_median"]
    save_json(args.out, "speed", {"meta": meta, "quick": args.quick, "warmup": warmup, "iterations": iterations,
                                  "rounds": rounds, "rows": rows})

    def label(r):
        return f"{r['framework']} {r['variant']}"

    series = [f"{f} {v}" for f, v in VARIANTS if v != "perturbed"]
    groups = list(dict.fromkeys(f"{r['network']} {r['image']} b{r['batch']}" for r in rows))
    values = {s: {} for s in series}
    for r in rows:
        if label(r) in values:
            values[label(r)][f"{r['network']} {r['image']} b{r['batch']}"] = r.get("images_per_s")
    grouped_bars(f"{args.out}/speed.png", groups, series, values, "images / s (this CPU)",
                 "Training throughput on this CPU: snrt policies and PyTorch")
    lines = ["# Speed and memory on this CPU: snrt against PyTorch", "", meta_line(meta, args.quick), "",
             f"Median wall seconds of one whole training iteration over {rounds} round(s) of {iterations} timed "
             f"iteration(s) after {warmup} warm-up, each configuration in its own process, the rounds going over "
             "every configuration in turn. Peak "
             "memory: snrt = the arena's measured peak (equal to the plan's prediction: column `= plan`); "
             "PyTorch = ru_maxrss (process resident high-water mark) after the iterations minus the resident "
             "bytes before them: what "
             "its allocator took from the OS for activations, gradients, momentum and workspaces, "
             "including allocator slack (an upper bound of its tensors, not the same measure). snrt's "
             "RSS growth is listed for comparison on the same footing ((bound): the iterations never passed the "
             "process's earlier high-water mark, so the number is an upper bound). `checkpoint` = "
             "torch.utils.checkpoint.checkpoint_sequential over the chain of single-tensor pieces "
             "(residual blocks) with about sqrt(pieces) segments. `perturbed` = plain PyTorch from initial "
             f"parameters scaled by (1 + {PERTURBATION:g} N(0, 1)): how far these short runs' losses move by "
             "themselves (see the last table).", ""]
    lines += table(["network", "image", "batch", "framework", "variant", "images/s", "s/iteration", "peak memory (MiB)",
                    "= plan", "RSS growth (MiB)", "vs faster torch layout", "first loss", "last loss"], [
        [r["network"], r["image"], r["batch"], r["framework"],
         r["variant"] + (f" ({r['segments']} of {r['pieces']} pieces)" if r.get("segments") else ""),
         f"{r['images_per_s']:.2f}" if "images_per_s" in r else "failed",
         f"{r['seconds_median']:.2f}" if "seconds_median" in r else "-",
         f"{r['peak_bytes'] / MIB:.0f}" if "peak_bytes" in r else "-",
         ("yes" if r["peak_bytes"] == r["planned_peak_bytes"] else "NO") if "planned_peak_bytes" in r else "-",
         (f"{r['rss_growth_bytes'] / MIB:.0f}" + ("" if r["new_high_water"] else " (bound)")) if "seconds" in r else "-",
         speedup(r, rows), f"{r['losses'][0]:.5f}" if "losses" in r else "-",
         f"{r['loss']:.4f}" if "loss" in r else "-"] for r in rows])
    lines += ["", "## Targets", "", "snrt none against the faster of PyTorch's two layouts (plain, channels_last), "
              "snrt superneurons against PyTorch checkpoint_sequential, and what superneurons costs over none "
              "(images/s ratios; the goals are >= 1.00x, >= 1.00x and <= 1.10x).", ""]
    lines += table(["network", "image", "batch", "none vs faster torch layout", "superneurons vs torch checkpoint",
                    "superneurons / none time"], targets(rows))
    lines += ["", "![speed](speed.png)", "", "## Same training?", "",
              "Every variant trains the same network from the same initial parameters on the same batches. "
              "Relative difference of the losses, per iteration, of snrt (none) against plain PyTorch, and of "
              "plain PyTorch against itself started from the perturbed parameters: where the two columns are "
              "of a size, the runs differ by no more than rounding does.", ""]
    lines += table(["network", "iteration", "snrt none vs torch plain", "torch perturbed vs torch plain"],
                   divergence(rows))
    save_markdown(args.out, "speed", lines)
    print("\n".join(lines))


def divergence(rows):
    """Per network and iteration: |loss - reference| / |reference| of snrt none and of perturbed
    PyTorch against plain PyTorch."""
    out = []
    for key in dict.fromkeys((r["network"], r["image"], r["batch"]) for r in rows):
        runs = {(r["framework"], r["variant"]): r.get("losses") for r in rows
                if (r["network"], r["image"], r["batch"]) == key}
        ref, ours, perturbed = runs.get(("torch", "plain")), runs.get(("snrt", "none")), runs.get(("torch", "perturbed"))
        if not (ref and ours and perturbed):
            continue
        for i, (a, b, c) in enumerate(zip(ref, ours, perturbed)):
            out.append([key[0], i, f"{abs(b - a) / abs(a):.1e}", f"{abs(c - a) / abs(a):.1e}"])
    return out


def torch_rate(r, rows, variants):
    """The best images/s of PyTorch's `variants` on r's network and batch (None if none ran)."""
    rates = [q["images_per_s"] for q in rows if q["network"] == r["network"] and q["batch"] == r["batch"]
             and q["framework"] == "torch" and q["variant"] in variants and "images_per_s" in q]
    return max(rates, default=None)


def speedup(r, rows):
    ref = torch_rate(r, rows, TORCH_LAYOUTS)
    return f"{r['images_per_s'] / ref:.2f}x" if ref and "images_per_s" in r else "-"


def targets(rows):
    """Per network: snrt none / faster torch layout, snrt superneurons / torch checkpoint (images/s),
    superneurons / none (seconds)."""
    out = []
    for r in rows:
        if (r["framework"], r["variant"]) != ("snrt", "none") or "images_per_s" not in r:
            continue
        sn = next((q for q in rows if (q["network"], q["batch"], q["framework"], q["variant"]) ==
                   (r["network"], r["batch"], "snrt", "superneurons") and "images_per_s" in q), None)
        layout, checkpoint = torch_rate(r, rows, TORCH_LAYOUTS), torch_rate(r, rows, ("checkpoint",))
        out.append([r["network"], r["image"], r["batch"],
                    f"{r['images_per_s'] / layout:.2f}x" if layout else "-",
                    f"{sn['images_per_s'] / checkpoint:.2f}x" if sn and checkpoint else "-",
                    f"{r['images_per_s'] / sn['images_per_s']:.2f}x" if sn else "-"])
    return out


if __name__ == "__main__":
    main()
