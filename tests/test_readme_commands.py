"""Every ``bertpipe`` command in the code blocks of README.md and docs/*.md still parses: a known
command, with options it has; the ones a test can run in seconds run against an empty storage root
(with the samples laid out, as after ``make samples``) and succeed. The others are listed below
with the reason they are not run, so a command added to the docs is either run or named here."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from flows.cli.main import COMMANDS, app

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# Run as documented (``run`` only in its --dry-run form).
RUN = {"plan", "config show", "config presets", "models list", "infra render", "run --dry-run"}
SKIPPED = {
    "samples fetch": "downloads from the package registry (the samples fixture fetches the same)",
    "tasks fetch": "downloads task data from its official sites",
    "download wikipedia": "downloads a dump from dumps.wikimedia.org",
    "corpus": "reads the documented input folders and runs a Beam job",
    "vocab": "reads a corpus folder made by the command before it",
    "instances": "reads corpus and vocab folders made by the commands before it",
    "pretrain": "reads an instances folder and trains for minutes",
    "export": "reads a pre-training run's checkpoints",
    "finetune": "fine-tunes a model for minutes",
    "features": "runs a model over a task file (minutes on CPU)",
    "predict": "reads a fine-tuned task model",
    "stats": "reads a stage's finished folder",
    "verify": "reads a stage's finished folder",
    "run": "the whole pipeline: minutes (its --dry-run form is run)",
    "refresh": "downloads a dump and trains for minutes",
    "server": "a server that runs until stopped",
    "serve": "serves deployments until stopped",
    "models import": "copies a 90 MB model into the registry",
    "models show": "reads a registry with versions",
    "models promote": "changes a registry with versions",
    "models rollback": "changes a registry with versions",
}
# Placeholders the docs write for a value the reader picks, and the value a test gives.
PLACEHOLDERS = {"--workers W": "--workers 2"}


def documented() -> list[tuple[str, str]]:
    """(file, command after ``bertpipe``) of every ``bertpipe``, ``.venv/bin/bertpipe`` or ``$B``
    line of a code block, continuation lines joined, comments dropped."""
    found = []
    for path in DOCS:
        for block in re.findall(r"```[a-z]*\n(.*?)```", path.read_text(encoding="utf-8"), flags=re.S):
            for line in block.replace("\\\n", " ").splitlines():
                for part in re.split(r"\s*(?:;|&&)\s*", line):
                    m = re.match(r"^\s*(?:\$B|(?:\S*/)?bertpipe)\s+(.*)$", part)
                    if m and not part.lstrip().startswith("B="):
                        found.append((path.name, m.group(1)))
    return found


def _click_command(words: list[str]) -> tuple[str, Any]:
    name, command = words[0], typer.main.get_command(app).commands[words[0]]
    if hasattr(command, "commands"):  # a group: the subcommand
        name, command = f"{words[0]} {words[1]}", command.commands[words[1]]
    return name, command


def test_the_documented_commands_exist_and_the_quick_ones_run(samples_dir, tmp_path, monkeypatch):
    commands = documented()
    assert len(commands) > 30 and any(c.startswith("plan ") for _, c in commands)
    monkeypatch.chdir(tmp_path)  # an empty storage root (./bertpipe-data) beside the samples
    (tmp_path / "samples").symlink_to(samples_dir, target_is_directory=True)
    problems, ran = [], []
    for where, text in commands:
        filled = text
        for placeholder, value in PLACEHOLDERS.items():
            filled = filled.replace(placeholder, value)
        words = [w for w in shlex.split(filled, comments=True) if w != "..."]
        try:
            name, command = _click_command(words)
        except (KeyError, IndexError):
            problems.append(f"{where}: `bertpipe {text}`: no such command")
            continue
        options = {o for p in command.params for o in p.opts + p.secondary_opts if o.startswith("-")}
        args = words[len(name.split()):]
        own = args[:args.index("--")] if "--" in args else args
        unknown = [w.split("=")[0] for w in own if w.startswith("--") and w.split("=")[0] not in options]
        if unknown:
            problems.append(f"{where}: `bertpipe {text}`: {name} has no option {', '.join(unknown)}")
            continue
        kind = "run --dry-run" if name == "run" and "--dry-run" in args else name
        if kind in RUN:
            done = CliRunner().invoke(app, words)
            ran.append(kind)
            if done.exit_code != 0:
                problems.append(f"{where}: `bertpipe {text}` exited {done.exit_code}: {done.output[-300:]}")
        elif kind not in SKIPPED:
            problems.append(f"{where}: `bertpipe {text}`: add {kind!r} to RUN (a test runs it) or "
                            "SKIPPED (with the reason it cannot run here)")
    assert not problems, "\n".join(problems)
    assert {"plan", "config show", "run --dry-run"} <= set(ran)


def test_version_and_every_command_s_help_exit_0():
    runner = CliRunner()
    shown = runner.invoke(app, ["--version"])
    assert shown.exit_code == 0 and re.fullmatch(r"bertpipe \S+ \(code \S+\)\n", shown.output), shown.output
    for name, entry in COMMANDS.items():
        for sub in (entry[1] if isinstance(entry, tuple) else [None]):
            words = [name, sub] if sub else [name]
            done = runner.invoke(app, [*words, "--help"])
            assert done.exit_code == 0, (words, done.output)


def test_the_readme_names_the_commands_that_take_no_config():
    text = " ".join((REPO / "README.md").read_text(encoding="utf-8").split())
    said = re.search(r"All commands but (.*?) take `--preset NAME`", text)
    assert said, "README.md: the sentence naming the commands without --preset is gone"
    named = set(re.findall(r"`([a-z ]+)`", said.group(1)))
    without = set()
    for name, entry in COMMANDS.items():
        for sub in (entry[1] if isinstance(entry, tuple) else [None]):
            words = [name, sub] if sub else [name]
            _, command = _click_command(words)
            if not any("--preset" in p.opts for p in command.params):
                without.add(" ".join(words))
    assert named == without
    assert not any(name in SKIPPED and name not in COMMANDS for name in SKIPPED if " " not in name)


@pytest.mark.parametrize("stage", ["corpus", "vocab", "instances", "pretrain"])
def test_a_stage_s_help_says_what_its_preset_trains(stage):
    shown = CliRunner().invoke(app, [stage, "--help"], terminal_width=200)
    if stage in ("instances", "pretrain"):
        assert "next_sentence_prediction is on" in " ".join(shown.output.split())
    assert "(MLM + NSP)" not in shown.output
