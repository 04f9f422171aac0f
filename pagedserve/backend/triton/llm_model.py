"""The decoupled Triton `llm` model's lifecycle: execute() only validates and enqueues; the engine loop
(engine_loop.py) drives the LLMEngine on its own thread; response threads (responses.py) send; the cancel
watcher (cancel_watcher.py) polls for cancelled requests and notices an unload. They talk through the typed
messages of messages.py. Every request ends with a FINAL response, errors and cancellations included.
"""

from __future__ import annotations

import itertools
import json
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import triton_python_backend_utils as pb_utils

from pagedserve.backend.core.errors import ShuttingDownError
from pagedserve.backend.triton.cancel_watcher import CancelWatcher
from pagedserve.backend.triton.encoding import OutputEncoder
from pagedserve.backend.triton.engine_loop import SHUTTING_DOWN, EngineLoop
from pagedserve.backend.triton.inputs import input_tensors, parse_llm_request
from pagedserve.backend.triton.instances import (
    Instance,
    instance_device,
    instance_engine_kwargs,
    machine_cores,
)
from pagedserve.backend.triton.lora import CONTROL_INPUT, control_request, lora_engine_kwargs, model_instances
from pagedserve.backend.triton.messages import ControlRequest, InFlight, Stop
from pagedserve.backend.triton.metrics import EngineMetrics, cache_config_labels
from pagedserve.backend.triton.protocols import FINAL
from pagedserve.backend.triton.responses import Outbox, ResponseThread
from pagedserve.backend.triton.settings import (
    GIL_SWITCH_INTERVAL_SECONDS,
    SHUTDOWN_TIMEOUT_SECONDS,
    ModelSettings,
    engine_arguments,
)
from pagedserve.backend.triton.tensors import TritonResponses, error_response

if TYPE_CHECKING:
    from pagedserve.backend.engine.llm_engine import LLMEngine


def _load_engine(model_path: str, engine_kwargs: dict) -> LLMEngine:
    """The LLMEngine for `model_path` (the default model when empty)."""
    from pagedserve.backend.engine.llm_engine import LLMEngine

    if not model_path:
        from pagedserve.backend.model.default_model import ensure_default_model

        model_path = str(ensure_default_model())
    return LLMEngine.from_pretrained(model_path, **engine_kwargs)


class TritonPythonModel:
    """Triton's entry points for the `llm` model."""

    def initialize(self, args: dict) -> None:
        """Start the threads (the engine loads on its own); raise startup errors."""
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise pb_utils.TritonModelException("the llm model needs `model_transaction_policy { decoupled: true }`")
        if pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL != FINAL:
            raise pb_utils.TritonModelException("this Triton's FINAL response flag is not the one pagedserve sends")
        parameters = config.get("parameters", {})
        instance = Instance.from_args(args, config)
        self._model_path, self._engine_kwargs = self._instance_arguments(parameters, instance)
        self._engine_kwargs = lora_engine_kwargs(self._engine_kwargs,
                                                 Path(args["model_repository"]) / args["model_version"])
        self._instances = model_instances(config)
        self._settings = settings = ModelSettings.from_parameters(parameters)
        self._ids = itertools.count()
        self._model_name = args["model_name"]
        self._finalizing = False
        self._outbox = Outbox(settings.response_threads)
        self._metrics = metrics = EngineMetrics(args["model_name"], args["model_version"], instance.name,
                                                str(self._engine_kwargs.get("data_parallel_rank", 0)))
        self._responders = [ResponseThread(shard, self._outbox, metrics, TritonResponses(), pb_utils.Logger)
                            for shard in range(settings.response_threads)]
        self._loop: EngineLoop | None = None
        self._loop_ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._watcher = CancelWatcher(args["model_name"], args["model_version"], settings.shutdown_grace,
                                      engine_inbox=None, step_seconds=lambda: self._loop.step_seconds,
                                      is_model_ready=pb_utils.is_model_ready, log=pb_utils.Logger)
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_SECONDS)
        self._engine_thread = threading.Thread(target=self._engine_main, args=(settings,),
                                               name="pagedserve-engine", daemon=True)
        for responder in self._responders:
            responder.thread.start()
        self._engine_thread.start()
        self._loop_ready.wait()
        if self._startup_error is not None:
            self._outbox.stop()
            for responder in self._responders:
                responder.thread.join()
            self._metrics.close()
            raise pb_utils.TritonModelException(f"the pagedserve engine failed to start: {self._startup_error!r}")
        self._watcher.thread.start()

    @staticmethod
    def _instance_arguments(parameters: dict, instance: Instance) -> tuple[str, dict]:
        """(model path, engine kwargs) of this instance: its device, its share of the cores and KV budget."""
        model_path, kwargs = engine_arguments(parameters)
        device = instance_device(instance, kwargs.get("device", "auto"), torch.cuda.is_available())
        kwargs = instance_engine_kwargs(kwargs, instance, device, machine_cores())
        shared = {key: kwargs[key] for key in ("cpu_threads", "num_blocks", "kv_cache_memory_bytes") if key in kwargs}
        pb_utils.Logger.log_info(f"pagedserve: instance {instance.name} ({instance.kind}, one of {instance.peers} "
                                 f"on its device) runs on {device} {shared}")
        return model_path, kwargs

    def execute(self, requests: list) -> None:
        """Validate each request and hand it to the engine loop; responses come from the response threads."""
        for request in requests:
            sender = request.get_response_sender()
            if self._finalizing or self._watcher.closing:
                sender.send(error_response(ShuttingDownError(SHUTTING_DOWN)), flags=FINAL)
                continue
            try:
                tensors = input_tensors(request)
                if CONTROL_INPUT in tensors:
                    control = control_request(tensors, self._settings.lora_runtime_updates, self._instances)
                    self._loop.inbox.put(ControlRequest(sender, control))
                    continue
                inputs = parse_llm_request(request, tensors)
            except Exception as error:  # noqa: BLE001 - INVALID_ARG for bad input, INTERNAL otherwise
                sender.send(error_response(error), flags=FINAL)
                continue
            self._loop.inbox.put(InFlight(f"req-{next(self._ids)}", sender, inputs, time.monotonic()))
        return None

    def finalize(self) -> None:
        """End every in-flight request with an error response, then stop the threads."""
        self._finalizing = True
        self._loop.inbox.put(Stop())
        self._engine_thread.join(SHUTDOWN_TIMEOUT_SECONDS)
        self._watcher.watch.put(None)
        self._watcher.thread.join(SHUTDOWN_TIMEOUT_SECONDS)
        self._outbox.stop()
        deadline = time.monotonic() + SHUTDOWN_TIMEOUT_SECONDS
        for responder in self._responders:
            responder.thread.join(max(0.0, deadline - time.monotonic()))
        if not any(responder.thread.is_alive() for responder in self._responders):
            self._metrics.close()

    def load_engine(self) -> LLMEngine:
        """The engine of this instance, built on the engine thread (tests/support's fault model wraps it)."""
        return _load_engine(self._model_path, self._engine_kwargs)

    def _unload_broken(self, reason: str) -> None:
        """The engine can run no further step: ask Triton to unload this model, so that it reads not ready
        (/v2/models/<name>/ready) and an orchestrator restarts the server. From a thread of its own, as the
        unload finalizes this model, which joins the engine thread."""
        pb_utils.Logger.log_error(f"pagedserve: {reason}; unloading model '{self._model_name}'")

        def unload() -> None:
            try:
                pb_utils.unload_model(self._model_name)
            except Exception as error:  # noqa: BLE001 - Triton refuses unloads outside explicit model control
                pb_utils.Logger.log_error(
                    f"pagedserve: model '{self._model_name}' stays loaded but cannot serve ({error}); run "
                    "tritonserver with --model-control-mode=explicit (as `pagedserve serve` does) to have it "
                    "unloaded")

        threading.Thread(target=unload, name="pagedserve-unload", daemon=True).start()

    def _describe_cache(self, engine) -> None:
        """The KV cache the budget bought, in the server's log and as vllm:cache_config_info."""
        labels = cache_config_labels(engine.cache_config, engine.runner.num_blocks)
        runner = engine.runner  # Python logging never reaches serve's output from the stub: Triton's log does
        pb_utils.Logger.log_info(f"pagedserve: KV cache: {labels['num_gpu_blocks']} blocks of {labels['block_size']} "
                                 f"tokens ({runner.num_blocks * runner.block_bytes / 2**20:.1f} MiB), dtype "
                                 f"{labels['cache_dtype']} ({str(runner.kv_cache_dtype).removeprefix('torch.')})")
        self._metrics.describe_cache(labels)

    def _engine_main(self, settings: ModelSettings) -> None:
        """Load the engine, report back to initialize(), then run the loop until Stop."""
        try:
            device = torch.device(self._engine_kwargs["device"])
            if device.type == "cuda" and device.index is not None:
                # Triton kernels launch on the thread's current device, not on their tensors' device.
                torch.cuda.set_device(device)
            engine = self.load_engine()
            self._describe_cache(engine)
            loop = EngineLoop(engine, settings, self._outbox, self._watcher.watch, pb_utils.Logger)
            self._watcher.engine_inbox = loop.inbox
            loop.on_broken = self._unload_broken
            encoder = OutputEncoder(engine.tokenizer)
            for responder in self._responders:
                responder.encoder = encoder
            self._loop = loop
        except BaseException as error:  # noqa: BLE001 - handed to initialize(), which raises it
            self._startup_error = error
        self._loop_ready.set()
        if self._startup_error is None:
            try:
                self._loop.run()
            finally:
                self._loop.engine.shutdown()  # joins the tensor-parallel workers
