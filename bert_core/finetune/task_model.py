"""A task model folder: a fine-tuned encoder with its task head, in transformers' layout.

    from bert_core.finetune.task_model import load_task_model
    model, meta = load_task_model("finetune/minilm/sentiment/model")   # (BertForTask, the bertpipe block)

The folder is what ``transformers`` opens with ``AutoModelForSequenceClassification`` (also
regression), ``AutoModelForQuestionAnswering`` (span), ``AutoModelForTokenClassification``
(token) or ``AutoModelForMultipleChoice``: ``config.json`` (the encoder's config, the head's
``architectures``, ``num_labels``, ``id2label``/``label2id``, ``problem_type``, and a
``"bertpipe"`` block: task, kind, pooling, max_seq_length, labels, lowercase, the SQuAD window
settings, the setting and seed, the pre-trained checkpoint), ``model.safetensors`` (transformers'
key names: ``bert.*``, and the head as ``classifier.*`` or ``qa_outputs.*``), the tokenizer files,
``README.md`` (the model card) and, for a pre-LN model, the modeling code transformers runs with
``trust_remote_code=True``. ``config.json`` is written last: a folder with it is finished.

A ``pooling: mean`` model reads the mean of the token states, which transformers' heads (the
pooler over ``[CLS]``) do not: transformers loads it, but only :func:`load_task_model`
reproduces its outputs. Every fine-tuning job writes its model to ``<job folder>/model``; per task,
``bert_core.finetune.report.publish_chosen`` copies the chosen setting's best seed to ``<task>/model``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from bert_core import storage
from bert_core.model.checkpoint import CheckpointError

MODEL_DIR = "model"  # a job's or a task's model folder, inside its own folder

HF_ARCHITECTURES = {
    "classification": "BertForSequenceClassification",
    "regression": "BertForSequenceClassification",
    "span": "BertForQuestionAnswering",
    "token": "BertForTokenClassification",
    "multiple_choice": "BertForMultipleChoice",
}
AUTO_CLASSES = {
    "BertForSequenceClassification": "AutoModelForSequenceClassification",
    "BertForQuestionAnswering": "AutoModelForQuestionAnswering",
    "BertForTokenClassification": "AutoModelForTokenClassification",
    "BertForMultipleChoice": "AutoModelForMultipleChoice",
}
_PIPELINE_TAGS = {"classification": "text-classification", "regression": "text-classification",
                  "span": "question-answering", "token": "token-classification",
                  "multiple_choice": "multiple-choice"}
# transformers' token and span heads have no pooler; these models never read it.
_NO_POOLER = ("span", "token")
SPAN_FIELDS = ("doc_stride", "max_query_length", "max_answer_length", "n_best_size")


class NotATaskModel(CheckpointError):
    """A folder that holds no fine-tuned task model (a pre-trained export, or no model at all)."""


def _head_name(kind: str) -> str:
    """transformers' name of the task layer: ``qa_outputs`` for span, ``classifier`` otherwise."""
    return "qa_outputs" if kind == "span" else "classifier"


# --------------------------------------------------------------------------- save


def job_meta(task: str, cfg: Any, seed: int | None = None) -> dict[str, Any]:
    """The ``bertpipe`` block's entries a job's config gives: the sequence length the task was
    trained with, the SQuAD window settings for span tasks, the setting and the seed."""
    from bert_core.finetune import get_task
    from bert_core.finetune.grid import Setting

    kind = get_task(task).kind
    meta: dict[str, Any] = {"max_seq_length": cfg.squad_max_seq_length if kind == "span" else cfg.max_seq_length,
                            "setting": Setting.of(cfg).as_dict(), "seed": seed}
    if kind == "span":
        meta.update({k: getattr(cfg, k) for k in SPAN_FIELDS})
    return meta


def hf_task_config(kind: str, labels: Sequence[str], meta: dict[str, Any]) -> dict[str, Any]:
    """The head's part of config.json: architecture, labels, problem type and the bertpipe block."""
    out: dict[str, Any] = {"architectures": [HF_ARCHITECTURES[kind]], "bertpipe": meta}
    if kind == "regression":
        out.update(num_labels=1, problem_type="regression", id2label={"0": "score"}, label2id={"score": 0})
    elif kind == "span":
        out.update(num_labels=2, id2label={"0": "start", "1": "end"}, label2id={"start": 0, "end": 1})
    elif kind in ("classification", "token"):
        out.update(num_labels=len(labels), id2label={str(i): name for i, name in enumerate(labels)},
                   label2id={name: i for i, name in enumerate(labels)})
        if kind == "classification":
            out["problem_type"] = "single_label_classification"
    return out


def save_task_model(
    model: Any, path: str, *, task: str, checkpoint: str, labels: Sequence[str] = (),
    max_seq_length: int, meta: dict[str, Any] | None = None, scores: Sequence[str] = (),
) -> str:
    """Write ``model`` (a :class:`~bert_core.finetune.heads.BertForTask` trained on ``task``) as a
    task model folder at ``path``; returns its URI.

    ``checkpoint`` is the pre-trained folder it started from: its ``vocab.txt`` (and
    ``tokenizer.json``) and casing are the model's. ``labels`` are the class or tag names by id
    (classification and token tasks); ``meta`` adds to the ``bertpipe`` block (:func:`job_meta`);
    ``scores`` are the card's lines on its scores (:func:`task_card`).
    """
    from bert_core.finetune import get_task
    from bert_core.model.checkpoint import hf_config_from_model, write_model_folder
    from bert_core.vocab.tokenization import load_tokenizer

    spec = get_task(task)
    if spec.kind not in HF_ARCHITECTURES:
        raise NotATaskModel(f"task {task}: a {spec.kind} task trains no model to save")
    if labels and model.head.out_features != len(labels):
        raise ValueError(f"{len(labels)} labels for a head of {model.head.out_features} outputs")
    lowercase = load_tokenizer(checkpoint).lowercase
    block = {"task": spec.name, "kind": spec.kind, "pooling": model.pooling, "max_seq_length": max_seq_length,
             "labels": list(labels), "lowercase": lowercase, "checkpoint": storage.to_uri(checkpoint),
             **(meta or {})}
    extra = hf_task_config(spec.kind, labels, block)
    cfg = model.bert.config
    head = _head_name(spec.kind)
    state = {(head + k[len("head"):] if k.startswith("head.") else k): v.detach().to("cpu").contiguous()
             for k, v in model.state_dict().items()
             if not (k.startswith("bert.pooler.") and spec.kind in _NO_POOLER)}
    hf = hf_config_from_model(cfg, extra["architectures"][0]) | extra
    card = task_card(hf, scores)
    return write_model_folder(path, cfg, state, extra["architectures"][0],
                              vocab_file=storage.join(checkpoint, "vocab.txt"), lowercase=lowercase,
                              extra_config={k: v for k, v in extra.items() if k != "architectures"},
                              files={"README.md": card})


# --------------------------------------------------------------------------- load


def read_meta(path: str) -> dict[str, Any]:
    """The ``bertpipe`` block of a task model folder's config.json, or :class:`NotATaskModel`
    naming the folder and what it is."""
    uri = storage.join(path, "config.json")
    if not storage.exists(uri):
        raise NotATaskModel(f"{storage.to_uri(path)} has no config.json: not a model folder; point at a "
                            f"fine-tuned task model (<finetune output>/<task>/{MODEL_DIR})")
    try:
        hf = json.loads(storage.read_text(uri))
    except json.JSONDecodeError as err:
        raise NotATaskModel(f"{uri}: not valid JSON ({err}); copy the task model again") from None
    meta = hf.get("bertpipe") if isinstance(hf, dict) else None
    if not isinstance(meta, dict) or meta.get("kind") not in HF_ARCHITECTURES:
        what = ", ".join((hf.get("architectures") or ["an unknown model"]) if isinstance(hf, dict) else [])
        raise NotATaskModel(
            f"{storage.to_uri(path)} is not a fine-tuned task model ({what or 'no architectures'}, no "
            "bertpipe task block in config.json: a pre-trained export?); point at a task model, "
            f"<finetune output>/<task>/{MODEL_DIR}, or fine-tune this checkpoint first")
    return meta


def load_task_model(path: str) -> tuple[Any, dict[str, Any]]:
    """``(BertForTask, meta)`` from a task model folder, in eval mode on the CPU; ``meta`` is the
    config's ``bertpipe`` block (task, kind, pooling, max_seq_length, labels, lowercase, and for
    span tasks doc_stride, max_query_length, max_answer_length, n_best_size). Its tokenizer is
    ``bert_core.vocab.tokenization.load_tokenizer(path)``."""
    from bert_core.finetune.heads import BertForTask
    from bert_core.model.bert import BertModel
    from bert_core.model.checkpoint import load_into, load_pretrained

    meta = read_meta(path)
    cfg, state = load_pretrained(path)
    kind, head = meta["kind"], _head_name(meta["kind"])
    state = {("head" + k[len(head):] if k.startswith(head + ".") else k): v for k, v in state.items()}
    if "head.weight" not in state:
        raise NotATaskModel(f"{storage.to_uri(path)}: model.safetensors has no {head}.weight (the task "
                            "head); copy the task model again")
    num_labels = len(meta.get("labels") or []) or int(state["head.weight"].shape[0])
    model = BertForTask(BertModel(cfg), kind, num_labels, meta.get("pooling", "cls"))
    if kind in _NO_POOLER:  # saved without it: its fresh init stands in, never read
        state = {k: v for k, v in model.state_dict().items() if k.startswith("bert.pooler.")} | state
    load_into(model, state, source=storage.to_uri(path))
    return model.eval(), meta


# --------------------------------------------------------------------------- the card


def _lineage_lines(checkpoint: str) -> list[str]:
    from bert_core.card import lineage, run_counts, run_of

    lines = [f"- pre-trained checkpoint `{checkpoint}`"]
    try:
        run = run_of(checkpoint) if checkpoint else None
    except (OSError, ValueError):
        run = None
    lin = lineage(run)
    if run:
        c = run_counts(run)
        lines.append(f"- its pre-training run `{run['uri']}`: {c['steps']:,} steps, {c['tokens']:,} token positions")
    for stage in ("corpus", "vocab", "instances"):
        if lin[stage]:
            lines.append(f"- {stage} `{lin[stage]['uri']}`")
    if not run:
        lines.append("- its pre-training is not recorded beside it (a model trained elsewhere)")
    return lines


def task_card(hf: dict[str, Any], scores: Sequence[str] = ()) -> str:
    """README.md of a task model with config ``hf``; ``scores``: the lines of its Scores section
    (a published model's: ``report.publish_chosen``), else it points at the job's metrics.json."""
    from bert_core.finetune import get_task

    meta = hf["bertpipe"]
    spec, kind = get_task(meta["task"]), meta["kind"]
    pre_ln = bool(hf.get("pre_layer_norm"))
    arch = HF_ARCHITECTURES[kind]
    auto = AUTO_CLASSES[arch]
    setting = meta.get("setting") or {}
    md = ["---", "license: other", "language:", "- en", "library_name: transformers",
          f"pipeline_tag: {_PIPELINE_TAGS[kind]}", "tags:", "- bert", "- bertpipe",
          f"- {'pre-ln' if pre_ln else 'post-ln'}", f"- {spec.base}", "---", "",
          f"# bertpipe BERT fine-tuned on {spec.name}", "", f"{spec.description}: a {kind} head "
          f"(`{arch}`) over a {'pre-LN' if pre_ln else 'post-LN'} BERT of {hf.get('num_hidden_layers')} "
          f"layers, hidden size {hf.get('hidden_size')}.", "", "## Task", ""]
    if meta.get("labels"):
        md.append(f"- labels: {', '.join(f'`{name}`' for name in meta['labels'])}")
    md += [f"- inputs up to {meta['max_seq_length']} word pieces, "
           f"{'uncased' if meta.get('lowercase') else 'cased'}",
           f"- the head reads {'the mean of the token states' if meta.get('pooling') == 'mean' else 'the pooler over [CLS]' if kind in ('classification', 'regression', 'multiple_choice') else 'every token state'}"]
    if kind == "span" and any(k in meta for k in SPAN_FIELDS):
        md.append("- windows: " + ", ".join(f"{k} {meta[k]}" for k in SPAN_FIELDS if k in meta))
    md += ["", "## Scores", "", *(scores or ["- this job's metrics.json, beside this folder; the task's "
                                             f"published model (<task>/{MODEL_DIR}) gives the chosen "
                                             "setting's scores over seeds"]), "", "## Fine-tuning", ""]
    if setting:
        md.append(f"- setting `{setting.get('name')}`: learning rate {setting.get('learning_rate')}, batch size "
                  f"{setting.get('batch_size')}, {setting.get('num_train_epochs')} epochs, pooling "
                  f"{setting.get('pooling')}, layer-wise decay {setting.get('layerwise_lr_decay')}")
    if meta.get("seed") is not None:
        md.append(f"- seed {meta['seed']}")
    md += [*_lineage_lines(meta.get("checkpoint") or ""), "", "## How to load", ""]
    if meta.get("pooling") == "mean":
        md += ["This model pools the mean of the token states; transformers' "
               f"`{arch}` reads the pooler over [CLS], so transformers loads the weights but does not "
               "reproduce this model's outputs. Load it with bertpipe:", ""]
    else:
        remote = ", trust_remote_code=True" if pre_ln else ""
        md += ["```python", f"from transformers import {auto}, AutoTokenizer", "", 'path = "."  # this folder',
               "tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)",
               f"model = {auto}.from_pretrained(path{remote}).eval()", "```", "", "or with bertpipe:", ""]
    md += ["```python", "from bert_core.finetune.task_model import load_task_model",
           "from bert_core.vocab.tokenization import load_tokenizer", "",
           'model, meta = load_task_model(".")', 'tokenizer = load_tokenizer(".")', "```", ""]
    return "\n".join(md)


def job_model_dir(job_dir: str) -> str:
    """A job's model folder, inside the job's folder (``grid.job_dir``)."""
    return storage.join(job_dir, MODEL_DIR)
