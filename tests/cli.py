"""Running the `lmforge` command line in a test: in this process through the console
script's own entry point (`lmforge.cli.main`, the same code a shell runs, without
a second of interpreter and torch start-up per command), or as a real process for
what only a process shows (the entry point itself, commands that start Ray)."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


def run_cli(*args: str, cwd: Path) -> Result:
    """`lmforge ARGS` run in `cwd`, in this process. An exception that escapes
    `main` is what the interpreter would print: a traceback on stderr, exit code 1."""
    out, err = io.StringIO(), io.StringIO()
    here = os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            from lmforge.cli import main

            try:
                code = main(list(args))
            except SystemExit as exit_:  # argparse's own errors
                code = exit_.code if isinstance(exit_.code, int) else 1
            except Exception:  # noqa: BLE001 - reported as the process would report it
                traceback.print_exc()
                code = 1
    finally:
        os.chdir(here)
    return Result(code, out.getvalue(), err.getvalue())


def run_cli_process(*args: str, cwd: Path, timeout_s: float = 300, env: dict | None = None) -> Result:
    """`python -m lmforge ARGS` as its own process (`env`: more variables for it)."""
    env = os.environ | {"OMP_NUM_THREADS": "1"} | (env or {})
    done = subprocess.run([sys.executable, "-m", "lmforge", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s)
    return Result(done.returncode, done.stdout, done.stderr)


def assert_clean_error(result: Result, *fragments: str) -> None:
    """Exit code 2, no traceback, one `lmforge: error:` line holding each fragment."""
    assert result.returncode == 2, result.stderr + result.stdout
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("lmforge: error:")]
    assert len(lines) == 1, result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
