"""A GGUF file's tokenizer as a Hugging Face folder (tokenizer.json, its config with the chat template, and
config.json from the file's metadata), written once beside the cache: for the models that read a folder (the
ensemble's tokenizer steps, the OpenAI shim) while the llm model serves the .gguf file itself."""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path

from pagedserve.backend.model import gguf_file
from pagedserve.backend.model.default_model import cache_root

_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")


def tokenizer_dir(gguf_path: str | Path, cache_dir: str | None = None) -> Path:
    """The folder holding `gguf_path`'s tokenizer and config, made on first use (atomically, so concurrent
    callers never see half a folder). It is keyed by the file's path, size and mtime: a changed file gets a
    new folder."""
    path = Path(gguf_path).expanduser().resolve()
    stat = path.stat()
    key = hashlib.blake2b(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode(), digest_size=8).hexdigest()
    target = cache_root(cache_dir) / "gguf-tokenizers" / f"{path.stem}-{key}"
    if all((target / name).is_file() for name in _FILES):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.stem}.tmp-", dir=target.parent))
    try:
        _write(path, staging)
        staging.chmod(0o755)
        try:
            staging.rename(target)
        except OSError:
            if not all((target / name).is_file() for name in _FILES):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _write(path: Path, out_dir: Path) -> None:
    """Save the GGUF's tokenizer (transformers reads its vocabulary, merges and chat template) and config."""
    from transformers import AutoTokenizer
    from transformers.utils import logging

    logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    tokenizer.save_pretrained(out_dir)
    tok_file = out_dir / "tokenizer_config.json"
    tok_config = json.loads(tok_file.read_text())
    if tokenizer.chat_template and "chat_template" not in tok_config:
        # Older readers (and the shim's template loader) look for the template inside tokenizer_config.json.
        tok_config["chat_template"] = tokenizer.chat_template
    tok_config.pop("local_files_only", None)
    tok_file.write_text(json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n")
    config = gguf_file.config_dict(path)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
