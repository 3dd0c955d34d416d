"""The planner makes the plans it made when results/plan_digests.jsonl was written
(scripts/plan_digests.py): a small part of that grid, recomputed. A change that alters a plan
on purpose regenerates the file with the script and says why in its commit."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from plan_digests import digests_of  # noqa: E402

RECORDED = ROOT / "results" / "plan_digests.jsonl"
SAMPLE = [  # (network, option labels): every budget, call and policy of each
    ("lenet", None),
    ("cifar_resnet20", {"resident,sgd,ranks=1", "streamed,adam,ranks=2"}),
    ("unet", {"resident,adam,ranks=1"}),
]


@pytest.fixture(scope="module")
def recorded():
    return {row["key"]: row["digest"] for row in map(json.loads, RECORDED.read_text().splitlines())}


@pytest.mark.parametrize("network,labels", SAMPLE, ids=[network for network, _ in SAMPLE])
def test_plans_are_the_recorded_ones(recorded, network, labels):
    computed = dict(digests_of(network, labels))
    assert len(computed) > 50
    missing = sorted(set(computed) - set(recorded))
    assert not missing, f"not in {RECORDED.name}: {missing[:5]}"
    differ = sorted(key for key, value in computed.items() if recorded[key] != value)
    assert not differ, f"{len(differ)} plans differ from {RECORDED.name}, first {differ[:5]}"
