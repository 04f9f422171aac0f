"""The OpenAI request fields the shim takes, and the OpenAI `param` each engine field is reported as."""

from __future__ import annotations

# Fields taken as they are by both endpoints: OpenAI's sampling knobs plus vLLM's common extras.
SAMPLING_FIELDS: dict[str, tuple[type, ...]] = {
    "temperature": (int, float),
    "top_p": (int, float),
    "presence_penalty": (int, float),
    "frequency_penalty": (int, float),
    "seed": (int,),
    "n": (int,),
    "top_k": (int,),
    "min_p": (int, float),
    "repetition_penalty": (int, float),
    "min_tokens": (int,),
    "ignore_eos": (bool,),
    "stop_token_ids": (list,),
    "skip_special_tokens": (bool,),
    "include_stop_str_in_output": (bool,),
    "logit_bias": (dict,),
    "allowed_token_ids": (list,),
    "bad_words": (list,),
    "truncate_prompt_tokens": (int,),
    "priority": (int,),  # vLLM's: lower first, under the llm model's scheduling_policy priority
}
KIND_WORDS = {(int, float): "a number", (int,): "an integer", (bool,): "a boolean", (list,): "a list", (dict,): "an object",
              (str,): "a string"}

# Output constraints: OpenAI's response_format and vLLM's extra fields for the engine's structured_outputs.
STRUCTURED_FIELDS = ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
_COMMON_FIELDS = {"model", "stream", "stream_options", "stop", "max_tokens", "user",
                  "add_special_tokens", "response_format", "spaces_between_special_tokens", *STRUCTURED_FIELDS}
COMPLETION_FIELDS = _COMMON_FIELDS | set(SAMPLING_FIELDS) | {"prompt", "echo", "logprobs", "best_of", "suffix"}
CHAT_FIELDS = _COMMON_FIELDS | set(SAMPLING_FIELDS) | {
    "messages", "logprobs", "top_logprobs", "max_completion_tokens", "tools",
    "tool_choice", "parallel_tool_calls", "functions", "function_call", "metadata", "store",
    "add_generation_prompt", "continue_final_message", "chat_template_kwargs", "echo",
    "include_reasoning", "thinking_token_budget", "reasoning_effort",  # reasoning/fields.py
}
CHAT_ROLES = {"system", "developer", "user", "assistant", "tool"}

# Engine fields whose OpenAI name is another, or the same; an engine field absent here has no OpenAI name.
ENGINE_FIELD_TO_PARAM = {
    "text_input": "prompt", "prompt": "prompt", "prompt_token_ids": "prompt", "input_ids": "prompt",
    "max_tokens": "max_tokens", "stop": "stop", "logprobs": "logprobs",
    "task": "model",  # the served model does not do what the endpoint asks (generation of an embedding model)
    "images": "messages", "image": "messages",  # the image_url parts of chat's messages (the only images)
    "structured_outputs": "structured_outputs", **{name: name for name in STRUCTURED_FIELDS},
    **{name: name for name in SAMPLING_FIELDS},
}


def openai_param(engine_field: str | None, renames: dict[str, str]) -> str | None:
    """The OpenAI `param` a refusal of `engine_field` is about: the request's own renames first (chat's
    `max_completion_tokens`), then the engine's names; None for a field OpenAI has no name for."""
    if engine_field is None:
        return None
    return renames.get(engine_field) or ENGINE_FIELD_TO_PARAM.get(engine_field)
