"""Pooling in the engine: which tasks a loaded model serves (`runner`), a pooling request made from its input
(text, token ids or a text pair), and the `PoolingGroup` the output processor keeps for it: it turns the
pooled vector into the answer (normalised, Matryoshka-truncated, or the classifier's probabilities)."""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pagedserve.backend.core.config import SchedulerConfig
from pagedserve.backend.core.errors import ConfigError, InvalidRequestError
from pagedserve.backend.core.outputs import CompletionOutput, RequestOutput
from pagedserve.backend.core.pooling_params import PoolingParams
from pagedserve.backend.core.request import FINISH_REASONS, Request, RequestStatus
from pagedserve.backend.engine.input_processing import resolve_prompt
from pagedserve.backend.engine.request_group import RequestGroup, StepBatch
from pagedserve.backend.worker.pooling import StepPooler


class PoolingSupport:
    """The tasks one engine serves ("generate", "embed", "classify", "score") and how its vectors are finished.

    `runner` auto serves pooling for an encoder, a classifier, or a folder with sentence-transformers' modules,
    generation otherwise; "all" lets a decoder do both in the same steps."""

    def __init__(self, runner: str, model_path: str, pooler: StepPooler, is_encoder: bool,
                 scheduler_config: SchedulerConfig):
        self.pooler = pooler
        self.is_encoder = is_encoder
        self.labels: tuple[str, ...] = tuple(getattr(pooler.model.config, "id2label", ()) or ())
        self.is_classifier = pooler.head is not None
        # A causal LM scored by token logits reads a pair as one text, query then document (vLLM's).
        self.joins_pairs = bool(getattr(pooler.model.config, "classifier_from_token", ()))
        self.raw = _config_json(model_path)
        self.max_tokens_per_step = scheduler_config.max_num_batched_tokens
        positions = int(pooler.model.config.max_position_embeddings)
        if is_encoder and scheduler_config.max_model_len > positions:  # learned positions end there
            raise ConfigError(f"max_model_len ({scheduler_config.max_model_len}) must be <= this encoder's "
                              f"{positions} positions", "max_model_len")
        self.tasks = self._tasks(runner, model_path)

    def _tasks(self, runner: str, model_path: str) -> frozenset[str]:
        pooling_only = self.is_encoder or self.is_classifier
        if runner == "auto":
            st_folder = (Path(model_path) / "modules.json").is_file()
            runner = "pooling" if pooling_only or st_folder else "generate"
        if pooling_only and runner != "pooling":
            kind = "an encoder" if self.is_encoder else "a sequence classifier"
            raise ConfigError(f"runner {runner!r} needs a model that generates; this is {kind}: use runner "
                              "'pooling' (or auto)", "runner")
        pooling = {"classify", "score"} if self.is_classifier else {"embed"}
        return frozenset({"generate"} | pooling if runner == "all" else pooling if runner == "pooling"
                         else {"generate"})

    @property
    def default_task(self) -> str:
        """The task a request that names none asks for."""
        return "classify" if self.is_classifier else "embed"

    @property
    def matryoshka_dimensions(self) -> list[int] | None:
        """The truncations a Matryoshka model supports (any up to its size when it lists none); None: not one."""
        dims = self.raw.get("matryoshka_dimensions")
        if dims:
            return [int(d) for d in dims]
        return [] if self.raw.get("is_matryoshka") else None

    def check_task(self, task: str) -> None:
        """Refuse a task this engine does not serve, naming `task`."""
        if task not in self.tasks:
            raise InvalidRequestError(f"this model does not serve task {task!r}; it serves "
                                      f"{', '.join(sorted(self.tasks))}", "task")

    def make_request(self, request_id: str, tokenizer: Any, vocab_size: int, prompt: str | None,
                     params: PoolingParams, token_ids: list[int] | None = None, text_pair: str | None = None,
                     **kwargs: Any) -> Request:
        """The scheduler Request of a pooling input; bad input refused naming its field."""
        self.check_task(params.task)
        self._check_dimensions(params)
        params = dataclasses.replace(params)  # its own copy: a pair's segment bound is this request's
        if prompt is not None and params.task == "embed":
            prompt = self._with_instruction(prompt, params.prompt_name)
        if text_pair is not None:
            token_ids, params.first_segment_tokens = _tokenize_pair(tokenizer, prompt, text_pair, self.joins_pairs)
        else:
            token_ids = resolve_prompt(tokenizer, vocab_size, prompt, token_ids)
        # The whole prompt in one step: an encoder attends both ways, CLS / mean pooling read every token.
        whole = self.is_encoder or self.pooler.config.pooling_type != "lasttoken"
        if whole and len(token_ids) > self.max_tokens_per_step:
            raise InvalidRequestError(f"input has {len(token_ids)} tokens; this model pools an input in one step "
                                      f"of at most max_num_batched_tokens ({self.max_tokens_per_step})", "input")
        # Pooling over every token needs each computed here: such a request never takes cached blocks.
        salt = f"pool-{uuid.uuid4().hex}" if whole else None
        return Request(request_id, token_ids, arrival_time=kwargs.get("arrival_time"), cache_salt=salt,
                       group_id=request_id, priority=kwargs.get("priority", 0), pooling_params=params,
                       whole_prompt=whole)

    def _with_instruction(self, text: str, name: str | None) -> str:
        """`text` after the folder's named prompt (its default one when `name` is None)."""
        prompts = self.pooler.config.prompts
        if name is None:
            name = self.pooler.config.default_prompt_name
            if name is None:
                return text
        if name not in prompts:
            raise InvalidRequestError(f"prompt_name {name!r} is not one of the model's prompts "
                                      f"({', '.join(sorted(prompts)) or 'none'})", "prompt_name")
        return prompts[name] + text

    def _check_dimensions(self, params: PoolingParams) -> None:
        if params.dimensions is None:
            return
        dims = self.matryoshka_dimensions
        if dims is None:
            raise InvalidRequestError("dimensions is only supported by a Matryoshka model; this one is not",
                                      "dimensions")
        size = int(self.pooler.model.config.hidden_size)
        if params.dimensions > size or (dims and params.dimensions not in dims):
            allowed = ", ".join(map(str, dims)) if dims else f"1 .. {size}"
            raise InvalidRequestError(f"dimensions must be one of {allowed}, got {params.dimensions}", "dimensions")

    def finish(self, vector: torch.Tensor, params: PoolingParams) -> list[float]:
        """The answer from a pooled fp32 vector: an embedding (truncated, normalised) or class probabilities."""
        if params.task == "embed":
            if params.dimensions is not None:
                vector = vector[: params.dimensions]
            normalize = self.pooler.config.normalize if params.normalize is None else params.normalize
            if normalize:
                vector = torch.nn.functional.normalize(vector, dim=-1)
            return vector.tolist()
        if params.activation:
            vector = _activation(self.raw, vector)
        return vector.tolist()


def _activation(raw: dict, logits: torch.Tensor) -> torch.Tensor:
    """The config's activation (sentence-transformers' activation_fn), else sigmoid for one label, softmax for
    more (vLLM's)."""
    name = str((raw.get("sentence_transformers") or {}).get("activation_fn", "")).rsplit(".", 1)[-1]
    if name == "Identity":
        return logits
    if name == "Sigmoid" or (not name and logits.numel() == 1):
        return torch.sigmoid(logits)
    return torch.softmax(logits, dim=-1)


def _tokenize_pair(tokenizer: Any, text: str | None, pair: str, join: bool) -> tuple[list[int], int | None]:
    """A text pair's ids as the tokenizer joins them (`join`: as one text), and how many of them are the first
    segment (where the tokenizer gives token types)."""
    for name, value in (("text", text), ("text_pair", pair)):
        if not isinstance(value, str) or not value:
            raise InvalidRequestError(f"{name} must be a non-empty string", name)
    if join:
        return list(tokenizer(text + pair)["input_ids"]), None
    encoded = tokenizer(text, pair)
    types = encoded.get("token_type_ids")
    first = None
    if types is not None and 1 in types:
        first = types.index(1)
        if any(t != 1 for t in types[first:]):
            raise InvalidRequestError("the tokenizer's token types for this pair are not one run of 0s then 1s",
                                      "text_pair")
    return list(encoded["input_ids"]), first


def _config_json(model_path: str) -> dict:
    path = Path(model_path) / "config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


class PoolingGroup(RequestGroup):
    """A pooling request as the output processor keeps it: one prefill-only sequence, finished once pooled."""

    def __init__(self, request_id: str, prompt: str | None, request: Request, support: PoolingSupport):
        self.request_id = request_id
        self.prompt = prompt
        self.request = request
        self.params = request.sampling_params
        self.pooling_params = request.pooling_params
        self.arrival_time = request.arrival_time
        self._support = support
        self.vector: list[float] | None = None
        self.finish_reason: str | None = None
        self.error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def sequence_ids(self) -> list[str]:
        return [self.request.request_id]

    def take_logits(self, request_id: str, row: int, logits: torch.Tensor, batch: StepBatch) -> None:
        raise RuntimeError(f"pooling request {request_id!r} was given a sample row")

    def record_prompt_logits(self, request_id: str, start: int, logits: torch.Tensor) -> None:
        """A pooling request asks for no prompt logprobs."""

    def record_pooled(self, vector: torch.Tensor) -> None:
        """Its pooled vector arrived: the answer, and the request is done."""
        self.vector = self._support.finish(vector, self.pooling_params)
        self.finish_reason = FINISH_REASONS[RequestStatus.FINISHED_STOPPED]

    def end(self, status: RequestStatus, error: str | None = None) -> list[str]:
        if self.finished:
            return []
        self.finish_reason, self.error = FINISH_REASONS[status], error
        return [self.request.request_id]

    def output(self) -> RequestOutput:
        done = CompletionOutput(index=0, text="", token_ids=[], finish_reason=self.finish_reason)
        return RequestOutput(
            request_id=self.request_id, prompt=self.prompt, prompt_token_ids=list(self.request.prompt_token_ids),
            outputs=[done], finished=self.finished, num_cached_tokens=max(self.request.num_cached_tokens, 0),
            error=self.error, pooled=self.vector,
        )


def run_pooling(engine: Any, inputs: Any, params: PoolingParams | None) -> list[RequestOutput]:
    """LLMEngine.encode: add every input (all or none), step until each has its final output, in input order."""
    if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)):
        inputs = [inputs]

    def submit(item: Any) -> Callable[[str], object]:
        if isinstance(item, tuple):
            return lambda rid: engine.add_pooling_request(rid, item[0], params, text_pair=item[1])
        if isinstance(item, str):
            return lambda rid: engine.add_pooling_request(rid, item, params)
        return lambda rid: engine.add_pooling_request(rid, None, params, prompt_token_ids=list(item))

    return engine.run_all([submit(item) for item in inputs], "encode")
