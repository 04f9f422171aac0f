"""OpenAI-compatible HTTP shim (FastAPI) in front of tritonserver's decoupled `llm` model.

Requests become `llm` requests over gRPC streaming; a client that goes away cancels its Triton request,
which frees its KV blocks. Run: `pagedserve openai --triton-url HOST:PORT` or
`python -m pagedserve.client.openai ...`.

fields (the OpenAI fields taken, engine field -> `param`), errors (OpenAI's error shape, llm and Triton
errors mapped by their wire tag), protocol (request bodies translated and validated), chat_template,
formats (SSE, usage, logprobs shapes), generation (what both endpoints' answers share), serving_completion
and serving_chat (the two endpoints), streams (merging, disconnects), shim (shared state), app (routes),
main (command line).
"""

from pagedserve.client.openai.main import add_arguments, main, run

__all__ = ["add_arguments", "main", "run"]
