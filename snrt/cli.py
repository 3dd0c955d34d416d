"""The `snrt` command: inspect (more subcommands arrive with the trainer and the planner)."""

import argparse
import json
import sys

from rich.console import Console

from snrt.config import load_config
from snrt.errors import SnrtError
from snrt.summary import summary_table, totals_by_type


def _positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text}")
    return value


def build_parser():
    parser = argparse.ArgumentParser(prog="snrt", description="Train networks larger than device memory.")
    commands = parser.add_subparsers(dest="command", required=True)
    inspect = commands.add_parser("inspect", help="summarise a network: layers, parameters, FLOPs, activation bytes")
    inspect.add_argument("config", help="network YAML file, e.g. configs/resnet50.yaml")
    inspect.add_argument("--batch", type=_positive_int, help="batch size for activation bytes (default: the file's train.batch)")
    inspect.add_argument("--json", action="store_true", help="print machine-readable JSON instead of a table")
    inspect.add_argument("--layers", action="store_true", help="list every node, not only totals by type")
    inspect.set_defaults(run=run_inspect)
    return parser


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
        print(json.dumps(inspect_report(config, batch), indent=2))
        return
    if args.layers:
        for r in config.graph.rows(batch):
            console.print(f"{r.name:40s} {r.type:20s} {str(list(r.shape)):20s} params={r.params}")
    console.print(summary_table(config.graph, batch))


def main(argv=None):
    args = build_parser().parse_args(argv)
    console = Console()
    try:
        args.run(args, console)
    except SnrtError as e:
        Console(stderr=True).print(f"[bold red]error:[/] {e}", highlight=False, markup=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
