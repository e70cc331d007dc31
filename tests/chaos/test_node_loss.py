"""A node is removed abruptly (`allow_graceful=False`) mid-run: with `elastic` the
job shrinks from dp 2 to dp 1, keeps the global batch by doubling accumulation,
and when a node joins again it grows back to dp 2 at its next checkpoint; with a
spare rank instead, it restarts at dp 2 at once (a shorter run of the same
schedule). The shrinking job runs through `lmforge train` with its progress on,
into a directory named like rich markup. Each trains exactly the samples
and (within 1e-4 after a resize, 1e-5 otherwise) the losses of the run that lost
nothing."""

import numpy as np
import pytest

from chaos import events, step_rows
from conftest import MULTINODE_STEPS as STEPS
from conftest import MULTINODE_TIMEOUT_S, SPARED_STEPS
from multinode_scenarios import CLI_DIR

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(MULTINODE_TIMEOUT_S)]


def _same_as_whole(runs, name, rel, steps=STEPS):
    """Steps 1..steps of the run `name` are those of the run that lost nothing."""
    whole, lost = step_rows(runs / "whole"), step_rows(runs / name)
    assert sorted(lost) == list(range(1, steps + 1))
    for step in range(1, steps + 1):
        assert lost[step]["loss"] == pytest.approx(whole[step]["loss"], rel=rel), step
    ids = lambda name: {s: row["ids"] for s, row in step_rows(runs / name, "samples.jsonl").items() if s <= steps}
    assert ids(name) == ids("whole")


def test_node_loss_shrinks_then_grows_back_and_trains_exactly(multinode):
    result, runs = multinode
    assert result["whole"]["dp"] == 2
    shrunk = result["shrunk"]
    assert shrunk["exit_code"] == 0 and "Traceback" not in shrunk["stderr"], shrunk["stderr"][-3000:]
    assert shrunk["final_step"] == STEPS and shrunk["failures"] >= 1 and shrunk["dp"] == 2
    # Every line the driver printed is plain text: the paths in it, the failure's cause.
    printed = shrunk["stderr"].splitlines()
    assert any(line.startswith("failure 1/3 at step") for line in printed), printed
    assert any(line.startswith("recovered in") for line in printed)
    assert any(line.startswith("checkpoint step") and f"{CLI_DIR}/tiny/checkpoints/step_" in line for line in printed)
    history = events(runs / CLI_DIR / "tiny")
    recovered = [event for event in history if event["event"] == "recovered"]
    assert recovered[-1]["dp"] == 1
    # `nodes_lost` is not asserted: it lists the nodes Ray has declared dead by then,
    # which on a loaded machine can come after the restart (seen in CI).
    (resized,) = [event for event in history if event["event"] == "resized"]
    assert (resized["from_dp"], resized["dp"]) == (1, 2) and resized["step"] > recovered[-1]["step"]
    # A data reader is kept by the next attempt only where it answered, else replaced:
    # a kept one is on the node of the reader started before it.
    readers = [event for event in history if event["event"] == "reader"]
    assert not readers[0]["kept"] and len(readers) == 1 + len(recovered) + 1  # the start, each restart, the growth
    assert all(reader["node"] == before["node"] for before, reader in zip(readers, readers[1:]) if reader["kept"])
    restored = [event["step"] for event in history if event["event"] == "restored"]
    assert restored[-1] % 10 == 0 and restored[-1] == resized["step"] - 1  # grew at a checkpoint, nothing redone
    _same_as_whole(runs, f"{CLI_DIR}/tiny", rel=1e-4)


def test_a_spare_rank_replaces_a_lost_node_without_shrinking(multinode):
    """No `elastic` here: the restart must place dp 2 again, in the spare's slot,
    while a rival placement group waits for a node. The lost node, silent but not
    yet declared dead by Ray, is found by the controller's heartbeats and not used again.
    The node went before the first storage checkpoint: the restart restores the
    in-memory snapshot, the lost rank's share from its replica on the other node,
    in processes that were already running."""
    result, runs = multinode
    spared = result["spared"]
    assert spared["final_step"] == SPARED_STEPS and spared["failures"] >= 1 and spared["dp"] == 2
    assert spared["rival_at_recovery"] == "PENDING"  # the capacity never left the job
    history = events(runs / "spared")
    # Ready from the start, used by the restart; the lost node's slot is gone.
    assert [event["ready"] for event in history if event["event"] == "spares"] == [1, 0]
    first_failure = next(event for event in history if event["event"] == "failure")
    first_layout, *restarts = [event["ranks"] for event in history if event["event"] == "layout"]
    assert first_failure["nodes_lost"] == [first_layout[1]["node"]]
    assert restarts and all(ranks[0]["node"] == first_layout[0]["node"] and ranks[1]["node"] not in first_failure["nodes_lost"] for ranks in restarts)
    assert not [event for event in history if event["event"] == "resized"]
    assert all(event["dp"] == 2 for event in history if event["event"] == "recovered")
    restored = [event for event in history if event["event"] == "restored"]
    assert restored and all(event["from_memory"] and event["step"] > 0 for event in restored)
    # The surviving rank kept its process, and the spare slot's was started while the job trained.
    assert [event["reused"] for event in history if event["event"] == "layout"][:2] == [0, 2]
    _same_as_whole(runs, "spared", rel=1e-5, steps=SPARED_STEPS)


def test_the_mixture_holds_its_weights_and_is_logged_per_step(multinode):
    """The elastic job trains on a 3:1 mixture: each step's row says how many samples
    of each source it took (those of its recorded ids), every whole chunk of the order
    takes exactly the rounded weights, and MLflow has the shares per step."""
    from mlflow.tracking import MlflowClient

    from conftest import MIXTURE_WEIGHTS
    from lmforge.data.mixture import CHUNK, ID_STRIDE, chunk_counts

    result, runs = multinode
    rows, ids = step_rows(runs / "whole"), step_rows(runs / "whole", "samples.jsonl")
    for step, row in rows.items():
        assert row["mixture"] == np.bincount([i // ID_STRIDE for i in ids[step]["ids"]], minlength=2).tolist(), step
    per_chunk = CHUNK // 8  # steps of global batch 8
    chunks = STEPS // per_chunk
    taken = np.sum([rows[step]["mixture"] for step in range(1, chunks * per_chunk + 1)], axis=0)
    assert taken.tolist() == (chunks * chunk_counts(MIXTURE_WEIGHTS)).tolist() and taken[0] == 3 * taken[1]
    client = MlflowClient(tracking_uri=result["whole"]["mlflow_tracking_uri"])
    shares = {m.step: m.value for m in client.get_metric_history(result["whole"]["mlflow_run_id"], "mixture_1")}
    assert shares == {step: row["mixture"][1] / 8 for step, row in rows.items()}
    inputs = client.get_run(result["whole"]["mlflow_run_id"]).inputs.dataset_inputs
    assert sorted(t.value for d in inputs for t in d.tags if t.key == "lmforge.mixture.weight") == ["1.0", "3.0"]  # each source an input
