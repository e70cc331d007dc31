"""The gRPC API's checked-in Python modules are what `make proto` generates from
completions.proto today (grpcio-tools, as pinned): an edit to the .proto without
regenerating fails here, not in a client."""

import shutil
from pathlib import Path

import pytest
from grpc_tools import protoc

import lmforge

PLATFORM = Path(lmforge.__file__).parents[1]
PROTO = "lmforge/serve/proto/completions.proto"


def test_the_generated_modules_are_current(tmp_path):
    (tmp_path / PROTO).parent.mkdir(parents=True)
    shutil.copy(PLATFORM / PROTO, tmp_path / PROTO)
    flags = [f"--python_out={tmp_path}", f"--grpc_python_out={tmp_path}", f"--pyi_out={tmp_path}"]
    assert protoc.main(["protoc", f"-I{tmp_path}", *flags, PROTO]) == 0
    for suffix in ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi"):
        name = PROTO.replace(".proto", suffix)
        if (tmp_path / name).read_text() != (PLATFORM / name).read_text():
            pytest.fail(f"{name} is stale: run `make proto`")
