"""Slots and the layout decisions built on them, on the session's one-node Ray
cluster (6 CPUs): what is reserved, kept, released, and the errors when it does
not fit. Node loss itself is in tests/chaos/test_node_loss.py."""

import json
import time
from contextlib import contextmanager

import pytest
import ray
from ray.util.state import list_actors

from lmforge.cluster import placement
from lmforge.cluster.capacity import Capacity
from lmforge.cluster.placement import MISSED_S, NodeWatch, Slots
from lmforge.errors import UserError
from lmforge.events import Spares
from lmforge.spec import JobSpec, spec_from_dict

pytestmark = pytest.mark.ray


def job(**sections) -> JobSpec:
    tree = {
        "name": "capacity",
        "model": {"preset": "tiny", "vocab_size": 512},
        "parallel": {"dp": 2},
        "train": {"global_batch": 12, "micro_batch": 1, "seq_len": 32},
        "data": {"path": "unused"},
        "resources": {"cpus_per_worker": 1},
        "fault_tolerance": {"max_failures": 1},
    }
    for section, values in sections.items():
        tree[section] = tree.get(section, {}) | values
    return spec_from_dict(tree)


def free_cpus() -> float:
    return ray.available_resources().get("CPU", 0)


def settles_at(cpus: float, timeout_s: float = 10) -> bool:
    """Ray frees a removed placement group's resources asynchronously."""
    deadline = time.time() + timeout_s
    while free_cpus() != cpus and time.time() < deadline:
        time.sleep(0.05)
    return free_cpus() == cpus


def test_slots_are_reserved_all_or_none_and_dropped_by_node(ray_session):
    before = ray.cluster_resources()["CPU"]  # nothing else holds any, once the tests before have let go:
    # their actors are killed asynchronously, which a loaded machine can take seconds to finish.
    assert settles_at(before, timeout_s=60), f"{free_cpus()} of {before} CPUs free; held by: {list_actors(filters=[('state', '=', 'ALIVE')])}"
    slots = Slots(group_size=2, cpus=1, gpus=0, name="test/slots/")
    slots.add(2, timeout_s=30)
    assert len(slots) == 2 and free_cpus() == before - 4
    (node,) = set(slots.nodes())
    assert node == ray.get_runtime_context().get_node_id()
    with pytest.raises(UserError, match="could not place 2 more groups of 2 workers"):
        slots.add(2, timeout_s=2)  # 4 more CPUs than are free: none of the two is kept
    assert len(slots) == 2 and settles_at(before - 4)
    assert slots.drop_lost({"some-other-node"}) == 0 and len(slots) == 2
    assert slots.drop_lost({node}) == 2 and len(slots) == 0
    assert settles_at(before)


@contextmanager
def started(spec: JobSpec):
    """(capacity, its events, the first layout); everything released afterwards."""
    events = []
    capacity = Capacity(spec, f"test/{id(spec)}/", events.append, placement_timeout_s=10)
    try:
        yield capacity, events, capacity.initial(spares_optional=False)
    finally:
        capacity.release()
    assert len(capacity.slots) == 0


def autoscaler_request() -> list:
    """What the autoscaler is asked to make room for (Ray's v1 autoscaler channel: this
    cluster runs none, and the request is recorded all the same)."""
    from ray._private.ray_constants import AUTOSCALER_RESOURCE_REQUEST_CHANNEL
    from ray.experimental.internal_kv import _internal_kv_get

    return json.loads(_internal_kv_get(AUTOSCALER_RESOURCE_REQUEST_CHANNEL) or "[]")


def test_an_elastic_restart_takes_the_largest_dp_the_kept_slots_hold(ray_session):
    with started(job(elastic={"min_dp": 1, "max_dp": 4})) as (capacity, _, first):
        assert autoscaler_request() == [{"CPU": 1.0}] * 4  # room for max_dp, asked before placing
        assert first.parallel.dp == 4 and len(capacity.slots) == 4
        capacity.slots.keep(3)  # as if the fourth slot's node were lost
        resized = capacity.fit(first)
        assert (resized.parallel.dp, resized.grad_accum) == (3, 4) and len(capacity.slots) == 3  # 4 x 3 before
    assert autoscaler_request() == []


def test_spares_take_a_lost_slots_place_and_the_surplus_is_released(ray_session):
    with started(job(fault_tolerance={"max_failures": 1, "spares": 1})) as (capacity, events, current):
        assert len(capacity.slots) == 3 and events == [Spares(ready=1, wanted=1)]
        capacity.slots.keep(2)  # a rank's slot lost: the spare's slot completes the layout
        assert capacity.fit(current).parallel.dp == 2 and len(capacity.slots) == 2
        assert events[-1] == Spares(ready=0, wanted=1)
        assert settles_at(ray.cluster_resources()["CPU"] - 2)
        capacity.probe(current)  # room is free again: the spare comes back
        assert len(capacity.slots) == 3 and events[-1].ready == 1


def test_spares_that_do_not_fit_are_refused_naming_the_field(ray_session):
    spec = job(parallel={"dp": 2}, fault_tolerance={"max_failures": 1, "spares": 8})
    capacity = Capacity(spec, "test/too-many/", lambda event: None, placement_timeout_s=2)
    before = ray.cluster_resources()["CPU"]  # nothing else holds any
    with pytest.raises(UserError, match="fault_tolerance.spares: with 8 spare ranks"):
        capacity.initial(spares_optional=False)
    assert len(capacity.slots) == 0 and settles_at(before)
    assert capacity.initial(spares_optional=True).parallel.dp == 2  # a replacement controller runs without them
    capacity.release()


@ray.remote(num_cpus=0)
class SlowStartingPinger:
    """A pinger whose process takes longer than `MISSED_S` to start, as on a loaded node."""

    def __init__(self):
        time.sleep(2 * MISSED_S)

    def ping(self) -> bool:
        return True


def test_node_watch_answers_for_live_nodes_and_names_the_others(ray_session, monkeypatch):
    here = ray.get_runtime_context().get_node_id()
    watch = NodeWatch(home="")  # no home node: this one is pinged like any other
    watch.watch([here, ""])  # "": a slot Ray has placed nowhere yet
    assert set(watch._pingers) == {here}
    assert watch.unresponsive({here}, since=time.time()) == set()
    gone = "ab" * 28  # a node id no node has: its ping cannot be placed, so it never answers
    assert watch.unresponsive({here, gone}, since=time.time(), missed_s=1.0) == {gone}
    watch.stop()
    # Silence counts from a pinger's first answer: one slow to start is waited for, not judged lost.
    monkeypatch.setattr(placement, "_Pinger", SlowStartingPinger)
    slow = NodeWatch(home="")
    asked = time.time()
    assert slow.unresponsive({here}, since=asked) == set() and time.time() - asked > MISSED_S
    slow.stop()
    with started(job()) as (capacity, _, _first):
        # Placing a layout watches its nodes, but the controller's own answers by itself
        # (other nodes' pingers: the multinode scenarios, where a lost node is found).
        assert capacity.watch.home == here and not capacity.watch._pingers
        assert capacity.watch.unresponsive({here}, since=time.time()) == set()
