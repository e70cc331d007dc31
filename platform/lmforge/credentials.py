"""Credentials are used, never written down. One place finds every value of a job
that may carry one: a URI's `user:password@` and its `password=`/`token=` query
parameters, and any field named like a secret anywhere in the tree (DeepSpeed's
`comet.api_key`). What a run logs, records, prints or submits goes through `redact`."""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

REDACTED = "***"
# A field or query parameter named like a secret: `password`, `api_key`, `comet.api_key`,
# `aws_secret_access_key`, `auth_token` (but not `tokenizer` or `max_tokens`).
SECRET_NAME = re.compile(
    r"(^|[_.-])(password|passwd|pwd|secret|secret[_-]access[_-]key|token|api[_-]?key|apikey|credentials?|"
    r"private[_-]?key|signature|sig)$",
    re.I,
)


def is_secret_name(name: str) -> bool:
    return bool(SECRET_NAME.search(str(name)))


def redact_uri(uri: str) -> str:
    """`uri` with its password (and any secret-named query parameter) replaced by ***."""
    if "://" not in uri:
        return uri
    parts = urlsplit(uri)
    netloc = parts.netloc
    if "@" in netloc:
        user, _, host = netloc.rpartition("@")
        name = user.split(":", 1)[0]
        netloc = f"{name}:{REDACTED}@{host}" if ":" in user else f"{REDACTED}@{host}"
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    query = urlencode([(key, REDACTED if is_secret_name(key) else value) for key, value in pairs], safe="*")
    if netloc == parts.netloc and not any(is_secret_name(key) for key, _ in pairs):
        return uri  # rebuilding would fold `sqlite:///path`'s empty host away
    return urlunsplit(parts._replace(netloc=netloc, query=query))


def without_credentials(uri: str) -> str:
    """A URI as it may be written down and still used (its credentials then come from
    the environment, as MLflow's MLFLOW_TRACKING_USERNAME/PASSWORD): `user:password@`
    and secret-named query parameters dropped."""
    if "://" not in uri:
        return uri
    if redact_uri(uri) == uri:
        return uri
    parts = urlsplit(uri)
    query = urlencode([(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True) if not is_secret_name(k)])
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2], query=query))


def redact(value: Any, name: str = "") -> Any:
    """A copy of `value` (a job as a dict, a list, a string) with every secret replaced."""
    if isinstance(value, dict):
        return {key: redact(item, str(key)) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact(item, name) for item in value]
    if is_secret_name(name) and value not in (None, ""):
        return REDACTED
    if isinstance(value, str):
        return redact_uri(value)
    return value


def secret_fields(value: Any, path: str = "") -> list[str]:
    """The dotted fields of `value` that hold a secret (what `redact` would change)."""
    if isinstance(value, dict):
        return [found for key, item in value.items() for found in secret_fields(item, f"{path}.{key}" if path else str(key))]
    if isinstance(value, (list, tuple)):
        return [found for i, item in enumerate(value) for found in secret_fields(item, f"{path}[{i}]")]
    return [path] if redact(value, path.rsplit(".", 1)[-1]) != value else []
