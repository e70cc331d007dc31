"""`lmforge` command line: a module per command group, each command a thin call of one
`lmforge.sdk` function (so a shell and a notebook cannot drift apart); the flags they
share are defined once (`common.py`).

Bad input (a `UserError`) prints one line and exits 2 without a traceback. Nothing
here imports torch: the SDK loads when a command runs, so `lmforge --help` and a bad
job file answer in a second.
"""

from __future__ import annotations

import argparse
import os
import sys

from lmforge import __version__
from lmforge.cli import common, distill, jobs, models, serving, training
from lmforge.errors import TrainingFailed, UserError

GROUPS = (training, distill, models, serving, jobs)


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="lmforge", description="Elastic LLM training on Ray.")
    sub = top.add_subparsers(dest="command", required=True)
    for group in GROUPS:
        group.add_parsers(sub)
    sub.add_parser("version", help="print the version").set_defaults(run=_version)
    return top


def _version(args) -> int:
    print(__version__)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    # Ray Data logs every dataset execution at INFO; the CLI shows its own progress.
    os.environ.setdefault("RAY_DATA_LOG_LEVEL", "WARNING")
    try:
        # Called as the `lmforge` program (no argv given), the process ends with the command.
        with common.stdout_for_json(getattr(args, "json", False), for_good=argv is None) as args.stdout:
            return args.run(args)
    except UserError as err:
        print(f"lmforge: error: {err}", file=sys.stderr)
        return err.exit_code
    except TrainingFailed as err:
        print(f"lmforge: training failed: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("lmforge: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
