"""A pre-training run folder: its config, its checkpoint steps and what may resume in it.

``RUN/pretrain_config.json`` is the config the ranks read; ``RUN/checkpoints/phase{i}/step{N}``
hold DeepSpeed checkpoints and ``latest`` names the newest complete one; with
``pretrain.checkpoint_uri`` the same layout is copied to ``<checkpoint_uri>/<run folder's name>/``
(``checkpoint_mirror.py``). A folder that holds a run of another config is refused, naming the
settings that differ.
"""

from __future__ import annotations

import json
import re
from typing import Any

from bert_core import storage
from bert_core.config import ConfigError, PipelineConfig, validate
from bert_core.pretrain.errors import PretrainConfigError

CONFIG_FILE = "pretrain_config.json"


_OPERATIONAL = {"launcher", "hostfile", "master_addr", "master_port", "monitor", "threads_per_rank",
                "log_every", "checkpoint_every", "peak_flops_per_rank", "launch_retries", "compile",
                "mlm_loss_chunk", "checkpoint_uri"}


def checkpoint_dir(run: str, phase_index: int) -> str:
    return storage.join(run, "checkpoints", f"phase{phase_index + 1}")


def mirror_folder(config: PipelineConfig, run: str) -> str:
    """``<pretrain.checkpoint_uri>/<run folder's name>``: the run folder's copy of its checkpoints
    (a pipeline run's folder is named by its version, so the copy is too)."""
    return storage.join(str(config.pretrain.checkpoint_uri), storage.to_uri(run).rstrip("/").rsplit("/", 1)[-1])


def check_checkpoint_uri(config: PipelineConfig) -> None:
    """Refuse a ``pretrain.checkpoint_uri`` whose scheme no installed backend serves, in one line
    saying what to install (:class:`~bert_core.storage.SchemeError`)."""
    if config.pretrain.checkpoint_uri:
        try:
            storage.backend(config.pretrain.checkpoint_uri)
        except storage.SchemeError as err:
            raise storage.SchemeError(f"pretrain.checkpoint_uri={err}") from None


def latest_step(run: str, phase_index: int) -> int | None:
    """The step ``latest`` names, if it names a saved step of the phase (None when ``latest`` is
    missing, garbage or dangling)."""
    ckpt = checkpoint_dir(run, phase_index)
    latest = storage.join(ckpt, "latest")
    if not storage.exists(latest):
        return None
    tag = storage.read_text(latest).strip()
    if not re.fullmatch(r"step\d+", tag) or int(tag[4:]) not in saved_steps(run, phase_index):
        return None
    return int(tag[4:])


def saved_steps(run: str, phase_index: int) -> list[int]:
    """Steps of the phase's ``step{N}/`` folders that hold a model file, newest first."""
    files = storage.glob(storage.join(checkpoint_dir(run, phase_index), "step*", "*model_states.pt"))
    tags = {uri.rsplit("/", 2)[-2] for uri in files}
    return sorted((int(t[4:]) for t in tags if re.fullmatch(r"step\d+", t)), reverse=True)


def resume_candidates(run: str, phase_index: int) -> tuple[list[int], list[str]]:
    """The steps to try resuming from, newest first, and a note for each thing passed over.

    With a valid ``latest`` these are its step and the older ones (a newer folder is a save that
    never finished); without one, every saved step.
    """
    ckpt = checkpoint_dir(run, phase_index)
    latest = storage.join(ckpt, "latest")
    steps, notes = saved_steps(run, phase_index), []
    named = latest_step(run, phase_index)
    if named is not None:
        notes += [f"skipped {ckpt}/step{s}: newer than latest, a save that did not finish"
                  for s in steps if s > named]
        steps = [s for s in steps if s <= named]
    elif storage.exists(latest):
        text = storage.read_text(latest).strip()
        notes.append(f"{latest} names {text[:40]!r}, not a saved step of this phase; "
                     "trying the saved steps, newest first")
    return steps, notes


def config_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """``section.field: old -> new`` for each training setting of ``model`` and ``pretrain`` that
    differs (operational ones such as ports and log intervals do not count). A setting that
    ``old`` lacks (it was written by a version without it) counts as its default."""
    try:
        old = validate(old, source="the run's config").model_dump(mode="json")
    except ConfigError:  # a config of another shape: compare what it holds
        pass
    changes: list[str] = []
    for section in ("model", "pretrain"):
        a, b = old.get(section) or {}, new.get(section) or {}
        for key in sorted(set(a) | set(b)):
            if key not in _OPERATIONAL:
                _diff(f"{section}.{key}", a.get(key), b.get(key), changes)
    return changes


def _diff(path: str, a: Any, b: Any, out: list[str]) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            _diff(f"{path}.{key}", a.get(key), b.get(key), out)
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _diff(f"{path}.{i}", x, y, out)
    elif a != b:
        out.append(f"{path}: {_short(a)} -> {_short(b)}")


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_run_config(config: PipelineConfig, run: str) -> None:
    """Refuse a run folder that holds (or is half-way through) a run of another config, and a
    ``pretrain.checkpoint_uri`` that no installed backend serves."""
    check_checkpoint_uri(config)
    if storage.has_manifest(run):
        old, what = storage.read_manifest(run).get("config") or {}, "was pre-trained"
    elif storage.exists(storage.join(run, CONFIG_FILE)) and any(
            saved_steps(run, i) for i in range(len(config.pretrain.phases))):
        old, what = json.loads(storage.read_text(storage.join(run, CONFIG_FILE))), "is being pre-trained"
    else:
        return
    changes = config_changes(old, config.model_dump(mode="json"))
    if changes:
        raise PretrainConfigError(
            f"{storage.to_uri(run)} {what} with another config ({'; '.join(changes[:4])}"
            f"{f'; and {len(changes) - 4} more' if len(changes) > 4 else ''}); "
            "pass a new --output for this config, or the run's own settings to reuse it"
        )


def check_splits(instances: str, lengths: list[int]) -> None:
    """Refuse, naming the file, instances whose splits pre-training reads do not match their
    manifests: for each sequence length the training shards (sizes) and the eval split
    (``seq{L}/eval/``: sizes, and sha256 when small), which must be there whenever the training
    manifest counts eval instances. A reader trusts only the shards a manifest names."""
    for length in sorted(set(lengths)):
        train = storage.join(instances, f"seq{length}")
        manifest = storage.read_manifest(train)
        storage.check_shards(train, manifest, checksums=False)
        eval_split = storage.join(train, "eval")
        if storage.has_manifest(eval_split) or (manifest.get("counts") or {}).get("eval_instances"):
            storage.check_shards(eval_split, storage.read_manifest(eval_split))


def total_steps(config: PipelineConfig) -> int:
    return sum(p.max_steps for p in config.pretrain.phases)


def steps_done(config: PipelineConfig, rows: list[dict[str, Any]]) -> int:
    """Optimizer steps finished over all phases, from the last metrics row."""
    if not rows:
        return 0
    last = rows[-1]
    return sum(p.max_steps for p in config.pretrain.phases[: last["phase"] - 1]) + last["step"]


def load_run_config(uri: str) -> PipelineConfig:
    return validate(json.loads(storage.read_text(uri)), source=uri)


def check_init_vocab(init_checkpoint: str, vocab_file: str) -> None:
    """Refuse an init checkpoint whose ``vocab.txt`` is not, token for token, the vocab the
    instances were made with: its embedding rows mean those tokens and no others."""
    source = storage.join(init_checkpoint, "vocab.txt")
    fix = (f"make the instances with the checkpoint's vocab (--set vocab.vocab_file={storage.to_uri(source)}), "
           "or start from a checkpoint trained with this vocab")
    if not storage.exists(source):
        raise PretrainConfigError(f"{storage.to_uri(init_checkpoint)} has no vocab.txt, so its rows cannot be "
                                  f"matched to the instances' vocab {storage.to_uri(vocab_file)}; {fix}")
    theirs, ours = storage.read_text(source).splitlines(), storage.read_text(vocab_file).splitlines()
    if theirs == ours:
        return
    first = next((i for i, (a, b) in enumerate(zip(theirs, ours, strict=False)) if a != b), min(len(theirs), len(ours)))
    at = (f"id {first} is {theirs[first]!r} there and {ours[first]!r} here" if first < min(len(theirs), len(ours))
          else f"the first {first} tokens agree")
    raise PretrainConfigError(
        f"{storage.to_uri(source)} ({len(theirs)} tokens) is not the vocab the instances were made with "
        f"({storage.to_uri(vocab_file)}, {len(ours)} tokens; {at}); {fix}")


def model_config(config: PipelineConfig, vocab_size: int, init_checkpoint: str | None = None):  # -> ModelConfig
    """The encoder's shape: the init checkpoint's own config.json if given, else ``config.model``
    with the instances' vocab size (rounded up to ``pad_vocab_to_multiple`` rows)."""
    if init_checkpoint:
        from bert_core.model.checkpoint import model_config_from_hf

        source = storage.join(init_checkpoint, "config.json")
        cfg = model_config_from_hf(json.loads(storage.read_text(source)), source=source)
        if (cfg.vocab_size or 0) < vocab_size:
            raise PretrainConfigError(
                f"{source}: vocab_size={cfg.vocab_size} but the instances' vocab has {vocab_size} "
                "tokens; start from a checkpoint trained with this vocab"
            )
        return cfg
    if config.model.vocab_size is not None and config.model.vocab_size < vocab_size:
        raise PretrainConfigError(
            f"model.vocab_size={config.model.vocab_size} is smaller than the instances' vocab "
            f"({vocab_size} tokens); leave model.vocab_size unset"
        )
    return config.model.for_vocab(vocab_size)
