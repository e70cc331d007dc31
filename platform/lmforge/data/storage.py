"""Where datasets live: a local directory or any fsspec URI (`s3://bucket/prefix`, ...).

Credentials come from the environment (for S3: AWS_* variables, a profile, an
instance role), never from the job file. Every failure becomes one `UserError`
naming the URI and the field it came from, so a missing bucket or a denied
request reads the same for prepare, training and evaluation.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import fsspec

from lmforge.errors import UserError
from lmforge.jsonfile import parse_object


def is_uri(path: str) -> bool:
    return "://" in str(path) and not str(path).startswith("file://")


def join(root: str | Path, *parts: str) -> str:
    """`root`/parts: a path, or a URI whose `//` a `Path` would fold away."""
    if is_uri(str(root)):
        return "/".join([str(root).rstrip("/"), *parts])
    return str(Path(root, *parts))


def _filesystem(path: str):
    # Listings uncached: a dataset another process is writing must be seen as it is now.
    return fsspec.core.url_to_fs(str(path), use_listings_cache=False)


@contextmanager
def named(uri: str, field: str):
    """Errors inside become one line: `field: uri: what went wrong`."""
    try:
        yield
    except UserError:
        raise
    except PermissionError as err:
        raise UserError(f"{field}: {uri}: access denied ({_reason(err)}); check the credentials in the environment") from None
    except FileNotFoundError as err:
        raise UserError(f"{field}: {uri}: not found ({_reason(err)})") from None
    except Exception as err:  # noqa: BLE001 - fsspec backends raise their own kinds (botocore's for an endpoint down)
        raise UserError(f"{field}: {uri}: unreadable ({_reason(err)})") from None


def _reason(err: Exception) -> str:
    return str(err).splitlines()[0] if str(err) else type(err).__name__


def exists(path: str, field: str) -> bool:
    with named(path, field):
        fs, inner = _filesystem(path)
        return fs.exists(inner)


def check_bucket(uri: str, field: str) -> None:
    """An object-store URI's bucket exists and answers (before anything is started)."""
    if not is_uri(uri):
        return
    with named(uri, field):
        fs, inner = _filesystem(uri)
        bucket = inner.split("/", 1)[0]
        if not fs.exists(bucket):
            raise UserError(f"{field}: {uri}: the bucket {bucket} does not exist")


def read_text(path: str, field: str) -> str:
    with named(path, field):
        fs, inner = _filesystem(path)
        with fs.open(inner, "rb") as f:
            return f.read().decode()


def read_json(path: str, field: str) -> dict:
    """The JSON object in a file or object; UserError naming the field and the file otherwise."""
    try:
        return parse_object(read_text(path, field), path)
    except ValueError as err:
        raise UserError(f"{field}: {err}") from None


def write_bytes(path: str, data: bytes, field: str = "data.path") -> None:
    with named(path, field):
        fs, inner = _filesystem(path)
        if not is_uri(path):
            Path(inner).parent.mkdir(parents=True, exist_ok=True)
        with fs.open(inner, "wb") as f:
            f.write(data)


def file_sizes(directory: str, field: str) -> dict[str, int]:
    """Name -> bytes of the files directly in `directory` (one listing, sizes included)."""
    with named(directory, field):
        fs, inner = _filesystem(directory)
        if not fs.exists(inner):
            return {}
        return {
            entry["name"].rstrip("/").rsplit("/", 1)[-1]: entry.get("size") for entry in fs.ls(inner, detail=True) if entry.get("type") != "directory"
        }


def read_parquet(paths: list[str], columns: list[str]):
    """One table of the files' columns, in order (paths on one filesystem or store)."""
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq

    if not paths or not is_uri(paths[0]):
        return pq.read_table(paths, columns=columns)
    filesystem = pafs.FileSystem.from_uri(paths[0])[0]
    return pq.read_table([pafs.FileSystem.from_uri(p)[1] for p in paths], columns=columns, filesystem=filesystem)


def files_below(path: str, field: str) -> set[str]:
    """Every file at or below `path` (recursively), as the filesystem names them."""
    with named(path, field):
        fs, inner = _filesystem(path)
        if not fs.exists(inner):
            return set()
        if fs.isfile(inner):
            return {inner}
        return set(fs.find(inner))


def require_empty(path: str, field: str) -> None:
    """Refuse to write a new dataset over anything: a file, or a directory or prefix
    that holds files (what a failed run cleans up must be only what it wrote)."""
    with named(path, field):
        fs, inner = _filesystem(path)
        if fs.exists(inner) and fs.isfile(inner):
            raise UserError(f"{field}: {path} is a file; give a new or empty directory")
    held = files_below(path, field)
    if held:
        example = sorted(held)[0].rsplit("/", 1)[-1]
        raise UserError(f"{field}: {path} is not empty ({len(held)} files, e.g. {example}); give a new or empty directory")


def remove_files(paths: set[str], root: str) -> None:
    """Best effort: the files a failed run wrote below `root`, one by one (never the
    prefix or bucket itself, which may hold what others wrote meanwhile)."""
    fs, _ = _filesystem(root)
    for path in sorted(paths):
        try:
            fs.rm_file(path)
        except (OSError, ValueError):
            pass
