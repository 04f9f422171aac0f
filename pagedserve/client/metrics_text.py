"""Reading tritonserver's Prometheus metrics text: the samples of the llm model, per instance or summed."""

from __future__ import annotations

import re
import urllib.request

from pagedserve.client.model_repository import LLM_MODEL_NAME


def fetch_metrics(metrics_url: str, timeout: float = 10.0) -> str:
    """The Prometheus text of tritonserver's metrics port."""
    with urllib.request.urlopen(metrics_url, timeout=timeout) as reply:
        return reply.read().decode()


def model_metric(metrics_text: str, name: str, model: str = LLM_MODEL_NAME) -> float:
    """The sample `name` (e.g. "vllm:num_requests_running") labelled with `model`, summed over the model's
    instances (one sample each, labelled `instance`); 0.0 if absent."""
    return sum(instance_metrics(metrics_text, name, model).values())


def instance_metrics(metrics_text: str, name: str, model: str = LLM_MODEL_NAME) -> dict[str, float]:
    """The sample `name` of each instance of `model`: {instance label ("" where none): value}."""
    pattern = re.compile(r"^" + re.escape(name) + r"\{([^}]*)\}\s+(\S+)$", re.MULTILINE)
    values: dict[str, float] = {}
    for labels, value in pattern.findall(metrics_text):
        if f'model="{model}"' in labels:
            instance = re.search(r'instance="([^"]*)"', labels)
            values[instance.group(1) if instance else ""] = float(value)
    return values
