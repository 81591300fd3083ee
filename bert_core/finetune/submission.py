"""Leaderboard submission files from a task model: GLUE's test-split TSVs, SQuAD's predictions.

    from bert_core.finetune.submission import write_submission
    write_submission("mnli", "finetune/demo/mnli/model", "glue_data", "finetune/demo/mnli/submission")

GLUE (gluebenchmark.com takes a zip of these): ``CoLA.tsv``, ``SST-2.tsv``, ``MRPC.tsv``,
``STS-B.tsv``, ``QQP.tsv``, ``MNLI-m.tsv`` + ``MNLI-mm.tsv`` (and ``AX.tsv``, GLUE's
``diagnostic/diagnostic.tsv`` predicted by the MNLI model), ``QNLI.tsv``, ``RTE.tsv``,
``WNLI.tsv``: a header ``index<TAB>prediction``, then one row per test row in the test file's
order, the prediction in GLUE's own label strings (``0``/``1``, ``entailment`` /
``not_entailment``, ``entailment`` / ``neutral`` / ``contradiction``; STS-B a score clipped to
[0, 5]). SQuAD's test set is hidden (the official server runs the model), so SQuAD v1.1 / v2.0
give ``predictions.json`` (question id -> answer text, ``""`` for no answer) and, for v2.0,
``null_odds.json`` on the dev file: what the official evaluation scripts read. Tasks with no
leaderboard write nothing and say why; a test file that is not there is skipped with a line
naming what to fetch.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

import numpy as np

from bert_core import storage
from bert_core.finetune import get_task, task_dir
from bert_core.finetune.errors import TaskDataError, TaskFileMissing

Log = Callable[[str], None]

NO_LEADERBOARD = {
    "sentiment": "the vaderSentiment sample has no leaderboard; its labelled test split is scored "
                 "by fine-tuning itself",
    "ner": "CoNLL-2003 has no submission server: its test file is labelled, so conlleval scores it "
           "locally",
    "ner_bilstm": "CoNLL-2003 has no submission server: its test file is labelled, so conlleval "
                  "scores it locally",
    "swag": "SWAG's leaderboard is AI2's web form, which takes an upload by hand; val.csv is scored "
            "by fine-tuning itself",
}
STSB_RANGE = (0.0, 5.0)  # STS-B's similarity scale
BATCH_SIZE = 64


def write_submission(task: str, model_dir: str, data_dir: str, out_dir: str, log: Log | None = None) -> list[str]:
    """Write the leaderboard files of ``task`` predicted by the task model in ``model_dir`` from
    the task's data under ``data_dir`` (as ``bertpipe finetune --data`` takes it) into ``out_dir``;
    return the URIs written (none for a task without a leaderboard or without test files)."""
    say = log or logging.getLogger(__name__).info
    spec = get_task(task)
    if spec.base in NO_LEADERBOARD:
        say(f"{spec.name}: no submission files: {NO_LEADERBOARD[spec.base]}")
        return []
    try:
        folder = task_dir(data_dir, spec)
    except TaskFileMissing as err:
        say(f"{spec.name}: no submission files: {err}")
        return []
    if spec.kind == "span":
        return _squad(spec.base, model_dir, folder, out_dir, say)
    return _glue(spec.base, model_dir, data_dir, folder, out_dir, say)


def _model(task: str, model_dir: str):
    from bert_core.finetune.predict import load

    tm = load(model_dir)
    if tm.task.split("@")[0] != task:
        raise TaskDataError(f"{model_dir} is a {tm.task} model, not a {task} model; give the {task} "
                            "task model for its submission files")
    return tm


def _glue_tests(task: str, data_dir: str, folder: str) -> list[tuple[str, str]]:
    """(submission file name, test file URI) of the task, AX for MNLI; the URIs may not exist."""
    from bert_core.finetune.glue import TEST_FILES

    tests = [(name, storage.join(folder, f"{stem}.tsv")) for name, stem in TEST_FILES[task].items()]
    if task == "mnli":
        # GLUE's download puts diagnostic/ beside the task folders; --data may be either.
        parent = folder.rstrip("/").rsplit("/", 1)[0]
        candidates = [storage.join(d, "diagnostic", "diagnostic.tsv") for d in dict.fromkeys((data_dir, parent))]
        tests.append(("AX", next((c for c in candidates if storage.exists(c)), "")))
    return tests


def _glue(task: str, model_dir: str, data_dir: str, folder: str, out_dir: str, say: Log) -> list[str]:
    from bert_core.finetune.glue import GLUE, read_test
    from bert_core.finetune.predict import classify, label_names

    written, tm = [], None
    for name, uri in _glue_tests(task, data_dir, folder):
        if name == "AX" and not uri:
            say(f"{task}: no AX.tsv: GLUE's diagnostic/diagnostic.tsv is not beside {folder}; fetch "
                "GLUE's diagnostic set to predict it")
            continue
        if not storage.exists(uri):
            say(f"{task}: no {name}.tsv: {uri} does not exist; fetch GLUE's {GLUE[task].folder} test "
                f"split ({uri.rsplit('/', 1)[-1]}) into {folder}")
            continue
        examples, rejects = read_test(task, uri)
        if rejects:
            r = rejects[0]
            say(f"{task}: {uri}: {len(rejects)} row(s) unreadable (line {r.line}: {r.detail}); "
                f"{name}.tsv lacks them and the server will refuse it until the file is fixed")
        if not examples:
            say(f"{task}: {uri} has no test rows; skipped {name}.tsv")
            continue
        tm = tm or _model(task, model_dir)
        logits, _ = classify(tm, [(e.text_a, e.text_b) for e in examples], BATCH_SIZE)
        if GLUE[task].labels:
            names = label_names(tm, logits.shape[-1])
            unknown = set(names) - set(GLUE[task].labels)
            if unknown:
                raise TaskDataError(f"{model_dir}: labels {sorted(unknown)} are not GLUE {task}'s "
                                    f"{list(GLUE[task].labels)}; give the model fine-tuned on GLUE {task}")
            preds = [names[int(i)] for i in logits.argmax(-1)]
        else:
            preds = [f"{v:.3f}" for v in np.clip(logits, *STSB_RANGE)]
        out = storage.join(out_dir, f"{name}.tsv")
        storage.write_text(out, "index\tprediction\n" + "".join(
            f"{e.guid}\t{p}\n" for e, p in zip(examples, preds, strict=True)))
        say(f"{task}: wrote {out} ({len(examples)} rows from {uri})")
        written.append(out)
    return written


def _squad(task: str, model_dir: str, folder: str, out_dir: str, say: Log) -> list[str]:
    from bert_core.finetune.predict import span_answers, squad_records
    from bert_core.finetune.squad import _find_files

    try:
        dev = _find_files(folder)[1]
    except TaskFileMissing as err:
        say(f"{task}: no predictions.json: {err}; fetch the SQuAD dev file")
        return []
    try:
        data = json.loads(storage.read_text(dev))
    except json.JSONDecodeError as err:
        raise TaskDataError(f"{dev}: not whole JSON (line {err.lineno}: {err.msg}); fetch it again") from None
    examples = [{"id": str(r.where), "question": r.fields["question"] or "", "context": r.fields["context"] or ""}
                for r in squad_records(data, dev)]
    tm = _model(task, model_dir)
    rows = span_answers(tm, examples, BATCH_SIZE)
    written = [storage.join(out_dir, "predictions.json")]
    storage.write_text(written[0], json.dumps({r["id"]: r["answer"] for r in rows}, indent=2))
    if task == "squad_v2":
        written.append(storage.join(out_dir, "null_odds.json"))
        storage.write_text(written[1], json.dumps({r["id"]: r.get("null_odds", 0.0) for r in rows}, indent=2))
    say(f"{task}: wrote {', '.join(written)} ({len(rows)} questions of {dev}; the test set is hidden, so "
        "these are the dev predictions the official evaluation script reads)")
    return written
