"""``bertpipe predict``: a saved task model of each kind (a tiny random BERT with the real vocab)
run on every input form; rows agree with the model's own forward pass; bad records go to the
rejects and are counted; a wrong input is one line."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from bert_core.finetune.predict import load, predict_file
from flows.cli.main import app

FIXTURES = Path(__file__).parent / "fixtures" / "tasks"
LABELS = {"sst2": ["0", "1"], "mnli": ["contradiction", "entailment", "neutral"], "stsb": [],
          "squad": [], "squad_v2": [], "ner": ["O", "B-LOC", "B-PER", "I-LOC", "I-PER"], "swag": []}
SPAN_META = {"doc_stride": 24, "max_query_length": 16, "max_answer_length": 30, "n_best_size": 20}


def make_task_models(root: Path, vocab_file: Path, labels: dict[str, list[str]] = LABELS) -> dict[str, str]:
    """A tiny random BERT (the real bert-base-uncased vocab) saved as a task model per task of
    ``labels`` (task -> its label names by id)."""
    import torch

    from bert_core.config import ModelConfig
    from bert_core.finetune import get_task
    from bert_core.finetune.heads import BertForTask
    from bert_core.finetune.task_model import save_task_model
    from bert_core.model.bert import BertModel
    from bert_core.model.checkpoint import save_pretrained

    torch.manual_seed(0)
    ckpt = root / "tiny-bert"
    save_pretrained(BertModel(ModelConfig(size="tiny", vocab_size=30522, max_position_embeddings=128)),
                    str(ckpt), vocab_file=str(vocab_file))
    out = {}
    for task in labels:
        kind = get_task(task).kind
        model = BertForTask(BertModel.from_pretrained(str(ckpt)), kind, max(len(labels[task]), 2))
        torch.nn.init.normal_(model.head.weight, std=0.5)  # outputs far from uniform: argmax is clear
        out[task] = save_task_model(model, str(root / task), task=task, checkpoint=str(ckpt),
                                    labels=labels[task], max_seq_length=48,
                                    meta=SPAN_META if kind == "span" else None)
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory, samples_dir) -> dict[str, str]:
    return make_task_models(tmp_path_factory.mktemp("task-models"), samples_dir / "models" / "minilm" / "vocab.txt")


def rows_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def own_logits(model_dir: str, a: str, b: str | None = None) -> np.ndarray:
    """The model's forward pass on one example, alone in its batch."""
    import torch

    from bert_core.finetune.glue import Example, encode_pairs

    tm = load(model_dir)
    enc = encode_pairs(tm.tokenizer, [Example("x", a, b, None)], tm.meta["max_seq_length"])
    ids = torch.tensor(enc["input_ids"])
    with torch.no_grad():
        return tm.model(ids, torch.tensor(enc["token_type_ids"]), torch.ones_like(ids))[0].numpy()


def test_classification_on_text_pairs_jsonl_and_tsv_agrees_with_the_forward_pass(models, tmp_path):
    texts = ["a fine film with a great cast", "dull", "the plot " * 40]  # the last is truncated
    (tmp_path / "in.txt").write_text("\n".join(texts) + "\n\n")
    c = predict_file(models["sst2"], str(tmp_path / "in.txt"), str(tmp_path / "out.jsonl"), batch_size=2)
    rows = rows_of(tmp_path / "out.jsonl")
    assert (c["read"], c["kept"], c["rejected"]) == (3, 3, 0) and len(rows) == 3
    for text, row in zip(texts, rows, strict=True):
        assert row["text"] == text and set(row["probabilities"]) == {"0", "1"}
        assert abs(sum(row["probabilities"].values()) - 1) < 1e-5
        assert row["label"] == max(row["probabilities"], key=row["probabilities"].get)
        logits = own_logits(models["sst2"], text)
        p = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
        assert np.allclose([row["probabilities"]["0"], row["probabilities"]["1"]], p, atol=1e-4)
    assert [r["truncated"] for r in rows] == [False, False, True]

    # pairs: TAB-separated lines, JSONL with a chosen field + text_pair, a TSV with GLUE's header
    (tmp_path / "pairs.txt").write_text("Emma lives in Quito .\tEmma lives somewhere .\n")
    (tmp_path / "pairs.jsonl").write_text(json.dumps({"id": "p1", "premise": "Emma lives in Quito .",
                                                      "text_pair": "Emma lives somewhere ."}) + "\n")
    (tmp_path / "pairs.tsv").write_text("index\tsentence1\tsentence2\n0\tEmma lives in Quito .\tEmma lives somewhere .\n")
    want = own_logits(models["mnli"], "Emma lives in Quito .", "Emma lives somewhere .")
    for name, field in (("pairs.txt", "text"), ("pairs.jsonl", "premise"), ("pairs.tsv", "text")):
        predict_file(models["mnli"], str(tmp_path / name), str(tmp_path / "o.jsonl"), field=field)
        (row,) = rows_of(tmp_path / "o.jsonl")
        assert row["label"] == LABELS["mnli"][int(want.argmax())], name
        assert row["text_pair"] == "Emma lives somewhere ."
        assert ("id" in row) == (name == "pairs.jsonl")


def test_regression_scores_are_the_forward_pass(models, tmp_path):
    (tmp_path / "in.jsonl.gz").write_bytes(gzip.compress(
        (json.dumps({"text": "A man plays a guitar .", "text_pair": "A man plays music ."}) + "\n").encode()))
    predict_file(models["stsb"], str(tmp_path / "in.jsonl.gz"), str(tmp_path / "o.jsonl"))
    (row,) = rows_of(tmp_path / "o.jsonl")
    assert abs(row["score"] - float(own_logits(models["stsb"], "A man plays a guitar .", "A man plays music ."))) < 1e-4


@pytest.mark.parametrize("task", ["squad", "squad_v2"])
def test_span_answers_are_spans_of_their_context_on_squad_json_and_jsonl(task, models, tmp_path):
    dev = FIXTURES / task / ("dev-v1.1.json" if task == "squad" else "dev-v2.0.json")
    data = json.loads(dev.read_text())
    contexts = {qa["id"]: p["context"] for a in data["data"] for p in a["paragraphs"] for qa in p["qas"]}
    c = predict_file(models[task], str(dev), str(tmp_path / "o.jsonl"), batch_size=4)
    rows = rows_of(tmp_path / "o.jsonl")
    assert c["kept"] == len(contexts) and [r["id"] for r in rows] == list(contexts)
    answered = [r for r in rows if r["answer"]]
    assert answered, "a random model still answers something"
    for r in answered:
        assert contexts[r["id"]][r["start"] : r["end"]] == r["answer"]
    if task == "squad_v2":
        assert all(set(r) >= {"null_odds", "score"} for r in rows)
        for r in rows:  # the null answer wins exactly where the no-answer score is higher
            assert (r["answer"] == "") == (r["null_odds"] > 0), r
            assert r["start"] is None if r["answer"] == "" else isinstance(r["start"], int)
    # the same questions as JSONL: the same answers (long contexts slide in doc_stride windows)
    first = next(iter(contexts))
    question = next(qa["question"] for a in data["data"] for p in a["paragraphs"] for qa in p["qas"] if qa["id"] == first)
    (tmp_path / "q.jsonl").write_text(json.dumps({"id": first, "question": question, "context": contexts[first]}) + "\n")
    predict_file(models[task], str(tmp_path / "q.jsonl"), str(tmp_path / "q.out.jsonl"))
    assert rows_of(tmp_path / "q.out.jsonl")[0] == rows[0]


def test_token_entities_are_chunks_of_the_predicted_tags(models, tmp_path):
    import torch

    from bert_core.finetune.data import collate
    from bert_core.finetune.ner import chunks, encode_sentences

    text = "John  Smith went to Paris with Mary Jones"
    (tmp_path / "in.txt").write_text(text + "\n")
    predict_file(models["ner"], str(tmp_path / "in.txt"), str(tmp_path / "o.jsonl"))
    (row,) = rows_of(tmp_path / "o.jsonl")
    tm = load(models["ner"])
    words = text.split()
    (f,) = encode_sentences([(words, ["O"] * len(words))], tm.tokenizer, {}, 48)
    batch = collate("token", [f], tm.tokenizer.pad_id)
    with torch.no_grad():
        best = tm.model(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"])[0].argmax(-1)
    tags = [LABELS["ner"][int(best[p])] for p in f["firsts"]]
    want = [(kind, " ".join(words[a:b])) for kind, a, b in chunks(tags)]
    assert [(e["label"], " ".join(e["text"].split())) for e in row["entities"]] == want
    assert want, "the random head names some entity"
    for e in row["entities"]:
        assert text[e["start"] : e["end"]] == e["text"]


def test_multiple_choice_picks_the_most_probable_ending(models, tmp_path):
    (tmp_path / "in.jsonl").write_text(
        json.dumps({"id": 7, "context": "She opened the door", "endings": ["and walked in.", "and ate a fish."]}) + "\n"
        + json.dumps({"context": "He sat down", "endings": ["to read.", "on a cloud.", "and slept.", "quickly."]}) + "\n")
    (tmp_path / "in.txt").write_text("She opened the door\tand walked in.\tand ate a fish.\n")
    predict_file(models["swag"], str(tmp_path / "in.jsonl"), str(tmp_path / "o.jsonl"), batch_size=1)
    rows = rows_of(tmp_path / "o.jsonl")
    assert [len(r["probabilities"]) for r in rows] == [2, 4] and rows[0]["id"] == 7
    for r in rows:
        assert r["choice"] == int(np.argmax(r["probabilities"])) and abs(sum(r["probabilities"]) - 1) < 1e-5
    predict_file(models["swag"], str(tmp_path / "in.txt"), str(tmp_path / "t.jsonl"))
    assert np.allclose(rows_of(tmp_path / "t.jsonl")[0]["probabilities"], rows[0]["probabilities"], atol=1e-5)


def test_bad_records_are_rejected_and_counted(models, tmp_path):
    lines = [json.dumps({"text": "good one"}), "{cut", json.dumps({"body": "no text"}), json.dumps([1, 2]),
             json.dumps({"text": 3}), json.dumps({"text": "   "}), json.dumps({"text": "good two"})]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    c = predict_file(models["sst2"], str(tmp_path / "in.jsonl"), str(tmp_path / "o.jsonl"))
    assert (c["read"], c["kept"], c["rejected"]) == (7, 2, 5)
    assert c["rejected_by_reason"] == {"bad_json": 2, "missing_field": 1, "not_text": 1, "empty_text": 1}
    rejects = rows_of(tmp_path / "o.jsonl.rejects.jsonl")
    assert [r["id"] for r in rejects] == [2, 3, 4, 5, 6] and all(r["source"].endswith("in.jsonl") for r in rejects)
    assert [r["text"] for r in rows_of(tmp_path / "o.jsonl")] == ["good one", "good two"]

    (tmp_path / "bad.tsv").write_text("text\tother\nfine\tx\nonly-one-column\n")
    c = predict_file(models["sst2"], str(tmp_path / "bad.tsv"), str(tmp_path / "t.jsonl"))
    assert (c["read"], c["kept"], c["rejected_by_reason"]) == (2, 1, {"bad_columns": 1})


def test_cli_rows_on_stdout_and_wrong_inputs_in_one_line(models, tmp_path):
    runner = CliRunner()
    (tmp_path / "in.txt").write_text("a fine film\n")
    r = runner.invoke(app, ["predict", models["sst2"], str(tmp_path / "in.txt")])
    assert r.exit_code == 0, r.output
    row = json.loads(next(line for line in r.output.splitlines() if line.startswith("{")))
    assert row["label"] in ("0", "1") and "read 1, kept 1, rejected 0" in r.output

    (tmp_path / "questions.txt").write_text("Where does Emma live?\n")
    (tmp_path / "all-bad.jsonl").write_text(json.dumps({"body": "x"}) + "\n" + json.dumps({"body": "y"}) + "\n")
    cases = [
        ([models["squad"], str(tmp_path / "questions.txt")],
         ["questions.txt", "a span model (squad) needs a question and a context"]),
        ([models["sst2"], str(tmp_path / "all-bad.jsonl")], ["all-bad.jsonl", "line 1", "'text'"]),
        ([models["sst2"], str(FIXTURES / "squad" / "dev-v1.1.json")], ["dev-v1.1.json", "SQuAD JSON"]),
        ([models["swag"], str(tmp_path / "in.txt")], ["in.txt", "endings"]),
        ([str(Path(models["sst2"]).parent / "tiny-bert"), str(tmp_path / "in.txt")], ["tiny-bert", "not a fine-tuned task model"]),
    ]
    for args, needles in cases:
        r = runner.invoke(app, ["predict", *args, "--output", str(tmp_path / "x.jsonl")])
        last = [line for line in r.output.splitlines() if line.strip()][-1]
        assert r.exit_code == 1 and "Traceback" not in r.output, r.output
        for needle in needles:
            assert needle in last, (needle, last)
    r = runner.invoke(app, ["predict", models["sst2"], str(tmp_path / "in.txt"), "--batch-size", "0"])
    assert r.exit_code == 2
