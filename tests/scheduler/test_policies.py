"""The policy table is the one description of the policies: the planner does what a row says,
and the config layer and the command line offer exactly its names."""

import pytest
from hypothesis import HealthCheck, given, settings

import snrt
from snrt.cli import build_parser
from snrt.config import with_settings
from snrt.scheduler.planner import make_plan
from snrt.scheduler.policies import AUTO, CHOICES, POLICIES, policy_named
from snrt.scheduler.verify import verify_plan
from tests.scheduler.graphs import build, graph_recipes
from tests.test_train import SMALL_RESNET


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph_recipes())
def test_the_planner_does_what_each_row_says(recipe):
    graph = build(recipe)
    for policy in POLICIES.values():
        kinds = {step.kind for step in make_plan(graph, 2, policy.name).steps}
        assert ("free" in kinds) == policy.frees, policy
        assert ("offload" in kinds) <= policy.offloads, policy  # a graph may have nothing to offload
        assert ("recompute" in kinds) <= policy.recomputes, policy


def test_on_a_resnet_every_row_shows_its_passes():
    graph = snrt.load_config(SMALL_RESNET).graph
    for policy in POLICIES.values():
        kinds = {step.kind for step in make_plan(graph, 4, policy.name).steps}
        assert (("free" in kinds), ("offload" in kinds), ("recompute" in kinds)) == \
            (policy.frees, policy.offloads, policy.recomputes), policy


def test_a_capped_policy_never_plans_more_than_its_cap():
    graph = snrt.load_config(SMALL_RESNET).graph
    for policy in POLICIES.values():
        if policy.capped_by:
            assert make_plan(graph, 4, policy.name).arena_bytes <= make_plan(graph, 4, policy.capped_by).arena_bytes


def test_config_and_command_line_offer_the_table_names():
    config = snrt.load_config(SMALL_RESNET)
    for name in CHOICES:
        assert with_settings(config, memory={"policy": name}).memory.policy == name
    with pytest.raises(snrt.ConfigError, match="memory.policy: expected one of none, liveness"):
        with_settings(config, memory={"policy": "everything"})
    for command in ("train", "plan"):
        args = build_parser().parse_args([command, "x.yaml", "--policy", "superneurons"])
        assert args.policy == "superneurons"
        with pytest.raises(SystemExit):
            build_parser().parse_args([command, "x.yaml", "--policy", "everything"])
    assert AUTO in CHOICES and AUTO not in POLICIES


def test_an_unknown_policy_is_a_clear_error():
    with pytest.raises(snrt.SnrtError, match="unknown memory policy 'fast'; expected one of none, .*auto"):
        policy_named("fast")
    with pytest.raises(snrt.SnrtError, match="unknown memory policy"):
        snrt.plan(snrt.load_config(SMALL_RESNET).graph, 2, "fast")


@pytest.mark.parametrize("name", [p.name for p in POLICIES.values() if p.offloads])
def test_just_in_time_prefetch_is_a_public_choice_that_needs_no_more_memory(name):
    graph = snrt.load_config("configs/cifar_resnet20.yaml").graph
    hidden = snrt.plan(graph, 16, name)
    just_in_time = snrt.plan(graph, 16, name, hide_copies=False)
    verify_plan(just_in_time)
    assert just_in_time.arena_bytes <= hidden.arena_bytes
    assert just_in_time.to_json() != hidden.to_json()
