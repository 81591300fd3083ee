"""What a whole run reads, checked before any of it starts: every problem at once, in one line.

    bertpipe run --preset demo          (flows/cli/run.py and flows/pipeline.py call check_run)
    bertpipe refresh --date 20261201    (flows/cli/refresh.py and flows/refresh.py call check_refresh)

Each check is cheap: paths, globs, registry records, a vocab file, a checkpoint's config.json;
no stage's work and no full read of a large input. The messages are the stages' own refusals, so
a problem reads the same here as where the stage would have met it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bert_core import storage
from bert_core.config import ConfigError, PipelineConfig
from bert_core.failures import Refusal, refusal
from bert_core.refresh.registry import Registry, registry_root, resolve_checkpoint


class PreflightError(Refusal):
    """The inputs of a run that cannot finish: every problem found, each naming its file or field."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        listed = "; ".join(f"({i}) {p}" for i, p in enumerate(problems, 1)) if len(problems) > 1 else problems[0]
        super().__init__(f"nothing was run, {len(problems)} input problem{'s' * (len(problems) > 1)}: {listed}")


class PreflightConfigError(PreflightError, ConfigError):
    """A :class:`PreflightError` whose every problem is the config's or the command's options'."""


class _Problems:
    """Refusals gathered from checks that each would stop the run on its own."""

    def __init__(self) -> None:
        self.errors: list[BaseException] = []

    def check(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, or None with its refusal kept; any other error is a bug and raised."""
        try:
            return fn(*args)
        except Exception as err:
            if refusal(err) is None:
                raise
            self.errors.append(err)
            return None

    def add(self, message: str) -> None:
        self.errors.append(ConfigError(message))

    def raise_any(self) -> None:
        if not self.errors:
            return
        messages = list(dict.fromkeys(refusal(e) or str(e) for e in self.errors))
        if all(isinstance(e, ConfigError) for e in self.errors):
            raise PreflightConfigError(messages)
        raise PreflightError(messages)


# --------------------------------------------------------------------------- the checks


def runs_base(config: PipelineConfig) -> str:
    """Where pre-training run folders go; refused when DeepSpeed could not save there."""
    base = config.runs_root or config.storage_root
    if not storage.is_local(base):
        raise ConfigError(
            f"storage_root={config.storage_root} is not a local folder and runs_root is unset: "
            "DeepSpeed saves pre-training checkpoints to a path; set runs_root to a local folder or "
            "a mount of the bucket (e.g. --set runs_root=/mnt/gcs/PREFIX/runs)"
        )
    return base


def _corpus(config: PipelineConfig, p: _Problems, dump_downloaded: bool = False) -> None:
    """The corpus globs, and the text field in the head of the text files; ``dump_downloaded``: the
    refresh's own dump replaces ``corpus.wikipedia``."""
    from bert_core.corpus.inputs import InputError, expand_inputs
    from bert_core.corpus.records import check_text_field

    kinds = ("books", "text") if dump_downloaded else ("wikipedia", "books", "text")
    files: dict[str, list[str]] = {kind: [] for kind in kinds}
    downloads = storage.join(config.storage_root, "downloads", "wikipedia")
    for kind in kinds:
        for pattern in getattr(config.corpus, kind):
            found = p.check(expand_inputs, [pattern], kind)
            if found is None and kind == "wikipedia" and storage.to_uri(pattern).startswith(downloads + "/"):
                p.errors[-1] = InputError(f"{refusal(p.errors[-1])}; `bertpipe download wikipedia "
                                          "--date YYYYMMDD` puts a dump there")
            files[kind] += found or []
    if files["text"]:
        p.check(check_text_field, files["text"], config.corpus)
    if not dump_downloaded and not any(getattr(config.corpus, k) for k in kinds):
        p.errors.append(InputError("no corpus inputs: set corpus.wikipedia, corpus.books and/or corpus.text"))


def _pretrain(config: PipelineConfig, p: _Problems) -> None:
    from bert_core.pretrain.run_folder import check_checkpoint_uri

    p.check(runs_base, config)
    p.check(check_checkpoint_uri, config)
    hostfile = config.pretrain.hostfile
    if config.pretrain.launcher == "hostfile" and hostfile and not storage.exists(hostfile):
        p.add(f"pretrain.hostfile {hostfile} does not exist; give a DeepSpeed hostfile "
              "(one 'host slots=N' line per node)")


def _tasks(config: PipelineConfig, p: _Problems) -> None:
    from bert_core.finetune import get_task

    tasks = config.finetune.tasks
    if not tasks:
        return
    known = [t for t in tasks if p.check(get_task, t) is not None]
    if not config.finetune.data_dir:
        p.add(f"finetune.data_dir is not set but finetune.tasks={tasks}; point it at a folder with "
              "one sub-folder per task (`bertpipe tasks fetch TASK` fills <storage_root>/tasks, "
              "`bertpipe samples fetch samples` gives samples/tasks)")
        return
    if storage.is_local(config.finetune.data_dir) and Path(storage.to_uri(config.finetune.data_dir)).is_file():
        return  # said by _config_paths
    for name in known:
        p.check(task_data, config, name)


def task_data(config: PipelineConfig, name: str) -> list[str]:
    """The files task ``name`` reads under ``finetune.data_dir``; when they are not there, the
    refusal names the command that fetches them (``bertpipe tasks fetch``) or where to put them."""
    from bert_core.finetune import get_task, task_files
    from bert_core.finetune.errors import TaskFileMissing
    from bert_core.finetune.fetch import missing_hint

    data_dir = config.finetune.data_dir or ""
    try:
        return task_files(data_dir, name)
    except TaskFileMissing as err:
        hint = missing_hint(name, data_dir, storage.join(config.storage_root, "tasks"))
        if hint is None:
            raise
        folder = storage.join(data_dir, get_task(name).folder)
        detail = err if storage.exists(folder) else f"{folder} does not exist"  # else a file is missing
        raise TaskFileMissing(f"no data for task {name!r} under {data_dir}: {hint} ({detail})") from None


def checkpoint_files(checkpoint: str, what: str) -> str:
    """A transformers-layout checkpoint folder that has its config and weights; refused otherwise."""
    from bert_core.model.checkpoint import WEIGHTS_BIN, WEIGHTS_INDEX, WEIGHTS_SAFETENSORS

    if not storage.exists(checkpoint):
        raise ConfigError(f"{what}: {checkpoint} does not exist; give a transformers-layout model folder "
                          "(config.json, model.safetensors, vocab.txt), e.g. samples/models/minilm")
    if not storage.exists(storage.join(checkpoint, "config.json")):
        raise ConfigError(f"{what}: {checkpoint} has no config.json; point at a transformers-layout "
                          "folder (or `bertpipe export` a DeepSpeed checkpoint first)")
    weights = (WEIGHTS_SAFETENSORS, WEIGHTS_INDEX, WEIGHTS_BIN)
    if not any(storage.exists(storage.join(checkpoint, w)) for w in weights):
        raise ConfigError(f"{what}: {checkpoint} has no {', '.join(weights)}; point at a folder with "
                          "the model's weights")
    return checkpoint


def extra_checkpoints(config: PipelineConfig) -> dict[str, str]:
    """Folder name under ``finetune/`` -> folder of each of ``finetune.extra_checkpoints``
    (``models:...`` resolved); refused when two would share a folder name with each other or
    with the pipeline's own (``pretrained``, and ``random-init`` with its baseline)."""
    from bert_core.finetune.grid import checkpoint_name

    taken = {"pretrained": "the pre-trained model"}
    if config.finetune.random_init_baseline:
        taken["random-init"] = "the random-init baseline"
    out: dict[str, str] = {}
    for extra in config.finetune.extra_checkpoints:
        folder = resolve_checkpoint(extra, config.storage_root)
        name = checkpoint_name(folder)
        if name in out or name in taken:
            raise ConfigError(f"finetune.extra_checkpoints: {folder} would share the folder finetune/{name} "
                              f"with {out.get(name) or taken[name]}; fine-tuning folders are named by the "
                              "checkpoint's folder name, so give it a folder of another name")
        out[name] = folder
    return out


def _extras(config: PipelineConfig, p: _Problems) -> None:
    for extra in config.finetune.extra_checkpoints:
        folder = p.check(resolve_checkpoint, extra, config.storage_root)
        if folder is not None:
            named = "" if folder == extra else f" {extra}"
            p.check(checkpoint_files, folder, f"finetune.extra_checkpoints{named}")
    p.check(extra_checkpoints, config)


def _current_model(config: PipelineConfig, p: _Problems) -> None:
    """The refresh's parent: ``models:current`` whole, and for ``refresh.vocab: keep`` its vocab,
    which the model must have been trained with (the continued run reads it)."""
    registry = Registry(registry_root(config.storage_root))
    current = p.check(registry.current)
    if current is None:
        return  # no current model: the refresh trains the first version from scratch
    model = p.check(registry.model, "current")
    if model is None or config.refresh.vocab != "keep":
        return
    vocab = registry.get(current)["vocab"]
    if p.check(storage.read_manifest, vocab) is None:
        return
    vocab_file = storage.join(vocab, "vocab.txt")
    tokens = p.check(storage.read_text, vocab_file)
    if tokens is None or config.refresh.init != "continue":
        return
    from bert_core.pretrain.run_folder import check_init_vocab, model_config

    p.check(model_config, config, len(tokens.splitlines()), model)
    p.check(check_init_vocab, model, vocab_file)


def _config_paths(config: PipelineConfig, p: _Problems, dump_downloaded: bool = False) -> None:
    """The paths the config names, each the kind its field takes (:func:`check_input`)."""
    given = [("vocab.vocab_file", config.vocab.vocab_file, "file"), ("pretrain.hostfile", config.pretrain.hostfile, "file"),
             ("finetune.data_dir", config.finetune.data_dir, "tasks"),
             *((f"corpus.{kind}", pattern, "files") for kind in ("wikipedia", "books", "text")
               if not (dump_downloaded and kind == "wikipedia") for pattern in getattr(config.corpus, kind)),
             *(("finetune.extra_checkpoints", extra, "model") for extra in config.finetune.extra_checkpoints)]
    for field, value, takes in given:
        p.check(check_input, field, value, takes)


def _vocab_file(config: PipelineConfig, p: _Problems) -> None:
    if config.vocab.vocab_file:
        from bert_core.vocab.tokenization import check_vocab_file

        p.check(check_vocab_file, config.vocab.vocab_file, config.vocab)


# --------------------------------------------------------------------------- a path given to a command


class InputKindError(ConfigError):
    """A path given to an option that is not the kind of thing the option takes: a folder of
    another stage, a file where a folder belongs, a folder where a file belongs."""


# The command that makes each stage's folder, named when another kind of folder is given.
MADE_BY = {"corpus": "bertpipe corpus --output ...", "vocab": "bertpipe vocab --output ...",
           "instances": "bertpipe instances --output ...", "pretrain": "bertpipe pretrain --output ...",
           "finetune": "bertpipe finetune --output ...", "model": "bertpipe export ... --output ...",
           "download": "bertpipe download wikipedia --to ..."}
_MODEL_FILES = "config.json, model.safetensors, vocab.txt"


@dataclass(frozen=True)
class Takes:
    """What an option takes: ``folder`` True a folder, False a file, None either; ``stages`` the
    stages whose folders it accepts (None: any folder; a folder of another stage is refused);
    ``model`` also a transformers-layout folder (config.json)."""

    what: str
    folder: bool | None
    stages: tuple[str, ...] | None = None
    model: bool = False


TAKES = {
    "corpus": Takes(f"a corpus folder ({MADE_BY['corpus']})", True, ("corpus",)),
    "vocab": Takes(f"a vocab folder ({MADE_BY['vocab']}) or a vocab.txt", None, ("vocab",)),
    "instances": Takes(f"an instances folder ({MADE_BY['instances']})", True, ("instances",)),
    "model": Takes(f"a transformers-layout model folder ({_MODEL_FILES})", True, (), model=True),
    "checkpoint": Takes("a DeepSpeed checkpoint folder or a transformers-layout model folder", True,
                        ("pretrain",), model=True),
    "tasks": Takes("a folder with one sub-folder per task (bertpipe tasks fetch ...)", True, ()),
    "stage": Takes(f"a stage's output folder (with {storage.MANIFEST})", True),
    "files": Takes("files: a file, a glob of files (e.g. FOLDER/*.txt) or a folder of them", None, ()),
    "file": Takes("a file", False),
    "folder": Takes("a folder", True),
}


def _found(path: str) -> tuple[str, str] | None:
    """What the local ``path`` is, as (kind, how a message names it): ("file", ...), ("model", ...)
    for a folder with config.json, (its stage, ...) for a folder whose manifest names one,
    ("folder", ...) otherwise; None when nothing is there."""
    where = Path(storage.to_uri(path))
    if not where.exists():
        return None
    if not where.is_dir():
        return "file", "a file"
    if (where / "config.json").is_file():
        return "model", "a transformers model folder (it holds config.json)"
    try:
        stage = json.loads((where / storage.MANIFEST).read_text(encoding="utf-8")).get("stage")
    except (OSError, ValueError, AttributeError):
        stage = None  # no manifest, or a damaged one: the command that reads it says so
    if isinstance(stage, str) and stage:
        return stage, f'{"an" if stage[0] in "aeiou" else "a"} {stage} folder (its {storage.MANIFEST} says stage "{stage}")'
    return "folder", "a folder"


def check_input(option: str, value: str | None, takes: str) -> None:
    """Refuse ``value`` given to ``option`` when it is not what ``TAKES[takes]`` says: a folder of
    another stage names both stages, a file where a folder belongs and a folder where a file
    belongs say so. A path that is not there, a glob, a remote URI or a ``models:`` reference is
    left to the command, which says what it needed."""
    if not value or value.startswith("models:") or any(c in value for c in "*?["):
        return
    if not storage.is_local(value):
        return  # a bucket's listing can take seconds; the command reads it and says what it met
    want, found = TAKES[takes], _found(value)
    if found is None:
        return
    kind, named = found
    if kind == "file":
        if want.folder:
            raise InputKindError(f"{option} {value} is a file; give "
                                 f"{'the folder that holds config.json' if want.model else want.what}")
        return
    if want.folder is False:
        raise InputKindError(f"{option} {value} is a folder; {option} takes {want.what}")
    if want.stages is None or kind == "folder" or kind in want.stages or (kind == "model" and want.model):
        return
    hint = ""
    if want.model and (Path(storage.to_uri(value)) / "hf" / "config.json").is_file():
        hint = f", e.g. its export {storage.join(value, 'hf')}"
    raise InputKindError(f"{option} {value}: that folder is {named}; {option} takes {want.what}{hint}")


def check_inputs(given: list[tuple[str, str | list[str] | None, str]]) -> None:
    """:func:`check_input` of each (option, value or values, what it takes), every problem at once
    (:class:`PreflightConfigError`)."""
    p = _Problems()
    for option, value, takes in given:
        for one in value if isinstance(value, list | tuple) else [value]:
            p.check(check_input, option, one, takes)
    if len(p.errors) == 1:
        raise p.errors[0]  # one problem reads best alone
    p.raise_any()


def check_finetune(config: PipelineConfig, checkpoint: str, what: str = "--checkpoint") -> None:
    """What every fine-tuning job of ``config.finetune.tasks`` reads, checked once before the first
    starts (a problem here would fail each job alike): the checkpoint's config and weights, and each
    task's files under ``finetune.data_dir``, there and not empty."""
    from bert_core.finetune.errors import TaskDataError

    p = _Problems()
    if not checkpoint.startswith("models:"):
        p.check(checkpoint_files, checkpoint, what)
    for name in config.finetune.tasks:
        for file in p.check(task_data, config, name) or []:
            if p.check(storage.size, file) == 0:
                p.errors.append(TaskDataError(f"{file} is empty: task {name!r} reads its examples there; "
                                              "fetch it again or put the task's file there"))
    p.raise_any()


# --------------------------------------------------------------------------- the runs


def check_run(config: PipelineConfig) -> None:
    """Everything ``bertpipe run`` reads: the corpus inputs, a given vocab, where pre-training
    saves, the fine-tune tasks' files and the extra checkpoints. Raises :class:`PreflightError`
    listing every problem (:class:`PreflightConfigError` when all are the config's)."""
    p = _Problems()
    _config_paths(config, p)
    _corpus(config, p)
    _vocab_file(config, p)
    _pretrain(config, p)
    _tasks(config, p)
    _extras(config, p)
    p.raise_any()


def check_refresh(config: PipelineConfig, date: str | None = None) -> None:
    """Everything ``bertpipe refresh`` reads besides the dump it downloads: the dump date given,
    the configured books and text, where pre-training saves, the current model it continues and
    its vocab, and the suite's fine-tune tasks' files. Raises like :func:`check_run`."""
    p = _Problems()
    if date is not None and not re.fullmatch(r"\d{8}", date):
        p.add(f"--date {date!r}: give a dump date as YYYYMMDD, e.g. 20261201")
    _config_paths(config, p, dump_downloaded=True)
    _corpus(config, p, dump_downloaded=True)
    _pretrain(config, p)
    _current_model(config, p)
    _tasks(config, p)
    p.raise_any()
