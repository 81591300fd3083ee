"""The demo's task models, proven outside bertpipe.

Each of the demo's fine-tuning tasks (``bert_core/presets/demo.yaml``: sentiment,
sentiment@300, squad, ner on the real sample task data) is fine-tuned through
``bert_core.finetune.report.run_many`` (the grid's jobs, selection and ``publish_chosen``) on a
tiny checkpoint of each layout the demo produces: post-LN (the sample MiniLM's) and pre-LN (the
demo's freshly pre-trained BERT and its random-init baseline). The demo's settings are shrunk
(one seed, one setting, a few training examples, short sequences); its task list and data are not.

Then every published ``<task>/model``:

- opens with transformers' ``AutoModelFor*`` (pre-LN with ``trust_remote_code=True``) in a
  process where ``import bert_core`` (and ``flows``, ``beam_jobs``) raises ImportError; its
  logits on the dev split's features, as bertpipe's own task reader builds them, match
  ``load_task_model``'s to 1e-4 and, through the task's own ``finish``, give the predictions the
  chosen job recorded (labels, answer texts, tags);
- run by ``bertpipe predict`` on a fresh input file of the dev split (JSONL sentences, the SQuAD
  JSON, one sentence a line) gives those predictions too (labels, answers by id, entity spans).

The demo's models pool the pooler over ``[CLS]`` (``pooling: cls``, the default): a
``pooling: mean`` model loads in transformers but its classes do not reproduce its outputs
(``bert_core.finetune.task_model``), so only ``cls`` models are proven here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.slow

DEMO_TASKS = ["sentiment", "sentiment@300", "squad", "ner"]
BATCH = 64  # train_and_predict's evaluation batch: the same padding as the job's own outputs

# Loads each task model with transformers alone and writes its logits; bertpipe cannot be imported.
OUTSIDE = r'''
import importlib.abc, json, sys

REFUSED = ("bert_core", "flows", "beam_jobs")


class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in REFUSED:
            raise ImportError(f"{name} is not importable in this process")
        return None


sys.meta_path.insert(0, Refuse())
refused = []
for name in REFUSED:
    try:
        __import__(name)
    except ImportError:
        refused.append(name)

import numpy as np
import torch
import transformers

torch.set_num_threads(1)
jobs = json.loads(sys.argv[1])
for job in jobs:
    auto = getattr(transformers, job["auto"])
    model = auto.from_pretrained(job["folder"], trust_remote_code=job["remote"]).eval()
    batches = np.load(job["inputs"])
    out = {}
    with torch.no_grad():
        for b in range(int(batches["n"])):
            feed = {k: torch.from_numpy(batches[f"{b}_{k}"])
                    for k in ("input_ids", "token_type_ids", "attention_mask")}
            o = model(**feed)
            logits = torch.stack([o.start_logits, o.end_logits], -1) if job["kind"] == "span" else o.logits
            out[f"{b}"] = logits.float().numpy()
    np.savez(job["outputs"], **out)
    job["class"] = type(model).__name__
    tokenizer = transformers.AutoTokenizer.from_pretrained(job["folder"], trust_remote_code=False)
    job["encoded"] = [tokenizer(t, truncation=True, max_length=job["max_len"])["input_ids"]
                      for t in job["texts"]]
loaded = sorted({m.split(".")[0] for m in sys.modules} & set(REFUSED))
print(json.dumps({"refused": refused, "loaded": loaded,
                  "jobs": [{k: j[k] for k in ("folder", "class", "encoded")} for j in jobs]}))
'''


@dataclass(frozen=True)
class Grid:
    """One checkpoint's fine-tuning of the demo's tasks: where it wrote, on what data."""

    layout: str
    output: Path
    data_dir: Path


@pytest.fixture(scope="module")
def grids(samples_dir, tiny_checkpoint, tiny_preln_checkpoint, tmp_path_factory) -> dict[str, Grid]:
    from bert_core.config import load_config
    from bert_core.finetune.report import run_many

    data_dir = samples_dir / "tasks"
    # Enough steps (1,000 sentences, 3 epochs, a high rate) that a tiny random BERT's sentiment
    # predictions are not all one label; fewer leave every dev sentence with the majority class.
    cfg = load_config("demo", sets=[
        f"finetune.data_dir={data_dir}", "finetune.seeds=[1]", "finetune.learning_rates=[2.0e-3]",
        "finetune.batch_sizes=[16]", "finetune.epochs=[3]", "finetune.max_train_examples=1000",
        "finetune.max_seq_length=24", "finetune.threads=1"]).finetune
    assert cfg.tasks == DEMO_TASKS and cfg.pooling == "cls"
    assert load_config("demo").model.pre_layer_norm  # the demo's own BERT (and its baseline) is pre-LN
    out = {}
    for layout, checkpoint in (("post-ln", tiny_checkpoint), ("pre-ln", tiny_preln_checkpoint)):
        output = tmp_path_factory.mktemp(f"demo-{layout}") / "finetune"
        index = run_many(cfg.tasks, cfg.seeds, str(data_dir), checkpoint, cfg, str(output))
        assert index["counts"]["failed"] == 0, index
        out[layout] = Grid(layout, output, data_dir)
    return out


# --------------------------------------------------------------------------- predictions


def recorded(kind: str, split: str, read) -> Any:
    """The predictions of one split in the files a job writes (``read(name)`` gives a file's
    text): ``{guid: label}``, ``{question id: answer}`` or one tag list per sentence."""
    if kind == "classification":
        return dict(line.split("\t") for line in read(f"{split}_predictions.tsv").splitlines()[1:])
    if kind == "span":
        return json.loads(read("predictions.json"))
    sentences, tags = [], []
    for line in read(f"{split}_predictions.txt").splitlines():
        if line.strip():
            tags.append(line.split(" ")[2])
        elif tags:
            sentences.append(tags)
            tags = []
    return sentences + ([tags] if tags else [])


def finished(data: Any, split: str, outputs: list[np.ndarray]) -> Any:
    """The task's own ``finish`` of ``outputs``, as ``run_job`` calls it, read as :func:`recorded`."""
    _, files = data.finish(split, outputs)

    def read(name: str) -> str:
        content = files[name]
        return content if isinstance(content, str) else json.dumps(content)

    return recorded(data.kind, split, read)


def chosen_job(grid: Grid, task: str, meta: dict[str, Any]) -> Path:
    from bert_core.finetune import get_task
    from bert_core.finetune.grid import Setting, job_dir

    return Path(job_dir(str(grid.output), get_task(task).name, Setting.from_dict(meta["setting"]), meta["seed"]))


def task_data(grid: Grid, task: str, folder: Path) -> tuple[Any, dict[str, Any], Any]:
    """The dev split's features by bertpipe's reader, with the model's tokenizer and its
    ``bertpipe`` settings (the job's config for the rest: its training cap fixes NER's tags)."""
    from bert_core.config import FinetuneConfig
    from bert_core.finetune.task_model import SPAN_FIELDS, read_meta
    from bert_core.finetune.train import prepare_task
    from bert_core.vocab.tokenization import load_tokenizer

    meta = read_meta(str(folder))
    job = json.loads((chosen_job(grid, task, meta) / "metrics.json").read_text())
    settings = {"squad_max_seq_length" if meta["kind"] == "span" else "max_seq_length": meta["max_seq_length"],
                **{k: meta[k] for k in SPAN_FIELDS if k in meta}}
    assert {k: job["config"][k] for k in settings} == settings  # the model says what the job ran
    cfg = FinetuneConfig(**{**job["config"], **settings})
    tokenizer = load_tokenizer(str(folder))
    return prepare_task(task, str(grid.data_dir), tokenizer, cfg), meta, tokenizer


def save_batches(kind: str, feats: list[dict[str, Any]], pad_id: int, path: Path) -> list[dict[str, torch.Tensor]]:
    from bert_core.finetune.data import collate

    batches = [collate(kind, feats[i : i + BATCH], pad_id) for i in range(0, len(feats), BATCH)]
    np.savez(path, n=len(batches), **{f"{b}_{k}": batch[k].numpy() for b, batch in enumerate(batches)
                                      for k in ("input_ids", "token_type_ids", "attention_mask")})
    return batches


def rows_of(kind: str, feats: list[dict[str, Any]], logits: list[np.ndarray]) -> list[np.ndarray]:
    """Per feature, as the job's outputs: token and span rows cut to the feature's length."""
    flat = [row for block in logits for row in block]
    return [row[: len(f["input_ids"])] if kind in ("token", "span") else row for f, row in zip(feats, flat, strict=True)]


def test_each_demo_task_model_gives_its_jobs_dev_predictions_in_transformers_without_bertpipe(grids, tmp_path):
    from bert_core.finetune import get_task
    from bert_core.finetune.glue import read_sentiment
    from bert_core.finetune.heads import mask_padding
    from bert_core.finetune.task_model import AUTO_CLASSES, HF_ARCHITECTURES, load_task_model

    cases, jobs = [], []
    for layout, grid in grids.items():
        for task in DEMO_TASKS:
            folder = grid.output / task / "model"
            data, meta, tokenizer = task_data(grid, task, folder)
            split = get_task(task).splits[0]
            feats = data.evals[split]
            assert meta["pooling"] == "cls" and meta["kind"] == data.kind and list(meta["labels"]) == list(data.labels)
            inputs, outputs = tmp_path / f"{layout}-{task}-in.npz", tmp_path / f"{layout}-{task}-out.npz"
            batches = save_batches(data.kind, feats, tokenizer.pad_id, inputs)
            model, _ = load_task_model(str(folder))
            with torch.no_grad():
                ours = [mask_padding(data.kind, model(b["input_ids"], b["token_type_ids"], b["attention_mask"]),
                                     b["attention_mask"]).numpy() for b in batches]
            texts = [e.text_a for e in read_sentiment(str(grid.data_dir / "sentiment"), split)[0][:50]] \
                if data.kind == "classification" else []
            jobs.append({"folder": str(folder), "kind": data.kind, "auto": AUTO_CLASSES[HF_ARCHITECTURES[data.kind]],
                         "remote": layout == "pre-ln", "inputs": str(inputs), "outputs": str(outputs),
                         "texts": texts, "max_len": meta["max_seq_length"]})
            cases.append((layout, task, split, data, feats, ours, outputs, texts))

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_MODULES_CACHE": str(tmp_path / "hf-modules")}
    run = subprocess.run([sys.executable, "-I", "-c", OUTSIDE, json.dumps(jobs)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.splitlines()[-1])
    assert report["refused"] == ["bert_core", "flows", "beam_jobs"] and report["loaded"] == []

    for (layout, task, split, data, feats, ours, outputs, texts), done in zip(cases, report["jobs"], strict=True):
        what = f"{layout} {task}"
        folder = grids[layout].output / task / "model"
        assert done["folder"] == str(folder)
        arch = HF_ARCHITECTURES[data.kind]  # pre-LN: the code written beside the weights
        assert done["class"] == (arch.replace("Bert", "BertpipePreLN", 1) if layout == "pre-ln" else arch), what
        theirs = np.load(outputs)
        theirs = rows_of(data.kind, feats, [theirs[str(b)] for b in range(len(ours))])
        ours = rows_of(data.kind, feats, ours)
        for a, b in zip(theirs, ours, strict=True):
            np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4, err_msg=what)
        meta = json.loads((folder / "config.json").read_text())["bertpipe"]
        job_dir = chosen_job(grids[layout], task, meta)
        expected = recorded(data.kind, split, lambda name, d=job_dir: (d / name).read_text())
        assert finished(data, split, theirs) == expected, what
        if task in ("sentiment", "ner"):  # the models tell examples apart: equal predictions say something
            assert len(set(expected.values()) if task == "sentiment" else {t for s in expected for t in s}) > 1, what
        key = {"token": "sentence", "span": "example_index"}.get(data.kind)
        assert len(expected) == len({f[key] for f in feats} if key else feats), what  # every dev example
        if texts:  # the folder's tokenizer in transformers encodes as bertpipe's reader did
            assert done["encoded"] == [f["input_ids"] for f in feats[: len(texts)]], what


def test_bertpipe_predict_on_each_demo_task_model_gives_the_recorded_predictions(grids, tmp_path):
    import prefect.main  # noqa: F401  (its log handlers on the real stderr, not CliRunner's)
    from typer.testing import CliRunner

    from bert_core.finetune import get_task, task_dir
    from bert_core.finetune.glue import read_sentiment
    from bert_core.finetune.ner import _find, chunks, read_conll
    from bert_core.finetune.squad import _find_files
    from flows.cli.main import app

    for layout, grid in grids.items():
        for task in DEMO_TASKS:
            spec = get_task(task)
            split, folder = spec.splits[0], grid.output / task / "model"
            meta = json.loads((folder / "config.json").read_text())["bertpipe"]
            job_dir = chosen_job(grid, task, meta)
            expected = recorded(spec.kind, split, lambda name, d=job_dir: (d / name).read_text())
            data = task_dir(str(grid.data_dir), spec)
            if spec.kind == "classification":
                source = tmp_path / f"{layout}-{task}.jsonl"
                examples = read_sentiment(data, split)[0]
                source.write_text("".join(json.dumps({"id": e.guid, "text": e.text_a}) + "\n" for e in examples))
            elif spec.kind == "span":
                source = Path(_find_files(data)[1])  # the dev SQuAD JSON as it is
            else:
                source = tmp_path / f"{layout}-{task}.txt"
                sentences = [words for words, _ in read_conll(_find(data, split))[0]]
                source.write_text("".join(" ".join(words) + "\n" for words in sentences))
            out = tmp_path / f"{layout}-{task}.predictions.jsonl"
            r = CliRunner().invoke(app, ["predict", str(folder), str(source), "--output", str(out)])
            assert r.exit_code == 0, r.output
            rows = [json.loads(line) for line in out.read_text().splitlines()]
            what = f"{layout} {task}"
            if spec.kind == "classification":
                assert {row["id"]: row["label"] for row in rows} == expected, what
            elif spec.kind == "span":
                assert {row["id"]: row["answer"] for row in rows} == expected, what
            else:
                assert len(rows) == len(sentences) == len(expected), what
                for words, tags, row in zip(sentences, expected, rows, strict=True):
                    starts = np.cumsum([0] + [len(w) + 1 for w in words]).tolist()
                    want = [{"text": " ".join(words[a:b]), "label": kind, "start": starts[a],
                             "end": starts[b - 1] + len(words[b - 1])} for kind, a, b in chunks(tags)]
                    assert row["entities"] == want, what
