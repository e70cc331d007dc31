"""Jobs on a remote Ray cluster, driven from a notebook or a shell: submit a job file
through Ray's job API, then follow, measure, plot and stop it. The driver runs on the
cluster, so the job outlives the process that submitted it."""

from lmforge.jobs.client import job, jobs, runs, submit
from lmforge.jobs.handle import JobHandle

__all__ = ["JobHandle", "job", "jobs", "runs", "submit"]
