"""Tiny random-weight models of each supported family with a real byte-level BPE tokenizer, for tests and benches."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

BOS_TOKEN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
END_OF_TEXT = "<|endoftext|>"
SPECIAL_TOKENS = [END_OF_TEXT, BOS_TOKEN, EOS_TOKEN]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Mixed prose, code, digits and non-ASCII so the merges cover common shapes; bytes cover the rest.
_TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog. The capital of France is Paris.
Once upon a time there was a small model that learned to count: one, two, three, four, five.
def add(a, b):
    return a + b
Numbers 0 1 2 3 4 5 6 7 8 9 10 42 100 2048 and symbols ! ? , . ; : ( ) [ ] { } < > = + - * /
Hello world! Hello there. How are you today? I am fine, thank you very much.
Paged attention stores keys and values in fixed-size blocks; a block table maps positions to blocks.
Café, naïve, résumé, München, Zürich,日本語, 中文, 한국어, emoji 🙂 and ✓ marks.
user assistant system: answer the question in one line please.
"""

_VOCAB_SIZE = 384

_ARCHITECTURES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
}


def build_tokenizer() -> Any:
    """Train the deterministic tiny byte-level BPE tokenizer as a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_TRAINING_TEXT.splitlines() * 4, trainer=trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=END_OF_TEXT,
        unk_token=None,
    )
    hf.chat_template = CHATML_TEMPLATE
    return hf


# Per-architecture config fields that keep the tiny model the plain variant our runner serves.
_ARCH_EXTRAS: dict[str, dict[str, Any]] = {
    "llama": {"attention_bias": False},
    "mistral": {"sliding_window": None},
    "qwen2": {"use_sliding_window": False},
    "qwen3": {"use_sliding_window": False, "head_dim": 32},  # head_dim != hidden_size / num_heads
    "phi3": {"sliding_window": None},
    # The MoE families: 8 experts, top-2; Qwen2-MoE with its shared expert, Qwen3-MoE renormalising.
    "mixtral": {"sliding_window": None, "num_local_experts": 8, "num_experts_per_tok": 2},
    "qwen2_moe": {"use_sliding_window": False, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "shared_expert_intermediate_size": 96},
    "qwen3_moe": {"use_sliding_window": False, "head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 32, "norm_topk_prob": True},
    # Gemma: an attention scale that is not head_dim ** -0.5, a window of 8 (shorter than most test prompts),
    # caps small enough to bend this model's scores and logits; Gemma 3 with a global layer every second one and
    # its two rope bases (these rope_parameters replace the rope_theta / rope_scaling arguments).
    "gemma2": {"head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 8, "attn_logit_softcapping": 5.0,
               "final_logit_softcapping": 10.0},
    "gemma3": {"head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 8, "sliding_window_pattern": 2,
               "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}},
}


def _widen_init(model: Any, random_norms: bool = False) -> None:
    """A wider init than the default 0.02 keeps greedy argmax margins large, so fp32 parity is stable;
    `random_norms` draws the norm weights too, so a norm loaded into the wrong place changes the output."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.5)
            elif param.dim() > 1:
                param.normal_(0.0, 0.2 if "embed" in name or "lm_head" in name else 0.1)
            elif random_norms and "norm" in name:
                param.uniform_(0.5, 1.5)


def make_tiny_model(
    path: str | Path,
    arch: str = "llama",
    *,
    tie_word_embeddings: bool = False,
    rope_scaling: dict | None = None,
    num_kv_heads: int = 2,
    num_heads: int = 4,
    hidden_size: int = 64,
    num_layers: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 1024,
    rope_theta: float = 10000.0,
    seed: int = 0,
    dtype: str = "float32",
    max_shard_size: str | None = None,
    config_extras: dict[str, Any] | None = None,
    random_norms: bool = False,
) -> Path:
    """Save a tiny random-weight `arch` model (safetensors) plus tokenizer and generation config to `path`.

    `rope_scaling` takes the config.json form, e.g. {"rope_type": "llama3", "factor": 8.0, ...}.
    `max_shard_size` (e.g. "20KB") writes a sharded checkpoint with an index file.
    `config_extras` are more (or overriding) keyword arguments of the transformers config class, e.g. a family's
    own keys; `random_norms` draws the norm weights instead of leaving them at one.
    """
    import torch
    import transformers

    if arch not in _ARCHITECTURES:
        raise ValueError(f"arch must be one of {sorted(_ARCHITECTURES)}, got {arch!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config_cls_name, model_cls_name = _ARCHITECTURES[arch]
    settings = dict(
        **_write_tokenizer(path),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie_word_embeddings,
        rope_parameters={**(rope_scaling or {"rope_type": "default"}), "rope_theta": rope_theta},
    )
    settings.update({**_ARCH_EXTRAS.get(arch, {}), **(config_extras or {})})
    config = getattr(transformers, config_cls_name)(**settings)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls_name)(config)
    _widen_init(model, random_norms)
    model.to(getattr(torch, dtype))
    _save(model, path, max_shard_size)
    return path


def _write_tokenizer(path: Path) -> dict[str, int]:
    """Save the tiny tokenizer and its chat template to `path`; returns the config fields it decides."""
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(path)
    _ensure_chat_template_in_config(path)
    bos_id, eos_id, eot_id = (tokenizer.convert_tokens_to_ids(t) for t in (BOS_TOKEN, EOS_TOKEN, END_OF_TEXT))
    return {"vocab_size": len(tokenizer), "bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": eot_id}


def _save(model: Any, path: Path, max_shard_size: str | None) -> None:
    """Write the weights (sharded when `max_shard_size` is given) and a generation config ending on eos or
    the end-of-text (pad) token, as the model config names them."""
    import transformers

    config = model.config
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=[config.eos_token_id, config.pad_token_id],
        pad_token_id=config.pad_token_id,
    )
    kwargs: dict[str, Any] = {"safe_serialization": True}
    if max_shard_size:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(path, **kwargs)


def _ensure_chat_template_in_config(path: Path) -> None:
    """Put the chat template into tokenizer_config.json too, where older readers look for it."""
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = CHATML_TEMPLATE
    config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False))


def copy_with_bos_tokenizer(source: str | Path, target: str | Path) -> Path:
    """Copy a tiny model folder, making its tokenizer add a BOS (END_OF_TEXT) of its own, as Llama's and
    Mistral's do, and its chat template start with `{{ bos_token }}` as theirs do."""
    import shutil

    target = Path(target)
    shutil.copytree(source, target)
    tokenizer_file = target / "tokenizer.json"
    tokenizer = json.loads(tokenizer_file.read_text())
    bos = {"SpecialToken": {"id": END_OF_TEXT, "type_id": 0}}
    bos_id = next(t["id"] for t in tokenizer["added_tokens"] if t["content"] == END_OF_TEXT)
    tokenizer["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {END_OF_TEXT: {"id": END_OF_TEXT, "ids": [bos_id], "tokens": [END_OF_TEXT]}},
    }
    tokenizer_file.write_text(json.dumps(tokenizer, ensure_ascii=False))
    template = "{{ bos_token }}" + CHATML_TEMPLATE
    (target / "chat_template.jinja").write_text(template)
    config_file = target / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config.update(bos_token=END_OF_TEXT, chat_template=template)
    config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False))
    return target


# A Hermes-style (Qwen2.5-like) template that renders tools into the system turn, an assistant's calls as
# <tool_call> blocks and tool results as <tool_response> blocks of a user turn: what tool tests render.
TOOL_CHAT_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- 'Functions you may call, one JSON schema a line:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\n\\nCall one by answering <tool_call>\\n{"name": <name>, "arguments": <object>}\\n</tool_call>' }}
{{- ', one block per call.<|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'assistant' and message.tool_calls %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for call in message.tool_calls %}
{%- set function = call.function if call.function is defined else call %}
{{- '\\n<tool_call>\\n{"name": "' + function.name + '", "arguments": ' + (function.arguments | tojson) + '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""


def copy_with_tool_template(source: str | Path, target: str | Path) -> Path:
    """Copy a tiny model folder, giving it TOOL_CHAT_TEMPLATE (in chat_template.jinja and tokenizer_config.json)."""
    import shutil

    target = Path(target)
    shutil.copytree(source, target)
    (target / "chat_template.jinja").write_text(TOOL_CHAT_TEMPLATE)
    config_file = target / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = TOOL_CHAT_TEMPLATE
    config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False))
    return target


# TOOL_CHAT_TEMPLATE with a Qwen3-shaped generation prompt: `enable_thinking` false closes an empty thinking
# block in the prompt (the model answers at once), `thinking` true opens one (DeepSeek-R1's and V3.1's way);
# otherwise the model may open it itself. A past assistant turn keeps only what follows its `</think>`.
THINK_CHAT_TEMPLATE = TOOL_CHAT_TEMPLATE.replace(
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}",
    "{%- set shown = message.content.split('</think>')[-1].lstrip('\\n') if message.role == 'assistant' "
    "else message.content %}{{- '<|im_start|>' + message.role + '\\n' + shown + '<|im_end|>\\n' }}",
).replace(
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}",
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- elif thinking is defined and thinking %}{{- '<think>\\n' }}{%- endif %}{%- endif %}",
)


def copy_with_think_template(source: str | Path, target: str | Path) -> Path:
    """Copy a tiny model folder, giving it THINK_CHAT_TEMPLATE (tools rendered, `<think>` in the prompt)."""
    target = copy_with_tool_template(source, target)
    (target / "chat_template.jinja").write_text(THINK_CHAT_TEMPLATE)
    config_file = target / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = THINK_CHAT_TEMPLATE
    config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False))
    return target


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_lora_adapter(
    base_dir: str | Path,
    out_dir: str | Path,
    rank: int = 8,
    targets: tuple[str, ...] = LORA_TARGETS,
    seed: int = 0,
    use_rslora: bool = False,
    alpha: int = 16,
) -> Path:
    """Save a PEFT LoRA adapter of the model in `base_dir` to `out_dir` (adapter_config.json and
    adapter_model.safetensors), its B matrices random (PEFT starts them at zero) so that it changes the output."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    out_dir = Path(out_dir)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0,
                             use_rslora=use_rslora, task_type="CAUSAL_LM")
    torch.manual_seed(seed)
    model = peft.get_peft_model(base, config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.1)
    model.save_pretrained(out_dir)
    return out_dir


IMAGE_TOKEN = "<image>"

# The vision towers of the tiny LLaVA: 28-pixel images in 7-pixel patches (16 patches), three layers; CLIP's has a
# class token that the "default" strategy drops, SigLIP's has none ("full").
_VISION_TOWERS: dict[str, tuple[str, str, str, dict[str, Any]]] = {
    "clip": ("CLIPVisionConfig", "CLIPImageProcessor", "default",
             {"size": {"shortest_edge": 28}, "crop_size": {"height": 28, "width": 28}}),
    "siglip": ("SiglipVisionConfig", "SiglipImageProcessor", "full", {"size": {"height": 28, "width": 28}}),
}


def make_tiny_llava(path: str | Path, vision: str = "clip", *, text_arch: str = "llama",
                    vision_feature_layer: int | list[int] = -2, seed: int = 0, image_size: int = 28,
                    patch_size: int = 7,
                    text_sizes: dict[str, int] | None = None, vision_sizes: dict[str, int] | None = None) -> Path:
    """Save a tiny random-weight LlavaForConditionalGeneration (a `vision` tower: clip or siglip, and a
    `text_arch` language model) with its processor: LlavaProcessor over transformers' image processor of that
    tower and the tiny tokenizer with IMAGE_TOKEN added, which the processor expands to
    (image_size / patch_size)^2 tokens an image (16 by default). `text_sizes` / `vision_sizes` override the
    configs' sizes (a benchmark's larger model: hidden_size, num_hidden_layers, ...)."""
    import torch
    import transformers

    config_name, processor_name, strategy, processor_args = _VISION_TOWERS[vision]
    processor_args = json.loads(json.dumps(processor_args).replace("28", str(image_size)))
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    image_processor = getattr(transformers, processor_name)(**processor_args)
    processor = transformers.LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=patch_size,
                                            vision_feature_select_strategy=strategy,
                                            num_additional_image_tokens=int(vision == "clip"),
                                            chat_template=CHATML_TEMPLATE)
    processor.save_pretrained(path)
    _ensure_chat_template_in_config(path)
    ids = {name: tokenizer.convert_tokens_to_ids(tok) for name, tok in
           (("bos_token_id", BOS_TOKEN), ("eos_token_id", EOS_TOKEN), ("pad_token_id", END_OF_TEXT))}
    text_config_name = _ARCHITECTURES[text_arch][0]
    text_config = getattr(transformers, text_config_name)(**{
        "vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024, "rms_norm_eps": 1e-5,
        **ids, **_ARCH_EXTRAS.get(text_arch, {}), **(text_sizes or {})})
    vision_config = getattr(transformers, config_name)(**{
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 2,
        **(vision_sizes or {}), "image_size": image_size, "patch_size": patch_size})
    config = transformers.LlavaConfig(vision_config=vision_config, text_config=text_config,
                                      image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
                                      vision_feature_layer=vision_feature_layer,
                                      vision_feature_select_strategy=strategy,
                                      image_seq_length=(image_size // patch_size) ** 2, **ids)
    torch.manual_seed(seed)
    model = transformers.LlavaForConditionalGeneration(config)
    _widen_init(model)
    _save(model, path, None)
    return path


QWEN_VL_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
QWEN_VL_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"  # one image's placeholder in a prompt


def make_tiny_qwen2_5_vl(path: str | Path, seed: int = 0, *, qwen2: bool = False,
                         text_sizes: dict[str, Any] | None = None, vision_sizes: dict[str, Any] | None = None) -> Path:
    """Save a tiny random-weight Qwen2_5_VLForConditionalGeneration (a 4-block ViT with 14-pixel patches, windows
    of 2x2 merged patches, full attention in blocks 1 and 3; M-RoPE sections [2, 3, 3]) with transformers'
    Qwen2-VL image processor (Pillow; images kept between 56x56 and 224x224 pixels) and the tiny tokenizer with
    Qwen's vision tokens. processor_config.json names Qwen2_5_VLProcessor as the hub's folders do. `qwen2`: a
    Qwen2VLForConditionalGeneration instead (its tower: no windows, LayerNorms, a two-layer MLP)."""
    import torch
    import transformers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN_VL_TOKENS})
    tokenizer.save_pretrained(path)
    _ensure_chat_template_in_config(path)
    # Saved as the hub's "Qwen2VLImageProcessor", which loads as this Pillow one where torchvision is missing.
    transformers.Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=224 * 224, patch_size=14, temporal_patch_size=2,
                                          merge_size=2).save_pretrained(path)
    processor_class = "Qwen2VLProcessor" if qwen2 else "Qwen2_5_VLProcessor"
    (path / "processor_config.json").write_text(json.dumps({"processor_class": processor_class}))
    token = {name: tokenizer.convert_tokens_to_ids(tok) for name, tok in zip(
        ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"), QWEN_VL_TOKENS,
        strict=True)}
    ids = {name: tokenizer.convert_tokens_to_ids(tok) for name, tok in
           (("bos_token_id", BOS_TOKEN), ("eos_token_id", EOS_TOKEN), ("pad_token_id", END_OF_TEXT))}
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5,
                use_sliding_window=False, **ids,
                rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e6})
    vision = dict(depth=4, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1, 3])
    if qwen2:
        vision = dict(depth=4, embed_dim=32, hidden_size=64, mlp_ratio=2, num_heads=2, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2)
    text, vision = {**text, **(text_sizes or {})}, {**vision, **(vision_sizes or {})}  # a benchmark's larger one
    prefix = "Qwen2VL" if qwen2 else "Qwen2_5_VL"
    config = getattr(transformers, f"{prefix}Config")(text_config=text, vision_config=vision, **token, **ids)
    torch.manual_seed(seed)
    model = getattr(transformers, f"{prefix}ForConditionalGeneration")(config)
    _widen_init(model, random_norms=True)
    _save(model, path, None)
    return path

IDEFICS3_TOKENS = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"] + [
    f"<row_{row}_col_{col}>" for row in range(1, 7) for col in range(1, 7)]


def make_tiny_idefics3(path: str | Path, seed: int = 0, *, text_sizes: dict[str, Any] | None = None,
                       vision_sizes: dict[str, Any] | None = None, longest_edge: int = 112,
                       scale_factor: int = 2) -> Path:
    """Save a tiny random-weight Idefics3ForConditionalGeneration (SmolVLM's layout: a 3-layer SigLIP tower over
    56-pixel tiles of 14-pixel patches, pixel shuffle by 2: 4 tokens a tile; a Llama decoder) with transformers'
    Idefics3Processor (its Pillow image processor: images resized to a longest edge of 112, so up to 2x2 tiles
    plus the global view) and the tiny tokenizer with Idefics3's tokens. A larger shape: `vision_sizes`' image_size
    is the tile, `longest_edge` the image processor's, `scale_factor` the pixel shuffle's."""
    import torch
    import transformers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": IDEFICS3_TOKENS})
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2, image_size=56,
                  patch_size=14)
    vision = {**vision, **(vision_sizes or {})}  # a benchmark's or a realistic-shape test's larger one
    tile = int(vision["image_size"])
    images = transformers.Idefics3ImageProcessorPil(size={"longest_edge": longest_edge},
                                                    max_image_size={"longest_edge": tile})
    tokens_a_tile = (tile // int(vision["patch_size"]) // scale_factor) ** 2
    transformers.Idefics3Processor(image_processor=images, tokenizer=tokenizer, image_seq_len=tokens_a_tile,
                                   chat_template=CHATML_TEMPLATE).save_pretrained(path)
    _ensure_chat_template_in_config(path)
    ids = {name: tokenizer.convert_tokens_to_ids(tok) for name, tok in
           (("bos_token_id", BOS_TOKEN), ("eos_token_id", EOS_TOKEN), ("pad_token_id", END_OF_TEXT))}
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5, **ids)
    text = {**text, **(text_sizes or {})}
    config = transformers.Idefics3Config(text_config=text, vision_config=vision, scale_factor=scale_factor,
                                         image_token_id=tokenizer.convert_tokens_to_ids("<image>"), **ids)
    torch.manual_seed(seed)
    model = transformers.Idefics3ForConditionalGeneration(config)
    _widen_init(model, random_norms=True)
    _save(model, path, None)
    return path

def tiny_image(width: int, height: int, seed: int = 0) -> Any:
    """A random RGB PIL image of that size."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)
