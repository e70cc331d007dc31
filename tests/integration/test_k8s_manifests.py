"""The KubeRay deployment, rendered per overlay (k8s/render.py): every manifest is
valid (KubeRay kinds strictly against the vendored CRD schemas, their pod templates
and the core kinds against Kubernetes' own schemas via kubernetes-validate), and
the security properties hold: no container as root, no credential in plain text or
in a process's argv, the autoscaler's token in its container alone, MLflow behind
authentication, token auth on, Ray's ports closed outside the namespace, egress
bounded for every pod, requests on every container, images pinned by digest, and a
build context that ships no repository, runs or databases."""

import copy
import functools
import json
import re
import shlex
import subprocess
import sys

import jsonschema
import kubernetes_validate
import pytest
import yaml

from conftest import REPO

K8S = REPO / "k8s"
sys.path.insert(0, str(K8S))
sys.path.insert(0, str(K8S / "schemas"))
from render import images, merge, render, unpinned  # noqa: E402
from trim import OVERLAYS, trim  # noqa: E402

KUBERNETES = "1.30"
SECRET_NAME = re.compile(r"PASSWORD|TOKEN|SECRET|CREDENTIAL|API_KEY", re.IGNORECASE)


@functools.lru_cache(maxsize=None)
def rendered(overlay: str) -> tuple:
    return tuple(render(overlay))


def every_doc():
    return [(overlay, doc) for overlay in OVERLAYS for doc in rendered(overlay)]


@functools.lru_cache(maxsize=None)
def vendored(kind: str) -> dict:
    return json.loads((K8S / "schemas" / f"{kind.lower()}.json").read_text())["schema"]


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


def cluster_specs(doc: dict) -> list[dict]:
    if doc["kind"] == "RayCluster":
        return [doc["spec"]]
    return [doc["spec"]["rayClusterSpec"]] if doc["kind"] == "RayJob" else []


def ray_pod_templates(doc: dict) -> list[dict]:
    """The templates of a Ray cluster's pods: the head's and each worker group's."""
    return [spec["headGroupSpec"]["template"] for spec in cluster_specs(doc)] + [
        group["template"] for spec in cluster_specs(doc) for group in spec.get("workerGroupSpecs", [])
    ]


def pod_templates(doc: dict) -> list[dict]:
    """Every pod template a manifest holds, KubeRay's included."""
    templates = ray_pod_templates(doc)
    if doc["kind"] == "RayJob" and "submitterPodTemplate" in doc["spec"]:
        templates.append(doc["spec"]["submitterPodTemplate"])
    if doc["kind"] in ("Deployment", "StatefulSet"):
        templates.append(doc["spec"]["template"])
    return templates


def containers(doc: dict):
    """(pod spec, container) for every container, the autoscaler's sidecar included."""
    for template in pod_templates(doc):
        for container in template["spec"].get("initContainers", []) + template["spec"]["containers"]:
            yield template["spec"], container
    for spec in cluster_specs(doc):
        if spec.get("enableInTreeAutoscaling"):
            yield {}, {"name": "autoscaler", **spec.get("autoscalerOptions", {})}


@pytest.mark.parametrize("overlay, doc", every_doc(), ids=lambda v: v if isinstance(v, str) else f"{v['kind']}/{v['metadata']['name']}")
def test_manifest_is_valid(overlay, doc):
    if doc["apiVersion"] == "ray.io/v1":
        jsonschema.validate(doc, strict(vendored(doc["kind"])))
        for template in pod_templates(doc):
            kubernetes_validate.validate(
                {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": template}, KUBERNETES, strict=True
            )
    else:
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)


def test_vendored_schemas_hold_just_the_fields_the_manifests_use():
    """Trimming the vendored schemas again changes nothing: no field is kept that no
    overlay sets (a field an overlay sets but the schema lacks fails validation above)."""
    docs = [doc for _, doc in every_doc()]
    for kind in ("RayCluster", "RayJob"):
        assert trim(vendored(kind), [doc for doc in docs if doc["kind"] == kind]) == vendored(kind), kind


ARGV_SECRET = re.compile(r"\$\((\w+)\)")


def insecure(doc: dict) -> list[str]:
    """What in one manifest breaks the security rules: a container that may run as
    root or escalate, one without requests, a credential written in plain text or
    expanded into a process's argv (where `ps` shows it), the head's Kubernetes token
    mounted where job code runs, an MLflow server that takes unauthenticated writes."""
    problems = []
    if doc["kind"] == "Secret":
        problems.append("a Secret in a manifest (Secrets are created out of band, never committed)")
    for pod, container in containers(doc):
        context = {**pod.get("securityContext", {}), **container.get("securityContext", {})}
        if context.get("runAsNonRoot") is not True or context.get("runAsUser") == 0:
            problems.append(f"{container['name']} may run as root")
        if context.get("allowPrivilegeEscalation") is not False or context.get("capabilities", {}).get("drop") != ["ALL"]:
            problems.append(f"{container['name']} may gain privileges")
        if not {"cpu", "memory"} <= set(container.get("resources", {}).get("requests", {})):
            problems.append(f"{container['name']} requests no cpu or memory")
        problems += [
            f"{variable['name']} in plain text"
            for variable in container.get("env", [])
            if SECRET_NAME.search(variable["name"]) and "value" in variable
        ]
        argv = " ".join(container.get("command", []) + container.get("args", []))
        problems += [f"{name} in a process's argv" for name in ARGV_SECRET.findall(argv) if SECRET_NAME.search(name)]
        problems += ["a password in a process's argv" for _ in re.findall(r"--requirepass\b", argv)]
    text = json.dumps(doc)
    problems += [f"credentials in {url}" for url in re.findall(r"[a-z]+://[^\s\"/]*@", text)]
    problems += [
        "the GCS Redis password in plain text"
        for spec in cluster_specs(doc)
        if "value" in spec.get("gcsFaultToleranceOptions", {}).get("redisPassword", {})
    ]
    for spec in cluster_specs(doc):
        head = spec["headGroupSpec"]["template"]["spec"]
        if head.get("automountServiceAccountToken") is not False:
            problems.append("job code on the head can read the autoscaler's Kubernetes token")
        mounts = [m["name"] for c in head["containers"] for m in c.get("volumeMounts", [])]
        if "autoscaler-token" in mounts:
            problems.append("the autoscaler's token is mounted where job code runs")
    if doc["kind"] == "Deployment" and doc["metadata"]["name"] == "lmforge-mlflow":
        if "--app-name=basic-auth" not in doc["spec"]["template"]["spec"]["containers"][0].get("args", []):
            problems.append("MLflow takes requests without authentication")
    return problems


def test_no_container_runs_as_root_and_no_credential_is_written():
    for overlay, doc in every_doc():
        assert insecure(doc) == [], f"{overlay}: {doc['kind']}/{doc['metadata']['name']}"


def test_the_security_rules_catch_each_mistake():
    docs = {(doc["kind"], doc["metadata"]["name"]): doc for doc in rendered("gpu-8x")}

    def broken(key, change):
        doc = copy.deepcopy(docs[key])
        change(doc)
        return insecure(doc)

    head = lambda doc: doc["spec"]["headGroupSpec"]["template"]["spec"]
    mlflow = lambda doc: doc["spec"]["template"]["spec"]["containers"][0]
    cluster, server, redis = ("RayCluster", "lmforge"), ("Deployment", "lmforge-mlflow"), ("Deployment", "lmforge-redis")
    assert broken(cluster, lambda d: head(d)["securityContext"].update(runAsUser=0)) == ["ray-head may run as root"]
    assert broken(cluster, lambda d: d["spec"]["autoscalerOptions"]["securityContext"].pop("allowPrivilegeEscalation")) == [
        "autoscaler may gain privileges"
    ]
    assert broken(cluster, lambda d: d["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"].pop("requests")) == [
        "ray-worker requests no cpu or memory"
    ]
    assert broken(server, lambda d: mlflow(d)["env"].append({"name": "AWS_SECRET_ACCESS_KEY", "value": "x"})) == [
        "AWS_SECRET_ACCESS_KEY in plain text"
    ]
    assert broken(server, lambda d: mlflow(d)["args"].__setitem__(1, "--backend-store-uri=postgresql://mlflow:hunter2@db/mlflow")) == [
        "credentials in postgresql://mlflow:hunter2@"
    ]
    assert broken(server, lambda d: mlflow(d)["args"].__setitem__(1, "--backend-store-uri=postgresql://$(PGUSER):$(PGPASSWORD)@db/mlflow")) == [
        "PGPASSWORD in a process's argv",
        "credentials in postgresql://$(PGUSER):$(PGPASSWORD)@",
    ]
    assert broken(server, lambda d: mlflow(d)["args"].remove("--app-name=basic-auth")) == ["MLflow takes requests without authentication"]
    assert broken(redis, lambda d: d["spec"]["template"]["spec"]["containers"][0]["args"].extend(["--requirepass", "$(REDIS_PASSWORD)"])) == [
        "REDIS_PASSWORD in a process's argv",
        "a password in a process's argv",
    ]
    assert broken(cluster, lambda d: head(d).pop("automountServiceAccountToken")) == [
        "job code on the head can read the autoscaler's Kubernetes token"
    ]
    assert broken(cluster, lambda d: head(d)["containers"][0]["volumeMounts"].append({"name": "autoscaler-token", "mountPath": "/t"})) == [
        "the autoscaler's token is mounted where job code runs"
    ]
    assert broken(cluster, lambda d: d["spec"]["gcsFaultToleranceOptions"].update(redisPassword={"value": "hunter2"})) == [
        "the GCS Redis password in plain text"
    ]
    assert insecure({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s"}, "stringData": {"password": "x"}}) != []


def test_token_auth_is_on_and_ray_ports_admit_only_the_namespace():
    for overlay in OVERLAYS:
        docs = rendered(overlay)
        clusters = [spec for doc in docs for spec in cluster_specs(doc)]
        assert len(clusters) == 3 and all(spec["authOptions"]["mode"] == "token" for spec in clusters)
        ray_labels = {"app.kubernetes.io/component": "ray"}
        assert all(ray_labels.items() <= template["metadata"]["labels"].items() for doc in docs for template in ray_pod_templates(doc))
        policy = next(d for d in docs if d["kind"] == "NetworkPolicy" and d["spec"]["podSelector"]["matchLabels"] == ray_labels)
        assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
        for rule in policy["spec"]["ingress"]:
            for peer in rule["from"]:
                assert "ipBlock" not in peer
                if "namespaceSelector" in peer:  # another namespace: one named namespace, one port, never the GCS
                    assert peer["namespaceSelector"]["matchLabels"].keys() == {"kubernetes.io/metadata.name"}
                    assert [port["port"] for port in rule["ports"]] in ([8265], [8080])
                else:
                    assert peer == {"podSelector": {}}
        assert unbounded(docs) == [], overlay


def unbounded(docs) -> list[str]:
    """Pods whose traffic no policy bounds: every component with a pod template needs
    ingress and egress rules, and egress to the wide network must spare the cloud's
    metadata endpoint (it hands out the node's credentials) and name its ports."""
    problems = []
    policies = {json.dumps(d["spec"]["podSelector"]["matchLabels"], sort_keys=True): d["spec"] for d in docs if d["kind"] == "NetworkPolicy"}
    components = {template["metadata"]["labels"]["app.kubernetes.io/component"] for doc in docs for template in pod_templates(doc)}
    for component in sorted(components):
        policy = policies.get(json.dumps({"app.kubernetes.io/component": component}))
        if policy is None or set(policy["policyTypes"]) != {"Ingress", "Egress"}:
            problems.append(f"{component}: no ingress and egress policy")
            continue
        for rule in policy.get("egress", []):
            for peer in rule["to"]:
                block = peer.get("ipBlock")
                if block and block["cidr"] == "0.0.0.0/0" and ("169.254.169.254/32" not in block.get("except", []) or not rule.get("ports")):
                    problems.append(f"{component}: egress anywhere, the metadata endpoint or every port included")
    mlflow = policies[json.dumps({"app.kubernetes.io/component": "mlflow"})]
    if any(peer != {"podSelector": {"matchLabels": {"app.kubernetes.io/component": "ray"}}} for rule in mlflow["ingress"] for peer in rule["from"]):
        problems.append("mlflow: reachable from pods other than Ray's")
    return problems


def test_the_traffic_rules_catch_each_mistake():
    docs = rendered("gpu-8x")

    def broken(name, change):
        changed = copy.deepcopy(list(docs))
        change(next(d["spec"] for d in changed if d["kind"] == "NetworkPolicy" and d["metadata"]["name"] == name))
        return unbounded(changed)

    assert broken("lmforge-postgres", lambda p: p.update(policyTypes=["Ingress"])) == ["postgres: no ingress and egress policy"]
    assert broken("lmforge-ray", lambda p: p["egress"][2]["to"][0]["ipBlock"].pop("except")) == [
        "ray: egress anywhere, the metadata endpoint or every port included"
    ]
    assert broken("lmforge-mlflow", lambda p: p["egress"][2].pop("ports")) == [
        "mlflow: egress anywhere, the metadata endpoint or every port included"
    ]
    assert broken("lmforge-mlflow", lambda p: p["ingress"][0]["from"].__setitem__(0, {"podSelector": {}})) == [
        "mlflow: reachable from pods other than Ray's"
    ]


def test_gpu_overlay_shape_and_cpu_dev_without_gpus():
    gpu = next(doc for doc in rendered("gpu-8x") if doc["kind"] == "RayCluster")["spec"]
    (workers,) = gpu["workerGroupSpecs"]
    worker = workers["template"]["spec"]
    (container,) = worker["containers"]
    assert container["resources"]["requests"]["nvidia.com/gpu"] == workers["rayStartParams"]["num-gpus"] == "8"
    assert any(t["key"] == "nvidia.com/gpu" for t in worker["tolerations"])
    volumes = {v["name"]: v for v in worker["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    assert volumes[mounts["/data"]]["persistentVolumeClaim"]["claimName"] == "lmforge-data"
    assert gpu["enableInTreeAutoscaling"] and workers["minReplicas"] < workers["maxReplicas"]
    assert gpu["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"  # no ranks on the head
    fault_tolerance = gpu["gcsFaultToleranceOptions"]
    redis = next(doc for doc in rendered("gpu-8x") if doc["kind"] == "Service" and doc["metadata"]["name"] == "lmforge-redis")
    assert fault_tolerance["redisAddress"] == f"{redis['metadata']['name']}:{redis['spec']['ports'][0]['port']}"
    assert fault_tolerance["redisPassword"]["valueFrom"]["secretKeyRef"]["name"] == "lmforge-redis"

    cpu = next(doc for doc in rendered("cpu-dev") if doc["kind"] == "RayCluster")["spec"]
    assert "gcsFaultToleranceOptions" not in cpu
    assert not any("nvidia.com/gpu" in json.dumps(group) for group in cpu["workerGroupSpecs"])
    # the overlay changed the group's size and resources, and kept the base's security and volumes
    assert cpu["workerGroupSpecs"][0]["template"]["spec"]["securityContext"] == worker["securityContext"]
    assert cpu["workerGroupSpecs"][0]["template"]["spec"]["volumes"] == [volumes["data"]]


def test_rayjobs_run_valid_lmforge_jobs_on_the_overlays_cluster():
    from lmforge import sdk

    for overlay in OVERLAYS:
        docs = rendered(overlay)
        cluster = next(doc for doc in docs if doc["kind"] == "RayCluster")["spec"]
        jobs = {doc["metadata"]["name"]: doc["spec"] for doc in docs if doc["kind"] == "RayJob"}
        assert set(jobs) == {"lmforge-pretrain", "lmforge-distill"}
        for name, job in jobs.items():
            assert job["rayClusterSpec"] == cluster, name
            assert job["shutdownAfterJobFinishes"] and job["ttlSecondsAfterFinished"] > 0 and job["backoffLimit"] >= 1
            words = shlex.split(job["entrypoint"])
            assert words[:2] == ["lmforge", "train"]
            overrides = [words[i + 1] for i, word in enumerate(words) if word == "--set"]
            spec = sdk.load(REPO / words[2], overrides)
            assert spec.output_dir == "/data/runs" and spec.tracking.uri == "http://lmforge-mlflow:5000"
            assert (spec.distill is not None) == (name == "lmforge-distill")
            assert spec.resources.gpus_per_worker == (1 if overlay == "gpu-8x" and name == "lmforge-pretrain" else 0)


def test_validation_catches_mistakes():
    cluster = next(doc for doc in rendered("cpu-dev") if doc["kind"] == "RayCluster")
    schema = strict(vendored("RayCluster"))
    typo = copy.deepcopy(cluster)
    typo["spec"]["workerGroupSpecs"][0]["replica"] = 2
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(typo, schema)
    wrong_type = copy.deepcopy(cluster)
    wrong_type["spec"]["workerGroupSpecs"][0]["replicas"] = "two"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(wrong_type, schema)
    bad_mode = copy.deepcopy(cluster)
    bad_mode["spec"]["authOptions"]["mode"] = "password"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad_mode, schema)
    misspelt = copy.deepcopy(cluster["spec"]["workerGroupSpecs"][0]["template"])
    misspelt["spec"]["containers"][0]["resource"] = misspelt["spec"]["containers"][0].pop("resources")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(
            {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": misspelt}, KUBERNETES, strict=True
        )
    pvc = next(doc for doc in rendered("cpu-dev") if doc["kind"] == "PersistentVolumeClaim")
    bad_pvc = copy.deepcopy(pvc)
    bad_pvc["spec"]["accessMode"] = "ReadWriteMany"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad_pvc, KUBERNETES, strict=True)


def test_overlay_merge_rules():
    base = {"containers": [{"name": "a", "image": "x", "env": [{"name": "K", "value": "1"}]}, {"name": "b"}], "args": [1, 2], "drop": 1}
    patch = {
        "containers": [{"name": "a", "env": [{"name": "L", "value": "2"}]}, {"name": "b", "$patch": "delete"}, {"name": "c"}],
        "args": [3],
        "drop": None,
    }
    assert merge(base, patch) == {
        "containers": [{"name": "a", "image": "x", "env": [{"name": "K", "value": "1"}, {"name": "L", "value": "2"}]}, {"name": "c"}],
        "args": [3],
    }
    assert base["args"] == [1, 2]  # the base is not modified


def test_render_command_pins_every_image_by_digest():
    """A tag can be moved to other contents: rendering refuses an image not pinned by
    digest, unless told it is a development cluster."""
    command = [sys.executable, str(K8S / "render.py"), "gpu-8x"]
    tagged = sorted(images(rendered("gpu-8x")))
    assert tagged == ["lmforge:0.1.0", "postgres:17.6", "redis:7.4"]
    refused = subprocess.run(command, capture_output=True, text=True)
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr.strip().startswith("render: images not pinned by digest: lmforge:0.1.0, postgres:17.6, redis:7.4; pass --pin")
    pins = [f"--pin={image}=sha256:{str(i) * 64}" for i, image in enumerate(tagged)]
    out = subprocess.run(command + pins, capture_output=True, text=True)
    assert out.returncode == 0 and "kind: RayJob" in out.stdout and "nvidia.com/gpu" in out.stdout
    docs = list(yaml.safe_load_all(out.stdout))
    assert unpinned(docs) == [] and sorted(images(docs)) == [f"{image}@sha256:{str(i) * 64}" for i, image in enumerate(tagged)]
    bad = subprocess.run(command + ["--pin", "redis:7.4=latest"], capture_output=True, text=True)
    assert bad.returncode == 2 and "expected IMAGE=sha256:<64 hex digits>" in bad.stderr
    assert subprocess.run(command + ["--allow-tags"], capture_output=True, text=True).returncode == 0


def test_the_image_build_pins_its_base_and_ships_no_repository_runs_or_databases():
    dockerfile = (K8S / "Dockerfile").read_text()
    bases = re.findall(r"^FROM\s+(\S+)", dockerfile, re.MULTILINE)
    assert bases and all(re.search(r"@(sha256:[0-9a-f]{64}|\$\{\w+\})$", base) for base in bases), bases
    assert re.search(r"^ARG RAY_DIGEST$", dockerfile, re.MULTILINE)  # required: no default that could go stale
    ignored = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines() if line.strip() and not line.startswith("#")]
    for path in (".git", ".venv", "runs", ".lmforge", "**/*.db", "mlruns", "**/__pycache__", ".env"):
        assert path in ignored, path
    missing = subprocess.run([sys.executable, str(K8S / "render.py"), "tpu"], capture_output=True, text=True)
    assert missing.returncode == 2 and missing.stderr.strip() == "render: no overlay 'tpu' (have: cpu-dev, gpu-8x)"


def test_grafana_dashboard_charts_every_exported_metric():
    from lmforge.tracking.prometheus import JOB_METRICS, RANK_METRICS

    dashboard = json.loads((K8S / "grafana" / "lmforge.json").read_text())
    queries = " ".join(target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", []))
    charted = set(re.findall(r"ray_(lmforge_\w+)", queries))
    assert charted == set(RANK_METRICS) | set(JOB_METRICS)
    assert {v["name"] for v in dashboard["templating"]["list"]} >= {"job"}
