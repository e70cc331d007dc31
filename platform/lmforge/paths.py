"""The job file's paths. A field typed `LocalPath` (a file or directory, or an fsspec
URI) or `CorpusPath` (also `builtin:NAME`) is resolved against the driver's working
directory by `resolve_paths`, so rank actors, whose working directory may differ,
see the same files. A section that gains a path types it so; nothing else is kept
in step."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Annotated, Any, Union, get_args

from pydantic import BaseModel


@dataclass(frozen=True)
class _Resolved:
    builtin: bool = False  # `builtin:NAME` names a corpus lmforge ships: left as is

    def resolve(self, path: str) -> str:
        if "://" in path or (self.builtin and path.startswith("builtin:")):
            return path
        return os.path.abspath(path)


LocalPath = Annotated[str, _Resolved()]
CorpusPath = Annotated[str, _Resolved(builtin=True)]


def resolve_paths(model: BaseModel) -> Any:
    """`model` (a section, or the whole job) with every path field made absolute,
    its sections' and their lists' too."""
    updates: dict[str, Any] = {}
    for name, field in type(model).model_fields.items():
        value = getattr(model, name)
        if value is None:
            continue
        marker = _marker(field.metadata) or _marker(get_args(field.annotation), deep=True)
        if isinstance(value, BaseModel):  # a section (also where a field is a path or a section: distill.teacher)
            updates[name] = resolve_paths(value)
        elif marker is not None:
            updates[name] = [marker.resolve(v) for v in value] if isinstance(value, list) else marker.resolve(value)
        elif isinstance(value, list) and any(isinstance(v, BaseModel) for v in value):
            updates[name] = [resolve_paths(v) if isinstance(v, BaseModel) else v for v in value]
    return model.model_copy(update=updates) if updates else model


def _marker(items: Union[tuple, list], deep: bool = False) -> _Resolved | None:
    """The path marker among a field's metadata, or (`deep`) inside its annotation's
    arguments: Optional[LocalPath] and list[LocalPath] carry it one level down."""
    for item in items:
        if isinstance(item, _Resolved):
            return item
        if deep:
            found = _marker(getattr(item, "__metadata__", ())) or _marker(get_args(item), deep=True)
            if found is not None:
                return found
    return None
