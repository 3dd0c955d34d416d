"""Gradients that pass through a layer unchanged (Layer.passes_gradient: Add, Identity) share
its output gradient's buffer where no later contribution can reach another owner before it is
read (snrt/scheduler/order.py); the training tests check the values (PASS_THROUGH against
PyTorch and bit-identical under every policy)."""

from pathlib import Path

import snrt
from snrt.scheduler.order import build_iteration
from snrt.scheduler.plan import Backward
from tests.test_train import PASS_THROUGH

ROOT = Path(__file__).resolve().parents[2]


def _targets(iteration, graph, node):
    """{input node: the buffer its gradient goes to} of `node`'s backward step, and the step."""
    step = next(s for s in iteration.steps if isinstance(s, Backward) and s.node == node)
    return {source: g[1] if g[1] >= 0 else g[0] for source, g in zip(graph.nodes[node].inputs, step.grad_inputs)}, step


def test_a_residual_add_hands_its_gradient_to_both_branches_without_a_copy():
    graph = snrt.load_config(ROOT / "configs" / "cifar_resnet20.yaml").graph
    iteration = build_iteration(graph, 2)
    adds = [name for name, node in graph.nodes.items() if node.layer.type_name == "Add"]
    assert len(adds) == 9
    for add in adds:
        targets, step = _targets(iteration, graph, add)
        assert set(targets.values()) == {step.grad_output}, add  # the body's, the skip's: gy itself


def test_owners_that_would_see_each_others_later_contributions_keep_their_own_buffers():
    """PASS_THROUGH's 'again' shares its gradient with 'thrice' and 'i' (i's later contribution,
    from 'twice', comes after thrice's step reads it); at 'thrice', 'r' (read three times, so
    added to within the step) and 'twice' (read again by 'bn') would each write into the buffer
    before 'i' reads it: both get buffers of their own. At 'twice', 'c' takes over, and 'i',
    already written, gets a partial: gy changes in that step (c's second contribution)."""
    graph = snrt.load_config(PASS_THROUGH).graph
    iteration = build_iteration(graph, 2)
    again, step = _targets(iteration, graph, "again")
    assert set(again.values()) == {step.grad_output}
    thrice, step = _targets(iteration, graph, "thrice")
    assert step.grad_output == again["i"]
    assert thrice["r"] != step.grad_output and thrice["twice"] != step.grad_output
    _, step = _targets(iteration, graph, "twice")
    grad_inputs = dict(zip(graph.nodes["twice"].inputs, step.grad_inputs))
    assert grad_inputs["i"][1] not in (-1, step.grad_output)  # a partial buffer, not gy
