"""`pagedserve generate` and `pagedserve chat` against the session tritonserver (tiny Llama); the structured
output flags' parsing runs without a server."""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import re
import subprocess
import sys

import jsonschema
import pytest

from pagedserve.client import commands
from pagedserve.client.cli import main
from pagedserve.client.openai.chat_template import ChatTemplate
from pagedserve.client.triton_client import TritonLLMClient

PROMPT = "Once upon a time"
# Every value bounded: the tiny model's greedy reply reaches the schema's end well within --max-tokens.
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def _generate(capsys, url: str, *flags: str) -> tuple[int, str, str]:
    code = main(["generate", PROMPT, "--url", url, "--temperature", "0", "--max-tokens", "16", *flags])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.slow
def test_generate_stream_prints_the_same_text_as_without_stream(triton_server, capsys):
    code, whole, _ = _generate(capsys, triton_server.grpc_url)
    assert code == 0 and whole.strip()
    code, streamed, _ = _generate(capsys, triton_server.grpc_url, "--stream")
    assert code == 0 and streamed == whole


@pytest.mark.slow
def test_generate_reports_a_refused_parameter_by_name(triton_server, capsys):
    code = main(["generate", PROMPT, "--url", triton_server.grpc_url, "--top-p", "3"])
    _, err = capsys.readouterr()
    assert code == 1 and "top_p" in err


@pytest.mark.slow
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


@pytest.mark.slow
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


def _parsed(*flags: str) -> dict:
    parser = argparse.ArgumentParser()
    commands.add_arguments(parser, "generate")
    return commands.sampling_parameters(parser.parse_args([PROMPT, *flags]))


def test_each_structured_flag_becomes_the_structured_outputs_parameter(tmp_path):
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SCHEMA))
    assert _parsed("--json-schema", str(schema_file))["structured_outputs"] == {"json": SCHEMA}
    assert _parsed("--regex", "[a-c]+")["structured_outputs"] == {"regex": "[a-c]+"}
    choices = _parsed("--choice", "yes", "--choice", "no, thanks")["structured_outputs"]
    assert choices == {"choice": ["yes", "no, thanks"]}
    assert "structured_outputs" not in _parsed()


@pytest.mark.parametrize(("content", "flags", "message"), [
    (None, ["--json-schema", "{missing}"], "argument --json-schema: cannot read"),
    ('{"type": ', ["--json-schema", "{file}"], "argument --json-schema: {file} is not valid JSON"),
    ("[1, 2]", ["--json-schema", "{file}"], "argument --json-schema: {file} must hold a JSON Schema object"),
    ("{}", ["--json-schema", "{file}", "--regex", "a"],
     "argument --regex: not allowed with argument --json-schema"),
    (None, ["--regex", "a", "--choice", "b"], "argument --choice: not allowed with argument --regex"),
])
@pytest.mark.parametrize("command", ["generate", "chat"])
def test_a_bad_schema_file_or_two_constraints_exit_2_naming_the_flag(tmp_path, capsys, command, content,
                                                                     flags, message):
    schema_file = tmp_path / "schema.json"
    if content is not None:
        schema_file.write_text(content)
    names = {"file": str(schema_file), "missing": str(tmp_path / "missing.json")}
    argv = [command, *([PROMPT] if command == "generate" else []), *(f.format(**names) for f in flags)]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message.format(**names) in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_generate_with_a_json_schema_prints_json_that_validates(triton_server, capsys, tmp_path, stream):
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SCHEMA))
    flags = ["--json-schema", str(schema_file), "--max-tokens", "64", *(["--stream"] if stream else [])]
    code, out, err = _generate(capsys, triton_server.grpc_url, *flags)
    assert code == 0, err
    jsonschema.validate(json.loads(out), SCHEMA)


@pytest.mark.slow
def test_generate_with_a_regex_or_choices_prints_a_match(triton_server, capsys):
    code, out, err = _generate(capsys, triton_server.grpc_url, "--regex", "[a-c]{2,4}-[0-9]{2}")
    assert code == 0 and re.fullmatch("[a-c]{2,4}-[0-9]{2}", out.removesuffix("\n")), (out, err)
    code, out, err = _generate(capsys, triton_server.grpc_url, "--choice", "yes", "--choice", "no, thanks",
                               "--temperature", "1", "--seed", "3")
    assert code == 0 and out.removesuffix("\n") in ("yes", "no, thanks"), (out, err)


@pytest.mark.slow
def test_generate_reports_a_regex_the_server_cannot_compile_by_field(triton_server, capsys):
    code, _, err = _generate(capsys, triton_server.grpc_url, "--regex", "[a-")
    assert code == 1 and "structured_outputs" in err


@pytest.mark.slow
def test_chat_with_choices_answers_every_turn_with_one_of_them(triton_server):
    done = subprocess.run(
        [sys.executable, "-m", "pagedserve.client.cli", "chat", "--url", triton_server.grpc_url,
         "--temperature", "1", "--seed", "5", "--choice", "red", "--choice", "green", "--choice", "blue"],
        input="Pick a colour\nAnd another\n", capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    replies = done.stdout.splitlines()
    assert len(replies) == 2 and set(replies) <= {"red", "green", "blue"}, done.stdout


def test_image_flags_read_files_and_chat_needs_a_model_with_an_image_token(tmp_path, capsys):
    image = tmp_path / "cat.png"
    image.write_bytes(b"\x89PNG bytes")
    parser = argparse.ArgumentParser()
    commands.add_arguments(parser, "generate")
    args = parser.parse_args([PROMPT, "--image", str(image), "--image", str(image)])
    assert args.image == [base64.b64encode(b"\x89PNG bytes").decode()] * 2
    with pytest.raises(SystemExit) as exited:
        parser.parse_args([PROMPT, "--image", str(tmp_path / "missing.png")])
    assert exited.value.code == 2 and "--image" in capsys.readouterr().err
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_token": "<image>"}))
    assert commands.with_image_placeholders("Hi", 2, tmp_path) == "<image>\n<image>\nHi"
    assert commands.with_image_placeholders("Hi", 0, tmp_path / "none") == "Hi"
    with pytest.raises(ValueError, match="takes no images"):
        commands.with_image_placeholders("Hi", 1, tmp_path / "none")
