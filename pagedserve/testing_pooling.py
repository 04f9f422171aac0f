"""Tiny random pooling models (embedding encoders and decoders, cross-encoders, sequence classifiers) saved with
transformers' classes plus sentence-transformers' module files, for tests and benches."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pagedserve.testing import _TRAINING_TEXT, _widen_init, make_tiny_model

_ENCODER_VOCAB_SIZE = 320
# (special tokens in id order, single template, pair template) of each encoder family's tokenizer.
_ENCODER_TOKENS = {
    "bert": (["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"], "[CLS] $A [SEP]", "[CLS] $A [SEP] $B:1 [SEP]:1"),
    "xlm_roberta": (["<s>", "<pad>", "</s>", "<unk>", "<mask>"], "<s> $A </s>", "<s> $A </s> </s> $B </s>"),
}
_ENCODER_CLASSES = {
    ("bert", "embed"): ("BertConfig", "BertModel"),
    ("bert", "classify"): ("BertConfig", "BertForSequenceClassification"),
    ("xlm_roberta", "embed"): ("XLMRobertaConfig", "XLMRobertaModel"),
    ("xlm_roberta", "classify"): ("XLMRobertaConfig", "XLMRobertaForSequenceClassification"),
}
POOLING_MODES = ("cls", "mean", "lasttoken")


def build_encoder_tokenizer(family: str) -> Any:
    """A deterministic tiny WordPiece tokenizer whose templates add the family's CLS/SEP (or <s>/</s>) tokens."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials, single, pair = _ENCODER_TOKENS[family]
    unk = specials[1] if family == "bert" else specials[3]
    tok = Tokenizer(models.WordPiece(unk_token=unk))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(vocab_size=_ENCODER_VOCAB_SIZE, special_tokens=specials, show_progress=False)
    tok.train_from_iterator(_TRAINING_TEXT.splitlines() * 4, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=[(t, tok.token_to_id(t)) for t in specials[:4]])
    if family == "bert":
        names = dict(pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")
    else:
        names = dict(bos_token="<s>", pad_token="<pad>", eos_token="</s>", unk_token="<unk>", cls_token="<s>",
                     sep_token="</s>", mask_token="<mask>")
    # BERT's tokenizer hands the model token type ids (its pair's second segment is type 1); XLM-R's does not.
    inputs = ["input_ids", "token_type_ids", "attention_mask"] if family == "bert" else ["input_ids", "attention_mask"]
    return PreTrainedTokenizerFast(tokenizer_object=tok, model_input_names=inputs, **names)


def write_sentence_transformers_files(path: str | Path, dimension: int, pooling: str = "cls",
                                      normalize: bool = True, max_seq_length: int | None = None) -> None:
    """modules.json, sentence_bert_config.json, 1_Pooling/config.json (and a Normalize module) as the hub's
    sentence-transformers folders have them."""
    if pooling not in POOLING_MODES:
        raise ValueError(f"pooling must be one of {POOLING_MODES}, got {pooling!r}")
    path = Path(path)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (path / "2_Normalize").mkdir(exist_ok=True)
    (path / "modules.json").write_text(json.dumps(modules, indent=2))
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length,
                                                                "do_lower_case": False}))
    (path / "1_Pooling").mkdir(exist_ok=True)
    modes = {f"pooling_mode_{m}": False for m in ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens",
                                                  "weightedmean_tokens", "lasttoken")}
    modes[{"cls": "pooling_mode_cls_token", "mean": "pooling_mode_mean_tokens",
           "lasttoken": "pooling_mode_lasttoken"}[pooling]] = True
    (path / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": dimension, **modes, "include_prompt": True}, indent=2))


def make_tiny_encoder(
    path: str | Path, family: str = "bert", *, head: str = "embed", pooling: str = "cls", normalize: bool = True,
    num_labels: int = 1, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
    intermediate_size: int = 128, max_position_embeddings: int = 130, seed: int = 0,
) -> Path:
    """Save a tiny random BERT or XLM-RoBERTa: `head` "embed" (the bare encoder plus sentence-transformers
    files pooling by `pooling`) or "classify" (a `*ForSequenceClassification` with `num_labels` labels)."""
    import torch
    import transformers

    config_name, model_name = _ENCODER_CLASSES[(family, head)]
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_encoder_tokenizer(family)
    tokenizer.save_pretrained(path)
    labels = {i: f"label_{i}" for i in range(num_labels)}
    config = getattr(transformers, config_name)(
        vocab_size=len(tokenizer), hidden_size=hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings, pad_token_id=tokenizer.pad_token_id,
        type_vocab_size=2 if family == "bert" else 1, id2label=labels, label2id={v: k for k, v in labels.items()},
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config)
    _widen_init(model)
    model.save_pretrained(path, safe_serialization=True)
    if head == "embed":
        offset = 0 if family == "bert" else tokenizer.pad_token_id + 1
        write_sentence_transformers_files(path, hidden_size, pooling, normalize, max_position_embeddings - offset)
    return path


def make_tiny_decoder_embedding(path: str | Path, arch: str = "qwen3", *, pooling: str = "lasttoken",
                                normalize: bool = True, **kwargs: Any) -> Path:
    """A tiny `arch` decoder (tied embeddings) plus sentence-transformers files: an embedding model such as
    Qwen3-Embedding or gte-Qwen2."""
    path = make_tiny_model(path, arch, tie_word_embeddings=True, **kwargs)
    hidden = json.loads((path / "config.json").read_text())["hidden_size"]
    write_sentence_transformers_files(path, hidden, pooling, normalize)
    return path


def make_tiny_decoder_classifier(path: str | Path, arch: str = "qwen3", *, num_labels: int = 1,
                                 seed: int = 0) -> Path:
    """A tiny `*ForSequenceClassification` decoder (the Qwen3 / Qwen2 sequence classifiers and rerankers)."""
    import torch
    import transformers

    path = make_tiny_model(path, arch, seed=seed)  # the tokenizer and a config to start from
    base = transformers.AutoConfig.from_pretrained(path)
    base.architectures = None
    labels = {i: f"label_{i}" for i in range(num_labels)}
    base.id2label, base.label2id = labels, {v: k for k, v in labels.items()}
    cls = getattr(transformers, f"{type(base).__name__.removesuffix('Config')}ForSequenceClassification")
    torch.manual_seed(seed)
    model = cls(base)
    _widen_init(model)
    for stale in [*path.glob("*.safetensors*"), path / "chat_template.jinja"]:
        stale.unlink(missing_ok=True)
    # Without a chat template sentence-transformers' CrossEncoder joins a pair as the tokenizer does (with one,
    # version 6 renders the pair as chat messages).
    tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
    tokenizer_config.pop("chat_template", None)
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    model.save_pretrained(path, safe_serialization=True)
    return path


# vLLM's documented prompt for Qwen3-Reranker (examples/offline_inference/qwen3_reranker.py): the query part, then
# the document part; scored as one text.
QWEN3_RERANKER_PREFIX = ('<|im_start|>system\nJudge whether the Document meets the requirements based on the Query '
                         'and the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
                         '<|im_start|>user\n')
QWEN3_RERANKER_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def qwen3_reranker_pair(query: str, document: str,
                        instruction: str = "Given a web search query, retrieve relevant passages that answer the "
                                           "query") -> tuple[str, str]:
    """(query text, document text) in Qwen3-Reranker's prompt."""
    return (f"{QWEN3_RERANKER_PREFIX}<Instruct>: {instruction}\n<Query>: {query}\n",
            f"<Document>: {document}{QWEN3_RERANKER_SUFFIX}")


def make_tiny_qwen3_reranker(path: str | Path, *, original: bool = True, tie_word_embeddings: bool = True,
                             seed: int = 0) -> Path:
    """A tiny Qwen3 causal LM whose vocabulary has "no" and "yes", its config.json carrying vLLM's hf_overrides
    for Qwen3-Reranker: architecture Qwen3ForSequenceClassification, classifier_from_token ["no", "yes"] and
    (`original`) is_original_qwen3_reranker."""
    import torch
    import transformers

    path = make_tiny_model(path, "qwen3", tie_word_embeddings=tie_word_embeddings, seed=seed)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    tokenizer.add_tokens(["no", "yes"])
    model = transformers.Qwen3ForCausalLM.from_pretrained(path)
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    torch.manual_seed(seed + 1)
    with torch.no_grad():  # distinct random rows for the new tokens, so yes - no is far from zero
        model.get_output_embeddings().weight[-2:] = torch.randn(2, model.config.hidden_size)
    tokenizer.save_pretrained(path)
    model.save_pretrained(path, safe_serialization=True)
    config = json.loads((path / "config.json").read_text())
    config.update(architectures=["Qwen3ForSequenceClassification"], classifier_from_token=["no", "yes"])
    if original:
        config["is_original_qwen3_reranker"] = True
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def make_tiny_modernbert(path: str | Path, *, head: str = "embed", pooling: str = "mean",
                         classifier_pooling: str = "cls", num_labels: int = 1, local_attention: int = 8,
                         num_layers: int = 4, seed: int = 0) -> Path:
    """Save a tiny random ModernBERT (global attention every third layer, a +-local_attention/2 window in the
    others, small enough that the test inputs cross it): `head` "embed" (ModernBertModel plus
    sentence-transformers files pooling by `pooling`) or "classify" (ModernBertForSequenceClassification pooling
    by `classifier_pooling`)."""
    import torch
    import transformers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_encoder_tokenizer("bert")
    tokenizer.model_input_names = ["input_ids", "attention_mask"]  # ModernBERT takes no token types
    tokenizer.save_pretrained(path)
    labels = {i: f"label_{i}" for i in range(num_labels)}
    config = transformers.ModernBertConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=num_layers,
        num_attention_heads=4, max_position_embeddings=512, local_attention=local_attention,
        global_attn_every_n_layers=3, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.cls_token_id,
        eos_token_id=tokenizer.sep_token_id, cls_token_id=tokenizer.cls_token_id,
        sep_token_id=tokenizer.sep_token_id, classifier_pooling=classifier_pooling, id2label=labels,
        label2id={v: k for k, v in labels.items()},
    )
    torch.manual_seed(seed)
    cls = transformers.ModernBertModel if head == "embed" else transformers.ModernBertForSequenceClassification
    model = cls(config)
    _widen_init(model, random_norms=True)
    model.save_pretrained(path, safe_serialization=True)
    if head == "embed":
        write_sentence_transformers_files(path, 64, pooling, max_seq_length=512)
    return path
