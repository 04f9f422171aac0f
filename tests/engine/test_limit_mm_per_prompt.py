"""limit_mm_per_prompt (vLLM's name and JSON, {"image": N}) as an engine parameter: checked as a config field
naming itself, enforced on a prompt's images before any is decoded (refused naming images, nothing left in the
engine), and the OpenAI shim's default when its own flag is not given."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path
from types import SimpleNamespace

import pytest

from pagedserve.backend.core.config import SchedulerConfig
from pagedserve.backend.core.errors import ConfigError, InvalidRequestError
from pagedserve.client.media_options import MAX_IMAGES_PER_PROMPT
from pagedserve.client.openai.media import MediaSettings, image_limit_of
from pagedserve.testing import make_tiny_llava, tiny_image
from tests.support.engines import cpu_engine, greedy, run_to_end


def _png(seed: int) -> bytes:
    buffer = io.BytesIO()
    tiny_image(24, 24, seed=seed).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.mark.parametrize("value", ['{"image": 2}', {"image": 2}])
def test_the_json_text_or_a_dict_gives_the_image_limit(value):
    config = SchedulerConfig(limit_mm_per_prompt=value)
    assert config.limit_mm_per_prompt == {"image": 2} and config.image_limit == 2
    assert SchedulerConfig().image_limit is None and SchedulerConfig(limit_mm_per_prompt="{}").image_limit is None


@pytest.mark.parametrize("value", ['{"video": 1}', '{"image": -1}', '{"image": true}', '{"image": 1.5}', "[1]",
                                   "image=2"])
def test_a_bad_limit_is_refused_naming_the_parameter(value):
    with pytest.raises(ConfigError) as info:
        SchedulerConfig(limit_mm_per_prompt=value)
    assert info.value.field == "limit_mm_per_prompt"


@pytest.fixture(scope="module")
def llava_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llava(tmp_path_factory.mktemp("llava-limit"), "clip", seed=5)


def test_the_engine_refuses_more_images_than_the_limit_naming_images(llava_path):
    engine = cpu_engine(llava_path, num_blocks=32, max_model_len=256, limit_mm_per_prompt='{"image": 1}')
    two = "<image> and <image>, compared."
    for images in ([_png(0), _png(1)], engine.image_processor.process_async(two, [_png(0), _png(1)])):
        with pytest.raises(InvalidRequestError, match=r"at most 1 image\(s\).*limit_mm_per_prompt.*got 2") as info:
            engine.add_request("two", two, greedy(4), images=images)
        assert info.value.field == "images"
    assert not engine.has_unfinished_requests()
    engine.add_request("one", "Describe <image> briefly.", greedy(4), images=[_png(0)])
    assert len(run_to_end(engine)["one"].outputs[0].token_ids) == 4


def test_a_limit_of_zero_refuses_any_image_and_not_a_text_prompt(llava_path):
    engine = cpu_engine(llava_path, num_blocks=32, max_model_len=256, limit_mm_per_prompt={"image": 0})
    with pytest.raises(InvalidRequestError, match="at most 0 image"):
        engine.add_request("img", "Describe <image>.", greedy(2), images=[b"not even decoded"])
    engine.add_request("text", "Just words.", greedy(2))
    assert len(run_to_end(engine)["text"].outputs[0].token_ids) == 2


class _Client:
    def __init__(self, parameters: dict[str, str]):
        self.parameters, self.calls = parameters, 0

    async def model_parameters(self) -> dict[str, str]:
        self.calls += 1
        return self.parameters


class _Shim:
    def __init__(self, flag: int | None, parameters: dict[str, str]):
        self.settings = SimpleNamespace(media=MediaSettings(image_limit=flag))
        self.client = _Client(parameters)


@pytest.mark.parametrize(("flag", "parameter", "limit"), [
    (None, '{"image": 3}', 3),  # the llm model's parameter is the shim's default
    (2, '{"image": 3}', 2),  # the shim's own flag wins
    (None, "", MAX_IMAGES_PER_PROMPT),  # unset: the llm model's cap
    (None, '{"image": 40}', MAX_IMAGES_PER_PROMPT),  # over the llm model's cap: the cap
])
def test_the_shim_takes_the_llm_models_limit_when_its_flag_is_not_given(flag, parameter, limit):
    shim = _Shim(flag, {"limit_mm_per_prompt": parameter})
    assert asyncio.run(image_limit_of(shim)) == limit
    assert asyncio.run(image_limit_of(shim)) == limit
    assert shim.client.calls == (0 if flag is not None else 1)  # read once
