"""What every command group shares: the flags defined once, and the one place the
CLI loads the SDK (and torch with it), when a command runs rather than when
`lmforge --help` or a bad job file is answered."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import os
import sys
from types import ModuleType
from typing import Iterator, TextIO


def sdk() -> ModuleType:
    """`lmforge.sdk`, imported on first use (it brings torch and Ray)."""
    return importlib.import_module("lmforge.sdk")


def add_job(parser: argparse.ArgumentParser, required: bool = True, help: str = "job YAML file") -> None:
    """The job file and its --set overrides."""
    parser.add_argument("job", nargs=None if required else "?", help=help)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="override a field, e.g. train.max_steps=10")


def add_cluster(parser: argparse.ArgumentParser, progress: bool = True) -> None:
    """The Ray cluster a command joins, and whether it shows progress."""
    parser.add_argument("--address", help="Ray cluster to join (default: RAY_ADDRESS, else an embedded local cluster)")
    if progress:
        parser.add_argument("--no-progress", action="store_true", help="no progress output")


def add_json(parser: argparse.ArgumentParser, what: str = "the result") -> None:
    parser.add_argument("--json", action="store_true", help=f"print {what} as JSON on stdout")


def add_tracking(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tracking-uri", help="MLflow store (default: MLFLOW_TRACKING_URI, else sqlite:///runs/mlflow.db)")
    parser.add_argument("--no-tracking", action="store_true", help="record no MLflow run")


def say(line: str) -> None:
    """Progress and outcomes go to stderr; stdout holds what --json asks for."""
    print(line, file=sys.stderr, flush=True)


def print_json(value, out: TextIO) -> int:
    print(json.dumps(value, indent=2), file=out, flush=True)
    return 0


@contextlib.contextmanager
def stdout_for_json(wanted: bool, for_good: bool) -> Iterator[TextIO]:
    """The stream `--json` writes to: stdout as the command found it, kept for the JSON
    alone, so that it parses. While the command runs, whatever else prints there goes to
    stderr: Python's prints and, when stdout is a file, what Ray, MLflow or native code
    write to it, child processes and messages at exit included (`for_good`: the process
    ends with the command, so stdout is not put back)."""
    if not wanted:
        yield sys.stdout
        return
    out, fd, saved = sys.stdout, None, None
    with contextlib.suppress(AttributeError, OSError, io.UnsupportedOperation):
        fd = out.fileno()
    if fd is not None:
        out.flush()
        out = os.fdopen(os.dup(fd), "w")
        saved = None if for_good else os.dup(fd)
        os.dup2(sys.stderr.fileno(), fd)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield out
    finally:
        out.flush()
        if fd is not None and saved is not None:
            os.dup2(saved, fd)
            os.close(saved)
            out.close()
