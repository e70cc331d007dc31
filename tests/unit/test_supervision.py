"""The failure budget the driver and the controller share: restarts counted against
`fault_tolerance.max_failures`, a backoff doubling up to a minute, and the count a
replacement controller continues from; a rank's reports recorded in its order."""

from hypothesis import given
from hypothesis import strategies as st

from lmforge.cluster.driver import Seen
from lmforge.cluster.supervision import MAX_BACKOFF_S, FailureBudget
from lmforge.events import Failure, InOrder, Start
from lmforge.spec import spec_from_dict


def test_the_budget_doubles_its_backoff_and_is_used_up_at_max_failures():
    budget = FailureBudget.of(
        spec_from_dict({"name": "b", "data": {"path": "d"}, "fault_tolerance": {"max_failures": 8, "backoff_s": 2.0}}).fault_tolerance
    )
    waits = []
    while not budget.used_up:
        assert budget.spend() == len(waits) + 1
        waits.append(budget.backoff())
    assert waits == [2.0, 4.0, 8.0, 16.0, 32.0, MAX_BACKOFF_S, MAX_BACKOFF_S, MAX_BACKOFF_S]
    assert budget.failures == 8 and FailureBudget(max_failures=0, backoff_s=1.0).used_up


def test_a_replacement_controller_continues_the_count_of_both_supervisors():
    """The driver counts the controller's failures from its events; the controller it
    starts next spends from where they stand, its predecessor's death included."""
    seen = Seen(spec_from_dict({"name": "b", "data": {"path": "d"}, "fault_tolerance": {"max_failures": 3}}))
    seen.add(Failure(attempt=1, max_failures=3, step=4, cause="RankHung", rank=1, nodes_lost=[]), None)
    handoff = seen.handoff(step=6)
    assert (handoff.failures, handoff.step) == (2, 6)
    budget = FailureBudget.of(seen.spec.fault_tolerance, handoff.failures)
    assert not budget.used_up and budget.spend() == 3 and budget.used_up


@given(st.permutations(range(12)))
def test_a_ranks_reports_are_recorded_in_its_order_whatever_order_they_arrive_in(arrival):
    """The controller's threads may run rank 0's report calls out of order (seen: step 4's
    row in metrics.jsonl before steps 2 and 3): each is released once, in the rank's
    order, and none past one still missing."""
    in_order, released = InOrder(), []
    for number in arrival:
        released += [event.step for event in in_order.arrived(number, Start(step=number))]
        arrived = set(arrival[: arrival.index(number) + 1])
        assert released == list(range(len(released))) and len(released) == min(set(range(13)) - arrived)
    assert released == list(range(12))
