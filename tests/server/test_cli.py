"""`pagedserve generate` and `pagedserve chat` against the session tritonserver (tiny Llama)."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
from pagedserve.client.cli import main
from pagedserve.client.openai.chat_template import ChatTemplate
from pagedserve.client.triton_client import TritonLLMClient

pytestmark = pytest.mark.slow

PROMPT = "Once upon a time"


def _generate(capsys, url: str, *flags: str) -> tuple[int, str, str]:
    code = main(["generate", PROMPT, "--url", url, "--temperature", "0", "--max-tokens", "16", *flags])
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_stream_prints_the_same_text_as_without_stream(triton_server, capsys):
    code, whole, _ = _generate(capsys, triton_server.grpc_url)
    assert code == 0 and whole.strip()
    code, streamed, _ = _generate(capsys, triton_server.grpc_url, "--stream")
    assert code == 0 and streamed == whole


def test_generate_reports_a_refused_parameter_by_name(triton_server, capsys):
    code = main(["generate", PROMPT, "--url", triton_server.grpc_url, "--top-p", "3"])
    _, err = capsys.readouterr()
    assert code == 1 and "top_p" in err


def test_generate_without_a_server_says_so(capsys):
    code = main(["generate", PROMPT, "--url", "127.0.0.1:9"])
    _, err = capsys.readouterr()
    assert code == 2 and "127.0.0.1:9" in err


async def _greedy(url: str, prompt: str, max_tokens: int) -> str:
    client = TritonLLMClient(url)
    try:
        params = {"temperature": 0, "max_tokens": max_tokens}
        return "".join([r.text[0] async for r in client.generate(prompt, sampling_parameters=params, stream=False)])
    finally:
        await client.close()


def test_chat_keeps_the_conversation_in_the_template_and_exits_at_end_of_input(triton_server):
    done = subprocess.run(
        [sys.executable, "-m", "pagedserve.client.cli", "chat", "--url", triton_server.grpc_url,
         "--temperature", "0", "--max-tokens", "8", "--system", "Be brief."],
        input="Hello\nAnd again\n", capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    template = ChatTemplate.from_model_dir(triton_server.model_path)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    first = asyncio.run(_greedy(triton_server.grpc_url, template.render(messages), 8))
    messages += [{"role": "assistant", "content": first}, {"role": "user", "content": "And again"}]
    second = asyncio.run(_greedy(triton_server.grpc_url, template.render(messages), 8))
    assert done.stdout == f"{first}\n{second}\n"
