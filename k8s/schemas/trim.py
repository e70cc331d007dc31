#!/usr/bin/env python3
"""Vendor the KubeRay CRD schemas the manifest tests need, trimmed to what the
rendered overlays use, so the tests run on a fresh clone without KubeRay's 2 MB of CRDs.

    python k8s/schemas/trim.py KUBERAY/ray-operator/config/crd/bases v1.7.0

Kept: every field some overlay sets, with its type, enum, pattern and the required
fields of its parent. Dropped: fields no manifest sets (so validation stays strict:
a field added later is refused until this is run again) and the pod templates,
which the tests validate with Kubernetes' own schemas instead."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from render import render  # noqa: E402

OVERLAYS = ("cpu-dev", "gpu-8x")
POD_TEMPLATES = ("template", "submitterPodTemplate")  # PodTemplateSpec: validated as core v1
OPAQUE = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}


def trim(schema: dict, instances: list) -> dict:
    kept = {key: value for key, value in schema.items() if key not in ("properties", "items", "additionalProperties", "description")}
    objects = [item for item in instances if isinstance(item, dict)]
    if "properties" in schema:
        used = {key for item in objects for key in item}
        kept["properties"] = {
            key: OPAQUE if key in POD_TEMPLATES else trim(sub, [item[key] for item in objects if key in item])
            for key, sub in schema["properties"].items() if key in used
        }
    if isinstance(schema.get("additionalProperties"), dict):
        kept["additionalProperties"] = trim(schema["additionalProperties"], [v for item in objects for v in item.values()])
    if "items" in schema:
        kept["items"] = trim(schema["items"], [v for item in instances if isinstance(item, list) for v in item])
    return kept


def main() -> None:
    crds, kuberay = Path(sys.argv[1]), sys.argv[2]
    docs = [doc for overlay in OVERLAYS for doc in render(overlay) if doc["apiVersion"] == "ray.io/v1"]
    for kind in sorted({doc["kind"] for doc in docs}):
        crd = next(d for path in crds.glob("*.yaml") for d in yaml.safe_load_all(path.read_text()) if d and d["spec"]["names"]["kind"] == kind)
        version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
        trimmed = trim(version["schema"]["openAPIV3Schema"], [doc for doc in docs if doc["kind"] == kind])
        out = HERE / f"{kind.lower()}.json"
        out.write_text(json.dumps({"kind": kind, "kuberay": kuberay, "schema": trimmed}, indent=1, sort_keys=True) + "\n")
        print(f"{out.name}: {out.stat().st_size:,} bytes")


if __name__ == "__main__":
    main()
