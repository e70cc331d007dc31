#!/usr/bin/env python3
"""Render a deployment: k8s/base with one overlay merged over it, as one YAML stream.

    python k8s/render.py gpu-8x --pin lmforge:0.1.0=sha256:... --pin postgres:17.6=sha256:... | kubectl apply -f -

An overlay is a folder of plain manifests. One whose kind and name match a base
manifest is merged into it (maps merge key by key; a list whose items all have a
`name` or `groupName` merges item by item; any other list, or `$patch: delete` on
an item, replaces or removes); any other is added. Then a manifest annotated
`lmforge.dev/extends: NAME` is merged over the one of its kind named NAME, and a
RayJob annotated `lmforge.dev/cluster-spec: NAME` gets the rendered RayCluster
NAME's spec as its rayClusterSpec, so each job's cluster is the one the overlay
describes.

Every image must then be pinned by digest (`--pin IMAGE=sha256:DIGEST`), since a tag
can be moved to other contents after it was reviewed; `--allow-tags` renders a
development cluster's manifests with tags as written."""

from __future__ import annotations

import argparse
import copy
import re
import sys
from pathlib import Path

import yaml

K8S = Path(__file__).resolve().parent
EXTENDS = "lmforge.dev/extends"
CLUSTER_SPEC_FROM = "lmforge.dev/cluster-spec"
LIST_KEYS = ("name", "groupName")
DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")


def load(folder: Path) -> list[dict]:
    docs = []
    for path in sorted(folder.glob("*.yaml")):
        docs.extend(doc for doc in yaml.safe_load_all(path.read_text()) if doc)
    return docs


def identity(doc: dict) -> tuple[str, str]:
    return doc["kind"], doc["metadata"]["name"]


def merge(base, patch):
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = copy.deepcopy(base)
        for key, value in patch.items():
            if value is None:
                merged.pop(key, None)
            else:
                merged[key] = merge(base.get(key), value)
        return merged
    if isinstance(base, list) and isinstance(patch, list) and (key := _list_key(base + patch)):
        merged = {item[key]: copy.deepcopy(item) for item in base}
        for item in patch:
            if item.get("$patch") == "delete":
                merged.pop(item[key], None)
            else:
                merged[item[key]] = merge(merged.get(item[key]), item)
        return list(merged.values())
    return copy.deepcopy(patch)


def _list_key(items: list):
    for key in LIST_KEYS:
        if items and all(isinstance(item, dict) and key in item for item in items):
            return key
    return None


def render(overlay: str) -> list[dict]:
    folder = K8S / "overlays" / overlay
    if not folder.is_dir():
        known = sorted(p.name for p in (K8S / "overlays").iterdir() if p.is_dir())
        print(f"render: no overlay {overlay!r} (have: {', '.join(known)})", file=sys.stderr)
        raise SystemExit(2)
    docs = {identity(doc): doc for doc in load(K8S / "base")}
    for patch in load(folder):
        docs[identity(patch)] = merge(docs.get(identity(patch)), patch)
    for key, doc in docs.items():
        if parent := _annotation(doc, EXTENDS):
            docs[key] = merge(docs[(doc["kind"], parent)], doc)
    for doc in docs.values():
        if source := _annotation(doc, CLUSTER_SPEC_FROM):
            doc["spec"]["rayClusterSpec"] = copy.deepcopy(docs[("RayCluster", source)]["spec"])
    return list(docs.values())


def images(node) -> set[str]:
    """Every container image a manifest (or any part of one) names."""
    if isinstance(node, dict):
        found = {node["image"]} if isinstance(node.get("image"), str) else set()
        return found.union(*(images(value) for value in node.values()))
    if isinstance(node, (list, tuple)):
        return set().union(*(images(item) for item in node))
    return set()


def pin(node, pins: dict[str, str]):
    """`node` with each image named in `pins` (IMAGE -> sha256:DIGEST) as IMAGE@DIGEST."""
    if isinstance(node, dict):
        return {key: (f"{value}@{pins[value]}" if key == "image" and value in pins else pin(value, pins)) for key, value in node.items()}
    if isinstance(node, (list, tuple)):
        return [pin(item, pins) for item in node]
    return node


def unpinned(docs: list[dict]) -> list[str]:
    return sorted(image for image in images(docs) if not DIGEST.match(image.rpartition("@")[2]))


def _pins(values: list[str]) -> dict[str, str]:
    pins = {}
    for value in values:
        image, _, digest = value.partition("=")
        if not DIGEST.match(digest):
            print(f"render: --pin {value!r}: expected IMAGE=sha256:<64 hex digits>", file=sys.stderr)
            raise SystemExit(2)
        pins[image] = digest
    return pins


def _annotation(doc: dict, name: str):
    return doc["metadata"].get("annotations", {}).get(name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overlay", help="a folder under k8s/overlays, e.g. cpu-dev or gpu-8x")
    parser.add_argument("--pin", action="append", default=[], metavar="IMAGE=sha256:DIGEST",
                        help="the digest an image is pinned to (crane digest IMAGE, or docker buildx imagetools inspect IMAGE)")
    parser.add_argument("--allow-tags", action="store_true", help="leave unpinned images as tagged (a development cluster)")
    args = parser.parse_args()
    docs = pin(render(args.overlay), _pins(args.pin))
    if unpinned(docs) and not args.allow_tags:
        print(f"render: images not pinned by digest: {', '.join(unpinned(docs))}; pass --pin IMAGE=sha256:DIGEST for each, "
              "or --allow-tags for a development cluster", file=sys.stderr)
        raise SystemExit(2)
    yaml.safe_dump_all(docs, sys.stdout, sort_keys=False)


if __name__ == "__main__":
    main()
