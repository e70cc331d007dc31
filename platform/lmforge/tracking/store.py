"""The MLflow client of a tracking URI. A new local (SQLite) store starts as a copy of an
empty one made once per MLflow version: MLflow builds a new database by running every
schema migration, 1.2-1.6 CPU-seconds of each job's first start in a new output dir."""

from __future__ import annotations

import os
import shutil
import sqlite3
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

SQLITE = "sqlite:///"


def mlflow_client(uri: str, registry: bool = False) -> MlflowClient:
    """`registry`: the same store also holds the model registry. MLflow is imported here,
    not with the module: it takes about 2 s, and most processes that import tracking
    (ranks, serving) never open a store."""
    from mlflow.tracking import MlflowClient

    if uri.startswith(SQLITE):
        start_from_template(Path(uri.removeprefix(SQLITE)))
    return MlflowClient(tracking_uri=uri, registry_uri=uri if registry else None)


def start_from_template(db: Path) -> None:
    """Where `db` does not exist yet, put an empty migrated store there (never over one
    that appeared meanwhile). Any failure leaves it to MLflow, which builds its own."""
    if db.exists():
        return
    try:
        template = _template()
        db.parent.mkdir(parents=True, exist_ok=True)
        _place(template, db)
    except (OSError, sqlite3.Error):
        return


def template_path() -> Path:
    import mlflow

    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "lmforge" / f"mlflow-{mlflow.__version__}-empty.db"


def _template() -> Path:
    from mlflow.tracking import MlflowClient

    template = template_path()
    if template.exists():
        return template
    template.parent.mkdir(parents=True, exist_ok=True)
    building = template.with_name(f".{template.name}.{uuid.uuid4().hex}")
    try:
        MlflowClient(tracking_uri=f"{SQLITE}{building}").search_experiments()  # MLflow migrates it
        # MLflow puts its Default experiment's artifacts under the creating process's
        # working directory; without it, the first open of each copy creates it there.
        with sqlite3.connect(building) as db:
            db.execute("DELETE FROM experiments WHERE experiment_id = 0")
        db.close()
        os.replace(building, template)
    finally:
        building.unlink(missing_ok=True)
    return template


def _place(template: Path, db: Path) -> None:
    copy = db.with_name(f".{db.name}.{uuid.uuid4().hex}")
    try:
        shutil.copyfile(template, copy)
        os.link(copy, db)  # atomic, and refuses to replace a store another process made first
    except FileExistsError:
        pass
    finally:
        copy.unlink(missing_ok=True)
