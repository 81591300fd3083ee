"""flows/cli/main.py: the one command map and the one rule for what a failed command says."""

from __future__ import annotations

import errno

import typer
from typer.testing import CliRunner

from bert_core.config import ConfigError
from bert_core.corpus.download import TransferError
from bert_core.storage import ManifestError
from flows.cli.main import COMMANDS, build_app, failure


def test_every_command_of_the_map_is_on_the_command_line() -> None:
    shown = CliRunner().invoke(build_app(), ["--help"])
    listed = {line.strip("│ ").split(" ", 1)[0] for line in shown.output.splitlines()}
    assert set(COMMANDS) <= listed


def test_a_failure_says_one_line_with_the_exit_code_of_its_kind() -> None:
    full = RuntimeError("write failed")
    full.__cause__ = OSError(errno.ENOSPC, "No space left on device", "/data/out")
    assert failure(ConfigError("pretrain.nodes:\n  must be >= 1")) == ("pretrain.nodes: must be >= 1", "red", 2)
    assert failure(ManifestError("x/_MANIFEST.json is not valid JSON"))[1:] == ("red", 1)
    assert failure(FileNotFoundError("no such file: x"))[1:] == ("red", 1)
    assert failure(full)[0].startswith("/data/out: No space left on device") and failure(full)[2] == 1
    assert failure(TransferError("gave up; run the same command again"))[1:] == ("yellow", 3)
    assert failure(RuntimeError("a bug")) is None and failure(KeyError("k")) is None


def test_the_command_line_catches_at_one_site() -> None:
    def refused() -> None:
        raise ManifestError("x: damaged; re-run the stage")

    def bug() -> None:
        raise ZeroDivisionError("a bug")

    app = build_app({"refused": refused, "bug": bug, "group": ("A group.", {"refused": refused})})
    for args in (["refused"], ["group", "refused"]):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 1 and result.output.strip() == "x: damaged; re-run the stage"
    crashed = CliRunner().invoke(app, ["bug"])
    assert isinstance(crashed.exception, ZeroDivisionError)  # a bug keeps its traceback
    assert isinstance(typer.Exit(1), RuntimeError)  # typer's own exits pass through failure() untouched
    assert failure(typer.Exit(1)) is None
