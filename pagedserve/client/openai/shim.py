"""What every request of the shim shares: its settings, the Triton client, and the model folder's chat
template and tokenizer, each made once on first use."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedserve.client.model_repository import tokenizer_folder
from pagedserve.client.openai.chat_template import ChatTemplate
from pagedserve.client.openai.errors import APIError, bad_request
from pagedserve.client.openai.lora import AdapterRegistry, LoRASettings
from pagedserve.client.openai.media import MediaSettings
from pagedserve.client.openai.protocol import GenerationRequest
from pagedserve.client.openai.reasoning import REASONING_PARSERS, ReasoningParser
from pagedserve.client.openai.tools import ToolSettings
from pagedserve.client.triton_client import LLMResponse, TritonLLMClient, TritonUnavailableError

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024


@dataclass
class ShimSettings:
    """What the shim needs to know; `model_path` is asked of Triton when not given."""

    triton_url: str = "localhost:8001"
    model_name: str | None = None
    model_path: str | None = None
    api_key: str | None = None
    metrics_url: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    aliases: tuple[str, ...] = ()  # more names the model answers to (vLLM's several --served-model-name)
    tools: ToolSettings = field(default_factory=ToolSettings)
    lora: LoRASettings = field(default_factory=LoRASettings)
    reasoning_parser: str | None = None  # vLLM's --reasoning-parser name (reasoning/REASONING_PARSERS)
    # The Responses API's store: at most this many responses, each kept this many seconds (oldest evicted).
    responses_store_size: int = 1024
    responses_store_max_age_s: float = 3600.0
    media: MediaSettings = field(default_factory=MediaSettings)  # image_url fetching and the image limit


class OpenAIShim:
    """The request handlers' shared state: the Triton client and the lazily loaded chat template."""

    def __init__(self, settings: ShimSettings):
        self.settings = settings
        self.model_name = settings.model_name or (Path(settings.model_path).name if settings.model_path else "llm")
        self.metrics_url = settings.metrics_url or f"http://{settings.triton_url.rsplit(':', 1)[0]}:8002/metrics"
        self.created = int(time.time())
        self._client: TritonLLMClient | None = None
        self._chat_template: ChatTemplate | None = None
        self._tokenizer: Any = None
        self._max_model_len: int | None = None
        self.adapters = AdapterRegistry(settings.lora)

    @property
    def client(self) -> TritonLLMClient:
        """The gRPC client of the `llm` model."""
        # Made on first use so the gRPC channel binds to the running event loop.
        if self._client is None:
            self._client = TritonLLMClient(self.settings.triton_url)
        return self._client

    async def close(self) -> None:
        """Close the gRPC channel, if one was opened."""
        if self._client is not None:
            await self._client.close()

    async def model_dir(self) -> Path:
        """The model folder: --model, else the `model_path` parameter of the llm model's config."""
        if self.settings.model_path is None:
            try:
                params = await self.client.model_parameters()
            except TritonUnavailableError as error:
                raise APIError(503, f"cannot ask Triton for the model folder: {error}") from error
            path = params.get("model_path") or params.get("model")
            if not path:
                raise APIError(500, "the llm model's config has no model_path parameter; start the shim with --model")
            self.settings.model_path = path
        return tokenizer_folder(self.settings.model_path)

    async def chat_template(self) -> ChatTemplate:
        """The model folder's chat template, read once."""
        if self._chat_template is None:
            folder = await self.model_dir()
            try:
                self._chat_template = ChatTemplate.from_model_dir(folder)
            except FileNotFoundError as error:
                raise bad_request(f"the model has no chat template ({error}); use /v1/completions",
                                  "messages") from error
        return self._chat_template

    async def tokenizer(self) -> Any:
        """The model folder's tokenizer.json (a `tokenizers.Tokenizer`), read once."""
        if self._tokenizer is None:
            from tokenizers import Tokenizer

            self._tokenizer = Tokenizer.from_file(str(await self.model_dir() / "tokenizer.json"))
        return self._tokenizer

    @property
    def reasoning_parser(self) -> ReasoningParser | None:
        """The --reasoning-parser's parser (None: the reasoning stays in the content)."""
        name = self.settings.reasoning_parser
        return None if name is None else REASONING_PARSERS[name]()

    async def reasoning_end_ids(self, parser: ReasoningParser) -> list[int]:
        """The token ids of the parser's end marker, which the engine waits for before a constraint."""
        return (await self.tokenizer()).encode(parser.end, add_special_tokens=False).ids

    async def decode(self, token_ids: list[int]) -> str:
        """Prompt text of token ids (for echo)."""
        return (await self.tokenizer()).decode(token_ids, skip_special_tokens=False)

    async def max_model_len(self) -> int | None:
        """The llm model's max_model_len parameter, else the model's max_position_embeddings, as the engine
        takes it; None while Triton cannot be asked (the model list still answers) or neither is known."""
        if self._max_model_len is None:
            try:
                params = await self.client.model_parameters()
            except TritonUnavailableError:
                return None
            value = params.get("max_model_len", "")
            if value.strip().isdigit():
                self._max_model_len = int(value)
            else:
                config = await self.model_dir() / "config.json"
                if config.exists():
                    self._max_model_len = json.loads(config.read_text()).get("max_position_embeddings")
        return self._max_model_len

    @property
    def served_names(self) -> list[str]:
        """Every name the model answers to: the model id first, then its aliases."""
        return [self.model_name, *(a for a in self.settings.aliases if a != self.model_name)]

    async def resolve_model(self, name: str) -> str | None:
        """The LoRA adapter a request's `model` names (None for the base model); 404 model_not_found when the
        name is neither a served name nor an adapter of the llm model."""
        if name in self.served_names:
            return None
        return await self.adapters.resolve(self.client, name, self.served_names)

    async def model_cards(self) -> list[dict]:
        """Each served name as /v1/models lists it (vLLM's card, with max_model_len), then each LoRA adapter."""
        max_len = await self.max_model_len()
        await self.adapters.refresh(self.client)
        return [*({"id": name, "object": "model", "created": self.created, "owned_by": "pagedserve",
                   "root": self.model_name, "parent": None, "max_model_len": max_len} for name in self.served_names),
                *self.adapters.cards(self.model_name, self.created, max_len)]

    def triton_streams(self, request: GenerationRequest, request_id: str) -> list[AsyncIterator[LLMResponse]]:
        """One `llm` request per prompt."""
        streams = []
        for i, prompt in enumerate(request.prompts):
            text, ids = (prompt, None) if isinstance(prompt, str) else (None, prompt)
            streams.append(
                self.client.generate(
                    text,
                    input_ids=ids,
                    sampling_parameters=request.sampling,
                    stream=request.stream or request.stream_upstream,
                    return_logprobs=request.logprobs is not None,
                    request_id=f"{request_id}-{i}",
                    add_special_tokens=request.add_special_tokens,
                    images=getattr(request, "images", None),
                )
            )
        return streams
