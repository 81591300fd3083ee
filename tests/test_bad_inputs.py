"""Every command that takes an input, met with the wrong input a user tries first: a missing file,
an empty one, a cut one, the wrong kind of folder, a field that is not there, an unknown scheme.
Each row ends with the documented exit code (2 config or option, 1 data, 3 machine or network),
one last line naming the file or field, no traceback, and no manifest written as done.

A new command adds its rows to ``ROWS``; ``test_every_command_that_takes_an_input_has_rows``
keeps the table complete."""

from __future__ import annotations

import gzip
import json
import socket
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner

from beam_jobs import build_vocab, clean_corpus, create_instances
from bert_core import storage
from bert_core.config import CorpusConfig, InstanceConfig, SequenceSpec, VocabConfig
from bert_core.finetune.report import failure_lines
from bert_core.preflight import TAKES
from flows.cli.inputs import COMMON, INPUTS, labels, takes
from flows.cli.main import COMMANDS, app

PROSE = ("The river runs through the old town. It was first mapped in 1820 by a surveyor, who "
         "walked its banks for three years. Today it feeds two lakes and a canal. ")


@dataclass(frozen=True)
class Made:
    """Real, finished stage outputs and a few bad files, made once for the table."""

    tmp: Path
    samples: Path
    silent_port: int  # a server on 127.0.0.1 that takes connections and never answers
    corpus: str
    vocab: str
    instances: str


@pytest.fixture(scope="module")
def made(samples_dir, tmp_path_factory) -> Iterator[Made]:
    tmp = tmp_path_factory.mktemp("bad-inputs")
    books = tmp / "books"
    books.mkdir()
    for n in range(4):
        (books / f"book{n}.txt").write_text(f"Book {n}\n\n" + "\n\n".join(
            f"Chapter {i}. {PROSE}" for i in range(12)), encoding="utf-8")
    corpus, vocab, instances = str(tmp / "corpus"), str(tmp / "vocab"), str(tmp / "instances")
    clean_corpus.run(CorpusConfig(books=[str(books / "*.txt")], dedup_near=False), corpus, workers=1)
    build_vocab.run(VocabConfig(vocab_size=200, num_unused=0), corpus, vocab, workers=1)
    create_instances.run(InstanceConfig(lengths=[SequenceSpec(max_seq_length=32, max_predictions_per_seq=4)],
                                        dupe_factor=1, num_shards=1, seed=1), corpus, vocab, instances, workers=1,
                         min_docs_per_bucket=2)
    # the bad files
    (tmp / "empty.txt").write_text("")
    (tmp / "empty.jsonl").write_text("")
    (tmp / "body.jsonl").write_text("".join(json.dumps({"id": i, "body": PROSE * 2}) + "\n" for i in range(3)))
    packed = gzip.compress(("".join(json.dumps({"text": PROSE * 3}) + "\n" for _ in range(200))).encode())
    (tmp / "cut.jsonl.gz").write_bytes(packed[: len(packed) // 2])
    (tmp / "no-manifest").mkdir()
    (tmp / "no-manifest" / "part-00000.parquet").write_bytes(b"PAR1")
    (tmp / "half-manifest").mkdir()
    text = Path(corpus, storage.MANIFEST).read_text()
    (tmp / "half-manifest" / storage.MANIFEST).write_text(text[: len(text) // 2])
    (tmp / "not-utf8.txt").write_bytes(b"\xff\xfe\x00bad\x00" * 10)
    # a finished corpus of no document, as a version that allowed it wrote one
    storage.write_manifest(str(tmp / "empty-corpus"), stage="corpus", config={}, counts={"documents": 0})
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)  # connections complete in the kernel's backlog; nothing ever reads them
    yield Made(tmp, samples_dir, silent.getsockname()[1], corpus, vocab, instances)
    silent.close()


def _dead_port() -> int:
    """A port on 127.0.0.1 that nobody listens on: connections are refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Row:
    command: str
    case: str
    args: Callable[[Made], list[str]]
    code: int
    needles: Callable[[Made], list[str]]
    output: str | None = "out"  # the folder under tmp that must hold no manifest afterwards


def out(m: Made, name: str = "out") -> str:
    return str(m.tmp / name)


def _without_vocab(m: Made) -> str:
    """The sample MiniLM's config.json alone: a model folder that names no vocab."""
    folder = m.tmp / "no-vocab"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text((m.samples / "models" / "minilm" / "config.json").read_text())
    return str(folder)


def _task_model(m: Made) -> str:
    """A task model (the sample MiniLM with a 2-label head, saved as fine-tuning saves one)."""
    folder = m.tmp / "task-model"
    if not (folder / "config.json").exists():
        from bert_core.finetune.heads import BertForTask
        from bert_core.finetune.task_model import save_task_model
        from bert_core.model.bert import BertModel

        minilm = str(m.samples / "models" / "minilm")
        save_task_model(BertForTask(BertModel.from_pretrained(minilm), "classification", 2), str(folder),
                        task="sst2", checkpoint=minilm, labels=["0", "1"], max_seq_length=64)
    return str(folder)


def _task_data(m: Made, name: str, text: str | None) -> str:
    """A task data folder whose sentiment/ holds no files (``text`` None) or the sample's files,
    each holding ``text``."""
    folder = m.tmp / name / "sentiment"
    folder.mkdir(parents=True, exist_ok=True)
    if text is not None:
        for real in (m.samples / "tasks" / "sentiment").glob("*.txt"):
            (folder / real.name).write_text(text)
    return str(m.tmp / name)


ROWS = [
    # corpus
    Row("corpus", "missing file", lambda m: ["--books", out(m, "nope.txt"), "--output", out(m)], 2,
        lambda m: ["nope.txt", "does not exist"]),
    Row("corpus", "glob that matches nothing", lambda m: ["--text", out(m, "nope/*.jsonl"), "--output", out(m)], 2,
        lambda m: ["nope/*.jsonl", "matched no files"]),
    Row("corpus", "empty records file", lambda m: ["--text", out(m, "empty.jsonl"), "--output", out(m),
                                                   "--workers", "1"], 1,
        lambda m: ["empty.jsonl", "0 documents kept"]),
    Row("corpus", "a text field the records lack", lambda m: ["--text", out(m, "body.jsonl"), "--output", out(m)], 2,
        lambda m: ["body.jsonl", "'text'", "they have: id, body", "--text-field"]),
    Row("corpus", "cut .jsonl.gz", lambda m: ["--text", out(m, "cut.jsonl.gz"), "--output", out(m),
                                              "--workers", "1"], 1,
        lambda m: ["cut.jsonl.gz", "allow_truncated"]),
    Row("corpus", "a scheme with no backend", lambda m: ["--text", "s3://bucket/x.jsonl", "--output", out(m)], 2,
        lambda m: ["s3://bucket/x.jsonl", "s3:// needs s3fs: pip install 'bertpipe[s3]'"]),
    Row("corpus", "an unknown scheme", lambda m: ["--text", "nosuch://a/b.jsonl", "--output", out(m)], 2,
        lambda m: ["nosuch://a/b.jsonl", "no storage backend"]),
    Row("corpus", "a store that never answers", lambda m: ["--text", f"http://127.0.0.1:{m.silent_port}/x.jsonl",
                                                           "--output", out(m)], 3,
        lambda m: [f"http://127.0.0.1:{m.silent_port}", "no answer within 3 s", "run again"]),
    Row("corpus", "a misspelt --set key", lambda m: ["--books", out(m, "*.txt"), "--output", out(m),
                                                     "--set", "corpus.min_char=3"], 2,
        lambda m: ["corpus.min_char", "did you mean"]),
    # vocab
    Row("vocab", "missing corpus", lambda m: ["--corpus", out(m, "nope"), "--output", out(m)], 1,
        lambda m: ["nope"]),
    Row("vocab", "a folder without a manifest", lambda m: ["--corpus", out(m, "no-manifest"), "--output", out(m)], 1,
        lambda m: ["no-manifest", storage.MANIFEST]),
    Row("vocab", "a manifest cut in half", lambda m: ["--corpus", out(m, "half-manifest"), "--output", out(m)], 1,
        lambda m: ["half-manifest"]),
    Row("vocab", "the wrong kind of folder", lambda m: ["--corpus", m.instances, "--output", out(m)], 2,
        lambda m: [m.instances, "instances"]),
    Row("vocab", "an empty vocab file", lambda m: ["--corpus", m.corpus, "--vocab-file", out(m, "empty.txt"),
                                                   "--output", out(m)], 1,
        lambda m: ["empty.txt"]),
    # instances
    Row("instances", "missing vocab", lambda m: ["--corpus", m.corpus, "--vocab", out(m, "nope"),
                                                 "--output", out(m)], 1,
        lambda m: ["nope"]),
    Row("instances", "the corpus given as the vocab", lambda m: ["--corpus", m.corpus, "--vocab", m.corpus,
                                                                 "--output", out(m)], 2,
        lambda m: [m.corpus, "vocab"]),
    Row("instances", "a corpus of no document", lambda m: ["--corpus", out(m, "empty-corpus"), "--vocab", m.vocab,
                                                           "--output", out(m)], 1,
        lambda m: ["empty-corpus", "0 documents"]),
    Row("instances", "a vocab that is not UTF-8", lambda m: ["--corpus", m.corpus, "--vocab",
                                                             out(m, "not-utf8.txt"), "--output", out(m)], 1,
        lambda m: ["not-utf8.txt"]),
    # pretrain
    Row("pretrain", "missing instances", lambda m: ["--instances", out(m, "nope"), "--output", out(m)], 2,
        lambda m: ["nope"]),
    Row("pretrain", "the corpus given as instances", lambda m: ["--instances", m.corpus, "--output", out(m)], 2,
        lambda m: [m.corpus]),
    Row("pretrain", "an init checkpoint of another vocab",
        lambda m: ["--instances", m.instances, "--output", out(m), "--init-checkpoint",
                   str(m.samples / "models" / "minilm"), "--set", "pretrain.phases=[{max_seq_length: 32, "
                   "max_steps: 2, global_batch_size: 4, micro_batch_size: 2, warmup_steps: 1}]",
                   "--set", "instances.lengths=[{max_seq_length: 32, max_predictions_per_seq: 4}]"], 2,
        lambda m: ["minilm/vocab.txt", "30522 tokens", "is not the vocab the instances were made with"]),
    Row("pretrain", "a missing init checkpoint", lambda m: ["--instances", m.instances, "--output", out(m),
                                                            "--init-checkpoint", out(m, "gone")], 2,
        lambda m: ["gone"]),
    Row("pretrain", "a checkpoint_uri whose backend is not installed",
        lambda m: ["--instances", m.instances, "--output", out(m), "--set", "pretrain.checkpoint_uri=s3://b/ckpt"], 2,
        lambda m: ["pretrain.checkpoint_uri=s3://b/ckpt", "s3:// needs s3fs: pip install 'bertpipe[s3]'"]),
    Row("pretrain", "--extend-to a missing run folder",
        lambda m: ["--instances", m.instances, "--output", out(m), "--extend-to", "10"], 2,
        lambda m: [out(m), "no such folder"]),
    Row("pretrain", "--extend-to the corpus folder", lambda m: ["--instances", m.instances, "--output", m.corpus,
                                                                "--extend-to", "10"], 2,
        lambda m: [m.corpus, "corpus stage, not a pre-training run"], output=None),
    # export
    Row("export", "missing source", lambda m: [out(m, "nope"), "--output", out(m)], 1, lambda m: ["nope"]),
    Row("export", "an empty folder", lambda m: [out(m, "no-manifest"), "--output", out(m)], 1,
        lambda m: ["no-manifest"]),
    # finetune
    Row("finetune", "missing task data", lambda m: ["--task", "sentiment", "--data", out(m, "nope"),
                                                    "--checkpoint", str(m.samples / "models" / "minilm"),
                                                    "--output", out(m)], 1,
        lambda m: ["nope"]),
    Row("finetune", "an unknown task", lambda m: ["--task", "nosuch", "--data", str(m.samples / "tasks"),
                                                  "--checkpoint", str(m.samples / "models" / "minilm"),
                                                  "--output", out(m)], 2,
        lambda m: ["nosuch"]),
    Row("finetune", "a missing checkpoint", lambda m: ["--task", "sentiment", "--data", str(m.samples / "tasks"),
                                                       "--checkpoint", out(m, "gone"), "--output", out(m)], 2,
        lambda m: ["gone", "does not exist"]),
    Row("finetune", "a task folder without the task's files",
        lambda m: ["--task", "sentiment", "--data", _task_data(m, "no-files", None),
                   "--checkpoint", str(m.samples / "models" / "minilm"), "--output", out(m)], 1,
        lambda m: [out(m, "no-files"), "sentiment"]),
    Row("finetune", "a task file that is empty",
        lambda m: ["--task", "sentiment", "--data", _task_data(m, "empty-files", ""),
                   "--checkpoint", str(m.samples / "models" / "minilm"), "--output", out(m)], 1,
        lambda m: [out(m, "empty-files"), "is empty", "sentiment"]),
    # features
    Row("features", "an empty input", lambda m: ["--checkpoint", str(m.samples / "models" / "minilm"),
                                                 "--input", out(m, "empty.txt"), "--output", out(m, "f.parquet")], 1,
        lambda m: ["empty.txt"], output=None),
    Row("features", "a missing input", lambda m: ["--checkpoint", str(m.samples / "models" / "minilm"),
                                                  "--input", out(m, "nope.txt"), "--output", out(m, "f.parquet")], 1,
        lambda m: ["nope.txt"], output=None),
    # predict
    Row("predict", "a missing input", lambda m: [_task_model(m), out(m, "nope.txt")], 1,
        lambda m: ["nope.txt", "does not exist"], output=None),
    Row("predict", "an empty input", lambda m: [_task_model(m), out(m, "empty.txt")], 1,
        lambda m: ["empty.txt", "empty"], output=None),
    Row("predict", "a cut input", lambda m: [_task_model(m), out(m, "cut.jsonl.gz")], 1,
        lambda m: ["cut.jsonl.gz", "cut short"], output=None),
    Row("predict", "records without the text field", lambda m: [_task_model(m), out(m, "body.jsonl")], 1,
        lambda m: ["body.jsonl", "line 1", "'text'"], output=None),
    Row("predict", "a missing model", lambda m: [out(m, "gone"), out(m, "body.jsonl")], 1,
        lambda m: ["gone", "does not exist"], output=None),
    Row("predict", "a pre-trained model, not a task model",
        lambda m: [str(m.samples / "models" / "minilm"), out(m, "body.jsonl")], 1,
        lambda m: ["minilm", "not a fine-tuned task model"], output=None),
    # verify, stats
    Row("verify", "a missing folder", lambda m: [out(m, "nope")], 1, lambda m: ["nope"], output=None),
    Row("verify", "a folder without a manifest", lambda m: [out(m, "no-manifest")], 1,
        lambda m: ["no-manifest"], output=None),
    Row("stats", "a manifest cut in half", lambda m: [out(m, "half-manifest")], 1,
        lambda m: ["half-manifest"], output=None),
    Row("stats", "a missing folder", lambda m: [out(m, "nope")], 1, lambda m: ["nope"], output=None),
    # download, models, refresh, run
    Row("download", "a date that is not a date", lambda m: ["wikipedia", "--date", "2026-13-01", "--to", out(m)], 2,
        lambda m: ["2026-13-01"]),
    Row("download", "an unreachable mirror", lambda m: ["wikipedia", "--date", "20261101", "--to", out(m),
                                                        "--base-url", f"http://127.0.0.1:{_dead_port()}",
                                                        "--retries", "0"], 3,
        lambda m: ["127.0.0.1"]),
    Row("tasks", "no task named", lambda m: ["fetch", "--to", out(m)], 2, lambda m: ["glue", "squad", "ner"]),
    Row("tasks", "an unknown task", lambda m: ["fetch", "glu", "--to", out(m)], 2,
        lambda m: ["'glu'", "glue, cola"]),
    Row("tasks", "--to a file", lambda m: ["fetch", "cola", "--to", out(m, "empty.txt")], 2,
        lambda m: ["empty.txt", "is a file"], output=None),
    Row("tasks", "an unreachable mirror", lambda m: ["fetch", "cola", "--to", out(m), "--retries", "0",
                                                     "--url", f"cola=http://127.0.0.1:{_dead_port()}/glue"], 3,
        lambda m: ["127.0.0.1", "CoLA.zip", "run the same command again"]),
    Row("tasks", "CoNLL-2003, which has no public copy", lambda m: ["fetch", "ner", "--to", out(m)], 1,
        lambda m: ["Reuters", f"{out(m)}/ner/{{train,valid,test}}.txt"]),
    Row("models", "a version that is not there", lambda m: ["show", "nosuch", "--set", f"storage_root={out(m)}"], 1,
        lambda m: ["nosuch"], output=None),
    Row("models", "import: a missing folder", lambda m: ["import", out(m, "nope"), "--set", f"storage_root={out(m)}"],
        1, lambda m: [out(m, "nope"), "does not exist"]),
    Row("models", "import: a folder with no config.json",
        lambda m: ["import", out(m, "no-manifest"), "--set", f"storage_root={out(m)}"], 1,
        lambda m: [out(m, "no-manifest"), "config.json"]),
    Row("models", "import: a model folder with no vocab.txt",
        lambda m: ["import", _without_vocab(m), "--set", f"storage_root={out(m)}"], 1,
        lambda m: [out(m, "no-vocab"), "vocab.txt"]),
    Row("refresh", "no current model to continue, task data missing",
        lambda m: ["--date", "20261101", "--set", f"storage_root={out(m)}", "--set",
                   f"finetune.data_dir={out(m, 'nope')}"], 1,
        lambda m: [out(m, "nope")]),
    Row("run", "a book glob that matches nothing",
        lambda m: ["--set", f"storage_root={out(m)}", "--set", f"corpus.books=[{out(m, 'nope')}/*.txt]",
                   "--set", "corpus.wikipedia=[]", "--set", "corpus.text=[]",
                   "--set", f"finetune.data_dir={m.samples}/tasks",
                   "--set", f"finetune.extra_checkpoints=[{m.samples}/models/minilm]"], 2,
        lambda m: [f"{out(m, 'nope')}/*.txt"]),
    # (`plan` on a glob that matches nothing prints the plan and names the input: tests/test_plan.py)
    Row("plan", "a size that is not a size",
        lambda m: ["--set", "corpus.wikipedia=[dumps/*.xml.bz2]", "--assume-size", "dumps/*.xml.bz2=lots"], 2,
        lambda m: ["--assume-size", "dumps/*.xml.bz2=lots"], output=None),
    Row("plan", "a size for a glob the config does not name",
        lambda m: ["--set", "corpus.wikipedia=[dumps/*.xml.bz2]", "--assume-size", "other/*.xml=2GB"], 2,
        lambda m: ["other/*.xml", "dumps/*.xml.bz2"], output=None),
    Row("config", "two errors at once", lambda m: ["show", "--set", "vocab.size=3", "--set",
                                                   "instances.masked_lm_prob=2"], 2,
        lambda m: ["vocab.size: unknown key; did you mean vocab.vocab_size?", "instances.masked_lm_prob"],
        output=None),
    Row("config", "a DeepSpeed key DeepSpeed does not read",
        lambda m: ["show", "--set", 'pretrain.deepspeed={"zero_optimisation": {}}'], 2,
        lambda m: ["pretrain.deepspeed.zero_optimisation", "did you mean pretrain.deepspeed.zero_optimization?"],
        output=None),
    Row("config", "a DeepSpeed key a typed setting sets",
        lambda m: ["show", "--set", "pretrain.deepspeed.zero_optimization.stage=2"], 2,
        lambda m: ["pretrain.deepspeed.zero_optimization.stage conflicts with pretrain.zero_stage"],
        output=None),
]


# ---------------------------------------------------------------- every input of every command, the wrong kind
# The values a command needs to parse, besides the one input a row makes wrong (checked first, so
# none of them is read).
NEEDS: dict[str, Callable[[Made], dict[str, str | list[str]]]] = {
    "corpus": lambda m: {"output": out(m)},
    "vocab": lambda m: {"output": out(m)},
    "instances": lambda m: {"corpus": m.corpus, "vocab": m.vocab, "output": out(m)},
    "pretrain": lambda m: {"instances": m.instances, "output": out(m)},
    "export": lambda m: {"source": out(m, "nope"), "output": out(m)},
    "finetune": lambda m: {"task": ["sentiment"], "data": str(m.samples / "tasks"),
                           "checkpoint": str(m.samples / "models" / "minilm"), "output": out(m)},
    "features": lambda m: {"checkpoint": str(m.samples / "models" / "minilm"), "input_": out(m, "nope.txt"),
                           "output": out(m, "f.parquet")},
    "predict": lambda m: {"model": str(m.samples / "models" / "minilm"), "input_": out(m, "nope.txt")},
    "stats": lambda m: {"uri": out(m, "nope")},
    "verify": lambda m: {"uri": out(m, "nope")},
    "download wikipedia": lambda m: {"date": "20261101"},
    "models show": lambda m: {"version": "nosuch"},
    "models promote": lambda m: {"version": "nosuch"},
    "models import": lambda m: {"path": out(m, "nope")},
}


def _functions() -> dict[str, Callable[..., None]]:
    """Command line (``tasks fetch``) -> the function it runs, for every command."""
    found = {}
    for name, entry in COMMANDS.items():
        if isinstance(entry, tuple):
            found |= {f"{name} {sub}": function for sub, function in entry[1].items()}
        else:
            found[name] = entry
    return found


def _text_params(function: Callable[..., None]) -> list[str]:
    """The parameters of a command whose values are text: each may be a path."""
    hints = typing.get_type_hints(function, include_extras=True)
    return [name for name in labels(function)
            if str in {typing.get_args(hints[name])[0], *typing.get_args(typing.get_args(hints[name])[0])}
            or "list[str]" in str(typing.get_args(hints[name])[0])]


def _argv(command: str, values: dict[str, str | list[str]]) -> tuple[str, list[str]]:
    """``bertpipe <command> ...`` for ``values``: arguments in their order, then the options."""
    function = _functions()[command]
    spelled = labels(function)
    head, *sub = command.split()
    argv = list(sub)
    for name in spelled:  # the signature's order
        if name in values and not spelled[name].startswith("-"):
            argv += values[name] if isinstance(values[name], list) else [values[name]]
    for name, value in values.items():
        if spelled[name].startswith("-"):
            for one in value if isinstance(value, list) else [value]:
                argv += [spelled[name], one]
    return head, argv


# (class, the wrong path, what the last line names) for what an input takes
_ANOTHER_STAGE = {"corpus": "vocab"}  # the folder given where this stage's belongs; others get the corpus


def _wrong(takes: str) -> list[tuple[str, Callable[[Made], str], Callable[[Made, str], list[str]]]]:
    want = TAKES[takes]
    cases = []
    if want.folder is not False and want.stages is not None:
        other = _ANOTHER_STAGE.get(takes, "corpus")
        cases.append((f"a {other} folder", lambda m, o=other: getattr(m, o),
                      lambda m, label, o=other: [getattr(m, o), f'says stage "{o}"', label, want.what]))
    if want.folder:
        cases.append(("a file", lambda m: out(m, "empty.txt"),
                      lambda m, label: [label, out(m, "empty.txt"), "is a file", "folder"]))
    if want.folder is False:
        cases.append(("a folder", lambda m: out(m, "no-manifest"),
                      lambda m, label: [label, out(m, "no-manifest"), "is a folder", want.what]))
    return cases


def _kind_rows() -> list[Row]:
    rows = []
    for command, function in _functions().items():
        spelled = labels(function)
        for name in _text_params(function):
            kind = takes(command, name)
            for case, bad, needles in ([] if kind is None else _wrong(kind)):
                label = spelled[name]

                def args(m: Made, command=command, name=name, bad=bad) -> list[str]:
                    return _argv(command, {**NEEDS.get(command, lambda m: {})(m), name: bad(m)})[1]

                rows.append(Row(command.split()[0], f"{' '.join(command.split()[1:])} {label} given {case}".strip(),
                                args, 2, lambda m, needles=needles, label=label: needles(m, label), output=None))
    return rows


KIND_ROWS = _kind_rows()


@pytest.mark.parametrize("row", ROWS + KIND_ROWS, ids=[f"{r.command}: {r.case}" for r in ROWS + KIND_ROWS])
def test_a_bad_input_is_one_last_line_with_its_exit_code_and_nothing_done(row: Row, made: Made, monkeypatch):
    monkeypatch.setenv("BERTPIPE_STORAGE_TIMEOUT", "3")
    target = made.tmp / row.output if row.output else None
    if target is not None and target.exists():
        import shutil

        shutil.rmtree(target)
    args = row.args(made)
    result = CliRunner().invoke(app, [row.command, *args])
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == row.code, result.output
    assert isinstance(result.exception, SystemExit), result.exception  # handled: no traceback
    assert "Traceback" not in result.output
    assert lines, "a failure says something"
    for needle in row.needles(made):
        assert needle in lines[-1], (needle, lines[-1])
    if target is not None:
        assert not list(target.rglob(storage.MANIFEST)), f"{target} holds a manifest after a failed run"


def test_every_text_option_of_every_command_says_what_it_takes():
    """A new command or option fails here until flows/cli/inputs.py says what it takes (a kind of
    path, or None for a value that is no path)."""
    missing = [f"{command} {labels(function)[name]}" for command, function in _functions().items()
               for name in _text_params(function) if name not in COMMON and name not in INPUTS.get(command, {})]
    assert not missing, f"add to flows/cli/inputs.py INPUTS: {missing}"
    kinds = {kind for command in INPUTS for kind in [*INPUTS[command].values(), *COMMON.values()]}
    assert kinds - {None} <= set(TAKES)
    assert set(INPUTS) == set(_functions())
    # every kind of path is given the wrong kind of thing by some row, every command with a path by its rows
    assert {row.command for row in KIND_ROWS} == {c.split()[0] for c, f in _functions().items()
                                                  if any(takes(c, n) for n in _text_params(f))}


def test_one_error_of_many_jobs_is_said_once_with_their_count():
    failures = [{"task": "sst2", "setting": f"lr{lr}", "seed": seed, "error": "TaskFileMissing: no train.tsv"}
                for lr in (1, 2, 3) for seed in (1, 2, 3, 4)] + [
        {"task": "cola", "setting": "lr1", "seed": 1, "error": "ValueError: bad label 'x' on line 3"}]
    lines = failure_lines(failures)
    assert lines == ["finetune: 12 jobs failed with the same error: TaskFileMissing: no train.tsv (sst2 lr1 seed=1, "
                     "sst2 lr1 seed=2, sst2 lr1 seed=3, and 9 more)",
                     "cola lr1 seed=1: ValueError: bad label 'x' on line 3"]
    pipeline = [{"task": "sst2", "checkpoint": c, "status": "failed", "error": "no weights"} for c in ("a", "b")]
    assert failure_lines(pipeline) == ["finetune: 2 jobs failed with the same error: no weights (sst2 a, sst2 b)"]


def test_every_command_that_takes_an_input_has_rows():
    takes_input = {"corpus", "vocab", "instances", "pretrain", "export", "finetune", "features", "predict", "refresh",
                   "models", "verify", "stats", "download", "run", "plan", "config", "tasks"}
    assert takes_input <= set(COMMANDS)
    assert {row.command for row in ROWS} == takes_input
