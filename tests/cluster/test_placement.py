"""The application is checked against the Ray cluster before anything is deployed, and the
replicas' CPU share fits the machine when the settings leave it open."""

from __future__ import annotations

import logging

import pytest

from cluster.errors import PlacementError
from cluster.placement import RayResources, place
from cluster.settings import load_settings


def local(num_cpus: float, num_gpus: float = 0.0) -> RayResources:
    return RayResources(num_cpus=num_cpus, num_gpus=num_gpus, largest_node_cpus=num_cpus,
                        largest_node_gpus=num_gpus, is_local=True)


@pytest.mark.parametrize("num_cpus, num_replicas, expected", [
    (2, 1, 1.0),  # at most 1 CPU each
    (2, 2, 0.87),  # (2 - 0.25) / 2, rounded down
    (1, 1, 0.75),  # a 1-core machine still fits its defaults
    (16, 3, 1.0),
])
def test_unset_replica_cpus_fit_the_machine(num_cpus: float, num_replicas: int,
                                            expected: float) -> None:
    settings = load_settings(replicas={"num_replicas": num_replicas})
    assert settings.replicas.num_cpus is None
    placed = place(settings, local(num_cpus))
    assert placed.replicas.num_cpus == expected
    assert num_replicas * expected + 0.25 <= num_cpus


@pytest.mark.parametrize("num_cpus, num_replicas, expected", [
    (2, 1, 2),  # make up: the router needs little, the replica computes on both cores
    (2, 2, 1),
    (1, 1, 1),
    (16, 3, 5),  # (16 - 0.25) / 3
])
def test_unset_engine_threads_use_the_local_machines_cores(num_cpus: float, num_replicas: int,
                                                           expected: int) -> None:
    settings = load_settings(replicas={"num_replicas": num_replicas})
    assert settings.engine.num_threads is None
    assert place(settings, local(num_cpus)).engine.num_threads == expected
    # set by hand: kept; on a joined Ray (not this machine): left to Ray
    fixed = load_settings(replicas={"num_replicas": num_replicas}, engine={"num_threads": 3})
    assert place(fixed, local(num_cpus)).engine.num_threads == 3
    joined = RayResources(num_cpus=num_cpus, num_gpus=0, largest_node_cpus=num_cpus,
                          largest_node_gpus=0, is_local=False)
    assert place(settings, joined).engine.num_threads is None


def test_autoscaling_shares_the_cpus_among_the_most_replicas_it_may_hold() -> None:
    settings = load_settings(replicas={"autoscaling": {"min_replicas": 1, "max_replicas": 4}})
    assert place(settings, local(2)).replicas.num_cpus == pytest.approx(0.43)


def test_two_one_cpu_replicas_and_a_router_on_two_cpus_are_refused_with_the_numbers() -> None:
    settings = load_settings(replicas={"num_replicas": 2, "num_cpus": 1})
    with pytest.raises(PlacementError) as caught:
        place(settings, local(2))
    message = str(caught.value)
    assert "2 model replica(s) x 1 CPU + 1 router(s) x 0.25 CPU = 2.25 CPU asked" in message
    assert "2 CPU available" in message and "replicas.num_cpus" in message


def test_autoscaling_max_replicas_must_fit_too() -> None:
    settings = load_settings(replicas={"num_cpus": 1, "autoscaling": {"max_replicas": 3}})
    with pytest.raises(PlacementError, match=r"3 model replica\(s\) \(autoscaling.max_replicas\)"):
        place(settings, local(3))
    assert place(settings, local(3.25)).replicas.num_cpus == 1


def test_gpus_and_the_largest_node_are_checked() -> None:
    settings = load_settings(replicas={"num_replicas": 2, "num_gpus": 1, "num_cpus": 1})
    with pytest.raises(PlacementError, match="2 GPU asked, 1 GPU available"):
        place(settings, local(8, num_gpus=1))
    two_small_nodes = RayResources(num_cpus=8, num_gpus=2, largest_node_cpus=4,
                                   largest_node_gpus=1, is_local=True)
    assert place(settings, two_small_nodes).replicas.num_gpus == 1
    wide = load_settings(replicas={"num_cpus": 6})
    with pytest.raises(PlacementError, match="one model replica asks 6 CPU, the largest node has 4"):
        place(wide, two_small_nodes)


def test_a_joined_cluster_that_is_short_only_warns(caplog) -> None:
    # it may autoscale, or hold an older version of this application that the new one replaces
    settings = load_settings(replicas={"num_replicas": 4, "num_cpus": 1},
                             ray={"address": "ray://head:10001"})
    joined = RayResources(num_cpus=2, num_gpus=0, largest_node_cpus=2, largest_node_gpus=0,
                          is_local=False)
    with caplog.at_level(logging.WARNING, logger="cluster.placement"):
        assert place(settings, joined) == settings
    assert "the Ray cluster at ray://head:10001" in caplog.text and "4.25 CPU asked" in caplog.text
