"""Extending a finished pre-training run to more steps, in its folder.

    bertpipe pretrain --preset demo --instances I --output RUN --extend-to 20000

``N`` (``--extend-to``) is the new ``max_steps`` of the run's last phase; the phases before it
stay as they are. The run goes on from a checkpoint of that phase with its optimizer state, LR
scheduler, loader position (epoch, position) and dropout seeds, under the config set to ``N``.
Pre-training's rate (:func:`~bert_core.model.schedule.warmup_decay_lr`) depends on ``max_steps``
once warm-up is over, so :func:`extension_plan` decides where the run re-enters:

- ``re-enter``: from the newest checkpoint at or before step ``max(2, warmup_steps) + 1``, the
  last step that a run set to the old length and one set to ``N`` take at the same rate
  (DeepSpeed warms up over at least 2 iterations). From it
  the run is, step for step, the run set to ``N`` from the start.
- ``re-stretch``: without such a checkpoint, from the finished step ``M``, on the schedule of a
  run set to ``N`` (step ``M + 1`` at the rate that run has there, then linearly to 0 at ``N``).
  Not the run set to ``N``: its steps between warm-up and ``M`` ran at lower rates.

:func:`extend_run` checks the folder, records the extension in ``RUN/extended.json`` (the
manifest copies it as ``extended``), points the phase's ``latest`` at the re-entry step, removes
the phase's later steps (here and under ``pretrain.checkpoint_uri``), writes the config set to
``N`` and removes the manifest, last; the launch then resumes the run as after any interruption.
A run's version counts the re-stretches since its last re-entry (:func:`version_extensions`).
"""

from __future__ import annotations

import datetime as _dt
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bert_core import storage
from bert_core.config import PipelineConfig, PretrainConfig, validate
from bert_core.model.schedule import warmup_decay_lr, warmup_iterations
from bert_core.pretrain.errors import PretrainConfigError
from bert_core.pretrain.run_folder import (
    CONFIG_FILE,
    check_run_config,
    checkpoint_dir,
    mirror_folder,
    saved_steps,
)

REENTER = "re-enter"
RESTRETCH = "re-stretch"
EXTENDED_FILE = "extended.json"
# The fields of an extension that say what was trained (not when).
_TRAINED = ("phase", "from", "to", "resume_step", "rule")


class ExtensionRefused(PretrainConfigError):
    """A run that cannot be extended as asked: the line says why and what to do."""


@dataclass(frozen=True)
class ExtendedSchedule:
    """The rates of the extended phase from its re-entry on: those of the phase set to
    ``total_steps`` (``rule`` says whether the steps before the re-entry ran on them too)."""

    rule: str
    peak: float
    warmup_steps: int
    total_steps: int

    def lr(self, step: int) -> float:
        """The rate of step ``step`` (1-based) of the phase."""
        return warmup_decay_lr(self.peak, self.warmup_steps, self.total_steps)(step)


def saved_by_rule(cfg: PretrainConfig, finished_step: int) -> list[int]:
    """The steps a finished last phase saved: each ``checkpoint_every``-th and its last."""
    return sorted({*range(cfg.checkpoint_every, finished_step + 1, cfg.checkpoint_every), finished_step})


def extension_plan(cfg: PretrainConfig, finished_step: int, to: int) -> tuple[int, ExtendedSchedule]:
    """(the step to re-enter at, the schedule from there) for the last phase of a run of ``cfg``
    that finished at ``finished_step``, extended to ``to`` steps (the module docstring's rule)."""
    phase = cfg.phases[-1]
    if to <= finished_step:
        raise ExtensionRefused(
            f"--extend-to {to}: the run's last phase has {finished_step} steps already; "
            f"give more than {finished_step}")
    same_rate_until = warmup_iterations(phase.warmup_steps) + 1
    early = [s for s in saved_by_rule(cfg, finished_step) if s <= same_rate_until]
    rule = REENTER if early else RESTRETCH
    resume_step = early[-1] if early else finished_step
    return resume_step, ExtendedSchedule(rule, phase.learning_rate, phase.warmup_steps, to)


def with_last_phase_steps(config: PipelineConfig, steps: int) -> PipelineConfig:
    """``config`` with its last phase set to ``steps`` steps."""
    pre = config.pretrain
    phases = [*pre.phases[:-1], pre.phases[-1].model_copy(update={"max_steps": steps})]
    return config.model_copy(update={"pretrain": pre.model_copy(update={"phases": phases})})


def read_extended(run: str) -> list[dict[str, Any]]:
    """The run's extensions, oldest first (``RUN/extended.json``; none when it is missing)."""
    path = storage.join(run, EXTENDED_FILE)
    return json.loads(storage.read_text(path)) if storage.exists(path) else []


def manifest_fields(run: str) -> dict[str, Any]:
    """What the run's manifest records of its extensions: ``extended``, where it has any."""
    extended = read_extended(run)
    return {"extended": extended} if extended else {}


def version_extensions(extended: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The extensions that make a run differ from one set to its length from the start: the
    re-stretches since its last re-entry (a re-entry replays the run set to ``N`` exactly)."""
    last_reentry = max((i for i, e in enumerate(extended) if e.get("rule") == REENTER), default=-1)
    return [{k: e.get(k) for k in _TRAINED} for e in extended[last_reentry + 1:]]


def describe(entry: dict[str, Any]) -> str:
    """One line saying where an extension re-enters and what it gives."""
    head = f"extending phase {entry['phase']} from {entry['from']} to {entry['to']} steps"
    if entry["rule"] == REENTER:
        return (f"{head}: re-entering at step {entry['resume_step']}, where the rates still agree, "
                f"so the run is the run set to {entry['to']} from the start")
    return (f"{head}: re-stretched from step {entry['resume_step']} at the rates of a run set to "
            f"{entry['to']} (no checkpoint where the rates still agree; not the run set to {entry['to']})")


def extend_run(config: PipelineConfig, run: str, to: int, prepare: bool = True,
               check: Callable[[PipelineConfig], Any] | None = None) -> PipelineConfig:
    """The config that extends ``run`` to ``to`` steps (its last phase), after making the folder
    ready for the launch (``prepare``: the launcher of node 0; the others take the config only).
    ``check`` (what the launch will read, e.g. ``loop.check_instances``) is called with that
    config before the folder is touched.

    ``config`` is the run's own (its last phase at the old length or at ``to``). An extension
    that stopped before its manifest goes on when given the same ``to``. Refused in one line
    (:class:`ExtensionRefused`): a missing folder, one that is not a pre-training run or has not
    finished, ``to`` not above the finished steps, a missing checkpoint the rule re-enters at.
    """
    where = storage.to_uri(run)
    target = with_last_phase_steps(config, to)
    if not storage.exists(run):
        raise ExtensionRefused(f"--output {where}: no such folder; --extend-to continues a finished "
                               "pre-training run in its folder")
    if not prepare:
        return target
    if not storage.has_manifest(run):
        started = storage.exists(storage.join(run, EXTENDED_FILE))
        pending = read_extended(run)[-1:] if started else []
        if pending and pending[0].get("to") == to and storage.exists(storage.join(run, CONFIG_FILE)):
            return target  # an extension that stopped: the launch resumes it from its checkpoint
        if pending:
            raise ExtensionRefused(
                f"{where}: its extension to {pending[0].get('to')} steps has not finished; run "
                f"--extend-to {pending[0].get('to')} to finish it, then extend again")
        if storage.exists(storage.join(run, CONFIG_FILE)):
            raise ExtensionRefused(
                f"{where}: the run has not finished (no {storage.MANIFEST}); run the same command "
                "without --extend-to to resume it, then extend it")
        raise ExtensionRefused(f"{where} is not a pre-training run (no {storage.MANIFEST} or "
                               f"{CONFIG_FILE}); give the --output folder of `bertpipe pretrain`")
    manifest = storage.read_manifest(run)
    if manifest.get("stage") != "pretrain":
        raise ExtensionRefused(f"{where} holds the output of the {manifest.get('stage')} stage, not "
                               "a pre-training run; give the --output folder of `bertpipe pretrain`")
    old = validate(manifest.get("config") or {}, source=storage.join(where, storage.MANIFEST))
    finished = old.pretrain.phases[-1].max_steps
    config = with_last_phase_steps(config, finished)
    check_run_config(config, run)  # the run's own settings, or refused naming those that differ
    resume_step, schedule = extension_plan(config.pretrain, finished, to)
    last = len(config.pretrain.phases) - 1
    ckpt = checkpoint_dir(run, last)
    if resume_step not in saved_steps(run, last):
        why = (f"the newest step a run set to {to} steps shares" if schedule.rule == REENTER
               else "the run's last step")
        raise ExtensionRefused(
            f"{ckpt}/step{resume_step}: missing, and extending to {to} steps {schedule.rule}s there "
            f"({why}); restore it from a copy, or train a new run set to {to} steps")
    if check is not None:
        try:
            check(target)
        except (ValueError, FileNotFoundError) as err:
            raise ExtensionRefused(f"pre-training stopped: {' '.join(str(err).split())}") from None
    entry = {"phase": last + 1, "from": finished, "to": to, "resume_step": resume_step,
             "rule": schedule.rule, "at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
    storage.write_text(storage.join(run, EXTENDED_FILE),
                       json.dumps([*manifest.get("extended", []), entry], indent=2))
    _drop_steps_after(config, run, last, resume_step)
    storage.write_text(storage.join(run, CONFIG_FILE), json.dumps(target.model_dump(mode="json"), indent=2))
    storage.remove(storage.join(run, storage.MANIFEST), recursive=False)  # no longer finished
    return target


def _drop_steps_after(config: PipelineConfig, run: str, phase_index: int, step: int) -> None:
    """Remove the phase's checkpoints after ``step``, first under ``pretrain.checkpoint_uri``
    (which would hand them back on the next start), then here, and point ``latest`` at ``step``."""
    ckpt = checkpoint_dir(run, phase_index)
    folders = [ckpt]
    if config.pretrain.checkpoint_uri:
        folders.insert(0, storage.join(mirror_folder(config, run), "checkpoints", f"phase{phase_index + 1}"))
    for folder in folders:
        tags = {uri.rsplit("/", 2)[-2] for uri in storage.glob(storage.join(folder, "step*", "*"))}
        for tag in sorted(tags):
            if re.fullmatch(r"step\d+", tag) and int(tag[4:]) > step:
                storage.remove(storage.join(folder, tag))
    storage.write_text(storage.join(ckpt, "latest"), f"step{step}")
