"""The `snrt` command: inspect, train and eval a network file."""

import argparse
import collections
import dataclasses
import errno
import json
import math
import os
import signal
import sys
import threading
from contextlib import nullcontext
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

from snrt.atomic import replace_atomically
from snrt.backends import BACKENDS, default_backend
from snrt.config import DATASETS, config_to_yaml, load_config, with_settings
from snrt.checkpoint import CheckpointError, NonFiniteError, load_checkpoint
from snrt.errors import ConfigError, DivergenceError, SnrtError
from snrt.layers.base import BACKWARD, FORWARD
from snrt.optim import make_optimizer
from snrt.parallel import Solo, first_failing_rank, launcher_rank, launcher_size, world
from snrt.runfolder import CHECKPOINT, RUN_FILES, RunFolder
from snrt.precision import PRECISIONS, PrecisionError
from snrt.scheduler import BudgetError, policies
from snrt.scheduler.planner import require_budget
from snrt.summary import human_bytes, summary_table, totals_by_type
from snrt.threads import (MAX_THREADS, Claims, describe_pools, in_a_child, limit_threads, thread_pools,
                          usable_cores)


def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text}")
    return value


def _thread_count(text):
    value = _positive_int(text)
    if value > MAX_THREADS:
        raise argparse.ArgumentTypeError(f"expected at most {MAX_THREADS} threads, got {value}")
    return value


def _path(text):
    """A path given on the command line: an empty one (an unset shell variable, say) is refused,
    where it would mean the current folder or the default silently."""
    if not text:
        raise argparse.ArgumentTypeError("expected a path, got an empty string")
    return text


def _data_spec(text):
    kind, _, path = text.partition(":")
    if kind not in DATASETS:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(DATASETS)} (with :PATH for npz, cifar and "
                                         f"folder), got {text!r}")
    if path and kind in ("synthetic", "digits"):
        raise argparse.ArgumentTypeError(f"{kind} reads no files (it is made, or comes with scikit-learn): give it "
                                         f"without :PATH, got {text!r}")
    return {"type": kind, **({"path": path} if path else {})}


def build_parser():
    parser = argparse.ArgumentParser(prog="snrt", description="Train networks larger than device memory.")
    commands = parser.add_subparsers(dest="command", required=True)

    inspect = commands.add_parser("inspect", help="summarise a network: layers, parameters, FLOPs, activation bytes")
    inspect.add_argument("config", type=_path, help="network YAML file, e.g. configs/resnet50.yaml")
    inspect.add_argument("--batch", type=_positive_int, help="batch size for activation bytes (default: the file's train.batch)")
    inspect.add_argument("--json", action="store_true", help="print machine-readable JSON instead of a table")
    inspect.add_argument("--layers", action="store_true", help="list every node, not only totals by type")
    inspect.set_defaults(run=run_inspect)

    train = commands.add_parser("train", help="train a network (CPU, or CUDA where CuPy finds a GPU)")
    _add_run_options(train)
    train.add_argument("--iterations", type=_positive_int, help="train up to this iteration (overrides train.iterations)")
    train.add_argument("--lr", type=float, help="base learning rate (overrides train.optimizer.lr)")
    train.add_argument("--policy", choices=policies.CHOICES, help="memory policy (overrides memory.policy)")
    train.add_argument("--budget", help="device-memory budget such as 12GiB (overrides memory.budget)")
    train.add_argument("--stream-parameters", action="store_true", default=None,
                       help="keep parameters and optimizer state in host memory, on the device only while used "
                            "(sets memory.stream_parameters)")
    train.add_argument("--host-store", metavar="DIR", type=_path,
                       help="CPU: keep the host store in a file in DIR instead of memory (sets memory.host_store)")
    train.add_argument("--seed", type=int, help="seed for initialisation, data and dropout (overrides train.seed)")
    train.add_argument("--out", type=_path,
                       help="output folder for metrics, checkpoint and summary (default runs/NAME)")
    start = train.add_mutually_exclusive_group()  # a resumed run's weights are its checkpoint's
    start.add_argument("--resume", nargs="?", const="", metavar="RUN_OR_CHECKPOINT",
                       help="continue from a checkpoint, or a run folder's (default: OUT/checkpoint.npz)")
    train.add_argument("--overwrite", action="store_true",
                       help="start over in an output folder that holds an earlier run (its files are deleted)")
    train.add_argument("--checkpoint-every", type=_positive_int, help="iterations between checkpoints")
    start.add_argument("--init-from", metavar="FILE", type=_path,
                       help="start from these weights: safetensors or a PyTorch state dict (see snrt export); "
                            "not with --resume")
    train.add_argument("--check", action="store_true", help="debug mode: check arena overlaps, poison freed memory")
    train.add_argument("--no-eval", action="store_true", help="skip the held-out evaluation at the end")
    train.set_defaults(run=run_train)

    plan = commands.add_parser("plan", help="memory plans of every policy, the steps, and a timeline PNG")
    plan.add_argument("config", type=_path, help="network YAML file, e.g. configs/resnet2500.yaml")
    plan.add_argument("--batch", type=_positive_int, help="batch size (overrides train.batch)")
    plan.add_argument("--image-size", type=_positive_int, help="square input size (overrides input.shape's H and W)")
    plan.add_argument("--policy", choices=policies.CHOICES, help="the policy to detail (default: memory.policy)")
    plan.add_argument("--budget", help="device-memory budget such as 12GiB (overrides memory.budget)")
    plan.add_argument("--stream-parameters", action="store_true", default=None,
                      help="plan parameters and optimizer state streamed from host memory (memory.stream_parameters)")
    _add_precision(plan)
    plan.add_argument("--json", action="store_true", help="print the per-policy summary as JSON")
    plan.add_argument("--steps", action="store_true", help="print every step of the detailed plan")
    plan.add_argument("--layers", action="store_true",
                      help="list what the detailed plan does with each layer's output: keep, recompute, offload")
    plan.add_argument("--png", type=_path, help="write the memory timeline of the detailed plan to this PNG file")
    plan.add_argument("--save", type=_path, help="write the detailed plan as JSON to this file")
    plan.add_argument("--ranks", type=_positive_int, default=1,
                      help="plan one rank of a data-parallel run on this many processes (batch = the global batch)")
    plan.set_defaults(run=run_plan, data=None)

    tune = commands.add_parser("tune", help="the largest batch each policy fits in a budget, predicted images/s, "
                                             "and the batch, policy and learning rate to train with")
    tune.add_argument("config", type=_path, help="network YAML file, e.g. configs/resnet50.yaml")
    tune.add_argument("--budget", help="device-memory budget such as 12GiB (default: memory.budget)")
    tune.add_argument("--stream-parameters", action="store_true", default=None,
                      help="plan parameters and optimizer state streamed from host memory (memory.stream_parameters)")
    _add_precision(tune)
    tune.add_argument("--image-size", type=_positive_int, help="square input size (overrides input.shape's H and W)")
    tune.add_argument("--max-batch", type=_positive_int, default=4096, help="largest batch to consider (default 4096)")
    tune.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                      help="whose cost model predicts the time (default cpu; plans are exact for any device)")
    tune.add_argument("--measure", action="store_true",
                      help="also train 3 iterations at the recommended batch (synthetic data) and report images/s")
    tune.add_argument("--lr-range", type=_positive_int, nargs="?", const=30, metavar="ITERATIONS",
                      help="also run a learning-rate range test of this many iterations (default 30) at the "
                           "recommended batch, and cap the scaled rate at a tenth of the rate of lowest loss")
    tune.add_argument("--out", type=_path, help="where to write the tuned config (default NAME.tuned.yaml)")
    tune.add_argument("--overwrite", action="store_true", help="replace the --out file if it exists")
    tune.add_argument("--png", type=_path, help="write predicted images/s against batch to this PNG file")
    tune.add_argument("--json", action="store_true", help="print the results as JSON")
    tune.set_defaults(run=run_tune)

    report = commands.add_parser("report", help="loss, accuracy, images/s and data wait of runs: a picture and a table")
    report.add_argument("runs", nargs="+", metavar="RUN", type=_path, help="run folders written by snrt train")
    report.add_argument("--png", type=_path,
                        help="the picture (default RUN/metrics.png for one run; needed for several)")
    report.add_argument("--json", action="store_true", help="print the table as JSON")
    report.set_defaults(run=run_report)

    export = commands.add_parser("export", help="a run's weights as safetensors or a PyTorch state dict, or its "
                                                "inference graph as ONNX")
    export.add_argument("source", metavar="RUN_OR_CHECKPOINT", type=_path, help="a run folder or a checkpoint file")
    export.add_argument("--format", choices=tuple(EXPORTED), default="safetensors")
    export.add_argument("--out", type=_path, help="the file to write (default: weights.safetensors, weights.pt or "
                                                  "model.onnx beside the checkpoint)")
    export.add_argument("--names-like", metavar="FILE", type=_path,
                        help="write the tensors under the names of this weights file of the target model "
                             "(a torchvision state dict, say), paired by name or by order and shape")
    export.set_defaults(run=run_export)

    evaluate = commands.add_parser("eval", help="loss and accuracy of a checkpoint on the held-out split")
    _add_run_options(evaluate)
    evaluate.add_argument("--checkpoint", required=True, metavar="RUN_OR_CHECKPOINT", type=_path,
                          help="checkpoint file written by snrt train, or its run folder")
    evaluate.set_defaults(run=run_eval)
    return parser


def _add_run_options(parser):
    parser.add_argument("config", type=_path, help="network YAML file, e.g. configs/resnet2500.yaml")
    parser.add_argument("--batch", type=_positive_int, help="batch size (overrides train.batch)")
    parser.add_argument("--image-size", type=_positive_int, help="square input size (overrides input.shape's H and W)")
    parser.add_argument("--classes", type=_positive_int, help="classes of the classifier (overrides input.classes)")
    parser.add_argument("--no-cuda-graph", dest="cuda_graph", action="store_false", default=None,
                        help="GPU: run every iteration step by step instead of replaying a captured CUDA graph "
                             "(for debugging; sets train.cuda_graph false)")
    _add_precision(parser)


def _add_precision(parser):
    parser.add_argument("--precision", choices=tuple(PRECISIONS),
                        help="the dtype tensors are stored in: fp32, tf32 (fp32 storage, tensor-core math), "
                             "bf16 or fp16 (2-byte activations) (overrides train.precision)")
    parser.add_argument("--no-fuse", dest="fuse", action="store_false", default=None,
                        help="plan every layer as a node of its own: no BatchNorm+ReLU or Add+ReLU fusion "
                             "(sets train.fuse false)")
    parser.add_argument("--data", type=_data_spec, metavar="TYPE[:PATH]",
                        help=f"data set: {', '.join(DATASETS)}; npz, cifar and folder (DIR/train/<class>/*) take :PATH")
    parser.add_argument("--workers", type=int, metavar="N",
                        help="processes that decode and augment batches (train.data.workers; 0: a thread; default: the "
                             "usable cores for image folders, else 0)")
    parser.add_argument("--skip-bad-images", action="store_true", default=None,
                        help="image folders: count and leave out unreadable images instead of stopping")
    parser.add_argument("--backend", choices=BACKENDS,
                        help="cpu or cuda (default: cuda when CuPy finds a GPU; snrt plan: without it, the layers' own "
                             "workspaces and the CPU cost model, the same plan on every machine)")
    parser.add_argument("--nondeterministic", dest="deterministic", action="store_false", default=None,
                        help="GPU: admit cuDNN's non-deterministic engines, which may be faster (results vary in "
                             "their last bits; sets train.deterministic false)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (for logs)")
    parser.add_argument("--threads", type=_thread_count,
                        help="threads of the CPU's BLAS pool (default: the cores this process may use)")


def _overrides(args):
    """The dotted-key overrides that the command-line flags ask for (a command may have only
    some of the flags)."""
    out = {}
    if getattr(args, "batch", None):
        out["train.batch"] = args.batch
    if getattr(args, "image_size", None):
        out["input.shape"] = _image_size(args.config, args.image_size)
    if getattr(args, "data", None):
        for key, value in args.data.items():
            out[f"train.data.{key}"] = value
    for flag, key in (("classes", "input.classes"), ("iterations", "train.iterations"), ("lr", "train.optimizer.lr"),
                      ("policy", "memory.policy"),
                      ("budget", "memory.budget"), ("seed", "train.seed"),
                      ("stream_parameters", "memory.stream_parameters"), ("host_store", "memory.host_store"),
                      ("precision", "train.precision"), ("skip_bad_images", "train.data.skip_bad_images"),
                      ("deterministic", "train.deterministic"), ("fuse", "train.fuse"),
                      ("cuda_graph", "train.cuda_graph"),
                      ("workers", "train.data.workers")):
        if getattr(args, flag, None) is not None:
            out[key] = getattr(args, flag)
    return out


def _image_size(source, size):
    """The input.shape override of --image-size: an image's (C, H, W) with H and W set to
    `size`. A shape of another length has no H and W to set (a vector input, say): an error,
    rather than a network on inputs of another kind. A value that is not a list is left for
    the file's own check to report."""
    def resized(shape):
        if not isinstance(shape, list):
            return shape
        if len(shape) != 3:
            raise ConfigError(source, "input.shape", f"--image-size sets the height and width of images (C, H, W); "
                                                     f"this network's input is {shape}, which has none to set")
        return [shape[0], size, size]
    return resized


def inspect_report(config, batch):
    """The summary as plain data (what `snrt inspect --json` prints)."""
    graph = config.graph
    rows = graph.rows(batch)
    per_image = {t.type: t.forward_flops for t in totals_by_type(graph.rows(1))}
    return {
        "name": config.name,
        "batch": batch,
        "input_shape": list(config.input.shape),
        "classes": config.input.classes,
        "layers": len(graph),
        "params": graph.num_params(),
        "forward_flops_per_image": sum(per_image.values()),
        "activation_bytes": sum(r.activation_bytes for r in rows),
        "by_type": [
            {"type": t.type, "layers": t.layers, "params": t.params,
             "forward_flops_per_image": per_image[t.type], "activation_bytes": t.activation_bytes}
            for t in totals_by_type(rows)
        ],
    }


def run_inspect(args, console):
    config = load_config(args.config)
    batch = args.batch or config.train.batch
    if args.json:
        report = inspect_report(config, batch)
        if args.layers:  # the rows of the --layers table
            report["nodes"] = [{"name": row.name, "type": row.type, "inputs": list(node.inputs), "shape": list(row.shape),
                                "params": row.params} for row, node in zip(config.graph.rows(batch),
                                                                           config.graph.nodes.values())]
        _print_json(console, report)
        return
    if args.layers:
        table = Table(title=f"{config.name}: every node at batch {batch}")
        for header in ("node", "type", "inputs", "output (per sample)", "params"):
            table.add_column(header)
        for row, node in zip(config.graph.rows(batch), config.graph.nodes.values()):
            table.add_row(row.name, row.type, ", ".join(node.inputs), str(list(row.shape)), str(row.params))
        console.print(table)
    console.print(summary_table(config.graph, batch))


def plan_headline(plan):
    """A table of the plan's device bytes by role: at the peak step, and summed over buffers."""
    ranks = f" on each of {plan.ranks} ranks" if plan.ranks > 1 else ""
    table = Table(title=f"memory plan: {plan.policy}, batch {plan.batch}{ranks}")
    table.add_column("role", no_wrap=True)
    table.add_column("at peak", justify="right", no_wrap=True)
    table.add_column("all buffers", justify="right", no_wrap=True)
    at_peak = plan.peak_by_role()
    for role, nbytes in plan.bytes_by_role().items():
        if nbytes:
            table.add_row(role.replace("_", " "), human_bytes(at_peak.get(role, 0)), human_bytes(nbytes))
    table.add_section()
    at_peak = plan.peak_by_dtype()
    for dtype, nbytes in sorted(plan.bytes_by_dtype().items()):
        table.add_row(f"in {dtype}" + (" (workspace)" if dtype == "uint8" else ""), human_bytes(at_peak.get(dtype, 0)),
                      human_bytes(nbytes))
    table.add_section()
    table.add_row("peak on device", human_bytes(plan.peak_bytes), "")
    table.add_row("arena", human_bytes(plan.arena_bytes), "")
    if plan.host_bytes:
        to_host, to_device = plan.copied_bytes()
        table.add_row("host store", human_bytes(plan.host_bytes), "")
        table.add_row("copied per iteration", f"{human_bytes(to_host)} out", f"{human_bytes(to_device)} back")
    if plan.ranks > 1:
        buckets = sum(s.kind == "allreduce" for s in plan.steps)
        table.add_row("gradients exchanged", human_bytes(plan.exchanged_bytes()), f"in {buckets} buckets")
    table.add_row("predicted iteration", f"{plan.predicted_s:.3f} s", f"{plan.stall_s:.3f} s waiting on copies")
    return table


def layers_table(plan, graph):
    """Every node's fate in `plan` (Plan.node_decisions) with its output's bytes."""
    table = Table(title=f"what {plan.policy} does with each layer's output and parameters, batch {plan.batch}")
    for header in ("node", "type", "output", "dtype", "decision", "parameters"):
        table.add_column(header, justify="right" if header == "output" else "left", no_wrap=True)
    output = dict(plan.inputs)
    output.update((s.node, s.output) for s in plan.steps if s.kind == "forward")
    decisions, homes = plan.node_decisions(), plan.parameter_homes()
    for node, decision in decisions.items():
        b = plan.buffers[output[node]]
        table.add_row(node, graph[node].layer.type_name, human_bytes(b.nbytes), b.dtype, decision, homes.get(node, "-"))
    counts = collections.Counter(decisions.values())
    table.caption = ", ".join(f"{counts[d]} {d}" for d in ("keep", "recompute", "offload", "unsaved") if counts[d])
    return table


def policy_row(plan, budget):
    """The numbers `snrt plan` shows for one plan."""
    to_host, to_device = plan.copied_bytes()
    return {
        "policy": plan.policy,
        "peak_bytes": plan.peak_bytes,
        "arena_bytes": plan.arena_bytes,
        "peak_by_role": {r: b for r, b in plan.peak_by_role().items() if b},
        "bytes_by_dtype": plan.bytes_by_dtype(),
        "offloaded_bytes": plan.host_bytes,
        "recomputed_flops": plan.recompute_flops,
        "copied_to_host_bytes": to_host,
        "copied_to_device_bytes": to_device,
        "predicted_s": plan.predicted_s,
        "exposed_copy_s": plan.stall_s,
        "fits_budget": None if budget is None else plan.arena_bytes <= budget,
        "ranks": plan.ranks,
        "exchanged_bytes": plan.exchanged_bytes(),
    }


def run_plan(args, console):
    from snrt.scheduler.fuse import planned_graph
    from snrt.scheduler.planner import each_plan, make_plan

    config = load_config(args.config, _overrides(args))
    for flag, output in (("--save", args.save), ("--png", args.png)):
        if output and Path(output).resolve() == Path(args.config).resolve():
            raise SnrtError(f"{output}: {flag} names the network file this command reads; write the plan elsewhere")
    budget, ranks = config.memory.budget, args.ranks
    if config.train.batch % ranks:
        raise SnrtError(f"{args.config}: train.batch: the batch {config.train.batch} must split evenly over the "
                        f"{ranks} ranks (it is the global batch); choose a multiple of {ranks}")
    batch = config.train.batch // ranks  # each rank's
    backend = args.backend  # None: the layers' own workspaces and the CPU rates, the same on every machine
    limit_threads(args.threads or usable_cores())  # before planning: CPU kernels size their workspace by it
    choices, estimate = _planning_choices(backend, config.train) if backend else ({}, None)
    update = {**make_optimizer(config.train.optimizer).plan_options, "ranks": ranks,  # planned as training plans it
              "bucket_bytes": config.train.gradient_bucket, "stream_parameters": config.memory.stream_parameters,
              "precision": config.train.precision, "fuse": config.train.fuse, **choices}
    chosen = args.policy or config.memory.policy
    require_budget(chosen, budget)  # before the table's plans, which can take minutes
    here = policies.planned_first(chosen)
    # a second process plans some rows where no device is involved (CUDA does not survive a fork)
    forks = usable_cores() > 1 and (backend != "cuda" or estimate is not None)
    others = policies.planning_groups([p for p in policies.POLICIES if p not in here])
    if estimate:
        print(f"note: {estimate}", file=sys.stderr)

    def rows(names):
        return {policy: policy_row(plan, budget) for policy, plan
                in each_plan(config.graph, batch, names, budget, **update)}

    rows_of, plans = {}, {}
    with console.status("planning (kernels new to this machine are timed first)...") as status:
        theirs = None
        if others and forks:
            _choose_kernels(config.graph, batch, choices.get("kernels"))  # timed here once, not by both processes
            status.update(f"planning {', '.join(here)} here, and with a second process "
                          f"{', '.join(p for g in others for p in g)}...")
            others = Claims(others)  # each group planned by whichever process is free first
            theirs = in_a_child(lambda: {p: row for group in others for p, row in rows(group).items()})
        for policy, plan in each_plan(config.graph, batch, [p for p in policies.POLICIES if p in here], budget,
                                      **update):
            plans[policy] = plan
            rows_of[policy] = policy_row(plan, budget)
        for group in others:
            rows_of.update(rows(group))
        if theirs:
            rows_of.update(theirs())
        table = [rows_of[p] for p in policies.POLICIES]
        detail = plans.get(chosen)
        if detail is None or (budget is not None and detail.arena_bytes > budget):  # auto, or a just-in-time retry
            status.update(f"planning {chosen}...")
            detail = make_plan(config.graph, batch, chosen, budget=budget, **update)
    if args.json:
        chosen_row = policy_row(detail, budget)
        if args.layers:
            chosen_row["layers"] = detail.node_decisions()
            chosen_row["parameters"] = detail.parameter_homes()
        if args.steps:
            chosen_row["steps"] = [detail.describe_step(i) for i in range(len(detail.steps))]
        _print_json(console, {"network": config.name, "batch": batch, "ranks": ranks, "budget_bytes": budget,
                              "backend": backend, "estimate": estimate, "policies": table, "chosen": chosen_row})
    else:
        console.print(_policy_table(config, batch, budget, table))
        console.print(plan_headline(detail))
        if args.layers:
            console.print(layers_table(detail, planned_graph(config.graph, detail)))
        if args.steps:
            for i in range(len(detail.steps)):
                console.print(detail.describe_step(i), highlight=False, markup=False)
    if args.save:
        _write_output(args.save, lambda: replace_atomically(args.save, lambda partial: partial.write_text(
            detail.to_json())))
    if args.png:
        from snrt.timeline import draw_timeline  # matplotlib only when a picture is asked for

        _write_output(args.png, lambda: draw_timeline(detail, args.png, budget=budget,
                                                      title=f"{config.name}: {detail.policy}, batch {batch}"))
        if args.json:  # stdout is the JSON alone
            print(f"timeline written to {args.png}", file=sys.stderr)
        else:
            console.print(f"timeline written to {args.png}")


def _planning_choices(backend, train):
    """(the PlanOptions fields {"cost_model", "kernels"} `snrt plan --backend B` plans with, None
    or a sentence saying the plan is an estimate): the backend's own, as `snrt train`'s plan
    (runtime.backend_planning; the CPU's compiled kernels are timed where new to the machine);
    for "cuda" on a machine without a usable GPU, the CUDA cost model's default rates and the
    layers' own workspaces, since cuDNN's engines and a GPU's rates are measured on one."""
    from snrt.backends import cuda_unavailable_reason
    from snrt.runtime import backend_planning
    from snrt.scheduler import cost

    reason = cuda_unavailable_reason() if backend == "cuda" else None
    if reason:
        return {"cost_model": cost.CUDA}, (
            f"no GPU to plan for here ({reason}): an estimate of the CUDA plan, with the CUDA cost model's default "
            f"rates and the layers' own workspaces (on a GPU, cuDNN's engines and its measured rates decide them)")
    return backend_planning(backend, train.precision, train.deterministic), None


def _choose_kernels(graph, batch, kernels):
    """Have the kernel choice `kernels` (None: the layers' own) choose every layer's kernels,
    timing those new to this machine, before a second process plans beside this one: two
    processes timing kernels at once would slow each other's timings down."""
    if kernels is None:
        return
    for name, node in graph.nodes.items():
        in_shapes = graph.in_shapes(name, batch)
        for phase in (FORWARD, BACKWARD):
            kernels.workspace_bytes(node.layer, in_shapes, phase)


def _policy_table(config, batch, budget, rows):
    ranks = rows[0]["ranks"] if rows else 1
    each = f" on each of {ranks} ranks" if ranks > 1 else ""
    title = f"{config.name}: memory plans at batch {batch}{each}" + (f", budget {human_bytes(budget)}" if budget else "")
    table = Table(title=title)
    for header in ("policy", "peak", "arena", "act+grad@peak", "offloaded", "recomputed", "predicted", "stalls",
                   "fits"):
        table.add_column(header, justify="left" if header == "policy" else "right", no_wrap=True)
    for r in rows:
        at_peak = r["peak_by_role"].get("activation", 0) + r["peak_by_role"].get("gradient", 0)
        table.add_row(r["policy"], human_bytes(r["peak_bytes"]), human_bytes(r["arena_bytes"]), human_bytes(at_peak),
                      human_bytes(r["offloaded_bytes"]), f"{r['recomputed_flops'] / 1e9:.1f} GF",
                      f"{r['predicted_s']:.2f} s", f"{r['exposed_copy_s']:.3f} s",
                      {None: "-", True: "yes", False: "no"}[r["fits_budget"]])
    if budget:
        table.caption = ("each policy's plan under the budget (superneurons grows into the room it leaves, from its "
                         "own plan or offload's, whichever is faster); one "
                         "over it is the policy's own plan, and gets there with just-in-time copies and idle tensors "
                         "spilled, when it can (--policy P shows that plan)")
    return table


def _make_trainer(args, config, plan=None):
    """The Trainer of `config` (with `plan` when it was made already, by `_plan_run`), every
    thread pool capped at --threads (or the usable cores)."""
    from snrt.train import Trainer  # the trainer pulls in the data pipeline; inspect doesn't need it

    limit_threads(args.threads or usable_cores())
    return Trainer(config, backend=args.backend or default_backend(), check=getattr(args, "check", False),
                   group=getattr(args, "group", None), plan=plan)


def _plan_run(args, config):
    """The plan of the run `args` asks for, made before anything touches the disk, so that an
    error in the command (the backend, the batch, the budget) comes before one about the output
    folder."""
    from snrt.train import Trainer

    limit_threads(args.threads or usable_cores())  # before planning: CPU kernels size their workspace by it
    return Trainer.plan_for(config, backend=args.backend or default_backend(), group=args.group)


class PeerFailed(SnrtError):
    """Another rank could not start the run (it reports why); this one stops without a word."""


def run_train(args, console):
    """Train; with several ranks (mpiexec), rank 0 owns the output folder and prints, and
    every rank's set-up is agreed on before the first iteration (see first_failing_rank)."""
    group = args.group
    config = load_config(args.config, _overrides(args))
    out = Path(args.out) if args.out else Path("runs") / config.name
    console.print(summary_table(config.graph, config.train.batch))
    # a first run on a machine times the kernels of shapes it has not met (cuDNN's engines, the CPU's choices)
    with nullcontext() if args.no_progress else console.status("planning (kernels new to this machine are timed "
                                                               "first)..."):
        plan = _plan_run(args, config)
    if group.rank != 0:
        return _train_in(None, out / CHECKPOINT, args, config, plan, console)
    with RunFolder(out) as folder:
        continues = _continues(args, folder)
        elsewhere = _checkpoint_in(args.resume) if args.resume and not continues else None
        folder.prepare(resume=continues, overwrite=args.overwrite, elsewhere=elsewhere)
        return _train_in(folder, folder.checkpoint, args, config, plan, console)


def _continues(args, folder):
    """Whether the run continues the one the locked `folder` holds: --resume of its own
    checkpoint (--resume of another run's starts this folder's run from that one's)."""
    return args.resume is not None and (not args.resume or
                                        _checkpoint_in(args.resume).resolve() == folder.checkpoint.resolve())


def _train_in(folder, checkpoint, args, config, plan, console):
    """The run of `config` on `plan` in the locked `folder` (None on ranks other than 0, which
    write nothing) with its `checkpoint` path; the exit status."""
    trainer = _make_trainer(args, config, plan)
    console.print(plan_headline(trainer.plan))
    kept = policies.POLICIES.get(config.memory.policy)
    if config.memory.stream_parameters and kept is not None and not kept.frees:
        freeing = ", ".join(name for name, row in policies.POLICIES.items() if row.frees)
        console.print(f"note: policy {kept.name} keeps every tensor on the device, so the parameters are not streamed "
                      f"(memory.stream_parameters); a policy that frees streams them: {freeing} or auto")
    ranks = f"; {trainer.group.size} ranks, batch {trainer.plan.batch} each" if trainer.group.size > 1 else ""
    workers = f"; {trainer.workers} data worker{'s' if trainer.workers != 1 else ''}" if trainer.workers else ""
    console.print(f"thread pools: {describe_pools(thread_pools())} ({usable_cores()} usable cores){ranks}{workers}")
    kernels = trainer.backend.describe_kernels(trainer.executor)
    if kernels:
        console.print(kernels)
    if args.init_from:
        trainer.load_weights(args.init_from)
        console.print(f"weights from {args.init_from}")
    source = None if args.resume is None else _checkpoint_in(args.resume) if args.resume else checkpoint
    if source is not None:
        note = trainer.restore(source)
        console.print(f"resumed from {source} at iteration {trainer.iteration}" + (f"; note: {note}" if note else ""))
    if trainer.group.size > 1:
        args.started = True  # from here on, a failure of one rank ends the job (see main)
        if first_failing_rank(trainer.group, False) is not None:
            raise PeerFailed("another rank could not start")
    if folder is None:
        trainer.fit(checkpoint=checkpoint, checkpoint_every=args.checkpoint_every)
        return 128 + int(trainer.stop_reason) if isinstance(trainer.stop_reason, int) else 0
    if args.resume is not None and trainer.iteration >= config.train.iterations:  # the folder stays as it is
        console.print(f"nothing to do: the run of {source} is at iteration {trainer.iteration} already, and "
                      f"train.iterations is {config.train.iterations}; ask for more with --iterations ({folder.path} "
                      "is left as it was)")
        return 0
    if args.overwrite:  # only now: a run that cannot start leaves the earlier one whole (prepare: not resumed)
        folder.start_over()
    if args.resume is not None:
        _write_output(folder.metrics, lambda: folder.truncate_metrics(trainer.iteration),
                      f"the run is as it was, at iteration {trainer.iteration}")
    out = folder.path
    _write_run_file(out / "config.yaml", config_to_yaml(config),
                    f"nothing was trained yet (iteration {trainer.iteration})")
    if getattr(trainer.train_set, "class_names", ()):  # an image folder: which class index is which folder
        _write_run_file(out / "classes.json", json.dumps(dict(enumerate(trainer.train_set.class_names)), indent=2),
                        f"nothing was trained yet (iteration {trainer.iteration})")
    history = _fit_with_metrics(trainer, folder, checkpoint, args, console)
    if trainer.backend.replay_unsupported_reason() is None:  # a backend that replays: did it?
        console.print(trainer.executor.describe_replay())
    summary = _summary(trainer, history, checkpoint)
    if trainer.stop_requested:
        console.print(f"interrupted at iteration {trainer.iteration}; checkpoint saved to {checkpoint}; "
                      f"continue with --resume")
    elif not args.no_eval:
        summary.update(_heldout(trainer, console))
    kept = f"the checkpoint of iteration {trainer.iteration} is saved to {checkpoint}"
    _write_run_file(out / "summary.json", json.dumps(summary, indent=2) + "\n", kept)
    if history:
        from snrt.timeline import draw_timeline  # matplotlib only once there is something to draw

        _write_output(out / "memory.png", lambda: draw_timeline(
            trainer.plan, out / "memory.png", budget=config.memory.budget, measured=trainer.executor.measured_bytes,
            title=f"{config.name}: {trainer.plan.policy}, batch {trainer.batch} (measured dashed)"), kept)
        _draw_run(out, kept)
    console.print(_summary_table(summary))
    return 128 + int(trainer.stop_reason) if trainer.stop_requested else 0  # the signal's conventional status


def _draw_run(folder, kept):
    """RUN/metrics.png of the run in `folder` (see snrt/report.py)."""
    from snrt.report import draw_metrics, load_run  # matplotlib only once there is something to draw

    _write_output(folder / "metrics.png", lambda: draw_metrics([load_run(folder)], folder / "metrics.png"), kept)


def run_report(args, console):
    """Redraw each run's metrics.png (several runs: one picture side by side) and print a table."""
    from snrt.report import display_name, draw_metrics, load_run, report_rows

    runs = [load_run(folder) for folder in args.runs]
    names = [r.name for r in runs]
    for i, name in enumerate(names):  # two folders of the same name: tell them apart by their path
        if names.count(name) > 1:
            runs[i].name = display_name(args.runs[i])
    path = Path(args.png) if args.png else (Path(args.runs[0]) / "metrics.png" if len(runs) == 1 else None)
    if path is None:
        raise SnrtError("several runs are drawn into one picture: name it with --png FILE")
    _write_output(path, lambda: draw_metrics(runs, path))
    rows = report_rows(runs)
    if args.json:
        _print_json(console, {"runs": rows, "png": str(path)})
        return 0
    table = Table(title="runs")
    for header in ("run", "iterations", "final loss", "held-out accuracy", "images/s", "data wait", "peak"):
        table.add_column(header, justify="left" if header == "run" else "right", no_wrap=True)
    for r in rows:
        table.add_row(r["run"], str(r["iterations"]), f"{r['final_loss']:.4f}",
                      "-" if r["heldout_accuracy"] is None else f"{r['heldout_accuracy']:.4f}",
                      "-" if r["images_per_s"] is None else f"{r['images_per_s']:.1f}",
                      "-" if r["data_wait_s"] is None else f"{r['data_wait_s'] * 1e3:.1f} ms",
                      "-" if r["peak_device_bytes"] is None else human_bytes(r["peak_device_bytes"]))
    console.print(table)
    console.print(f"written {path}")
    return 0


def _heldout(trainer, console):
    """The summary's held-out loss and accuracy; a loss that is not finite is said in one line
    with its likely cause, and recorded as no result (null) with that line beside it."""
    loss, accuracy = trainer.evaluate()
    if math.isfinite(loss):
        return {"heldout_loss": loss, "heldout_accuracy": accuracy}
    note = trainer.nonfinite_evaluation(loss)
    console.print(f"note: {note}")
    return {"heldout_loss": None, "heldout_accuracy": None, "heldout_note": note}


def _write_run_file(path, text, kept):
    """Write one of the run folder's small files, atomically (an earlier version stays whole
    until the new one is); a failure names the file and says what was kept."""
    _write_output(path, lambda: replace_atomically(path, lambda partial: partial.write_text(text)), kept)


def _print_json(console, value):
    """Print `value` as JSON on `console`'s file, the whole of a --json command's standard
    output. A reader that went away (`| head`) ends the command quietly, as the console does
    when it prints a table (status 1)."""
    try:
        print(json.dumps(value, indent=2), file=console.file, flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nor at exit: nothing reaches it
        raise SystemExit(1) from None


def _write_output(path, write, kept=None):
    """`write()`'s result; it writes the file `path`, and an OSError is the one-line error of a
    file that cannot be written, saying what was `kept` of the run."""
    try:
        return write()
    except OSError as e:
        raise _cannot_write(path, e, kept) from None


def _cannot_write(path, error, kept=None):
    """The SnrtError of a file `path` that could not be written (OSError `error`), saying what
    was `kept` of the run."""
    return SnrtError(f"{path}: cannot write ({error.strerror or error})" + (f"; {kept}" if kept else ""))


def _fit_with_metrics(trainer, folder, checkpoint, args, console):
    """Train, one line of metrics.jsonl and one progress update per iteration; the history.

    A metrics line that cannot be written stops the run after that iteration with its
    checkpoint saved; a checkpoint that cannot be written ends it too. Either way the error
    names the file, the iteration the run reached and what was kept."""
    total = trainer.config.train.iterations
    failure = []  # the metrics file's write error: the run stops, its checkpoint is still saved
    metrics_file = folder.open_metrics()

    def metrics_failed(error):
        failure.append(f"{folder.metrics}: cannot write metrics ({error.strerror or error})")
    try:
        with _progress(console, args.no_progress) as progress:
            task = progress.add_task("train", total=total, completed=trainer.iteration, status="")

            def report(m):
                try:
                    metrics_file.write(json.dumps(dataclasses.asdict(m)) + "\n")
                    metrics_file.flush()
                except OSError as e:
                    metrics_failed(e)
                    trainer.stop_reason = trainer.stop_reason or "metrics write error"
                status = (f"loss {m.loss:.4f}  acc {m.accuracy:.3f}  {m.images_per_s:.1f} img/s  "
                          f"data {m.data_wait_s * 1e3:.1f} ms  device {human_bytes(m.peak_device_bytes)}")
                progress.update(task, completed=m.iteration + 1, status=status)
                if args.no_progress:
                    console.print(f"iteration {m.iteration + 1}/{total}  {status}")

            try:
                history = trainer.fit(on_iteration=report, checkpoint=checkpoint,
                                      checkpoint_every=args.checkpoint_every)
            except NonFiniteError:
                raise
            except CheckpointError as e:
                reached = f"the run had reached iteration {trainer.iteration}"
                raise SnrtError("; ".join([*failure[:1], str(e), reached])) from None
    finally:
        try:
            metrics_file.close()  # lines its flush could not write are the failure already recorded
        except OSError as e:
            metrics_failed(e)
    if failure:
        raise SnrtError(f"{failure[0]}; stopped at iteration {trainer.iteration} with its checkpoint saved to "
                        f"{checkpoint}; free some space and continue with --resume")
    return history


def _summary(trainer, history, checkpoint):
    timed = history[1:] or history  # the first iteration includes one-off warm-up costs
    return {
        "network": trainer.config.name,
        "iterations": trainer.iteration,
        "batch": trainer.batch,
        "policy": trainer.config.memory.policy,
        "precision": trainer.config.train.precision,
        **({"loss_scale": trainer.loss_scale.scale, "skipped_updates": sum(m.skipped for m in history)}
           if trainer.loss_scale else {}),
        **({"skipped_images": len(trainer.train_set.skipped)} if getattr(trainer.train_set, "skipped", ()) else {}),
        "final_loss": history[-1].loss if history else None,
        "mean_images_per_s": sum(m.images_per_s for m in timed) / len(timed) if timed else None,
        "predicted_peak_device_bytes": trainer.plan.peak_bytes,
        "measured_peak_device_bytes": trainer.backend.arena.peak_bytes,
        "predicted_iteration_s": trainer.plan.predicted_s,
        "thread_pools": describe_pools(thread_pools()),
        "data_workers": trainer.workers,
        "checkpoint": str(checkpoint),
    }


def _summary_table(summary):
    table = Table(title="summary")
    table.add_column("")
    table.add_column("value", justify="right")
    for key, value in summary.items():
        if key == "heldout_note":
            continue  # printed above the table
        if value is None and key.startswith("heldout"):
            value = "not finite"
        elif isinstance(value, float):
            value = f"{value:.4f}"
        elif key.endswith("_bytes"):
            value = human_bytes(value)
        table.add_row(key.replace("_", " "), str(value))
    return table


def _progress(console, disabled):
    return Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
        TextColumn("{task.fields[status]}"), console=console, disable=disabled,
    )


def run_tune(args, console):
    from snrt import tune
    from snrt.scheduler import cost

    config = load_config(args.config, _overrides(args))
    budget = config.memory.budget
    if budget is None:
        raise SnrtError(f"{args.config}: memory.budget: snrt tune needs a budget: pass --budget, e.g. --budget 12GiB")
    out = args.out or f"{config.name}.tuned.yaml"
    tune.check_destination(out, args.overwrite)  # before the sweep, which can take minutes
    options = {**make_optimizer(config.train.optimizer).plan_options, "stream_parameters": config.memory.stream_parameters,
               "cost_model": {"cpu": cost.CPU, "cuda": cost.CUDA}[args.device], "precision": config.train.precision,
               "fuse": config.train.fuse}
    points = []
    with console.status("planning...") as status:
        def planning(policy, batch):
            status.update(f"planning {policy} at batch {batch}...")
        for policy in policies.POLICIES:
            points += tune.sweep(config.graph, policy, budget, args.max_batch, on_plan=planning, **options)
    if not points:
        raise SnrtError(f"{args.config}: memory.budget: no policy fits batch 1 in {human_bytes(budget)}; "
                        f"`snrt plan {args.config} --batch 1` shows what each needs")
    best = tune.recommend(points)
    tuned = tune.tuned_config(config, best, budget)
    scaled_lr, range_test = tuned.train.optimizer.lr, None
    if args.lr_range:
        range_test = _range_test(args, tuned, console)
        tuned = with_settings(tuned, train={"optimizer": {"lr": min(scaled_lr, range_test.suggested_lr)}})
    measured = _measure(args, tuned) if args.measure else None
    path = _write_output(out, lambda: tune.write_config(tuned, out, args.overwrite))
    if args.png:
        _write_output(args.png, lambda: tune.draw_throughput(points, args.png, f"{config.name}: predicted images/s in "
                                                                               f"{human_bytes(budget)}"))
        if range_test:
            lr_png = Path(args.png).with_suffix(".lr.png")
            _write_output(lr_png, lambda: tune.draw_range_test(range_test, lr_png, f"{config.name}: learning-rate "
                                                                                   f"range test at batch {best.batch}"))
    report = {"network": config.name, "budget_bytes": budget, "device_cost_model": args.device,
              "largest_batch": tune.largest(points),
              "points": [{**dataclasses.asdict(p), "images_per_s": p.images_per_s} for p in points],
              "recommended": {"policy": best.policy, "batch": best.batch, "lr": tuned.train.optimizer.lr,
                              "warmup": tuned.train.schedule.warmup, "predicted_images_per_s": best.images_per_s,
                              "measured_images_per_s": measured, "scaled_lr": scaled_lr},
              "lr_range": None if range_test is None else {
                  "lrs": range_test.lrs, "losses": range_test.losses, "suggested_lr": range_test.suggested_lr},
              "config": str(path)}
    if args.json:
        _print_json(console, report)
        return 0
    console.print(_tune_table(config, budget, points))
    lr_note = f"lr {tuned.train.optimizer.lr:g} (from {config.train.optimizer.lr:g} at batch {config.train.batch}, " \
              f"linear scaling" + (f" to {scaled_lr:g}, capped by the range test's {range_test.suggested_lr:.3g}"
                                   if range_test else "") + f"), warm-up {tuned.train.schedule.warmup} iterations"
    console.print(Text(f"recommended: {best.policy} at batch {best.batch}, {best.images_per_s:.1f} images/s predicted"
                       + (f", {measured:.1f} measured" if measured else "") + f"; {lr_note}"))
    console.print(Text(f"tuned config written to {path}: snrt train {path}"))
    return 0


def _range_test(args, config, console):
    """The learning-rate range test of `config` (the tuned one) on its own data."""
    from snrt import tune

    trainer = _make_trainer(argparse.Namespace(threads=None, backend=None, check=False), config)
    try:
        with console.status("learning-rate range test...") as status:
            def show(m):
                status.update(f"learning-rate range test: iteration {m.iteration + 1}/{args.lr_range}, "
                              f"lr {m.lr:.3g}, loss {m.loss:.4f}")
            test = tune.range_test(trainer, config.train.optimizer.lr, args.lr_range, on_iteration=show)
    finally:
        trainer.backend.close()
    _raise_if_signalled(trainer)
    return test


def _measure(args, config):
    """Mean images/s of 3 iterations of `config` on synthetic data (the first left out)."""
    config = with_settings(config, train={"iterations": 3, "data": {"type": "synthetic",
                                                                    "samples": 2 * config.train.batch}})
    trainer = _make_trainer(argparse.Namespace(threads=None, backend=None, check=False), config)
    try:
        history = trainer.fit()
    finally:
        trainer.backend.close()
    _raise_if_signalled(trainer)
    timed = history[1:] or history
    return sum(m.images_per_s for m in timed) / len(timed)


def _raise_if_signalled(trainer):
    """Stop the command as the signal that stopped `trainer`'s training loop early would have
    (its handlers turned SIGINT and SIGTERM into a request to stop): a test or measurement cut
    short is not a result to write."""
    if trainer.stop_reason == signal.SIGINT:
        raise KeyboardInterrupt
    if trainer.stop_reason == signal.SIGTERM:
        raise Terminated


def _tune_table(config, budget, points):
    table = Table(title=f"{config.name}: batches that fit {human_bytes(budget)}, predicted images/s")
    for header in ("policy", "largest batch", "arena there", "best images/s", "at batch"):
        table.add_column(header, justify="left" if header == "policy" else "right", no_wrap=True)
    for policy in policies.POLICIES:
        mine = [p for p in points if p.policy == policy]
        if not mine:
            table.add_row(policy, "none fits", "", "", "")
            continue
        top, fastest = max(mine, key=lambda p: p.batch), max(mine, key=lambda p: p.images_per_s)
        table.add_row(policy, str(top.batch), human_bytes(top.arena_bytes), f"{fastest.images_per_s:.1f}",
                      str(fastest.batch))
    return table


EXPORTED = {"safetensors": "weights.safetensors", "torch": "weights.pt", "onnx": "model.onnx"}  # format: file


def run_export(args, console):
    """Write a checkpoint's parameters and statistics (not its optimizer state) as weights, or
    with the network of the run (its config.yaml) as an ONNX model: atomically, and never over
    the checkpoint."""
    checkpoint = _checkpoint_in(args.source)
    arrays, meta = load_checkpoint(checkpoint)
    weights = {key: value for key, value in arrays.items() if key.count(":") == 1}  # node:name; not node:name:state
    out = Path(args.out) if args.out else checkpoint.with_name(EXPORTED[args.format])
    if out.resolve() == checkpoint.resolve():
        raise SnrtError(f"{out}: is the checkpoint being exported; choose another --out")
    if out.resolve() in {checkpoint.resolve().with_name(name) for name in RUN_FILES}:
        raise SnrtError(f"{out}: is a file of the run being exported ({', '.join(RUN_FILES)}); choose another --out")
    if args.names_like:
        if args.format == "onnx":
            raise SnrtError("--names-like renames weights files (safetensors, torch); an ONNX model keeps snrt's names")
        from snrt.weights import named_like

        weights = named_like(weights, args.names_like)
    try:
        if args.format == "onnx":
            from snrt.onnx_export import to_onnx

            network = checkpoint.with_name("config.yaml")
            if not network.is_file():
                raise SnrtError(f"{network}: not found; ONNX export needs the network, which snrt train writes "
                                "there beside the checkpoint")
            graph = load_config(network).graph
            if meta.get("graph", graph.fingerprint()) != graph.fingerprint():
                raise SnrtError(f"{checkpoint}: made for another network (structure {meta['graph']}) than {network} "
                                f"describes ({graph.name!r}, structure {graph.fingerprint()}): its layers, options or "
                                "connections differ; export the checkpoint beside the config.yaml of its run")
            model = to_onnx(graph, {tuple(k.split(":")): v for k, v in weights.items()}).SerializeToString()
            replace_atomically(out, lambda partial: partial.write_bytes(model))
        else:
            from snrt.weights import export

            export(weights, out, args.format)
    except OSError as e:
        raise _cannot_write(out, e) from None
    console.print(f"{len(weights)} tensors of {checkpoint} written to {out}")
    return 0


def _checkpoint_in(path):
    """The checkpoint `path` names: a checkpoint file, or a run folder's checkpoint."""
    path = Path(path)
    return path / CHECKPOINT if path.is_dir() else path


def run_eval(args, console):
    config = load_config(args.config, _overrides(args))
    trainer = _make_trainer(args, config)
    checkpoint = _checkpoint_in(args.checkpoint)
    trainer.restore(checkpoint, optimizer_state=False)  # evaluated: its optimizer is not needed
    loss, accuracy = trainer.evaluate()
    if not math.isfinite(loss):
        raise SnrtError(f"{checkpoint}: {trainer.nonfinite_evaluation(loss)}")
    console.print(f"{config.name} at iteration {trainer.iteration}: held-out loss {loss:.4f}, accuracy {accuracy:.4f} "
                  f"({len(trainer.heldout_set.y)} samples)")


class StandardOutput:
    """The command's standard output `stream`, as the console and --json write it: an error
    writing it (a full disk under a redirection) names it, as a file's error does."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text):
        return self._named(self.stream.write, text)

    def flush(self):
        return self._named(self.stream.flush)

    def __getattr__(self, name):  # isatty, fileno, encoding: the stream's
        return getattr(self.stream, name)

    @staticmethod
    def _named(call, *args):
        try:
            return call(*args)
        except OSError as e:
            e.filename = e.filename or "standard output"
            raise


class Terminated(BaseException):
    """SIGTERM outside the training loop (which handles it itself): stop quietly."""


def _terminate(signum, frame):
    raise Terminated()


def main(argv=None):
    """The `snrt` command; returns the exit status: 0, 2 for an error the user can fix, 128 +
    the signal's number when SIGINT or SIGTERM stopped it (a training run saves its checkpoint
    first). User text (paths, names) is never read as console markup.

    Started by mpiexec as one of several processes, `train` trains data parallel (every rank
    one part of each batch; rank 0 prints and writes); the other commands run on rank 0 only.
    """
    args = build_parser().parse_args(argv)
    args.group, args.started = Solo(), False
    leader = launcher_rank() == 0
    if launcher_size() > 1 and args.command != "train" and not leader:
        return 0
    console = Console(file=StandardOutput(sys.stdout), markup=False, quiet=not leader)
    if not console.is_terminal:  # logs and pipes: wide enough for the tables
        console = Console(file=console.file, width=120, markup=False, quiet=not leader)
    previous = {}
    if threading.current_thread() is threading.main_thread():  # the training loop installs its own meanwhile
        previous = {signal.SIGINT: signal.signal(signal.SIGINT, signal.default_int_handler),
                    signal.SIGTERM: signal.signal(signal.SIGTERM, _terminate)}
    try:
        if args.command == "train":
            args.group = world()
        return args.run(args, console) or 0
    except (SnrtError, OSError, MemoryError, KeyboardInterrupt, Terminated) as e:
        message, status = _describe(e, args)
        _report(args, e, message, status, leader)
        return status
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _describe(error, args):
    """(message, exit status) for an error that ends the command."""
    if isinstance(error, BudgetError):  # the planner knows no file: name the one whose budget it is
        return f"{args.config}: memory.budget: {error}", 2
    if isinstance(error, PrecisionError):  # nor does the runtime: name the file whose precision it is
        return f"{args.config}: {error}", 2
    if isinstance(error, MemoryError) or isinstance(error, OSError) and error.errno == errno.ENOMEM:
        return ("not enough memory for this run: lower --batch or --image-size, or shrink the device footprint "
                "with --policy and --budget (snrt plan shows each policy's peak)"), 2
    if isinstance(error, OSError):  # a file the run needs or writes: named, with the system's reason
        return f"{error.filename + ': ' if error.filename else ''}{error.strerror or error}", 2
    if isinstance(error, KeyboardInterrupt):
        return "interrupted", 128 + signal.SIGINT
    if isinstance(error, Terminated):
        return "terminated", 128 + signal.SIGTERM
    return str(error), 2


def _report(args, error, message, status, leader):
    """Print `message` once for the whole job. Alone: print it. With several ranks: a failed
    set-up is agreed on first and told by the lowest failing rank; a divergence (every rank
    sees the same loss) by rank 0; any other failure once training started by the rank it
    happened on, which then ends every rank (MPI_Abort) so that none waits for it forever."""
    group = args.group
    if group.size == 1:
        if leader or launcher_size() == 1:
            _error(message)
        return
    if isinstance(error, PeerFailed):
        return
    if not args.started:
        if first_failing_rank(group, True) == group.rank:
            _error(message if group.rank == 0 else f"rank {group.rank}: {message}")
        return
    if isinstance(error, DivergenceError):
        if group.rank == 0:
            _error(message)
        return
    _error(f"rank {group.rank} of {group.size}: {message}; ending every rank")
    sys.stderr.flush()
    group.abort(status)


def _error(message):
    # one line, however long: the terminal folds it, and a path in it stays whole for copying
    Console(stderr=True, markup=False, highlight=False).print(Text.assemble(("error:", "bold red"), " ", message),
                                                              soft_wrap=True)


if __name__ == "__main__":
    sys.exit(main())
