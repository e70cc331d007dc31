"""The layout planner: the cluster string, the step-time model's terms moving the
way their formulas say, and a search that only returns valid layouts that fit."""

import pytest

from lmforge.errors import UserError
from lmforge.memory.estimate import worst_rank
from lmforge.planner.cluster import Cluster, assumed_cluster, parse_cluster
from lmforge.planner.search import search
from lmforge.planner.throughput import step_time
from lmforge.spec import spec_from_dict

CLUSTER = Cluster(nodes=2, gpus_per_node=4, gpu_mem=80 * 10**9)


def job(parallel=None, **train):
    parallel = parallel or {}
    return spec_from_dict(
        {
            "name": "p",
            "model": {"preset": "1b", "tie_embeddings": False},
            "parallel": parallel,
            "train": {"global_batch": 32, "micro_batch": 1, "seq_len": 2048, "precision": "bf16"} | train,
            "resources": {"gpus_per_worker": 1} if parallel.get("cpu_offload") else {},
            "data": {"path": "unused"},
        }
    )


def test_cluster_string_with_hardware_figures():
    c = parse_cluster("nodes=2, gpus_per_node=8, gpu_mem=141GB, peak_tflops=989, efficiency=0.4, inter_gbps=25")
    assert (c.gpus, c.gpu_mem, c.efficiency, c.inter_gbps, c.intra_gbps) == (16, 141 * 10**9, 0.4, 25.0, 300.0)
    assert c.usable < c.gpu_mem
    with pytest.raises(UserError, match="efficiency must be a number above 0 and at most 1"):
        parse_cluster("nodes=1,gpus_per_node=8,gpu_mem=80GB,efficiency=2")
    assert assumed_cluster(32) == Cluster(4, 8, 80 * 10**9) and assumed_cluster(2).gpus == 2
    offload = parse_cluster("nodes=1,gpus_per_node=8,gpu_mem=80GB,host_mem=1TB,host_gbps=25,cpu_gbps=5")
    assert (offload.host_mem, offload.host_gbps, offload.cpu_gbps, offload.usable_host_per_gpu) == (10**12, 25.0, 5.0, int(0.9 * 10**12 / 8))


def test_bubble_follows_the_schedule_formula():
    for pp, micro in ((2, 8), (4, 8), (4, 16)):
        t = step_time(job({"pp": pp, "dp": 8 // pp}, global_batch=micro * (8 // pp)), CLUSTER)
        assert t.bubble == pytest.approx((t.compute + t.recompute) * (pp - 1) / micro)
    interleaved = step_time(job({"pp": 2, "dp": 4, "schedule": "interleaved-1f1b", "virtual_stages": 2}, global_batch=32), CLUSTER)
    plain = step_time(job({"pp": 2, "dp": 4}, global_batch=32), CLUSTER)
    assert interleaved.bubble == pytest.approx(plain.bubble / 2)


def test_recompute_and_tensor_parallel_costs():
    base = step_time(job({"dp": 8}), CLUSTER)
    assert base.recompute == 0 and base.tp_comm == 0 and base.bubble == 0
    full = step_time(job({"dp": 8, "activation_checkpointing": "full"}), CLUSTER)
    assert full.recompute == pytest.approx(base.compute / 3)
    tp2, tp4 = (step_time(job({"dp": 8 // t, "tp": t}), CLUSTER) for t in (2, 4))
    assert 0 < tp2.tp_comm < tp4.tp_comm  # the ring's 2 (t-1)/t grows with t
    assert tp2.compute == pytest.approx(base.compute)  # the same work, spread differently


def test_data_parallel_traffic_grows_with_sharding_and_shows_when_compute_is_short():
    # A short step (small batch) cannot hide the gradient traffic of a 1B model. Two
    # micro-batches: ZeRO-3 gathers the weights twice for each.
    short = {z: step_time(job({"dp": 8, "zero": z}, global_batch=16, seq_len=256), CLUSTER) for z in (0, 2, 3)}
    assert all(t.dp_comm > 0 for t in short.values())
    assert short[0].dp_comm < short[3].dp_comm and short[2].dp_comm < short[3].dp_comm
    long = step_time(job({"dp": 8, "zero": 2}, global_batch=256, seq_len=2048), CLUSTER)
    assert long.dp_comm == 0 and long.dp_hidden > 0


def test_search_returns_only_valid_layouts_that_fit_fastest_first():
    spec = job({"dp": 8})
    found = search(spec, CLUSTER)
    assert found
    times = [c.time.total for c in found]
    assert times == sorted(times)
    for c in found:
        p = c.spec.parallel
        assert c.spec.world_size == CLUSTER.gpus and CLUSTER.gpus_per_node % p.tp == 0
        assert c.memory.device_total <= CLUSTER.usable and c.memory == worst_rank(c.spec)
        assert c.spec.train.global_batch == 32 and c.spec.train.seq_len == 2048
    assert len({(c.spec.parallel.tp, c.spec.parallel.pp) for c in found}) > 3  # a real range was weighed
    layouts = [
        (c.spec.parallel.tp, c.spec.parallel.pp, c.spec.parallel.zero, c.spec.parallel.activation_checkpointing, c.spec.parallel.ac_every)
        for c in found
    ]
    assert len(layouts) == len(set(layouts))  # each layout once, with its best micro-batch
    small = search(spec, Cluster(2, 4, 10 * 10**9))
    assert 0 < len(small) < len(found) and all(c.memory.device_total <= Cluster(2, 4, 10 * 10**9).usable for c in small)
    assert search(spec, Cluster(2, 4, 10**8)) == []


def test_where_nothing_fits_the_devices_cpu_offload_is_weighed_within_host_memory():
    spec = job()
    assert not any(c.spec.parallel.cpu_offload for c in search(spec, Cluster(1, 2, 16 * 10**9)))  # it fits: no offload
    small = Cluster(1, 2, 6 * 10**9)
    found = search(spec, small)
    assert found and all(c.spec.parallel.cpu_offload for c in found)
    for c in found:
        assert c.memory.device_total <= small.usable and 0 < c.memory.host <= small.usable_host_per_gpu
        assert c.time.offload > 0 and "CPU offload" in c.reason(small) and "of host memory per rank" in c.reason(small)
        applied = spec_from_dict(spec.model_dump(mode="json", exclude_unset=True), c.overrides())
        assert applied.parallel == c.spec.parallel and applied.resources.gpus_per_worker == 1
    assert search(spec, Cluster(1, 2, 6 * 10**9, host_mem=20 * 10**9)) == []  # the states do not fit the host either


def test_offload_costs_its_copies_and_the_optimizer_step_on_the_cpu():
    on = lambda **parallel: step_time(job({"dp": 8, "cpu_offload": True, **parallel}, global_batch=64), CLUSTER)
    off = step_time(job({"dp": 8}, global_batch=64), CLUSTER)
    assert off.offload == 0 and on(zero=2).offload > 0
    assert on(zero=3).offload > on(zero=2).offload  # parameters copied in for every pass of every micro-batch
    slow_host = Cluster(2, 4, 80 * 10**9, host_gbps=5.0, cpu_gbps=1.0)
    assert step_time(job({"dp": 8, "cpu_offload": True}, global_batch=64), slow_host).offload > on(zero=2).offload


def test_search_refuses_deepspeed_jobs():
    spec = spec_from_dict(
        {"name": "d", "engine": "deepspeed", "deepspeed": {"config": {"zero_optimization": {"stage": 2}}}, "data": {"path": "unused"}}
    )
    with pytest.raises(UserError, match="--search: plans layouts for engine: native"):
        search(spec, CLUSTER)


def test_a_layouts_overrides_give_the_job_that_layout():
    spec = job({"dp": 8})
    found = search(spec, CLUSTER)
    for c in (
        found[0],
        next(c for c in found if c.spec.parallel.pp > 1),
        next(c for c in found if c.spec.parallel.activation_checkpointing == "selective"),
    ):
        applied = spec_from_dict(spec.model_dump(mode="json", exclude_unset=True), c.overrides())
        assert applied.parallel == c.spec.parallel and applied.train == c.spec.train


def test_links_follow_the_placement_rule():
    """pp2 x dp2 x tp2 placed as cluster.topology places it: on nodes of 4 a replica
    fills a node (the pipeline inside it, DP between nodes); on nodes of 2 a replica
    spans two (the pipeline between nodes too); on one node of 8 nothing crosses."""
    layout = job({"pp": 2, "dp": 2, "tp": 2}, global_batch=16, seq_len=256)
    fast = 1e9 * CLUSTER.intra_gbps
    slow = 1e9 * CLUSTER.inter_gbps

    def links(gpus_per_node):
        t = step_time(layout, Cluster(nodes=8 // gpus_per_node, gpus_per_node=gpus_per_node, gpu_mem=80 * 10**9))
        one_node = step_time(layout, Cluster(nodes=1, gpus_per_node=8, gpu_mem=80 * 10**9))
        ratio = lambda term: (
            (getattr(t, term) + (t.dp_hidden if term == "dp_comm" else 0))
            / (getattr(one_node, term) + (one_node.dp_hidden if term == "dp_comm" else 0))
        )
        return {term: round(ratio(term), 6) for term in ("pp_comm", "dp_comm")}

    assert links(4) == {"pp_comm": 1.0, "dp_comm": round(fast / slow, 6)}
    assert links(2) == {"pp_comm": round(fast / slow, 6), "dp_comm": round(fast / slow, 6)}
    assert links(8) == {"pp_comm": 1.0, "dp_comm": 1.0}
