"""LoRA adapters on the OpenAI shim, as vLLM serves them: the `model` field names an adapter, /v1/models lists each
with its `parent` (the base model) and `root` (its folder), and /v1/load_lora_adapter and /v1/unload_lora_adapter
(vLLM's bodies; off unless --enable-lora-runtime-updates) load and unload them. With --lora-separator, the name
`BASE<SEP>ADAPTER` of Triton's OpenAI frontend names the adapter too. The llm model's lora_control requests
(pagedserve/backend/triton/lora.py) list, load and unload; the shim keeps the last list and asks again for a name not in it.
As vLLM answers them, a load of a folder that does not exist and an unload of an unknown adapter are 404s, any
other refused load a 400.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from pagedserve.backend.core.errors import ErrorKind, from_wire
from pagedserve.client.openai.errors import TRITON_ERRORS, APIError, bad_request, triton_api_error
from pagedserve.client.openai.protocol import refuse_unknown_fields
from pagedserve.client.triton_client import TritonLLMClient

# vLLM's switch for its runtime adapter endpoints, read as the default of --enable-lora-runtime-updates.
RUNTIME_UPDATES_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
RUNTIME_UPDATES_FLAG = "--enable-lora-runtime-updates"


def runtime_updates_from_env() -> bool:
    """Whether VLLM_ALLOW_RUNTIME_LORA_UPDATING asks for the runtime endpoints, as vLLM reads it."""
    return os.environ.get(RUNTIME_UPDATES_ENV, "0").strip().lower() in ("1", "true")


@dataclass(frozen=True)
class LoRASettings:
    """The shim's LoRA flags."""

    runtime_updates: bool = False
    separator: str | None = None  # Triton's OpenAI frontend --lora-separator


def model_not_found(name: str) -> APIError:
    """vLLM's answer to a model (or adapter) it does not serve."""
    return APIError(404, f"The model `{name}` does not exist.", "model", "model_not_found")


class AdapterRegistry:
    """The llm model's adapters (name -> folder) as last listed."""

    def __init__(self, settings: LoRASettings):
        self.settings = settings
        self.known: dict[str, str] = {}

    async def refresh(self, client: TritonLLMClient) -> dict[str, str]:
        """List the llm model's adapters now; {} while Triton cannot be asked (the model list still answers)."""
        try:
            self.known = dict((await client.lora_control({"action": "list"}))["lora_adapters"])
        except TRITON_ERRORS:
            self.known = {}
        return self.known

    def adapter_name(self, name: str, served: list[str]) -> str:
        """The adapter a model name asks for: the name itself, or the part after `BASE<SEP>`."""
        separator = self.settings.separator
        if separator and separator in name:
            base, _, adapter = name.partition(separator)
            if base in served and adapter:
                return adapter
        return name

    async def resolve(self, client: TritonLLMClient, name: str, served: list[str]) -> str:
        """The adapter `name` asks for, listed again when not known; 404 model_not_found when not served."""
        adapter = self.adapter_name(name, served)
        if adapter not in self.known and adapter not in (await self.refresh(client)):
            raise model_not_found(name)
        return adapter

    def card(self, model_id: str, adapter: str, base: str, created: int, max_model_len: int | None) -> dict:
        """One adapter's model card (vLLM's: `root` its folder, `parent` the base model)."""
        return {"id": model_id, "object": "model", "created": created, "owned_by": "pagedserve",
                "root": self.known.get(adapter), "parent": base, "max_model_len": max_model_len}

    def cards(self, base: str, created: int, max_model_len: int | None) -> list[dict]:
        """The adapters as /v1/models lists them: by name, or as `BASE<SEP>ADAPTER` with a separator."""
        separator = self.settings.separator
        return [self.card(f"{base}{separator}{name}" if separator else name, name, base, created, max_model_len)
                for name in self.known]


def _text_field(body: dict, name: str) -> str:
    value = body.get(name)
    return value.strip() if isinstance(value, str) else ""


def _control_error(error: Exception) -> APIError:
    """A refused load or unload: 400 naming the field the llm model named (its message names the adapter), but
    404 for a lora_path that is no folder (the llm model names that field for it alone), as vLLM answers it."""
    wire = from_wire(str(error))
    if wire is not None and wire.kind is ErrorKind.INVALID_ARGUMENT:
        if wire.field == "lora_path":
            return APIError(404, wire.message, "lora_path", "not_found")
        return bad_request(wire.message, wire.field if wire.field == "lora_name" else None)
    return triton_api_error(error)


def _check_enabled(shim: Any) -> None:
    if not shim.settings.lora.runtime_updates:
        raise APIError(404, "loading and unloading LoRA adapters at run time is off: start the shim with "
                            f"{RUNTIME_UPDATES_FLAG} (or {RUNTIME_UPDATES_ENV}=True)", code="not_found")


async def load_lora_adapter(shim: Any, body: dict) -> str:
    """vLLM's POST /v1/load_lora_adapter {lora_name, lora_path}: load the adapter in the llm model."""
    _check_enabled(shim)
    refuse_unknown_fields(body, {"lora_name", "lora_path"})
    name, path = _text_field(body, "lora_name"), _text_field(body, "lora_path")
    if not name or not path:
        raise bad_request("Both 'lora_name' and 'lora_path' must be provided.", "lora_name" if not name else "lora_path")
    if name in shim.served_names:
        raise bad_request(f"'{name}' is the base model's name; give the adapter another.", "lora_name")
    if name in await shim.adapters.refresh(shim.client):
        raise bad_request(f"The lora adapter '{name}' has already been loaded.", "lora_name")
    try:
        await shim.client.lora_control({"action": "load", "lora_name": name, "lora_path": path})
    except TRITON_ERRORS as error:
        raise _control_error(error) from error
    await shim.adapters.refresh(shim.client)
    return f"Success: LoRA adapter '{name}' added successfully."


async def unload_lora_adapter(shim: Any, body: dict) -> str:
    """vLLM's POST /v1/unload_lora_adapter {lora_name}: unload the adapter; refused while requests use it."""
    _check_enabled(shim)
    refuse_unknown_fields(body, {"lora_name", "lora_int_id"})
    name = _text_field(body, "lora_name")
    if not name:
        raise bad_request("'lora_name' must be provided (pagedserve has no lora_int_id).", "lora_name")
    if name not in await shim.adapters.refresh(shim.client):
        raise APIError(404, f"The lora adapter '{name}' cannot be found.", "lora_name", "not_found")
    try:
        await shim.client.lora_control({"action": "unload", "lora_name": name})
    except TRITON_ERRORS as error:
        raise _control_error(error) from error
    await shim.adapters.refresh(shim.client)
    return f"Success: LoRA adapter '{name}' removed successfully."
