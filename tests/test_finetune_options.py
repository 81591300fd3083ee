"""Fine-tuning options for checkpoints whose [CLS] pre-training never trained: mean pooling,
top-layer re-init and layer-wise learning-rate decay."""

from __future__ import annotations

import pytest
import torch

from bert_core.config import FinetuneConfig, ModelConfig
from bert_core.finetune.heads import BertForTask
from bert_core.finetune.train import layer_groups, reinit_top_layers
from bert_core.model.bert import BertModel


def tiny(pre_layer_norm: bool = True) -> BertModel:
    torch.manual_seed(0)
    return BertModel(ModelConfig(size="tiny", vocab_size=50, pre_layer_norm=pre_layer_norm))


def test_mean_pooling_reads_every_real_token_and_ignores_padding():
    model = BertForTask(tiny(), "classification", 3, pooling="mean").eval()
    ids = torch.tensor([[2, 7, 9, 3]])
    padded = torch.tensor([[2, 7, 9, 3, 0, 0]])
    ones, mask = torch.ones_like(ids), torch.tensor([[1, 1, 1, 1, 0, 0]])
    with torch.no_grad():
        logits = model(ids, torch.zeros_like(ids), ones)
        assert torch.allclose(logits, model(padded, torch.zeros_like(padded), mask), atol=1e-5)
        states = model.bert(ids, torch.zeros_like(ids), ones).last_hidden_state
        assert torch.allclose(logits, model.head(states.mean(1)), atol=1e-6)
        # a token other than [CLS] moves the mean-pooled logits
        assert not torch.allclose(logits, model(torch.tensor([[2, 7, 11, 3]]), torch.zeros_like(ids), ones))


def test_pooling_is_checked():
    with pytest.raises(ValueError, match="pooling"):
        BertForTask(tiny(), "classification", 2, pooling="max")
    with pytest.raises(ValueError):
        FinetuneConfig(pooling="max")


def test_layerwise_decay_gives_each_depth_its_rate_and_every_parameter_one_group():
    model = BertForTask(tiny(), "classification", 2)
    groups = layer_groups(model, 0.01, 1e-3, 0.8)
    seen = [id(p) for g in groups for p in g["params"]]
    assert sorted(seen) == sorted(id(p) for p in model.parameters())  # each once
    rate = {id(p): g["lr"] for g in groups for p in g["params"]}
    assert rate[id(model.bert.embeddings.word_embeddings.weight)] == pytest.approx(1e-3 * 0.8**3)
    assert rate[id(model.bert.encoder.layer[0].intermediate.dense.weight)] == pytest.approx(1e-3 * 0.8**2)
    assert rate[id(model.bert.encoder.layer[1].intermediate.dense.weight)] == pytest.approx(1e-3 * 0.8)
    assert rate[id(model.head.weight)] == rate[id(model.bert.pooler.dense.weight)] == pytest.approx(1e-3)
    decay = {id(p): g["weight_decay"] for g in groups for p in g["params"]}
    assert decay[id(model.head.weight)] == 0.01 and decay[id(model.head.bias)] == 0.0
    assert len(layer_groups(model, 0.01, 1e-3, 1.0)) == 2  # off: the plain weight-decay groups


def test_reinit_top_layers_resets_the_top_only():
    bert = tiny()
    with torch.no_grad():
        for p in bert.parameters():
            p.mul_(5.0)  # as pre-training grows the weights
    bottom = bert.encoder.layer[0].attention.self.qkv.weight.clone()
    reinit_top_layers(bert, 1)
    assert torch.equal(bert.encoder.layer[0].attention.self.qkv.weight, bottom)
    assert float(bert.encoder.layer[1].attention.self.qkv.weight.std()) == pytest.approx(0.02, rel=0.2)
    assert float(bert.pooler.dense.weight.std()) == pytest.approx(0.02, rel=0.2)
    assert torch.equal(bert.encoder.ln.weight, torch.ones_like(bert.encoder.ln.weight))
    with pytest.raises(ValueError, match="2 layers"):
        reinit_top_layers(bert, 3)


def test_a_fine_tuning_data_error_is_a_refusal_of_one_line(tmp_path):
    from typer.testing import CliRunner

    from bert_core.failures import Refusal
    from bert_core.finetune import get_task
    from bert_core.finetune.errors import AllJobsFailed, TaskDataError, TaskFileMissing, UnknownTask
    from bert_core.finetune.report import write_results
    from flows.cli.main import app, failure

    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    r = CliRunner().invoke(app, ["features", "--checkpoint", str(tmp_path), "--input", str(empty),
                                 "--output", str(tmp_path / "f.parquet")])
    assert r.exit_code == 1 and "Traceback" not in r.output
    assert r.output.strip() == (f"{empty}: no sentences (the file is empty or blank); give one sentence a "
                                "line (--format text) or CoNLL columns (word ... tag, blank line between "
                                "sentences)")
    assert isinstance(r.exception, SystemExit)  # handled by the one catch, not a crash

    with pytest.raises(UnknownTask) as unknown:
        get_task("nope")
    with pytest.raises(AllJobsFailed) as all_failed:
        write_results(str(tmp_path / "ft"), FinetuneConfig(), str(tmp_path), str(tmp_path),
                      [{"task": "sst2", "setting": {"name": "lr1e-4"}, "seed": 1, "ok": False,
                        "error": "TaskFileMissing: train.tsv does not exist"}])
    for err, builtin in ((TaskDataError("x"), ValueError), (TaskFileMissing("x"), FileNotFoundError),
                         (unknown.value, KeyError), (all_failed.value, RuntimeError)):
        assert isinstance(err, Refusal) and isinstance(err, builtin)
        assert failure(err)[1:] == ("red", 1) and "\n" not in failure(err)[0]
    assert failure(unknown.value)[0].startswith("unknown task 'nope'; registered tasks: cola")  # no quotes around it
    assert failure(all_failed.value)[0] == ("every fine-tuning job failed: sst2 lr1e-4 seed=1: "
                                            "TaskFileMissing: train.tsv does not exist")
