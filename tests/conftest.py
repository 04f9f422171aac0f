"""Session fixtures: the tiny random-weight models the tests make, and transformers as the oracle
(tests.support.oracle)."""

from __future__ import annotations

import os

# Before anything imports triton: its own library (tl.max, tl.sum, ...) is jit'd at `import triton`, so a
# test module that pulls it in early (transformers via sentence-transformers) left those helpers compiled for
# a GPU and every interpreted kernel test after it in that worker failed (tests/kernels/conftest.py's switch
# came too late).
os.environ["TRITON_INTERPRET"] = "1"

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from pagedserve.testing import make_tiny_model
from tests.support.oracle import HFReference

LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama with grouped-query attention (4 query heads, 2 KV heads)."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Qwen2 with QKV bias."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2", seed=1)


@pytest.fixture(scope="session")
def tiny_mistral_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Mistral (no sliding window), saved as a sharded checkpoint with an index file."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-mistral"), "mistral", seed=2, max_shard_size="100KB")


@pytest.fixture(scope="session")
def tiny_tied_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama whose lm_head is tied to the input embeddings."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-tied"), "llama", tie_word_embeddings=True, seed=3)


@pytest.fixture(scope="session")
def tiny_llama3_rope_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama with llama3 rope scaling whose original context (64) is shorter than the test prompts."""
    return make_tiny_model(
        tmp_path_factory.mktemp("tiny-llama3-rope"), "llama", rope_scaling=LLAMA3_ROPE_SCALING, seed=4
    )


@pytest.fixture(scope="session")
def tiny_linear_rope_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Qwen2 with linear rope scaling (positions divided by 4)."""
    return make_tiny_model(
        tmp_path_factory.mktemp("tiny-linear-rope"),
        "qwen2",
        rope_scaling={"rope_type": "linear", "factor": 4.0},
        seed=5,
    )


@pytest.fixture(scope="session")
def hf_reference() -> HFReference:
    """A session-wide transformers oracle."""
    return HFReference()


# Files that start real servers first: with `-n 2 --dist loadfile` xdist hands out files in collection order, and
# the server files (alphabetically last) otherwise ran at the end with one worker idle beside them.
_SERVER_FOLDERS = ("server", "reliability")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Server files before the rest; a stable sort, so each file keeps its own tests' order."""
    items.sort(key=lambda item: item.path.parent.name not in _SERVER_FOLDERS)
