"""docs/deploy/'s Kubernetes manifests, offline: the built-in kinds validate against Kubernetes' OpenAPI schemas
(kubernetes-validate, strict), the CRDs (ServiceMonitor, InferenceService) have their required fields, and
every port, probe path and flag agrees with the launcher and the Dockerfile."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
import yaml

from pagedserve.client import launcher
from pagedserve.client.launcher import (
    GRPC_PORT,
    HTTP_PORT,
    LIVE_PATH,
    LLM_READY_PATH,
    METRICS_PATH,
    METRICS_PORT,
    OPENAI_PORT,
    READY_PATH,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
DEPLOY = REPO_ROOT / "docs" / "deploy"
KUBERNETES_VERSION = "1.30.0"  # the oldest minor the manifests promise to fit (autoscaling/v2 is GA since 1.23)
PORTS = {"http": HTTP_PORT, "grpc": GRPC_PORT, "metrics": METRICS_PORT, "openai": OPENAI_PORT}
BUILT_IN = {("apps/v1", "Deployment"), ("v1", "Service"), ("v1", "ConfigMap"),
            ("autoscaling/v2", "HorizontalPodAutoscaler")}
WAITING_METRIC = "vllm:num_requests_waiting"


def _documents() -> dict[str, dict]:
    """Every manifest in docs/deploy by kind (each kind appears once)."""
    documents = {}
    for path in sorted(DEPLOY.glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            assert document["kind"] not in documents, f"{path.name}: a second {document['kind']}"
            documents[document["kind"]] = document
    return documents


DOCUMENTS = _documents()


def _container(kind: str = "Deployment") -> dict:
    return DOCUMENTS[kind]["spec"]["template"]["spec"]["containers"][0]


def test_every_manifest_has_an_api_version_a_kind_and_a_name():
    assert set(DOCUMENTS) == {"Deployment", "Service", "ServiceMonitor", "ConfigMap", "HorizontalPodAutoscaler",
                              "InferenceService"}
    for kind, document in DOCUMENTS.items():
        assert document["apiVersion"] and document["metadata"]["name"], kind


@pytest.mark.parametrize("kind", sorted(kind for _, kind in BUILT_IN))
def test_built_in_kinds_validate_against_the_kubernetes_schemas_strictly(kind):
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install -e '.[test]'")
    document = DOCUMENTS[kind]
    assert (document["apiVersion"], kind) in BUILT_IN
    try:
        kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)
    except Exception as error:  # noqa: BLE001 - jsonschema's message names the offending field
        pytest.fail(f"{kind}: {getattr(error, 'message', error)}")


def test_deployment_ports_probes_and_args_are_the_launchers():
    container, spec = _container(), DOCUMENTS["Deployment"]["spec"]
    assert {port["name"]: port["containerPort"] for port in container["ports"]} == PORTS
    assert container["readinessProbe"]["httpGet"] == {"path": READY_PATH, "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": LLM_READY_PATH, "port": "http"}
    assert container["startupProbe"]["httpGet"]["path"] == LIVE_PATH
    # The pod outlives `pagedserve serve`'s stop: tritonserver's exit timeout and the shim's stop after it.
    assert spec["template"]["spec"]["terminationGracePeriodSeconds"] > launcher.EXIT_TIMEOUT_SECONDS + 20
    assert spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()
    annotations = spec["template"]["metadata"]["annotations"]
    assert (annotations["prometheus.io/port"], annotations["prometheus.io/path"]) == (str(METRICS_PORT), METRICS_PATH)


def _dockerfile() -> str:
    return (REPO_ROOT / "Dockerfile").read_text()


def test_deployment_args_are_serve_flags_after_the_images_entrypoint():
    entrypoint = re.search(r"^ENTRYPOINT (\[.*\])$", _dockerfile(), re.MULTILINE)
    command = yaml.safe_load(entrypoint.group(1))
    assert command[:2] == ["pagedserve", "serve"]
    parser = argparse.ArgumentParser(exit_on_error=False)
    launcher.add_arguments(parser)
    args = parser.parse_args(command[2:] + _container()["args"])
    assert (args.host, args.instances) == ("0.0.0.0", 1)
    exposed = re.search(r"^EXPOSE (.*)$", _dockerfile(), re.MULTILINE).group(1).split()
    assert sorted(map(int, exposed)) == sorted(PORTS.values())


def test_service_exposes_every_named_port_of_the_pods():
    service = DOCUMENTS["Service"]["spec"]
    assert {port["name"]: (port["port"], port["targetPort"]) for port in service["ports"]} == {
        name: (number, name) for name, number in PORTS.items()}
    assert service["selector"] == DOCUMENTS["Deployment"]["spec"]["selector"]["matchLabels"]


def test_service_monitor_scrapes_the_metrics_port_of_the_service():
    monitor = DOCUMENTS["ServiceMonitor"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= DOCUMENTS["Service"]["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"] == [{"port": "metrics", "path": METRICS_PATH, "interval": "15s"}]


def test_hpa_scales_the_deployment_on_the_adapters_waiting_requests_metric():
    hpa = DOCUMENTS["HorizontalPodAutoscaler"]["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "pagedserve"}
    assert 1 <= hpa["minReplicas"] <= hpa["maxReplicas"]
    (metric,) = hpa["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["target"]["type"] == "AverageValue"
    (rule,) = yaml.safe_load(DOCUMENTS["ConfigMap"]["data"]["config.yaml"])["rules"]
    assert rule["name"]["as"] == metric["pods"]["metric"]["name"]
    assert re.fullmatch(rule["name"]["matches"], WAITING_METRIC)
    assert rule["seriesQuery"].startswith(WAITING_METRIC + "{")
    assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
    assert "sum(<<.Series>>{<<.LabelMatchers>>}) by (<<.GroupBy>>)" == rule["metricsQuery"]
    # The name is the llm model's gauge (metrics.py imports Triton's stub module, so read its text).
    assert f'"{WAITING_METRIC}"' in (REPO_ROOT / "pagedserve" / "backend" / "triton" / "metrics.py").read_text()


def test_kserve_inference_service_runs_the_image_as_a_triton_predictor():
    service = DOCUMENTS["InferenceService"]
    assert service["apiVersion"] == "serving.kserve.io/v1beta1"
    predictor = service["spec"]["predictor"]
    triton = predictor["triton"]
    assert triton["storageUri"] and triton["image"] == _container()["image"]
    assert triton["command"] == ["tritonserver"]
    flags = dict(arg.removeprefix("--").split("=", 1) for arg in triton["args"])
    assert flags["model-repository"] == "/mnt/models"  # where KServe's storage initializer puts storageUri
    assert (flags["http-port"], flags["grpc-port"]) == ("8080", "9000")  # KServe's ports for Triton
    assert flags["metrics-port"] == service["metadata"]["annotations"]["prometheus.kserve.io/port"] == str(METRICS_PORT)
    assert int(flags["exit-timeout-secs"]) == launcher.EXIT_TIMEOUT_SECONDS
    assert triton["readinessProbe"]["httpGet"] == {"path": READY_PATH, "port": 8080}
    assert triton["livenessProbe"]["httpGet"] == {"path": LLM_READY_PATH, "port": 8080}
    assert [f"--{key}={value}" for key, value in flags.items() if key in ("model-control-mode", "load-model")] == \
        list(launcher.EXPLICIT_MODEL_CONTROL)
    assert predictor["minReplicas"] <= predictor["maxReplicas"]


def test_the_readme_describes_every_manifest_and_names_only_files_that_exist():
    readme = (DEPLOY / "README.md").read_text()
    listed = set(re.findall(r"^\| `([\w.-]+\.yaml)` \|", readme, re.MULTILINE))
    assert listed == {path.name for path in DEPLOY.glob("*.yaml")}
    applied = set(re.findall(r"docs/deploy/([\w.-]+\.yaml)", readme))
    assert applied and applied <= listed, applied
