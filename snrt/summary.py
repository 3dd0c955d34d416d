"""Network summaries: per-type totals of layers, parameters, FLOPs and activation bytes."""

import io
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table


@dataclass
class TypeTotals:
    """Totals over every node of one layer type, at one batch size."""

    type: str
    layers: int = 0
    params: int = 0
    forward_flops: int = 0
    activation_bytes: int = 0


def human_bytes(n):
    """1536 -> '1.5 KiB'."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def human_count(n):
    """25557032 -> '25.56M'."""
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def totals_by_type(rows):
    """Aggregate LayerRows by layer type, in order of first appearance."""
    by_type = {}
    for row in rows:
        t = by_type.setdefault(row.type, TypeTotals(row.type))
        t.layers += 1
        t.params += row.params
        t.forward_flops += row.forward_flops
        t.activation_bytes += row.activation_bytes
    return list(by_type.values())


def summary_table(graph, batch):
    """A rich Table of the graph's layers by type, with a total row."""
    rows = graph.rows(batch)
    per_image_flops = {t.type: t.forward_flops for t in totals_by_type(graph.rows(1))}
    table = Table(title=f"{graph.name}: {len(graph)} layers, batch {batch}")
    table.add_column("type", no_wrap=True)
    for header in ("layers", "params", "FLOPs/img fwd", "activations"):
        table.add_column(header, justify="right", no_wrap=True)
    groups = totals_by_type(rows)
    for t in groups:
        table.add_row(
            t.type, str(t.layers), human_count(t.params),
            human_count(per_image_flops[t.type]), human_bytes(t.activation_bytes),
        )
    table.add_section()
    table.add_row(
        "total", str(len(rows)), human_count(sum(t.params for t in groups)),
        human_count(sum(per_image_flops.values())), human_bytes(sum(t.activation_bytes for t in groups)),
    )
    return table


def format_summary(graph, batch):
    """The summary table rendered as plain text."""
    console = Console(file=io.StringIO(), width=100, color_system=None)
    console.print(summary_table(graph, batch))
    return console.file.getvalue()
