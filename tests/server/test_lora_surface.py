"""LoRA's serving surface decided without a server: multi_lora.json, the lora_control request, `serve`'s flags
and the repository they write, the shim's model names and its runtime endpoints' refusals, the metric's labels."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from pagedserve.backend.core.errors import InvalidRequestError, to_wire
from pagedserve.backend.triton.lora import (
    control_request,
    lora_engine_kwargs,
    lora_info_labels,
    model_instances,
    parse_lora_control,
    read_multi_lora,
    run_lora_control,
)
from pagedserve.backend.triton.settings import ModelSettings, engine_arguments
from pagedserve.client.lora_options import add_lora_arguments, lora_modules, lora_parameters, lora_shim_flags
from pagedserve.client.model_repository import DEFAULT_MODEL_REPOSITORY, prepare_model_repository
from pagedserve.client.openai.app import create_app
from pagedserve.client.openai.lora import AdapterRegistry, LoRASettings
from pagedserve.client.openai.shim import ShimSettings
from pagedserve.client.triton_client import TritonRequestError

UNREACHABLE = "127.0.0.1:9"


def _write(path: Path, entries: object) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "multi_lora.json").write_text(json.dumps(entries))
    return path


def test_multi_lora_json_maps_names_to_folders_relative_to_the_file(tmp_path):
    (tmp_path / "adapters" / "sql").mkdir(parents=True)
    (tmp_path / "abs").mkdir()
    version = _write(tmp_path / "llm" / "1", {"sql": "../../adapters/sql", "abs": str(tmp_path / "abs")})
    assert read_multi_lora(version) == {"sql": str(tmp_path / "adapters" / "sql"), "abs": str(tmp_path / "abs")}
    assert read_multi_lora(tmp_path / "elsewhere") == {}
    kwargs = lora_engine_kwargs({"enable_lora": True, "max_loras": 2}, version)
    assert kwargs == {"enable_lora": True, "max_loras": 2, "lora_modules": read_multi_lora(version)}
    assert lora_engine_kwargs({"dtype": "float32"}, tmp_path / "elsewhere") == {"dtype": "float32"}


@pytest.mark.parametrize("entries, words", [
    ({"gone": "/no/such/adapter"}, "folder of LoRA adapter 'gone' does not exist"),
    (["sql"], "must hold a JSON object"),
    ({"sql": 3}, "adapter 'sql' must map"),
])
def test_a_bad_multi_lora_json_is_refused_naming_the_file_and_the_entry(tmp_path, entries, words):
    version = _write(tmp_path, entries)
    with pytest.raises(ValueError, match=words) as refused:
        read_multi_lora(version)
    assert "multi_lora.json" in str(refused.value)


def test_adapters_listed_with_lora_off_are_refused_not_served_as_the_base(tmp_path):
    (tmp_path / "a").mkdir()
    version = _write(tmp_path / "1", {"a": str(tmp_path / "a")})
    with pytest.raises(ValueError, match="enable_lora is not true"):
        lora_engine_kwargs({}, version)


def test_lora_parameters_reach_the_engine_and_the_runtime_flag_the_model():
    parameters = {key: {"string_value": value} for key, value in {
        "enable_lora": "true", "max_loras": "4", "max_lora_rank": "16", "max_cpu_loras": "",
        "enable_lora_runtime_updates": "true"}.items()}
    _, kwargs = engine_arguments(parameters)
    assert kwargs == {"enable_lora": True, "max_loras": 4, "max_lora_rank": 16}
    assert ModelSettings.from_parameters(parameters).lora_runtime_updates
    assert not ModelSettings.from_parameters({}).lora_runtime_updates
    with pytest.raises(ValueError, match="enable_lora_runtime_updates must be true or false"):
        ModelSettings.from_parameters({"enable_lora_runtime_updates": {"string_value": "maybe"}})


def test_lora_control_requests_are_validated_by_field():
    assert parse_lora_control('{"action": "list"}', False, 2).action == "list"
    load = parse_lora_control('{"action": "load", "lora_name": "a", "lora_path": "/p"}', True, 1)
    assert (load.action, load.lora_name, load.lora_path) == ("load", "a", "/p")
    cases = [
        ('{"action": "load", "lora_name": "a", "lora_path": "/p"}', False, 1, "lora_control", "is off"),
        ('{"action": "unload", "lora_name": "a"}', True, 2, "lora_control", "this model runs 2"),
        ('{"action": "load", "lora_name": "a"}', True, 1, "lora_path", "non-empty"),
        ('{"action": "unload", "lora_name": ""}', True, 1, "lora_name", "non-empty"),
        ('{"action": "reload"}', True, 1, "action", "one of list, load, unload"),
        ('{"action": "list", "lora_int_id": 1}', True, 1, "lora_int_id", "unknown lora_control field"),
        ("[1]", True, 1, "lora_control", "JSON object"),
    ]
    for raw, runtime, instances, field, words in cases:
        with pytest.raises(InvalidRequestError, match=words) as refused:
            parse_lora_control(raw, runtime, instances)
        assert refused.value.field == field, raw


def test_a_lora_control_carrying_a_prompt_is_refused():
    tensors = {"text_input": object(), "lora_control": object()}
    with pytest.raises(InvalidRequestError, match="one of its own") as refused:
        control_request(tensors, True, 1)
    assert refused.value.field == "lora_control"


def test_model_instances_counts_every_group_and_gpu():
    assert model_instances({}) == 1
    assert model_instances({"instance_group": [{"count": 2, "kind": "KIND_CPU"},
                                               {"count": 1, "kind": "KIND_GPU", "gpus": [0, 1]}]}) == 4


def _serve_args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_lora_arguments(parser)
    return parser.parse_args(list(flags))


def test_serve_lora_flags_write_multi_lora_json_and_the_parameters(tmp_path):
    for name in ("sql", "chat"):
        (tmp_path / name).mkdir()
    args = _serve_args("--lora", f"sql={tmp_path / 'sql'}", "--lora", f"chat={tmp_path / 'chat'}",
                       "--max-loras", "2", "--enable-lora-runtime-updates", "--lora-separator", "_lora_")
    vllm_form = _serve_args("--lora-modules", f"sql={tmp_path / 'sql'}", f"chat={tmp_path / 'chat'}")
    assert lora_modules(vllm_form) == lora_modules(args)
    params = lora_parameters(args)
    assert params == {"enable_lora": "true", "max_loras": "2", "enable_lora_runtime_updates": "true"}
    assert lora_shim_flags(args) == ["--enable-lora-runtime-updates", "--lora-separator", "_lora_"]
    repository = prepare_model_repository(DEFAULT_MODEL_REPOSITORY, tmp_path / "models", str(tmp_path / "m"),
                                          params, None, lora_modules(args))
    version = repository / "llm" / "1"
    assert read_multi_lora(version) == {"sql": str(tmp_path / "sql"), "chat": str(tmp_path / "chat")}
    config = (repository / "llm" / "config.pbtxt").read_text()
    assert 'key: "max_loras" value: { string_value: "2" }' in config
    assert 'key: "enable_lora_runtime_updates" value: { string_value: "true" }' in config
    assert lora_parameters(_serve_args()) == {} and lora_shim_flags(_serve_args()) == []


def test_serve_refuses_a_missing_adapter_folder_a_repeated_name_and_limits_without_lora(tmp_path, capsys):
    with pytest.raises(SystemExit):
        _serve_args("--lora", f"sql={tmp_path / 'missing'}")
    assert "the folder of adapter 'sql' does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _serve_args("--lora", "no-equals-sign")
    assert "expected NAME=PATH or a JSON object" in capsys.readouterr().err
    twice = _serve_args("--lora", f"a={tmp_path}", "--lora", f"a={tmp_path}")
    with pytest.raises(SystemExit, match="given twice"):
        lora_modules(twice)
    with pytest.raises(SystemExit, match="--max-lora-rank needs LoRA on"):
        lora_parameters(_serve_args("--max-lora-rank", "64"))


def test_vllm_json_lora_modules_name_a_folder_and_the_served_base_model(tmp_path):
    (tmp_path / "sql").mkdir()
    model = tmp_path / "tiny-model"
    item = json.dumps({"name": "sql", "path": str(tmp_path / "sql"), "base_model_name": "tiny-model"})
    args = _serve_args("--lora-modules", item, json.dumps({"name": "plain", "path": str(tmp_path / "sql")}))
    args.model = str(model)
    assert lora_modules(args) == {"sql": str(tmp_path / "sql"), "plain": str(tmp_path / "sql")}
    args.model = "elsewhere/other-model"
    with pytest.raises(SystemExit, match="base_model_name 'tiny-model' is not the served base model "
                                         "\\('other-model' or 'elsewhere/other-model'\\)"):
        lora_modules(args)


@pytest.mark.parametrize("item, words", [
    ('{"name": "sql", "path": ', "invalid JSON for --lora-modules"),
    ('{"path": "/tmp"}', "needs 'name'"),
    ('{"name": "sql"}', "needs 'path'"),
    ('{"name": "sql", "path": "/tmp", "rank": 8}', "unknown --lora-modules field 'rank'"),
    ('{"name": "sql", "path": "/tmp", "base_model_name": 3}', "base_model_name must be a non-empty string"),
])
def test_a_bad_json_lora_module_is_an_argparse_error_naming_the_flag(item, words, capsys):
    with pytest.raises(SystemExit):
        _serve_args("--lora-modules", item)
    err = capsys.readouterr().err
    assert "argument --lora/--lora-modules:" in err and words in err, err


def test_model_names_ask_for_an_adapter_by_name_or_by_base_separator_adapter():
    registry = AdapterRegistry(LoRASettings(separator="_lora_"))
    served = ["tiny"]
    assert registry.adapter_name("tiny_lora_sql", served) == "sql"
    assert registry.adapter_name("sql", served) == "sql"
    assert registry.adapter_name("other_lora_sql", served) == "other_lora_sql"
    assert AdapterRegistry(LoRASettings()).adapter_name("tiny_lora_sql", served) == "tiny_lora_sql"
    registry.known = {"sql": "/adapters/sql"}
    (card,) = registry.cards("tiny", 0, 256)
    assert (card["id"], card["parent"], card["root"]) == ("tiny_lora_sql", "tiny", "/adapters/sql")


def test_runtime_adapter_endpoints_are_off_unless_enabled_and_answer_openai_errors():
    with TestClient(create_app(ShimSettings(triton_url=UNREACHABLE, model_name="tiny"))) as client:
        reply = client.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/p"})
        assert reply.status_code == 404 and "--enable-lora-runtime-updates" in reply.json()["error"]["message"]
        assert client.get("/v1/models/sql").json()["error"]["code"] == "model_not_found"
    settings = ShimSettings(triton_url=UNREACHABLE, model_name="tiny", lora=LoRASettings(runtime_updates=True))
    with TestClient(create_app(settings)) as client:
        reply = client.post("/v1/load_lora_adapter", json={"lora_name": "a"})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "lora_path"
        reply = client.post("/v1/load_lora_adapter", json={"lora_name": "tiny", "lora_path": "/p"})
        assert reply.status_code == 400 and "the base model's name" in reply.json()["error"]["message"]
        reply = client.post("/v1/unload_lora_adapter", json={"lora_name": "a"})
        assert reply.status_code == 404 and reply.json()["error"]["message"] == "The lora adapter 'a' cannot be found."
        reply = client.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/p"})
        assert reply.status_code == 503  # Triton unreachable: the service is at fault


class _Engine:
    """An engine's LoRA calls: a load is refused as a corrupt adapter's would be."""

    def add_lora(self, name: str, path: str) -> None:
        raise InvalidRequestError(f"LoRA adapter {name!r} ({path}): adapter_model.safetensors cannot be read", "lora")

    def list_loras(self) -> dict[str, str]:
        return {}


async def _closed() -> None:
    return None


def test_loading_a_missing_folder_is_404_naming_it_and_other_failed_loads_stay_400(tmp_path):
    async def lora_control(body: dict) -> dict:
        # The llm model's answer to the shim's control, refusals on the wire as Triton carries them.
        control = parse_lora_control(json.dumps(body), True, 1)
        try:
            return run_lora_control(_Engine(), control)
        except InvalidRequestError as error:
            raise TritonRequestError(to_wire(error)) from None

    settings = ShimSettings(triton_url=UNREACHABLE, model_name="tiny", lora=LoRASettings(runtime_updates=True))
    with TestClient(create_app(settings)) as client:
        # The shim's gRPC client stands in for Triton (made here, it would need a running event loop).
        client.app.state.shim._client = SimpleNamespace(lora_control=lora_control, close=_closed)
        missing = tmp_path / "missing"
        reply = client.post("/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": str(missing)})
        error = reply.json()["error"]
        assert reply.status_code == 404 and (error["param"], error["code"]) == ("lora_path", "not_found")
        assert "'sql'" in error["message"] and str(missing) in error["message"]
        reply = client.post("/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": str(tmp_path)})
        assert reply.status_code == 400 and "cannot be read" in reply.json()["error"]["message"]


def test_lora_info_labels_name_the_adapters_of_running_and_waiting_requests():
    stats = SimpleNamespace(running_lora_adapters=["b", "a"], waiting_lora_adapters=[], max_lora=4)
    assert lora_info_labels(stats) == {"running_lora_adapters": "a,b", "waiting_lora_adapters": "",
                                       "max_lora": "4"}
    assert lora_info_labels(SimpleNamespace(max_lora=0)) is None
