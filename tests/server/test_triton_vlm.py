"""A vision-language model through tritonserver: the `llm` model's `image` input (Triton's vLLM-backend name:
base64 image files beside text_input) over gRPC streaming gives the in-process engine's greedy text for the same
image; bad image input is refused naming the field, and the server serves on with nothing left behind."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path

import pytest

from pagedserve.backend.core.sampling_params import SamplingParams
from pagedserve.testing import make_tiny_llava, tiny_image
from tests.support.engines import cpu_engine
from tests.support.servers import CPU_FP32, RunningTriton, triton_running

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}
PROMPT = "Describe <image> in one line please."


def _png(seed: int) -> bytes:
    buffer = io.BytesIO()
    tiny_image(40, 30, seed=seed).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def llava_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llava(tmp_path_factory.mktemp("tiny-llava-server"), "clip", seed=3)


@pytest.fixture(scope="module")
def llava_server(llava_path, tmp_path_factory) -> Iterator[RunningTriton]:
    params = {**CPU_FP32, "max_model_len": "256", "num_blocks": "64"}
    with triton_running(llava_path, tmp_path_factory.mktemp("llava-server"), params, llm_only=True) as running:
        yield running


def test_image_input_streams_the_engines_greedy_text_for_that_image(llava_server, llava_path):
    images = [_png(0), _png(1)]
    request = {"text_input": PROMPT, "sampling_parameters": GREEDY, "exclude_input_in_output": True}
    texts = []
    for image in images:
        streamed = llava_server.grpc_stream("llm", {**request, "stream": True,
                                                    "image": [base64.b64encode(image).decode()]})
        whole = llava_server.grpc_stream("llm", {**request, "image": ["data:image/png;base64,"
                                                                      + base64.b64encode(image).decode()]})
        assert streamed.error is None and whole.error is None
        assert "".join(streamed.texts()) == whole.texts()[0]
        texts.append(whole.texts()[0])
    engine = cpu_engine(llava_path, num_blocks=32)
    for index, (image, text) in enumerate(zip(images, texts, strict=True)):
        engine.add_request(f"r{index}", PROMPT, SamplingParams(**GREEDY), images=[image])
        outputs = []
        while engine.has_unfinished_requests():
            outputs += [out for out in engine.step() if out.finished]
        assert outputs[0].outputs[0].text == text
    assert texts[0] != texts[1]  # the image, not only the text, decides the output
    llava_server.wait_idle()


@pytest.mark.parametrize(("image", "field", "words"), [
    (["%%% not base64"], "image", "not base64"),
    ([base64.b64encode(b"plain text, not an image").decode()], "images", "not a readable image"),
    ([base64.b64encode(_png(0)).decode()] * 2, "images", "placeholders"),
])
def test_bad_image_input_is_refused_naming_the_field_and_the_server_goes_on(llava_server, image, field, words):
    request = {"text_input": PROMPT, "sampling_parameters": GREEDY, "stream": True, "image": image}
    result = llava_server.grpc_stream("llm", request)
    assert result.error is not None
    assert words in str(result.error) and f"field={field}" in str(result.error)
    ok = llava_server.grpc_stream("llm", {**request, "image": [base64.b64encode(_png(0)).decode()]})
    assert ok.error is None
    llava_server.wait_idle()


def test_openai_chat_image_url_data_part_gives_the_engines_text(llava_server, llava_path):
    import openai
    from transformers import AutoTokenizer

    image = _png(2)
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    content = [{"type": "text", "text": "Describe "}, {"type": "image_url", "image_url": {"url": url}},
               {"type": "text", "text": " in one line please."}]
    with llava_server.openai_shim() as base_url:
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none")
        reply = client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=12,
                                               temperature=0.0, messages=[{"role": "user", "content": content}],
                                               extra_body={"ignore_eos": True})
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(
                model=client.models.list().data[0].id, max_tokens=4,
                messages=[{"role": "user", "content": [{"type": "image_url",
                                                        "image_url": {"url": "http://127.0.0.1/x.png"}}]}])
        assert refused.value.body["param"] == "messages[0].content[0].image_url.url"
    tokenizer = AutoTokenizer.from_pretrained(str(llava_path), local_files_only=True)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Describe <image> in one line please."}],
                                           tokenize=False, add_generation_prompt=True)
    engine = cpu_engine(llava_path, num_blocks=32)
    engine.add_request("chat", prompt, SamplingParams(**GREEDY), images=[image], add_special_tokens=False)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [out for out in engine.step() if out.finished]
    assert reply.choices[0].message.content == outputs[0].outputs[0].text
    assert reply.usage.prompt_tokens == len(outputs[0].prompt_token_ids) > 16
    llava_server.wait_idle()


def test_cli_generate_and_chat_send_their_image_files(llava_server, llava_path, tmp_path, capsys):
    import subprocess
    import sys

    from pagedserve.client.cli import main
    from pagedserve.client.openai.chat_template import ChatTemplate

    files = [tmp_path / "a.png", tmp_path / "b.png"]
    for seed, path in enumerate(files, start=3):
        path.write_bytes(_png(seed))
    encoded = [base64.b64encode(path.read_bytes()).decode() for path in files]
    sampling = {"temperature": 0.0, "max_tokens": 8}

    def greedy(prompt: str, images: list[str], **flags: bool) -> str:
        result = llava_server.grpc_stream("llm", {"text_input": prompt, "sampling_parameters": sampling,
                                                  "exclude_input_in_output": True, "image": images, **flags})
        assert result.error is None
        return result.texts()[0]

    code = main(["generate", PROMPT, "--url", llava_server.grpc_url, "--temperature", "0", "--max-tokens", "8",
                 "--image", str(files[0])])
    assert code == 0 and capsys.readouterr().out == greedy(PROMPT, encoded[:1]) + "\n"
    done = subprocess.run([sys.executable, "-m", "pagedserve.client.cli", "chat", "--url", llava_server.grpc_url,
                           "--temperature", "0", "--max-tokens", "8", "--image", str(files[0]), "--image",
                           str(files[1])], input="What are these?\nAnd again\n", capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    template = ChatTemplate.from_model_dir(llava_path)
    messages = [{"role": "user", "content": "<image>\n<image>\nWhat are these?"}]
    first = greedy(template.render(messages), encoded, add_special_tokens=False)
    messages += [{"role": "assistant", "content": first}, {"role": "user", "content": "And again"}]
    second = greedy(template.render(messages), encoded, add_special_tokens=False)
    assert done.stdout == f"{first}\n{second}\n"
    llava_server.wait_idle()


def test_openai_image_url_fetched_from_an_allowed_loopback_host_as_its_data_url(llava_server):
    import threading
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    import openai

    image = _png(4)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path == "/slow.png":
                time.sleep(2.5)
            body = image + b"\0" * 64 if self.path == "/big.png" else image
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            try:
                self.wfile.write(body)
            except (BrokenPipeError, ConnectionResetError):  # the shim hung up past its limit
                pass

        def log_message(self, *args: object) -> None:
            pass

    files = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    files.daemon_threads = True
    threading.Thread(target=files.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{files.server_address[1]}"
    try:
        with llava_server.openai_shim("--allowed-media-domains", "127.0.0.1", "--media-max-bytes", str(len(image)),
                                      "--media-fetch-timeout", "1") as base_url:
            client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none")
            model = client.models.list().data[0].id

            def ask(url: str) -> str:
                content = [{"type": "text", "text": "Describe "}, {"type": "image_url", "image_url": {"url": url}}]
                reply = client.chat.completions.create(model=model, max_tokens=8, temperature=0.0,
                                                       messages=[{"role": "user", "content": content}])
                return reply.choices[0].message.content

            assert ask(f"{base}/cat.png") == ask("data:image/png;base64," + base64.b64encode(image).decode())
            for path, words in (("/big.png", "over"), ("/slow.png", "within 1 s")):
                with pytest.raises(openai.BadRequestError, match=words) as refused:
                    ask(f"{base}{path}")
                assert refused.value.body["param"] == "messages[0].content[1].image_url.url"
    finally:
        files.shutdown()
        files.server_close()
    llava_server.wait_idle()
