"""A connection to a cluster's Ray job API: its address, its auth token, and Ray's
connection, authentication and lookup failures as lmforge's one-line errors."""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Optional

from lmforge.errors import UserError, first_line

DEFAULT_ADDRESS = "http://127.0.0.1:8265"
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")


class ClusterUnreachable(UserError):
    """Nothing answers at the address, or it is not a Ray job API."""


class AuthenticationFailed(UserError):
    """The cluster wants a token this client did not send, or sent wrong."""


class UnknownJob(UserError):
    """No job with that id on the cluster."""


def address_of(address: Optional[str]) -> str:
    return address or os.environ.get("RAY_ADDRESS") or DEFAULT_ADDRESS


@contextmanager
def translated(address: str, job_id: Optional[str] = None):
    """Ray's exceptions for an unreachable cluster, a refused token or an unknown job,
    as lmforge's (each a `UserError`: one line, exit 2 on the CLI)."""
    from ray.exceptions import AuthenticationError

    try:
        yield
    except AuthenticationError:
        raise AuthenticationFailed(
            f"{address}: the cluster refused this client's auth token (set RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH to the "
            "cluster's token, or pass token=)"
        ) from None
    except ConnectionError as err:
        raise ClusterUnreachable(f"{address}: no Ray job API answers there ({first_line(err)})") from None
    except RuntimeError as err:
        if job_id is not None and "404" in str(err):
            raise UnknownJob(f"{address}: no job {job_id!r} on this cluster (`lmforge jobs` lists them)") from None
        raise


def connect(address: Optional[str] = None, token: Optional[str] = None):
    """A `JobSubmissionClient` for `address` (default: RAY_ADDRESS, else the local
    dashboard). `token`: the cluster's auth token, if not in Ray's environment variables."""
    from ray.job_submission import JobSubmissionClient

    address = address_of(address)
    token = token or cluster_token()
    headers = {"Authorization": f"Bearer {token}"} if token else None
    with translated(address):
        return JobSubmissionClient(address, headers=headers)


def cluster_token() -> Optional[str]:
    """Ray's own settings for the token (RAY_AUTH_TOKEN, else the file RAY_AUTH_TOKEN_PATH
    names), whether or not RAY_AUTH_MODE is set in this process."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return os.environ["RAY_AUTH_TOKEN"].strip()
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    if path:
        try:
            return open(path).read().strip()
        except OSError as err:
            raise UserError(f"RAY_AUTH_TOKEN_PATH: cannot read {path} ({err.strerror})") from None
    return None
