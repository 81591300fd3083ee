"""A pre-LN BERT exported by bertpipe, as transformers' remote code.

``bertpipe export`` copies this file and ``configuration_bertpipe_preln.py`` beside the weights
of a pre-LN model (``model.pre_layer_norm: true``), so that

    model = transformers.AutoModel.from_pretrained(folder, trust_remote_code=True)

(or ``AutoModelForPreTraining`` / ``AutoModelForMaskedLM``, and for a fine-tuned task model
``AutoModelForSequenceClassification`` / ``...QuestionAnswering`` / ``...TokenClassification`` /
``...MultipleChoice``, the same maths as transformers' ``Bert*`` heads) computes what bertpipe's own model
(``bert_core/model/bert.py``) computes with the same weights: the same parameter names as
transformers' BERT, each layer ``x = x + attn(LN(x)); x = x + ffn(LN(x))``, then one final
LayerNorm (``bert.encoder.ln``). Hidden states at padding positions read 0, as in bertpipe.
It imports torch and transformers only: it runs where bertpipe is not installed.
"""

import functools

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import (
    BaseModelOutputWithPooling,
    MaskedLMOutput,
    MultipleChoiceModelOutput,
    QuestionAnsweringModelOutput,
    SequenceClassifierOutput,
    TokenClassifierOutput,
)
from transformers.models.bert.modeling_bert import BertForPreTrainingOutput

from .configuration_bertpipe_preln import BertpipePreLNConfig


def _activation(name):
    if name == "gelu":  # exact, erf-based
        return F.gelu
    if name == "gelu_new":  # tanh approximation
        return functools.partial(F.gelu, approximate="tanh")
    if name == "relu":
        return F.relu
    raise ValueError(f"hidden_act={name!r} is not supported; use gelu, gelu_new or relu")


def _padding_mask(attention_mask, dtype):
    """[B, T] of 1 (token) / 0 (padding) -> additive [B, 1, 1, T], or None when nothing is padded."""
    if attention_mask is None or bool(attention_mask.bool().all()):
        return None
    keep = attention_mask[:, None, None, :].to(torch.bool)
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill(~keep, torch.finfo(dtype).min)


class BertpipePreLNEmbeddings(nn.Module):
    def __init__(self, config):
        super().__init__()
        H = config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, H, padding_idx=config.pad_token_id)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, H)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, H)
        self.LayerNorm = nn.LayerNorm(H, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids, token_type_ids):
        T = input_ids.shape[1]
        if T > self.position_embeddings.num_embeddings:
            raise ValueError(f"sequence length {T} exceeds max_position_embeddings="
                             f"{self.position_embeddings.num_embeddings}; truncate the inputs")
        pos = torch.arange(T, device=input_ids.device)
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids) + self.position_embeddings(pos)
        return self.dropout(self.LayerNorm(x))


class BertpipePreLNSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        H = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.query = nn.Linear(H, H)
        self.key = nn.Linear(H, H)
        self.value = nn.Linear(H, H)
        self.dropout_p = config.attention_probs_dropout_prob

    def forward(self, x, mask):
        B, T, H = x.shape
        q, k, v = (proj(x).view(B, T, self.num_heads, H // self.num_heads).transpose(1, 2)
                   for proj in (self.query, self.key, self.value))  # each [B, nh, T, hs]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                           dropout_p=self.dropout_p if self.training else 0.0)
        return y.transpose(1, 2).reshape(B, T, H)


class BertpipePreLNProjection(nn.Module):
    """dense + dropout back to the hidden size; ``LayerNorm`` normalises the sublayer's input."""

    def __init__(self, config, in_features):
        super().__init__()
        self.dense = nn.Linear(in_features, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)


class BertpipePreLNAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self = BertpipePreLNSelfAttention(config)
        self.output = BertpipePreLNProjection(config, config.hidden_size)


class BertpipePreLNIntermediate(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)


class BertpipePreLNLayer(nn.Module):
    """x = x + attn(LN(x)); x = x + ffn(LN(x))."""

    def __init__(self, config):
        super().__init__()
        self.attention = BertpipePreLNAttention(config)
        self.intermediate = BertpipePreLNIntermediate(config)
        self.output = BertpipePreLNProjection(config, config.intermediate_size)
        self.act = _activation(config.hidden_act)

    def forward(self, x, mask):
        out = self.attention.output
        x = x + out.dropout(out.dense(self.attention.self(out.LayerNorm(x), mask)))
        out = self.output
        return x + out.dropout(out.dense(self.act(self.intermediate.dense(out.LayerNorm(x)))))


class BertpipePreLNEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layer = nn.ModuleList(BertpipePreLNLayer(config) for _ in range(config.num_hidden_layers))
        self.ln = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)  # the final LayerNorm


class BertpipePreLNPooler(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, hidden):
        return torch.tanh(self.dense(hidden[:, 0]))


class BertpipePreLNPredictionHeadTransform(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.act = _activation(config.hidden_act)

    def forward(self, x):
        return self.LayerNorm(self.act(self.dense(x)))


class BertpipePreLNPredictionHead(nn.Module):
    """transform, then the word embeddings (tied) as the decoder, + ``bias``."""

    def __init__(self, config):
        super().__init__()
        self.transform = BertpipePreLNPredictionHeadTransform(config)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))

    def forward(self, hidden, word_embeddings):
        return F.linear(self.transform(hidden), word_embeddings, self.bias)


class BertpipePreLNPreTrainedModel(PreTrainedModel):
    config_class = BertpipePreLNConfig
    base_model_prefix = "bert"
    _no_split_modules = ["BertpipePreLNEmbeddings", "BertpipePreLNLayer"]
    # transformers' BERT stores a copy of the tied decoder bias; this model reads ``predictions.bias``
    _keys_to_ignore_on_load_unexpected = [r"cls\.predictions\.decoder\."]

    def _init_weights(self, module):
        """BERT's init, for weights the checkpoint lacks (a head on an encoder-only export)."""
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.padding_idx is not None and not getattr(module.weight, "_is_hf_initialized", False):
                with torch.no_grad():
                    module.weight[module.padding_idx].zero_()
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
        elif isinstance(module, BertpipePreLNPredictionHead):
            nn.init.zeros_(module.bias)


class BertpipePreLNModel(BertpipePreLNPreTrainedModel):
    """The encoder: ``last_hidden_state`` [B, T, H] (after the final LayerNorm) and
    ``pooler_output`` [B, H] = tanh(dense([CLS]))."""

    _keys_to_ignore_on_load_unexpected = [r"^cls\."]  # the pre-training heads of a full export

    def __init__(self, config, add_pooling_layer=True):
        super().__init__(config)
        self.embeddings = BertpipePreLNEmbeddings(config)
        self.encoder = BertpipePreLNEncoder(config)
        self.pooler = BertpipePreLNPooler(config) if add_pooling_layer else None  # token/span heads: none
        self.post_init()

    def get_input_embeddings(self):
        return self.embeddings.word_embeddings

    def set_input_embeddings(self, value):
        self.embeddings.word_embeddings = value

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, output_hidden_states=None,
                return_dict=None):
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        if output_hidden_states is None:
            output_hidden_states = bool(getattr(self.config, "output_hidden_states", False))
        x = self.embeddings(input_ids, token_type_ids)  # [B, T, H]
        mask = _padding_mask(attention_mask, x.dtype)
        pad = None if mask is None else ~attention_mask.bool()[..., None]  # [B, T, 1]
        hidden = [x] if output_hidden_states else None
        for layer in self.encoder.layer:
            x = layer(x, mask)
            if pad is not None:
                x = x.masked_fill(pad, 0.0)
            if hidden is not None:
                hidden.append(x)
        x = self.encoder.ln(x)
        if pad is not None:
            x = x.masked_fill(pad, 0.0)
        if hidden is not None:
            hidden[-1] = x
        pooled = self.pooler(x) if self.pooler is not None else None
        out = BaseModelOutputWithPooling(last_hidden_state=x, pooler_output=pooled,
                                         hidden_states=tuple(hidden) if hidden is not None else None)
        return out if (self.config.return_dict if return_dict is None else return_dict) else out.to_tuple()


class BertpipePreLNPreTrainingHeads(nn.Module):
    def __init__(self, config, nsp: bool):
        super().__init__()
        self.predictions = BertpipePreLNPredictionHead(config)
        if nsp:
            self.seq_relationship = nn.Linear(config.hidden_size, 2)


class BertpipePreLNForPreTraining(BertpipePreLNPreTrainedModel):
    """Masked LM + next sentence prediction, as bertpipe pre-trained it."""

    def __init__(self, config):
        super().__init__(config)
        self.bert = BertpipePreLNModel(config)
        self.cls = BertpipePreLNPreTrainingHeads(config, nsp=True)
        self.post_init()

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, labels=None,
                next_sentence_label=None, output_hidden_states=None, return_dict=None):
        out = self.bert(input_ids, attention_mask, token_type_ids, output_hidden_states, return_dict=True)
        logits = self.cls.predictions(out.last_hidden_state, self.bert.embeddings.word_embeddings.weight)
        nsp = self.cls.seq_relationship(out.pooler_output)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))
        if next_sentence_label is not None:
            nsp_loss = F.cross_entropy(nsp.view(-1, 2), next_sentence_label.view(-1))
            loss = nsp_loss if loss is None else loss + nsp_loss
        result = BertForPreTrainingOutput(loss=loss, prediction_logits=logits, seq_relationship_logits=nsp,
                                          hidden_states=out.hidden_states)
        return result if (self.config.return_dict if return_dict is None else return_dict) else result.to_tuple()


class BertpipePreLNForMaskedLM(BertpipePreLNPreTrainedModel):
    """The masked-LM head alone (fill-mask)."""

    _keys_to_ignore_on_load_unexpected = [r"cls\.predictions\.decoder\.", r"cls\.seq_relationship\."]

    def __init__(self, config):
        super().__init__(config)
        self.bert = BertpipePreLNModel(config)
        self.cls = BertpipePreLNPreTrainingHeads(config, nsp=False)
        self.post_init()

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, labels=None,
                output_hidden_states=None, return_dict=None):
        out = self.bert(input_ids, attention_mask, token_type_ids, output_hidden_states, return_dict=True)
        logits = self.cls.predictions(out.last_hidden_state, self.bert.embeddings.word_embeddings.weight)
        loss = None if labels is None else F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))
        result = MaskedLMOutput(loss=loss, logits=logits, hidden_states=out.hidden_states)
        return result if (self.config.return_dict if return_dict is None else return_dict) else result.to_tuple()


def _dropout(config):
    p = getattr(config, "classifier_dropout", None)
    return nn.Dropout(config.hidden_dropout_prob if p is None else p)


def _result(output, return_dict, config):
    return output if (config.return_dict if return_dict is None else return_dict) else output.to_tuple()


class BertpipePreLNForSequenceClassification(BertpipePreLNPreTrainedModel):
    """dropout + classifier on the pooled [CLS]; ``problem_type`` picks the loss, as in
    transformers' ``BertForSequenceClassification``."""

    _keys_to_ignore_on_load_unexpected = [r"^cls\."]

    def __init__(self, config):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.bert = BertpipePreLNModel(config)
        self.dropout = _dropout(config)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, labels=None,
                output_hidden_states=None, return_dict=None):
        out = self.bert(input_ids, attention_mask, token_type_ids, output_hidden_states, return_dict=True)
        logits = self.classifier(self.dropout(out.pooler_output))  # [B, num_labels]
        loss = None
        if labels is not None:
            problem = self.config.problem_type or (
                "regression" if self.num_labels == 1 else
                "single_label_classification" if labels.dtype in (torch.long, torch.int) else
                "multi_label_classification")
            if problem == "regression":
                loss = F.mse_loss(logits.squeeze(-1) if self.num_labels == 1 else logits,
                                  labels.squeeze(-1) if self.num_labels == 1 else labels)
            elif problem == "single_label_classification":
                loss = F.cross_entropy(logits.view(-1, self.num_labels), labels.view(-1))
            else:
                loss = F.binary_cross_entropy_with_logits(logits, labels)
        result = SequenceClassifierOutput(loss=loss, logits=logits, hidden_states=out.hidden_states)
        return _result(result, return_dict, self.config)


class BertpipePreLNForMultipleChoice(BertpipePreLNPreTrainedModel):
    """Inputs [B, choices, T]: dropout + a one-score classifier on each choice's pooled [CLS]."""

    _keys_to_ignore_on_load_unexpected = [r"^cls\."]

    def __init__(self, config):
        super().__init__(config)
        self.bert = BertpipePreLNModel(config)
        self.dropout = _dropout(config)
        self.classifier = nn.Linear(config.hidden_size, 1)
        self.post_init()

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, labels=None,
                output_hidden_states=None, return_dict=None):
        choices = input_ids.shape[1]

        def flat(x):
            return None if x is None else x.view(-1, x.shape[-1])  # [B * choices, T]

        out = self.bert(flat(input_ids), flat(attention_mask), flat(token_type_ids), output_hidden_states,
                        return_dict=True)
        logits = self.classifier(self.dropout(out.pooler_output)).view(-1, choices)  # [B, choices]
        loss = None if labels is None else F.cross_entropy(logits, labels)
        result = MultipleChoiceModelOutput(loss=loss, logits=logits, hidden_states=out.hidden_states)
        return _result(result, return_dict, self.config)


class BertpipePreLNForTokenClassification(BertpipePreLNPreTrainedModel):
    """dropout + classifier on every token's last state."""

    _keys_to_ignore_on_load_unexpected = [r"^cls\."]

    def __init__(self, config):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.bert = BertpipePreLNModel(config, add_pooling_layer=False)
        self.dropout = _dropout(config)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, labels=None,
                output_hidden_states=None, return_dict=None):
        out = self.bert(input_ids, attention_mask, token_type_ids, output_hidden_states, return_dict=True)
        logits = self.classifier(self.dropout(out.last_hidden_state))  # [B, T, num_labels]
        loss = None if labels is None else F.cross_entropy(logits.view(-1, self.num_labels), labels.view(-1))
        result = TokenClassifierOutput(loss=loss, logits=logits, hidden_states=out.hidden_states)
        return _result(result, return_dict, self.config)


class BertpipePreLNForQuestionAnswering(BertpipePreLNPreTrainedModel):
    """``qa_outputs`` on every token's last state: start and end logits (SQuAD)."""

    _keys_to_ignore_on_load_unexpected = [r"^cls\."]

    def __init__(self, config):
        super().__init__(config)
        self.bert = BertpipePreLNModel(config, add_pooling_layer=False)
        self.qa_outputs = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, start_positions=None,
                end_positions=None, output_hidden_states=None, return_dict=None):
        out = self.bert(input_ids, attention_mask, token_type_ids, output_hidden_states, return_dict=True)
        start, end = self.qa_outputs(out.last_hidden_state).split(1, dim=-1)  # each [B, T, 1]
        start, end = start.squeeze(-1).contiguous(), end.squeeze(-1).contiguous()
        loss = None
        if start_positions is not None and end_positions is not None:
            t = start.shape[1]
            loss = (F.cross_entropy(start, start_positions.clamp(0, t), ignore_index=t)
                    + F.cross_entropy(end, end_positions.clamp(0, t), ignore_index=t)) / 2
        result = QuestionAnsweringModelOutput(loss=loss, start_logits=start, end_logits=end,
                                              hidden_states=out.hidden_states)
        return _result(result, return_dict, self.config)
