"""A new local MLflow store copied from an empty migrated one: the same schema and
Default experiment as a store MLflow builds itself, never over an existing store, and
MLflow's own build wherever the copy cannot be made."""

import sqlite3
import threading

from lmforge.tracking import store
from lmforge.tracking.store import mlflow_client, start_from_template, template_path


def _schema(db) -> tuple:
    """Each table's, index's and trigger's definition as its sorted clauses: MLflow's own
    migrations write a table's constraints in an order that differs from build to build."""
    with sqlite3.connect(db) as con:
        statements = [row[0] for row in con.execute("SELECT sql FROM sqlite_master WHERE sql IS NOT NULL")]
        tables = sorted(sorted(line.strip().rstrip(",").strip() for line in sql.splitlines()) for sql in statements)
        version = con.execute("SELECT version_num FROM alembic_version").fetchall()
    con.close()
    return tables, version


def test_a_copied_store_is_the_one_mlflow_builds(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    built = tmp_path / "built" / "mlflow.db"
    built.parent.mkdir()
    monkeypatch.chdir(built.parent)
    built_default = mlflow_client_without_template(built).get_experiment("0")

    copied = tmp_path / "copied" / "mlflow.db"
    copied.parent.mkdir()
    monkeypatch.chdir(copied.parent)
    client = mlflow_client(f"sqlite:///{copied}")
    assert template_path().exists() and template_path().parent == tmp_path / "cache" / "lmforge"
    assert _schema(copied) == _schema(built)
    # The Default experiment is made by the first open, under that process's directory, as MLflow does.
    default = client.get_experiment("0")
    assert (default.name, default.artifact_location) == (built_default.name, str(copied.parent / "mlruns" / "0"))
    run = client.create_run(client.create_experiment("lmforge"))
    client.log_metric(run.info.run_id, "loss", 1.5)
    assert mlflow_client(f"sqlite:///{copied}").get_run(run.info.run_id).data.metrics == {"loss": 1.5}


def mlflow_client_without_template(db):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    client.search_experiments()
    return client


def test_an_existing_store_is_never_replaced_and_racing_starts_make_one(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    existing = tmp_path / "mine.db"
    existing.write_bytes(b"not MLflow's, and not ours to replace")
    start_from_template(existing)
    assert existing.read_bytes() == b"not MLflow's, and not ours to replace"

    store._template()  # made once beforehand: the race is over placing it
    target = tmp_path / "raced" / "mlflow.db"
    placed = []
    real_place = store._place

    def slow_place(template, db):  # every thread copies before any links
        barrier.wait()
        real_place(template, db)
        placed.append(db)

    barrier = threading.Barrier(4)
    monkeypatch.setattr(store, "_place", slow_place)
    threads = [threading.Thread(target=start_from_template, args=(target,)) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(placed) == 4 and sorted(p.name for p in target.parent.iterdir()) == ["mlflow.db"]  # no copy left behind
    assert _schema(target) == _schema(template_path())


def test_without_a_cache_mlflow_builds_the_store_itself(tmp_path, monkeypatch):
    unwritable = tmp_path / "a-file"
    unwritable.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(unwritable))  # the cache cannot be made under a file
    db = tmp_path / "runs" / "mlflow.db"
    client = mlflow_client(f"sqlite:///{db}")
    assert client.create_experiment("lmforge") and db.exists()
