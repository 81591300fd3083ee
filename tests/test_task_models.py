"""Task models: every kind saved with its head opens in transformers (post-LN as its own BERT,
pre-LN with the code written beside it) and computes our logits; ``load_task_model`` gives our
model back; a fine-tuning run publishes the chosen setting's best seed as ``<task>/model``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bert_core import storage
from bert_core.config import FinetuneConfig
from bert_core.finetune.heads import BertForTask, task_loss
from bert_core.finetune.task_model import NotATaskModel, load_task_model, save_task_model
from bert_core.model.bert import BertModel
from bert_core.model.checkpoint import CheckpointError

# kind -> (a task of that kind, its label names, the transformers Auto class)
KINDS = {
    "classification": ("sentiment", ["negative", "neutral", "positive"], "AutoModelForSequenceClassification"),
    "regression": ("stsb", [], "AutoModelForSequenceClassification"),
    "span": ("squad", [], "AutoModelForQuestionAnswering"),
    "token": ("ner", ["O", "B-LOC", "I-LOC", "B-PER", "I-PER"], "AutoModelForTokenClassification"),
    "multiple_choice": ("swag", [], "AutoModelForMultipleChoice"),
}
CHOICES = 4


def batch(kind: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Two random sequences, the second padded after 7 tokens ([B, choices, T] for multiple choice)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, 2000, (2, 12), generator=g)
    types = torch.zeros_like(ids)
    types[:, 6:] = 1
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    if kind == "multiple_choice":
        ids, types, mask = (x[:, None].expand(2, CHOICES, 12).clone() for x in (ids, types, mask))
        ids[:, 1:, 3] += torch.arange(1, CHOICES)  # the endings differ
    return {"input_ids": ids, "token_type_ids": types, "attention_mask": mask}


def labels_for(kind: str, num_labels: int) -> torch.Tensor:
    if kind == "token":
        return torch.randint(0, num_labels, (2, 12), generator=torch.Generator().manual_seed(1))
    return {"classification": torch.tensor([0, 2]), "regression": torch.tensor([0.5, -1.0]),
            "span": torch.tensor([[1, 3], [2, 5]]), "multiple_choice": torch.tensor([1, 3])}[kind]


def trained(checkpoint: str, kind: str, num_labels: int, pooling: str = "cls") -> BertForTask:
    """A task model after a few AdamW steps on one batch: every weight, the head's too, moved off its init."""
    torch.manual_seed(0)
    model = BertForTask(BertModel.from_pretrained(checkpoint), kind, num_labels or CHOICES, pooling)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    b = batch(kind)
    for _ in range(3):
        task_loss(kind, model(**b), labels_for(kind, num_labels)).backward()
        opt.step()
        opt.zero_grad()
    return model.eval()


def hf_logits(out, kind: str) -> torch.Tensor:
    if kind == "span":
        return torch.stack([out.start_logits, out.end_logits], -1)
    return out.logits.squeeze(-1) if kind == "regression" else out.logits


@pytest.mark.parametrize("pre_ln", [False, True], ids=["post-ln", "pre-ln"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_a_saved_task_model_gives_our_logits_in_transformers(kind, pre_ln, tiny_checkpoint, tiny_preln_checkpoint,
                                                             tmp_path):
    import transformers

    task, labels, auto = KINDS[kind]
    checkpoint = tiny_preln_checkpoint if pre_ln else tiny_checkpoint
    model = trained(checkpoint, kind, len(labels))
    folder = tmp_path / "model"
    save_task_model(model, str(folder), task=task, checkpoint=checkpoint, labels=labels, max_seq_length=64)
    b = batch(kind, seed=3)
    with torch.no_grad():
        ours = model(**b)
        theirs_model = getattr(transformers, auto).from_pretrained(str(folder), trust_remote_code=pre_ln).eval()
        theirs = hf_logits(theirs_model(**b), kind)
    if kind in ("span", "token"):  # padding positions: ours read 0 states, transformers' anything
        keep = b["attention_mask"].bool()
        ours, theirs = ours[keep], theirs[keep]
    assert ours.shape == theirs.shape
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=1e-5)
    assert type(theirs_model).__name__ == (
        {"classification": "BertpipePreLNForSequenceClassification", "regression": "BertpipePreLNForSequenceClassification",
         "span": "BertpipePreLNForQuestionAnswering", "token": "BertpipePreLNForTokenClassification",
         "multiple_choice": "BertpipePreLNForMultipleChoice"}[kind] if pre_ln
        else json.loads((folder / "config.json").read_text())["architectures"][0])

    hf = json.loads((folder / "config.json").read_text())
    if labels:
        assert theirs_model.config.id2label == dict(enumerate(labels))
        assert hf["label2id"] == {name: i for i, name in enumerate(labels)}
    if kind == "regression":
        assert hf["num_labels"] == 1 if "num_labels" in hf else len(hf["id2label"]) == 1
        assert hf["problem_type"] == "regression"
    if kind == "classification":
        assert hf["problem_type"] == "single_label_classification"
    assert hf["bertpipe"]["kind"] == kind and hf["bertpipe"]["task"] == task
    assert ("auto_map" in hf) == pre_ln

    back, meta = load_task_model(str(folder))
    with torch.no_grad():
        torch.testing.assert_close(back(**b), model(**b), atol=0, rtol=0)
    assert meta["labels"] == labels and meta["max_seq_length"] == 64 and meta["pooling"] == "cls"
    assert meta["lowercase"] is True and back.kind == kind and not back.training


def test_mean_pooling_round_trips_in_bertpipe_and_the_card_says_transformers_does_not(tiny_checkpoint, tmp_path):
    model = trained(tiny_checkpoint, "classification", 3, pooling="mean")
    folder = tmp_path / "mean"
    save_task_model(model, str(folder), task="sentiment", checkpoint=tiny_checkpoint,
                    labels=["negative", "neutral", "positive"], max_seq_length=32)
    back, meta = load_task_model(str(folder))
    b = batch("classification")
    with torch.no_grad():
        torch.testing.assert_close(back(**b), model(**b), atol=0, rtol=0)
    assert meta["pooling"] == "mean" and back.pooling == "mean"
    card = (folder / "README.md").read_text()
    assert "does not reproduce" in card and "AutoModelForSequenceClassification.from_pretrained" not in card


def test_a_span_model_records_its_windows(tiny_checkpoint, tmp_path):
    from bert_core.finetune.task_model import job_meta

    cfg = FinetuneConfig(squad_max_seq_length=96, doc_stride=24, max_query_length=24, learning_rate=1e-4,
                         batch_size=32, num_train_epochs=3)  # one job's one setting
    meta = job_meta("squad", cfg, seed=2)
    model = BertForTask(BertModel.from_pretrained(tiny_checkpoint), "span", 2)
    save_task_model(model, str(tmp_path / "m"), task="squad", checkpoint=tiny_checkpoint,
                    max_seq_length=meta["max_seq_length"], meta=meta)
    _, back = load_task_model(str(tmp_path / "m"))
    assert {k: back[k] for k in ("max_seq_length", "doc_stride", "max_query_length", "max_answer_length",
                                 "n_best_size", "seed")} == {
        "max_seq_length": 96, "doc_stride": 24, "max_query_length": 24, "max_answer_length": 30,
        "n_best_size": 20, "seed": 2}
    assert back["setting"]["name"] == "lr1e-4-bs32-ep3"


def test_a_folder_that_is_no_task_model_is_refused_by_name(tiny_checkpoint, tiny_preln_checkpoint, tmp_path):
    for pretrained in (tiny_checkpoint, tiny_preln_checkpoint):
        with pytest.raises(NotATaskModel, match="is not a fine-tuned task model") as err:
            load_task_model(pretrained)
        assert pretrained in str(err.value) and "pre-trained export" in str(err.value)
    with pytest.raises(NotATaskModel, match="no config.json"):
        load_task_model(str(tmp_path / "nothing"))
    model = BertForTask(BertModel.from_pretrained(tiny_checkpoint), "classification", 3)
    folder = tmp_path / "m"
    save_task_model(model, str(folder), task="sentiment", checkpoint=tiny_checkpoint,
                    labels=["negative", "neutral", "positive"], max_seq_length=32)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # cut short
    with pytest.raises(CheckpointError, match="damaged"):
        load_task_model(str(folder))
    (folder / "config.json").write_text("{")
    with pytest.raises(NotATaskModel, match="not valid JSON"):
        load_task_model(str(folder))


def predictions(path: Path) -> dict[str, str]:
    return dict(line.split("\t") for line in path.read_text().splitlines()[1:])


@pytest.mark.parametrize("save_every_job", [False, True], ids=["chosen-only", "every-job"])
def test_a_finetune_run_publishes_the_chosen_model_with_its_card(save_every_job, sentiment_tasks, tiny_checkpoint,
                                                                 tmp_path):
    import prefect.main  # noqa: F401  (its log handlers on the real stderr, not CliRunner's)
    from typer.testing import CliRunner

    from bert_core.finetune.data import collate
    from bert_core.finetune.glue import SENTIMENT_LABELS, prepare, read_sentiment
    from bert_core.vocab.tokenization import load_tokenizer
    from flows.cli.main import app

    out = tmp_path / "ft"
    r = CliRunner().invoke(app, [
        "finetune", "--task", "sentiment", "--data", str(sentiment_tasks), "--checkpoint", tiny_checkpoint,
        "--output", str(out), "--seeds", "1,2", "--learning-rates", "1e-3", "--batch-sizes", "16", "--epochs",
        "1", "--set", "finetune.threads=1", "--set", "finetune.max_seq_length=32",
        "--set", f"finetune.save_every_job={str(save_every_job).lower()}"])
    assert r.exit_code == 0, r.output
    task = out / "sentiment"
    manifest = storage.read_manifest(str(task))
    setting = manifest["stats"]["summary"]["sentiment"]["selected"]
    dev = manifest["stats"]["grid"]["sentiment"][setting]["metrics"]["dev/accuracy"]["values"]
    seed = 1 if dev["1"] >= dev["2"] else 2
    assert manifest["model"] == {"setting": setting, "seed": seed, "path": "model"}
    jobs = sorted(p.relative_to(task).as_posix() for p in task.glob("*/seed=*/model"))
    assert jobs == ([f"{setting}/seed=1/model", f"{setting}/seed=2/model"] if save_every_job else [])
    listed = {s["path"] for s in manifest["shards"]}
    assert {f"model/{p.name}" for p in (task / "model").iterdir()} <= listed
    assert {f"{j}/{p.name}" for j in jobs for p in (task / j).iterdir()} <= listed
    storage.check_shards(str(task), manifest, checksums=True)  # what it lists is there, whole

    # the card: the task, the chosen setting over seeds on dev and on test, where it came from
    card = (task / "model" / "README.md").read_text()
    summary = manifest["stats"]["summary"]["sentiment"]
    assert "fine-tuned on sentiment" in card and f"`{setting}`" in card and "seeds 1, 2" in card
    assert f"test accuracy: {summary['final']['mean']:.1f} ± {summary['final']['sd']:.1f} over 2 seeds" in card
    assert f"pre-trained checkpoint `{storage.to_uri(tiny_checkpoint)}`" in card
    assert "AutoModelForSequenceClassification.from_pretrained(path)" in card

    # the published model is the chosen job's: it predicts what that job wrote for the test split
    model, meta = load_task_model(str(task / "model"))
    assert meta["seed"] == seed and meta["labels"] == list(SENTIMENT_LABELS)
    tokenizer = load_tokenizer(str(task / "model"))
    cfg = FinetuneConfig(max_seq_length=meta["max_seq_length"])
    data = prepare("sentiment", str(sentiment_tasks / "sentiment"), tokenizer, cfg)
    examples = read_sentiment(str(sentiment_tasks / "sentiment"), "test")[0]
    with torch.no_grad():
        logits = model(**{k: v for k, v in collate("classification", data.evals["test"], tokenizer.pad_id).items()
                          if k != "labels"})
    ours = {e.guid: meta["labels"][int(i)] for e, i in zip(examples, logits.argmax(-1), strict=True)}
    job = task / setting / f"seed={seed}" / "test_predictions.tsv"
    assert ours == predictions(job)
