"""`lmforge submit | jobs | status | logs | stop`: jobs on a cluster, over `lmforge.jobs`
(what `sdk.submit`, `sdk.job` and `sdk.jobs` are)."""

from __future__ import annotations

import json
import sys

from rich.table import Table

from lmforge import jobs
from lmforge.cli import common
from lmforge.console import text_console


def add_parsers(sub) -> None:
    def cluster_flags(parser):
        parser.add_argument("--address", help="the cluster's job API, http://HOST:8265 (default: RAY_ADDRESS, else http://127.0.0.1:8265)")
        parser.add_argument("--token", help="the cluster's auth token (default: RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH)")

    submit = sub.add_parser("submit", help="run a job on a Ray cluster through its job API; it outlives this command")
    common.add_job(submit, help="job YAML file (validated here before anything is submitted)")
    submit.add_argument("--working-dir", help="directory to upload as the job's working directory (relative paths in the job resolve there)")
    submit.add_argument("--follow", action="store_true", help="show the job's output until it ends; exit 1 if it failed")
    cluster_flags(submit)
    submit.set_defaults(run=run)
    listing = sub.add_parser("jobs", help="list the cluster's lmforge jobs")
    listing.add_argument("--json", action="store_true", help="print the list as JSON")
    cluster_flags(listing)
    listing.set_defaults(run=run)
    for name, text in (("status", "a job's status"), ("logs", "a job's output"), ("stop", "stop a running job")):
        parser = sub.add_parser(name, help=text)
        parser.add_argument("id", help="the job's id (as `lmforge submit` printed it, or from `lmforge jobs`)")
        if name == "logs":
            parser.add_argument("--follow", action="store_true", help="keep printing until the job ends")
            parser.add_argument("--events", action="store_true", help="include the driver's JSON event lines")
        if name == "status":
            parser.add_argument("--json", action="store_true", help="the status and, once finished, the summary as JSON")
        cluster_flags(parser)
        parser.set_defaults(run=run)


def run(args) -> int:
    if args.command == "submit":
        handle = jobs.submit(args.job, args.overrides, address=args.address, working_dir=args.working_dir, token=args.token)
        print(handle.id)
        print(f"submitted to {handle.address}: follow with `lmforge logs {handle.id} --follow`", file=sys.stderr)
        if args.follow:
            handle.logs(follow=True)
            handle.wait()
        return 0
    if args.command == "jobs":
        frame = jobs.jobs(args.address, args.token)
        if args.json:
            print(frame.to_json(orient="records", date_format="iso"), file=args.stdout)
        else:
            _table(frame)
        return 0
    handle = jobs.job(args.id, args.address, args.token)
    if args.command == "status":
        status = handle.status()
        summary = handle.summary()
        print(
            json.dumps({"id": handle.id, "status": status, "summary": summary and summary.as_json()}, indent=2) if args.json else status,
            file=args.stdout,
        )
        return 0
    if args.command == "logs":
        if args.follow:
            handle.logs(follow=True, events=args.events)
        else:
            sys.stdout.write(handle.logs(events=args.events))
        return 0
    stopped = handle.stop()
    print(f"{handle.id}: {'stopping' if stopped else 'already ended (' + handle.status() + ')'}", file=sys.stderr)
    return 0


def _table(frame) -> None:
    table = Table(show_edge=False)
    for column in ("id", "job", "status", "start", "end"):
        table.add_column(column)
    for row in frame.itertuples():
        table.add_row(row.id, row.job, row.status, _when(row.start), _when(row.end))
    text_console(stderr=False).print(table)


def _when(stamp) -> str:
    return "" if stamp is None or stamp != stamp else stamp.strftime("%Y-%m-%d %H:%M:%S")
