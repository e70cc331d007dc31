"""DCP readers that never run code from a checkpoint: DCP keeps a checkpoint's index
(`.metadata`) as a pickle and reads it with `pickle.load`, so a crafted file would run
its payload wherever a checkpoint is opened (`export`, `generate`, a teacher). These
readers unpickle it with only the classes DCP's metadata is made of (checked with
torch 2.13); anything else is refused, naming the file. Tensors and bytes are read as
DCP reads them (`weights_only`)."""

from __future__ import annotations

import pathlib
import pickle

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint.filesystem import _StorageInfo

ALLOWED = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): torch.Size,
    ("pathlib", "PosixPath"): pathlib.PosixPath,
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
    ("collections", "OrderedDict"): __import__("collections").OrderedDict,
}


class MetadataRefused(pickle.UnpicklingError):
    pass


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in ALLOWED:
            return ALLOWED[(module, name)]
        if module == dcp_metadata.__name__ and isinstance(getattr(dcp_metadata, name, None), type):
            return getattr(dcp_metadata, name)  # its dataclasses and enums
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == "torch.serialization" and name == "_get_layout":
            return torch.serialization._get_layout  # a layout by its name
        raise MetadataRefused(f"{module}.{name} is not part of a checkpoint's metadata")


class _SafeMetadata:
    def read_metadata(self, *args, **kwargs):
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            try:
                metadata = _MetadataUnpickler(stream).load()
            except MetadataRefused as err:
                raise MetadataRefused(f"{path}: refused to unpickle it: {err}") from None
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeFileSystemReader(_SafeMetadata, dcp.FileSystemReader):
    pass


class SafeFsspecReader(_SafeMetadata, FsspecReader):
    pass
