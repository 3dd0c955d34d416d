"""The plan-digest harness: sha256 of `plan.to_json()` for every zoo network under every
policy, budget and planning option, so that a change to the planner's code that must not change
its plans (a refactoring, a speed-up) is checked against every plan it makes, errors included.

The grid, per network of configs/ at its file's batch: the options {resident, streamed
parameters} x {SGD with momentum, Adam} x {1 rank, 2 ranks (half the batch each)}, and for each
the budgets {none, 0.5, 0.9, 1.2 x the smallest arena of the fixed policies' own plans}; at
each, `make_plan` for every policy and `auto`, `each_plan` over the fixed policies, and
`plan_within` for each fixed policy (under a budget). A call that raises is digested by its
error's type and message. Results are JSON lines {"key", "digest"}, one per call, written as
they come (a long run keeps what it finished).

    python scripts/plan_digests.py                                   # the whole zoo -> results/plan_digests.jsonl
    python scripts/plan_digests.py --configs lenet cifar_resnet20 --out /tmp/d.jsonl
    python scripts/plan_digests.py --check results/plan_digests.jsonl  # recompute those keys, compare

tests/scheduler/test_plan_digests.py recomputes a small part of the committed file.
"""

import argparse
import hashlib
import json
import multiprocessing
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import snrt  # noqa: E402
from snrt.optim import Adam, SGD  # noqa: E402
from snrt.scheduler.planner import each_plan, make_plan, plan_within  # noqa: E402
from snrt.scheduler.policies import POLICIES  # noqa: E402

OPTIMIZERS = {"sgd": SGD(momentum=0.9), "adam": Adam()}
BUDGET_FRACTIONS = (None, 0.5, 0.9, 1.2)
# the networks whose grid takes longest (minutes to hours on 2 cores), digested last
SLOWEST = ("resnet101", "inceptionv4", "resnet152", "cifar_resnet164", "resnet2500")


def option_grid():
    """(label, make_plan keywords, ranks) of every planning option of the grid."""
    for streamed in (False, True):
        for name, optimizer in OPTIMIZERS.items():
            for ranks in (1, 2):
                label = f"{'streamed' if streamed else 'resident'},{name},ranks={ranks}"
                yield label, dict(stream_parameters=streamed, ranks=ranks, **optimizer.plan_options), ranks


def digest(call):
    """sha256 of what `call()` returns (a Plan's JSON) or of the error it raises."""
    try:
        text = call().to_json()
    except Exception as error:  # BudgetError and friends are results too
        text = f"{type(error).__name__}: {error}"
    return hashlib.sha256(text.encode()).hexdigest()


def digests_of(config_name, labels=None):
    """[(key, digest)] of network `config_name` (configs/NAME.yaml) over the grid, or over the
    options whose label is in `labels`."""
    config = snrt.load_config(ROOT / "configs" / f"{config_name}.yaml")
    graph = config.graph
    out = []
    for label, options, ranks in option_grid():
        if labels is not None and label not in labels:
            continue
        batch = max(1, config.train.batch // ranks)
        own = [make_plan(graph, batch, policy, **options).arena_bytes for policy in POLICIES]
        for fraction in BUDGET_FRACTIONS:
            budget = None if fraction is None else int(min(own) * fraction)
            prefix = f"{config_name}|{label}|budget={fraction}"
            for policy in (*POLICIES, "auto"):
                out.append((f"{prefix}|make_plan|{policy}",
                            digest(lambda: make_plan(graph, batch, policy, budget=budget, **options))))
            try:
                for policy, plan in each_plan(graph, batch, POLICIES, budget=budget, **options):
                    out.append((f"{prefix}|each_plan|{policy}", digest(lambda: plan)))
            except Exception as error:
                out.append((f"{prefix}|each_plan", digest(lambda: _raise(error))))
            if budget is not None:
                for policy in POLICIES:
                    out.append((f"{prefix}|plan_within|{policy}",
                                digest(lambda: plan_within(graph, batch, policy, budget, **options))))
    return out


def _raise(error):
    raise error


def _network(name):
    start = time.perf_counter()
    return name, digests_of(name), time.perf_counter() - start


def run(names, out, processes):
    """Digest every network in `names` (in `processes` processes) into the JSON-lines file `out`."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as f, multiprocessing.Pool(processes) as pool:
        for name, rows, seconds in pool.imap_unordered(_network, names):
            for key, value in rows:
                f.write(json.dumps({"key": key, "digest": value}) + "\n")
            f.flush()
            print(f"{name:20s} {len(rows):5d} digests in {seconds:7.1f} s", flush=True)


def check(path):
    """Recompute every network and option of the file `path`; print the keys that differ."""
    recorded = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        recorded[row["key"]] = row["digest"]
    wanted = {}
    for key in recorded:
        network, label = key.split("|")[:2]
        wanted.setdefault(network, set()).add(label)
    differ = 0
    for network, labels in wanted.items():
        for key, value in digests_of(network, labels):
            if recorded.get(key) != value:
                differ += 1
                print(f"differs: {key}")
    print(f"{len(recorded)} recorded digests, {differ} differ")
    return differ == 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=None, help="network names of configs/ (default: all)")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "plan_digests.jsonl")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--check", type=Path, default=None, help="a digest file to recompute and compare")
    args = parser.parse_args()
    if args.check:
        sys.exit(0 if check(args.check) else 1)
    names = args.configs or sorted(p.stem for p in (ROOT / "configs").glob("*.yaml"))
    names.sort(key=lambda name: SLOWEST.index(name) if name in SLOWEST else -1)  # a long run keeps the most
    run(names, args.out, args.processes)


if __name__ == "__main__":
    main()
