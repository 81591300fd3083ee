"""The real run's first steps as a new user takes them: `bertpipe download wikipedia` and
`bertpipe tasks fetch` from local copies of the official sites, then `bertpipe run --preset
bert-base-128 --dry-run` on what they wrote: every stage finds its input."""

from __future__ import annotations

from static_site import serving
from test_download import DATE, _site_tree
from test_tasks_fetch import _glue_zip, _mrpc_files, lay_out
from typer.testing import CliRunner

from bert_core.finetune import fetch
from bert_core.finetune.fetch import SOURCES
from flows.cli.main import app


def test_download_and_tasks_fetch_feed_the_bert_base_preset(site, dump, tmp_path, monkeypatch):
    _site_tree(site.root, dump)
    monkeypatch.setenv("BERTPIPE_DUMPS_URL", site.url)
    root = tmp_path / "data"
    at = ["--preset", "bert-base-128", "--set", f"storage_root={root}"]
    cli = CliRunner()

    before = cli.invoke(app, ["run", "--dry-run", *at])
    assert before.exit_code != 0 and "bertpipe download wikipedia" in before.output  # says what to run

    got = cli.invoke(app, ["download", "wikipedia", "--date", DATE, *at])
    assert got.exit_code == 0, got.output

    # the preset's tasks, as the official hosts serve them (their pinned sizes and sha256 those of
    # these tiny files)
    payloads = {"mrpc": _mrpc_files(), "sst2": {"SST-2.zip": _glue_zip("SST-2")},
                "cola": {"CoLA.zip": _glue_zip("CoLA")}, "stsb": {"STS-B.zip": _glue_zip("STS-B")},
                "rte": {"RTE.zip": _glue_zip("RTE")}}
    hosts = tmp_path / "hosts"
    table = lay_out(hosts, payloads)
    monkeypatch.setattr(fetch, "SOURCES", {**SOURCES, **table})
    with serving(hosts) as task_site:
        monkeypatch.setenv("BERTPIPE_TASKS_URL", task_site.url)
        fetched = cli.invoke(app, ["tasks", "fetch", *payloads, *at])
    assert fetched.exit_code == 0, fetched.output

    books = root / "books"
    books.mkdir()
    (books / "a-book.txt").write_text("It was a bright cold day in April.\n" * 50)
    dry = cli.invoke(app, ["run", "--dry-run", *at])
    assert dry.exit_code == 0, dry.output
    for stage in ("corpus", "vocab", "instances", "pretrain", "finetune"):
        assert stage in dry.output
