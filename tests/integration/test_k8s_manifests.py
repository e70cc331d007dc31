"""The KubeRay manifests validate against the KubeRay v1 CRD schemas (strictly:
an unknown field anywhere is an error, as with `kubectl --validate=strict`) and
the core kinds against Kubernetes' own schemas via kubernetes-validate."""

import copy
import functools

import jsonschema
import kubernetes_validate
import pytest
import yaml

from conftest import REPO

CRDS = REPO.parent / "shared" / "kuberay-crds"
K8S = REPO / "k8s"


@functools.lru_cache(maxsize=None)
def crd_schema(kind: str) -> dict:
    for path in CRDS.glob("*.yaml"):
        for doc in yaml.load_all(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
            if doc and doc["spec"]["names"]["kind"] == kind:
                version = next(v for v in doc["spec"]["versions"] if v["name"] == "v1")
                return strict(version["schema"]["openAPIV3Schema"])
    raise LookupError(kind)


def strict(schema: dict) -> dict:
    """Forbid properties a schema does not declare, unless it preserves unknown fields."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if "properties" in node and "additionalProperties" not in node and not node.get("x-kubernetes-preserve-unknown-fields"):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


def manifests():
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            yield path.name, doc


pytestmark = pytest.mark.skipif(not CRDS.is_dir(), reason="KubeRay CRDs are not beside the repository")


@pytest.mark.parametrize("name, doc", list(manifests()), ids=lambda v: v if isinstance(v, str) else "")
def test_manifest_is_valid(name, doc):
    if doc["apiVersion"] == "ray.io/v1":
        jsonschema.validate(doc, crd_schema(doc["kind"]))
    else:
        kubernetes_validate.validate(doc, "1.30", strict=True)


def test_rayjob_runs_the_quickstart_with_lmforge():
    job = next(doc for _, doc in manifests() if doc["kind"] == "RayJob")
    assert job["spec"]["entrypoint"].startswith("lmforge train jobs/quickstart.yaml")
    assert (REPO / "jobs" / "quickstart.yaml").exists()
    assert job["spec"]["backoffLimit"] >= 1


def test_validation_catches_mistakes():
    cluster = next(doc for _, doc in manifests() if doc["kind"] == "RayCluster")
    typo = copy.deepcopy(cluster)
    typo["spec"]["workerGroupSpecs"][0]["replica"] = 2
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(typo, crd_schema("RayCluster"))
    wrong_type = copy.deepcopy(cluster)
    wrong_type["spec"]["workerGroupSpecs"][0]["replicas"] = "two"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(wrong_type, crd_schema("RayCluster"))
    pvc = next(doc for _, doc in manifests() if doc["kind"] == "PersistentVolumeClaim")
    bad_pvc = copy.deepcopy(pvc)
    bad_pvc["spec"]["accessMode"] = "ReadWriteMany"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad_pvc, "1.30", strict=True)
