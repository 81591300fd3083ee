"""The weight-decay groups shared by pre-training and fine-tuning (bert_core/model/weight_decay.py).

    .venv/bin/python -m pytest -q tests/test_weight_decay.py
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from bert_core.config import ModelConfig
from bert_core.finetune.heads import BertForTask
from bert_core.model.bert import BertForPreTraining
from bert_core.model.weight_decay import param_groups


def google_bert_no_decay(name: str) -> bool:
    """google-research/bert's exclusion list, by name: biases and parameters named LayerNorm."""
    return name.endswith(".bias") or "LayerNorm" in name


def tiny(pre_layer_norm: bool) -> BertForPreTraining:
    torch.manual_seed(0)
    return BertForPreTraining(ModelConfig(size="tiny", vocab_size=120, pre_layer_norm=pre_layer_norm))


def names_of(model: nn.Module, params: list[nn.Parameter]) -> list[str]:
    name = {id(p): n for n, p in model.named_parameters()}
    return [name[id(p)] for p in params]


def expected_names(model: nn.Module) -> tuple[set[str], set[str]]:
    """(decayed, not decayed) from the module types: matrices of Linear/embedding layers decay;
    biases and every LayerNorm parameter do not."""
    decay, plain = set(), set()
    for prefix, module in model.named_modules():
        for pname, _ in module.named_parameters(recurse=False):
            full = f"{prefix}.{pname}" if prefix else pname
            if isinstance(module, nn.LayerNorm) or pname == "bias":
                plain.add(full)
            else:
                decay.add(full)
    return decay, plain


@pytest.mark.parametrize("pre_layer_norm", [False, True], ids=["post-LN", "pre-LN"])
def test_layernorms_and_biases_never_decay(pre_layer_norm):
    model = tiny(pre_layer_norm)
    decay, plain = param_groups(model, 0.01)
    assert decay["weight_decay"] == 0.01 and plain["weight_decay"] == 0.0
    want_decay, want_plain = expected_names(model)
    assert set(names_of(model, decay["params"])) == want_decay
    assert set(names_of(model, plain["params"])) == want_plain
    assert "bert.embeddings.word_embeddings.weight" in want_decay
    assert "bert.encoder.layer.0.attention.self.qkv.weight" in want_decay
    assert "cls.predictions.bias" in want_plain
    layer_norms = {f"{p}.{w}" for p, m in model.named_modules() if isinstance(m, nn.LayerNorm)
                   for w in ("weight", "bias")}
    assert layer_norms <= want_plain
    assert len(decay["params"]) + len(plain["params"]) == len(list(model.parameters()))


def test_pre_ln_final_norm_is_not_decayed_as_the_name_rule_would():
    model = tiny(pre_layer_norm=True)
    name = "bert.encoder.ln.weight"  # the pre-LN encoder's closing LayerNorm
    assert name in dict(model.named_parameters())
    assert not google_bert_no_decay(name)  # a name list misses it ...
    _, plain = param_groups(model, 0.01)
    assert name in names_of(model, plain["params"])  # ... the shape rule does not


def test_post_ln_groups_equal_the_name_rule():
    """The default (post-LN) model gets the same two groups, in the same order, as the
    name-based rule gives: pre-training's optimizer is unchanged."""
    model = tiny(pre_layer_norm=False)
    decay, plain = param_groups(model, 0.01)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert [id(p) for p in decay["params"]] == [id(p) for n, p in named if not google_bert_no_decay(n)]
    assert [id(p) for p in plain["params"]] == [id(p) for n, p in named if google_bert_no_decay(n)]


@pytest.mark.parametrize("pre_layer_norm", [False, True], ids=["post-LN", "pre-LN"])
def test_adamw_step_shrinks_only_the_decayed_weights(pre_layer_norm):
    """A fine-tuning model (encoder + head), one real AdamW step with zero gradients: only the
    decay moves the weights, so the decayed ones shrink and the rest stay where they are."""
    encoder = tiny(pre_layer_norm).bert
    model = BertForTask(encoder, "classification", 3)
    frozen = model.bert.embeddings.position_embeddings.weight
    frozen.requires_grad_(False)  # frozen parameters are in neither group
    lr, wd = 0.1, 0.5
    decay, plain = param_groups(model, wd)
    assert all(p is not frozen for p in decay["params"] + plain["params"])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in decay["params"] + plain["params"]:
        p.grad = torch.zeros_like(p)
    torch.optim.AdamW([decay, plain], lr=lr).step()
    decayed = set(names_of(model, decay["params"]))
    for n, p in model.named_parameters():
        if n in decayed:
            torch.testing.assert_close(p.detach(), before[n] * (1 - lr * wd))
        else:
            assert torch.equal(p.detach(), before[n]), n
    assert "head.weight" in decayed and "head.bias" not in decayed
