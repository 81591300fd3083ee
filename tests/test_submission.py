"""Leaderboard submission files from task models (tiny random BERTs): GLUE's test TSVs in the
test files' order with GLUE's label strings, SQuAD's predictions.json on dev, and the tasks and
files that are skipped with a line saying why."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_predict import make_task_models

from bert_core.finetune.errors import TaskDataError
from bert_core.finetune.glue import GLUE
from bert_core.finetune.submission import write_submission

FIXTURES = Path(__file__).parent / "fixtures" / "tasks"
PAIR = ("A man plays a guitar .", "A man plays music .")
# GLUE's test.tsv header of each task, and the columns holding the texts.
TEST_HEADERS = {
    "cola": "index\tsentence", "sst2": "index\tsentence",
    "mrpc": "index\t#1 ID\t#2 ID\t#1 String\t#2 String",
    "stsb": "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2",
    "qqp": "id\tquestion1\tquestion2",
    "mnli": "index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\tsentence2_binary_parse\t"
            "sentence1_parse\tsentence2_parse\tsentence1\tsentence2",
    "qnli": "index\tquestion\tsentence", "rte": "index\tsentence1\tsentence2",
    "wnli": "index\tsentence1\tsentence2",
}
INDEXES = ["12", "3", "7", "0"]  # not sorted: the submission keeps the test file's order
GLUE_TASKS = tuple(TEST_HEADERS)


def glue_test_row(header: str, index: str, n: int) -> str:
    cells = []
    for col in header.split("\t"):
        if col in ("index", "id"):
            cells.append(index)
        elif col in ("sentence", "sentence1", "question1", "question", "#1 String"):
            cells.append(f"{PAIR[0]} {n}")
        elif col in ("sentence2", "question2", "#2 String"):
            cells.append(PAIR[1])
        else:
            cells.append("x")
    return "\t".join(cells)


@pytest.fixture(scope="module")
def glue(tmp_path_factory, samples_dir):
    """Task models of every GLUE task and SQuAD, and a GLUE data folder with test files."""
    root = tmp_path_factory.mktemp("submission")
    labels = {**{t: list(GLUE[t].labels) for t in GLUE_TASKS}, "squad": [], "squad_v2": []}
    models = make_task_models(root / "models", samples_dir / "models" / "minilm" / "vocab.txt", labels)
    data = root / "glue_data"
    stems = {"mnli": ["test_matched", "test_mismatched"]}
    for task, header in TEST_HEADERS.items():
        folder = data / GLUE[task].folder
        folder.mkdir(parents=True)
        for stem in stems.get(task, ["test"]):
            rows = [glue_test_row(header, i, n) for n, i in enumerate(INDEXES)]
            (folder / f"{stem}.tsv").write_text("\n".join([header, *rows]) + "\n")
    (data / "diagnostic").mkdir()
    (data / "diagnostic" / "diagnostic.tsv").write_text(
        "\n".join(["index\tsentence1\tsentence2", *(f"{i}\t{PAIR[0]}\t{PAIR[1]}" for i in ("0", "1"))]) + "\n")
    for task in ("squad", "squad_v2"):
        (data / task).mkdir()
        for f in (FIXTURES / task).iterdir():
            (data / task / f.name).write_text(f.read_text())
    return models, data


EXPECTED = {"cola": ["CoLA.tsv"], "sst2": ["SST-2.tsv"], "mrpc": ["MRPC.tsv"], "stsb": ["STS-B.tsv"],
            "qqp": ["QQP.tsv"], "mnli": ["MNLI-m.tsv", "MNLI-mm.tsv", "AX.tsv"], "qnli": ["QNLI.tsv"],
            "rte": ["RTE.tsv"], "wnli": ["WNLI.tsv"]}


@pytest.mark.parametrize("task", GLUE_TASKS)
def test_glue_files_have_glue_names_header_rows_and_labels(task, glue, tmp_path):
    models, data = glue
    said: list[str] = []
    written = write_submission(task, models[task], str(data), str(tmp_path / "sub"), log=said.append)
    assert [Path(w).name for w in written] == EXPECTED[task]
    for uri in written:
        lines = Path(uri).read_text().splitlines()
        assert lines[0] == "index\tprediction"
        rows = [line.split("\t") for line in lines[1:]]
        assert [r[0] for r in rows] == (["0", "1"] if uri.endswith("AX.tsv") else INDEXES)
        for _, pred in rows:
            if task == "stsb":
                assert 0.0 <= float(pred) <= 5.0
            else:
                assert pred in GLUE[task].labels
    assert len(said) == len(written)


def test_missing_test_files_are_skipped_with_a_line_naming_them(glue, tmp_path):
    models, _ = glue
    data = tmp_path / "glue_data"
    (data / "RTE").mkdir(parents=True)
    (data / "MNLI").mkdir()
    said: list[str] = []
    assert write_submission("rte", models["rte"], str(data), str(tmp_path / "sub"), log=said.append) == []
    assert "test.tsv" in said[0] and "RTE" in said[0]
    said.clear()
    assert write_submission("mnli", models["mnli"], str(data), str(tmp_path / "sub"), log=said.append) == []
    assert len(said) == 3 and "test_matched.tsv" in said[0] and "diagnostic" in said[2]
    said.clear()
    assert write_submission("qqp", models["qqp"], str(data), str(tmp_path / "sub"), log=said.append) == []
    assert "QQP" in said[0]
    assert not (tmp_path / "sub").exists()


@pytest.mark.parametrize("task", ["sentiment", "ner", "swag"])
def test_tasks_without_a_leaderboard_write_nothing_and_say_why(task, tmp_path):
    said: list[str] = []
    assert write_submission(task, str(tmp_path / "any"), str(FIXTURES), str(tmp_path / "sub"), log=said.append) == []
    assert len(said) == 1 and said[0].startswith(f"{task}: no submission files")


def test_a_model_of_another_task_is_refused(glue, tmp_path):
    models, data = glue
    with pytest.raises(TaskDataError, match="sst2 model, not a rte model"):
        write_submission("rte", models["sst2"], str(data), str(tmp_path / "sub"))


@pytest.mark.parametrize("task", ["squad", "squad_v2"])
def test_squad_predictions_answer_every_dev_question(task, glue, tmp_path):
    models, data = glue
    written = write_submission(task, models[task], str(data), str(tmp_path / "sub"), log=lambda m: None)
    assert [Path(w).name for w in written] == (["predictions.json"] if task == "squad"
                                               else ["predictions.json", "null_odds.json"])
    dev = json.loads(next((FIXTURES / task).glob("dev-*.json")).read_text())
    contexts = {qa["id"]: p["context"] for a in dev["data"] for p in a["paragraphs"] for qa in p["qas"]}
    predictions = json.loads(Path(written[0]).read_text())
    assert set(predictions) == set(contexts)
    assert all(answer in contexts[qid] for qid, answer in predictions.items())
    if task == "squad_v2":
        odds = json.loads(Path(written[1]).read_text())
        assert set(odds) == set(contexts)
        assert all((predictions[q] == "") == (odds[q] > 0) for q in odds)


def test_fine_tuning_writes_the_chosen_models_submission_into_the_task_folder(tiny_checkpoint, tmp_path):
    """run_many (the CLI's loop) on RTE with a test file: the chosen model's RTE.tsv lands in
    rte/submission/ and the task's manifest vouches for it; with finetune.submission off, none."""
    import shutil

    from bert_core import storage
    from bert_core.config import FinetuneConfig
    from bert_core.finetune.report import run_many

    data = tmp_path / "data"
    shutil.copytree(FIXTURES / "RTE", data / "RTE")
    header = TEST_HEADERS["rte"]
    (data / "RTE" / "test.tsv").write_text("\n".join([header, *(glue_test_row(header, i, n)
                                                                for n, i in enumerate(INDEXES))]) + "\n")
    for on in (True, False):
        cfg = FinetuneConfig(tasks=["rte"], seeds=[1], learning_rates=[1e-4], batch_sizes=[8], epochs=[1],
                             max_seq_length=32, threads=1, submission=on)
        output = tmp_path / f"out-{on}"
        run_many(["rte"], [1], str(data), tiny_checkpoint, cfg, str(output))
        manifest = storage.read_manifest(str(output / "rte"))
        listed = {s["path"] for s in manifest["shards"]}
        assert ("submission/RTE.tsv" in listed) is on
        assert (output / "rte" / "submission" / "RTE.tsv").exists() is on
        if on:
            rows = (output / "rte" / "submission" / "RTE.tsv").read_text().splitlines()
            assert rows[0] == "index\tprediction" and [r.split("\t")[0] for r in rows[1:]] == INDEXES
        storage.check_shards(str(output / "rte"))
