"""docs/deploy/fleet/, offline: the replicas (StatefulSet), vllm-router in front of them and the Gateway API
Inference Extension's InferencePool with its endpoint picker. Built-in kinds validate strictly against Kubernetes'
schemas; the router's flags are ones the installed vllm-router takes; worker URLs, event sources, block size and
ports agree with the replicas and with the engine's own parsing of its flags."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

from pagedserve.backend.core.kv_events import KVEventsConfig
from pagedserve.client import fleet
from pagedserve.client.launcher import METRICS_PORT, OPENAI_PORT

FLEET = Path(__file__).resolve().parents[2] / "docs" / "deploy" / "fleet"
KUBERNETES_VERSION = "1.30.0"
BUILT_IN = {("apps/v1", "StatefulSet"), ("apps/v1", "Deployment"), ("v1", "Service"), ("v1", "ConfigMap"),
            ("v1", "ServiceAccount"), ("rbac.authorization.k8s.io/v1", "Role"),
            ("rbac.authorization.k8s.io/v1", "RoleBinding")}


def _documents() -> list[dict]:
    return [doc for path in sorted(FLEET.glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text())]


DOCUMENTS = _documents()


def _one(kind: str, name: str) -> dict:
    (found,) = [d for d in DOCUMENTS if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def _router_argv() -> list[str]:
    container = _one("Deployment", "pagedserve-router")["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["sh", "-c"]
    # The tokenizer path is a command substitution; the rest is plain words.
    script = re.sub(r'"\$\(python3 .*?\)"', "TOKENIZER", container["args"][0], flags=re.DOTALL)
    argv = shlex.split(script)
    assert argv[:2] == ["exec", "vllm-router"]
    return argv[2:]


@pytest.mark.parametrize("index", range(len(DOCUMENTS)))
def test_each_built_in_kind_validates_strictly(index):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    document = DOCUMENTS[index]
    if (document["apiVersion"], document["kind"]) not in BUILT_IN:
        assert document["kind"] == "InferencePool"
        return
    try:
        kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)
    except Exception as error:  # noqa: BLE001 - jsonschema's message names the offending field
        pytest.fail(f"{document['kind']} {document['metadata']['name']}: {getattr(error, 'message', error)}")


def test_the_router_takes_every_flag_and_names_each_replica_and_its_event_sockets():
    argv = _router_argv()
    help_text = subprocess.run([fleet.router_binary(), "--help"], capture_output=True, text=True, timeout=60).stdout
    for flag in (word for word in argv if word.startswith("--")):
        assert re.search(rf"\[{re.escape(flag)}[ \]]", help_text), f"vllm-router has no {flag}"
    assert argv[argv.index("--policy") + 1] == fleet.ROUTER_POLICIES["kv_events"]
    replicas = _one("StatefulSet", "pagedserve")["spec"]
    service = replicas["serviceName"]
    hosts = [f"pagedserve-{rank}.{service}" for rank in range(replicas["replicas"])]
    start = argv.index("--worker-urls") + 1
    assert argv[start:start + len(hosts)] == [f"http://{host}:{OPENAI_PORT}" for host in hosts]
    sources = [argv[i + 1] for i, word in enumerate(argv) if word == "--kv-event-source"]
    replays = [argv[i + 1] for i, word in enumerate(argv) if word == "--kv-event-replay-source"]
    container = replicas["template"]["spec"]["containers"][0]
    config = KVEventsConfig.from_dict(container["args"][container["args"].index("--kv-events-config") + 1])
    event_port, replay_port = (int(e.rsplit(":", 1)[1]) for e in (config.endpoint, config.replay_endpoint))
    assert config.publishes and "*" in config.endpoint  # binds on the pod, the router connects
    assert sources == [f"http://{h}:{OPENAI_PORT}=tcp://{h}:{event_port}" for h in hosts]
    assert replays == [f"http://{h}:{OPENAI_PORT}=tcp://{h}:{replay_port}" for h in hosts]
    block_size = container["args"][container["args"].index("--block-size") + 1]
    assert argv[argv.index("--kv-event-block-size") + 1] == block_size
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert (ports["openai"], ports["metrics"], ports["kv-events"], ports["kv-replay"]) == (
        OPENAI_PORT, METRICS_PORT, event_port, replay_port)


def test_the_replicas_flags_parse_as_serve_parses_them():
    import argparse

    from pagedserve.client import launcher
    from pagedserve.client.cli import main  # noqa: F401 - the CLI imports cleanly

    parser = argparse.ArgumentParser()
    launcher.add_arguments(parser)
    container = _one("StatefulSet", "pagedserve")["spec"]["template"]["spec"]["containers"][0]
    args = parser.parse_args(["--host", "0.0.0.0", *container["args"]])
    assert json.loads(args.kv_events_config)["enable_kv_cache_events"] is True and args.block_size == 16


def test_the_inference_pool_selects_the_replicas_and_names_its_picker():
    pool = _one("InferencePool", "pagedserve-fleet")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    pods = _one("StatefulSet", "pagedserve")["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= pods.items()
    assert pool["spec"]["targetPorts"] == [{"number": OPENAI_PORT}]
    picker = pool["spec"]["endpointPickerRef"]
    service = _one("Service", picker["name"])
    assert picker["port"]["number"] in [p["port"] for p in service["spec"]["ports"]]
    assert picker["failureMode"] in ("FailOpen", "FailClose")
    config = yaml.safe_load(_one("ConfigMap", "pagedserve-fleet-epp")["data"]["epp.yaml"])
    plugins = {plugin["type"] for plugin in config["plugins"]}
    referenced = {ref["pluginRef"] for profile in config["schedulingProfiles"] for ref in profile["plugins"]}
    assert referenced <= plugins and "prefix-cache-scorer" in plugins
    prefix = next(p for p in config["plugins"] if p["type"] == "prefix-cache-scorer")
    replicas = _one("StatefulSet", "pagedserve")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert str(prefix["parameters"]["blockSize"]) == replicas[replicas.index("--block-size") + 1]
