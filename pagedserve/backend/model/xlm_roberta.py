"""XLM-RoBERTa (bge-m3, multilingual-e5, the bge rerankers): BERT's encoder with positions counted from
padding_idx + 1 and one token type; its sequence classifier is a dense + tanh + out_proj head on <s>."""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.backend.model.bert import (
    _ENCODER_FUSED,
    _IGNORED,
    BertModel,
    EncoderArchConfig,
    EncoderFamily,
)


class XLMRobertaArchConfig(EncoderArchConfig):
    """XLM-R's config.json: as BERT's, its positions starting after the padding index."""

    counts_positions_after_padding = True


class RobertaClassifierHead(nn.Module):
    """RoBERTa's classification head: [N, H] <s> rows -> dense -> tanh -> out_proj -> [N, labels]."""

    def __init__(self, cfg: EncoderArchConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.out_proj = nn.Linear(cfg.hidden_size, len(cfg.id2label))

    def forward(self, cls_rows: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.dense(cls_rows)))


class XLMRobertaModel(BertModel):
    """BERT's encoder (the position offset is in the config)."""


class XLMRobertaForSequenceClassification(XLMRobertaModel):
    """The encoder plus RoBERTa's classification head on the <s> row."""

    def __init__(self, cfg: EncoderArchConfig, max_position: int):
        super().__init__(cfg, max_position)
        self.pooling_head = RobertaClassifierHead(cfg)


class RobertaClassifierFamily(EncoderFamily):
    """XLMRobertaForSequenceClassification: `classifier.*` goes into the head."""

    head_names = {"classifier.": "pooling_head."}


FAMILIES = {
    "XLMRobertaModel": EncoderFamily(XLMRobertaArchConfig, XLMRobertaModel, _ENCODER_FUSED, _IGNORED),
    "XLMRobertaForSequenceClassification": RobertaClassifierFamily(
        XLMRobertaArchConfig, XLMRobertaForSequenceClassification, _ENCODER_FUSED, _IGNORED),
}
