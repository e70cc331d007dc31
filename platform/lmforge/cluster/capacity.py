"""How large each attempt of a job runs, and the slots it runs in.

The controller asks for a layout at the start, after a failure and after a stop
to grow; this decides it from the slots held (placement.Slots), reserving more
only when the layout needs them. After a failure the slots on lost nodes are
dropped and the survivors kept, spares included, so a spare takes a lost group's
place with no capacity given back. While running it looks now and then for room
to grow an elastic job (the ranks then stop at their next checkpoint) and to
refill the spares. An elastic job also asks Ray's autoscaler for room for its
largest layout, so that on a cluster that adds nodes on demand there is room to find.
"""

from __future__ import annotations

import time
from typing import Callable

import ray
from ray.autoscaler.sdk import request_resources

from lmforge.cluster.placement import NodeWatch, Slots, node_labels, node_rooms, tp_bundle
from lmforge.cluster.topology import Unplaceable, arrange, assign
from lmforge.errors import UserError
from lmforge.events import Event, GrowPending, Spares
from lmforge.ray_runtime import DATA_CPUS, fits
from lmforge.spec import JobSpec

RESIZE_PROBE_S = 5.0  # how long an elastic start tries each larger layout before a smaller one
PROBE_EVERY_S = 2.0  # how often a running job looks for room to grow or for its spares
# A worker outlives its node's raylet by up to Ray's raylet death check (1 s by default):
# an answer from a node counts as life only from this long after the failure (seen: a
# node's pinger answering 0.3 s after its ranks had died, and the restart placed there).
NODE_SETTLE_S = 1.0


def check_placement(spec: JobSpec) -> None:
    """Before anything starts: the layout (an elastic job's smallest) and its spares
    can be placed by the rule (cluster.topology) on the cluster's nodes, all their
    resources counted; else one line saying why."""
    p, res = spec.parallel, spec.resources
    dp = spec.elastic.min_dp if spec.elastic else p.dp
    bundle, label = tp_bundle(p.tp, res.cpus_per_worker, res.gpus_per_worker), res.replica_label
    rooms = node_rooms(bundle, label, free=False)
    if label and not rooms:
        raise UserError(f"resources.replica_label: no live node carries the label {label!r}")
    if not any(room.groups for room in rooms):
        raise UserError(
            f"parallel.tp: a tensor-parallel group of {p.tp} ranks needs {_amounts(bundle)} on one node; "
            f"no {'node labelled ' + repr(label) if label else 'node'} has that much"
        )
    try:
        assign(p.pp, dp, spec.fault_tolerance.spares // p.tp, rooms, by_label=bool(label))
    except Unplaceable as err:
        field = "resources.replica_label" if label else "parallel"
        raise UserError(
            f"{field}: pp {p.pp} x dp {dp} x tp {p.tp} cannot be placed with each tensor-parallel group inside a node"
            f"{' and each replica within one value of ' + repr(label) if label else ''} ({_amounts(bundle)} a group): {err}"
        ) from None


def _amounts(bundle: dict[str, float]) -> str:
    return " + ".join(f"{amount:g} {kind}" for kind, amount in bundle.items())


class Capacity:
    def __init__(self, spec: JobSpec, name: str, report: Callable[[Event], None], placement_timeout_s: float):
        p, res = spec.parallel, spec.resources
        self.spec, self.report, self.placement_timeout_s = spec, report, placement_timeout_s
        self.slots = Slots(p.tp, res.cpus_per_worker, res.gpus_per_worker, name)
        self.spare_groups = spec.fault_tolerance.spares // p.tp
        self.lost: set[str] = set()  # nodes found gone, perhaps not yet declared dead by Ray
        self.watch = NodeWatch()
        self.growth_pending = False
        self._spares_ready = 0
        self._probed_at = 0.0

    def groups(self, dp: int) -> int:
        return self.spec.parallel.pp * dp

    def initial(self, spares_optional: bool) -> JobSpec:
        """The first layout: the job's dp (elastic: the largest in range that can be
        placed, waiting only for the smallest) and its spares, which must fit unless
        `spares_optional` (a controller replacing one that died)."""
        spec, elastic = self.spec, self.spec.elastic
        self._ask_autoscaler()
        dps = [spec.parallel.dp] if elastic is None else [dp for dp in range(elastic.max_dp, elastic.min_dp - 1, -1) if self._fits(dp, 0)]
        error: UserError | None = None
        for i, dp in enumerate(dps):
            timeout_s = self.placement_timeout_s if i == len(dps) - 1 else RESIZE_PROBE_S
            for spares in (self.spare_groups, 0) if spares_optional and self.spare_groups else (self.spare_groups,):
                try:
                    self.slots.add(self.groups(dp) + spares, timeout_s, on=self._by_rule(dp, spares))
                except UserError as err:
                    error = err
                    continue
                self._report_spares(spares)
                self._arrange(dp)
                self.watch.watch(self.slots.nodes())
                return spec if elastic is None else spec.with_dp(dp)
        if self.spare_groups and not spares_optional and error is not None:
            raise UserError(f"fault_tolerance.spares: with {spec.fault_tolerance.spares} spare ranks beside the job's: {error}")
        raise error or UserError(f"elastic.min_dp: the cluster cannot hold even dp {elastic.min_dp}")

    def find_lost(self, rank_nodes: list[str], since: float) -> None:
        """After a failure at `since`: which of the job's nodes are gone, dead to Ray
        or missing heartbeats; their slots are released (the rest kept)."""
        nodes = (set(self.slots.nodes()) | set(rank_nodes)) - {""}
        alive = self.alive_nodes()
        self.lost |= (nodes - alive) | self.watch.unresponsive(nodes & alive, since + NODE_SETTLE_S)
        self.slots.drop_lost(self.lost)

    def fit(self, current: JobSpec) -> JobSpec:
        """The layout to restart on, in the slots held: the same dp when they hold it
        (spares taking lost groups' place). Otherwise an elastic job takes the largest
        dp they hold, and the missing slots are reserved, avoiding lost nodes, for
        a fixed dp or elastic.min_dp (UserError when they cannot be)."""
        self.growth_pending = False
        elastic, held = self.spec.elastic, len(self.slots)
        if elastic is None:
            dp = current.parallel.dp
        else:
            dp = max((d for d in range(elastic.min_dp, elastic.max_dp + 1) if self.groups(d) <= held), default=elastic.min_dp)
        if held < self.groups(dp):
            try:
                self.slots.add(self.groups(dp) - held, self.placement_timeout_s, frozenset(self.lost))
            except UserError as err:
                field = "elastic.min_dp" if elastic else "resources"
                raise UserError(f"{field}: after a failure the cluster cannot hold dp {dp} again: {err}") from None
        self._arrange(dp)
        self.slots.keep(self.groups(dp) + self.spare_groups)
        self._report_spares(len(self.slots) - self.groups(dp))
        self.watch.watch(self.slots.nodes())
        return current if elastic is None else current.with_dp(dp)  # current: as the guards changed it

    def probe(self, current: JobSpec) -> None:
        """Now and then while running: reserve room to grow (elastic, below max_dp),
        then refill missing spares, one slot at a time."""
        if time.time() - self._probed_at < PROBE_EVERY_S or self.growth_pending:
            return
        self._probed_at = time.time()
        dp, elastic, held = current.parallel.dp, self.spec.elastic, len(self.slots)
        for larger in range(elastic.max_dp, dp, -1) if elastic else ():
            extra = self.groups(larger) - held
            if extra <= 0 or self._room_for(extra):
                if extra > 0 and not self._try_add(extra):
                    continue
                self.growth_pending = True
                self.report(GrowPending(dp=dp, to_dp=larger))
                return
        spares = held - self.groups(dp)
        if spares < self.spare_groups and self._room_for(1) and self._try_add(1):
            spares += 1
        self._report_spares(spares)

    def release(self) -> None:
        self.watch.stop()
        self.slots.keep(0)
        if self.spec.elastic:
            request_resources(bundles=[])  # the request outlives its caller unless replaced

    def _ask_autoscaler(self) -> None:
        """Ask for room for max_dp and the spares. The placement groups of a larger
        layout are pending only for the few seconds it is tried, too briefly for an
        autoscaler to act on; this request stands until the job ends (a no-op where
        no autoscaler runs). Ray keeps one such request per cluster: the last wins."""
        elastic = self.spec.elastic
        if elastic:
            request_resources(bundles=[dict(self.slots.bundle) for _ in range(self.groups(elastic.max_dp) + self.spare_groups)])

    def _by_rule(self, dp: int, spares: int) -> list[str] | None:
        """The node of each new slot by the placement rule (cluster.topology), in what
        the nodes have free now; None (Ray chooses, and `_arrange` orders what it
        chose) when the free room does not hold them so, e.g. while an autoscaler adds nodes."""
        rooms = node_rooms(self.slots.bundle, self.spec.resources.replica_label, frozenset(self.lost))
        try:
            return assign(self.spec.parallel.pp, dp, spares, rooms, by_label=bool(self.spec.resources.replica_label))
        except Unplaceable:
            return None

    def _arrange(self, dp: int) -> None:
        """Order the slots held so that the layout's ranks sit where the rule puts them
        (after a restart, the survivors and their replacements)."""
        label = self.spec.resources.replica_label
        order = arrange(self.spec.parallel.pp, dp, self.slots.nodes(), node_labels(label), by_label=bool(label))
        self.slots.reorder(order)

    def alive_nodes(self) -> set[str]:
        return {node["NodeID"] for node in ray.nodes() if node["Alive"]} - self.lost

    def _fits(self, dp: int, spares: int) -> bool:
        res = self.spec.resources
        return fits((self.groups(dp) + spares) * self.spec.parallel.tp, res.cpus_per_worker, res.gpus_per_worker)

    def _room_for(self, groups: int) -> bool:
        """Clearly enough free CPUs for `groups` more slots (skips a placement's wait)."""
        free = ray.available_resources().get("CPU", 0) - DATA_CPUS
        return groups * self.slots.bundle["CPU"] <= free

    def _try_add(self, groups: int) -> bool:
        try:
            self.slots.add(groups, 1.0, frozenset(self.lost))
        except UserError:
            return False
        self.watch.watch(self.slots.nodes())
        return True

    def _report_spares(self, groups: int) -> None:
        ready = min(groups, self.spare_groups) * self.spec.parallel.tp
        if self.spare_groups and ready != self._spares_ready:
            self._spares_ready = ready
            self.report(Spares(ready=ready, wanted=self.spec.fault_tolerance.spares))
