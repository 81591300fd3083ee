"""``bertpipe tasks fetch`` (bert_core/finetune/fetch.py) against the official hosts' paths served
on 127.0.0.1 (tests/static_site.py): real-format GLUE zips, Microsoft's MRPC files, SQuAD JSON
and SWAG CSV built from tests/fixtures/tasks, read afterwards by the tasks' own readers."""

from __future__ import annotations

import hashlib
import io
import zipfile
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from static_site import serving
from typer.testing import CliRunner

from bert_core import storage
from bert_core.config import FinetuneConfig, load_config
from bert_core.corpus.download import TransferError
from bert_core.finetune import fetch, task_files
from bert_core.finetune.fetch import SOURCES, Source, TaskChecksumError, TaskData, fetch_task

FIXTURES = Path(__file__).parent / "fixtures" / "tasks"


def _on_site(site_root: Path, url: str, data: bytes) -> None:
    parts = urlsplit(url)
    path = site_root / parts.netloc / parts.path.lstrip("/")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def _glue_zip(folder: str, extra: dict[str, bytes] | None = None) -> bytes:
    """A zip shaped like GLUE's: ``<TASK>/<file>`` members (and a deeper ``original/`` folder)."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for f in sorted((FIXTURES / folder).iterdir()):
            z.writestr(f"{folder}/{f.name}", f.read_bytes())
        for name, data in (extra or {}).items():
            z.writestr(f"{folder}/{name}", data)
    return out.getvalue()


def _mrpc_files() -> dict[str, bytes]:
    """Microsoft's two files (BOM, CRLF-free header) and GLUE's dev ids, from the fixture split."""
    train = (FIXTURES / "MRPC" / "train.tsv").read_text().splitlines()
    dev = (FIXTURES / "MRPC" / "dev.tsv").read_text().splitlines()
    # the fixture's train and dev share ids: make them distinct, as Microsoft's are
    dev = [dev[0]] + [f"{r.split(chr(9))[0]}\t9{n}1\t9{n}2\t" + "\t".join(r.split("\t")[3:])
                      for n, r in enumerate(dev[1:])]
    header = "\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String"
    ids = "".join(f"{r.split(chr(9))[1]}\t{r.split(chr(9))[2]}\n" for r in dev[1:])
    return {"msr_paraphrase_train.txt": "\n".join([header, *train[1:], *dev[1:]]).encode() + b"\n",
            "msr_paraphrase_test.txt": "\n".join([header, *dev[1:3]]).encode() + b"\n",
            "mrpc_dev_ids.tsv": ids.encode()}


def _payloads() -> dict[str, dict[str, bytes]]:
    """Task -> {official file name: bytes} for the tasks the tests fetch."""
    return {
        "cola": {"CoLA.zip": _glue_zip("CoLA")},
        "mnli": {"MNLI.zip": _glue_zip("MNLI", {"original/multinli_1.0_train.txt": b"x" * 100})},
        "mrpc": _mrpc_files(),
        "squad": {f.name: f.read_bytes() for f in sorted((FIXTURES / "squad").iterdir())},
        "swag": {"train.csv": (FIXTURES / "swag" / "train.csv").read_bytes(),
                 "val.csv": (FIXTURES / "swag" / "val.csv").read_bytes(),
                 "test.csv": (FIXTURES / "swag" / "val.csv").read_bytes()},
    }


def lay_out(root: Path, payloads: dict[str, dict[str, bytes]]) -> dict[str, TaskData]:
    """Each task's files at their official URLs' paths under ``root``; returns the table of their
    sources with these files' sizes and sha256 (what the pinned table says of the real ones)."""
    table: dict[str, TaskData] = {}
    for task, files in payloads.items():
        sources = []
        for source in SOURCES[task].sources:
            data = files[source.name]
            _on_site(root, source.url, data)
            sources.append(Source(source.url, len(data), hashlib.sha256(data).hexdigest()))
        table[task] = TaskData(tuple(sources), SOURCES[task].unpack)
    return table


@pytest.fixture
def hosts(tmp_path):
    """The official hosts' paths on 127.0.0.1, and the table of those files' sizes and sha256
    (the pinned table with the tiny files' own checksums)."""
    root = tmp_path / "hosts"
    table = lay_out(root, _payloads())
    with serving(root) as site:
        yield site, table


def _fetched(site) -> list[str]:
    return [p for p, _ in site.requests]


def test_fetch_lays_out_each_task_as_its_reader_reads_it(hosts, samples_dir, tmp_path):
    from bert_core.finetune.train import prepare_task
    from bert_core.vocab.tokenization import load_tokenizer

    site, table = hosts
    data_dir = str(tmp_path / "tasks")
    for name in ("cola", "mnli", "mrpc", "squad", "swag"):
        manifest = fetch_task(name, data_dir, base=site.url, table=table, staging=str(tmp_path / "stage"))
        assert manifest["stage"] == "tasks-fetch" and manifest["config"]["task"] == name
        assert all(s["published"] for s in manifest["config"]["sources"])
        assert storage.shard_problems(manifest["uri"], manifest, checksums=True) == []
        assert task_files(data_dir, name)
    assert sorted(p.name for p in (tmp_path / "tasks" / "MNLI").iterdir()) == [
        "_MANIFEST.json", "dev_matched.tsv", "dev_mismatched.tsv", "train.tsv"]  # original/ left in the zip
    assert not list((tmp_path / "stage").iterdir())  # no part left behind
    # MRPC split by GLUE's dev ids: the fixture's dev pairs are dev.tsv, the rest train.tsv
    mrpc = tmp_path / "tasks" / "MRPC"
    assert len((mrpc / "dev.tsv").read_text().splitlines()) == len((FIXTURES / "MRPC" / "dev.tsv").read_text().splitlines())
    assert (mrpc / "test.tsv").read_text().startswith("index\t#1 ID\t#2 ID\t#1 String\t#2 String\n0\t")
    # the real readers, with the real tokenizer of the sample MiniLM
    tokenizer = load_tokenizer(str(samples_dir / "models" / "minilm"))
    cfg = FinetuneConfig()
    for name in ("mrpc", "mnli", "squad", "swag"):
        task = prepare_task(name, data_dir, tokenizer, cfg)
        assert task.train and all(task.evals.values()), name
    assert prepare_task("mrpc", data_dir, tokenizer, cfg).counts["train_rejected"] == 0
    # a second run fetches nothing
    site.requests.clear()
    fetch_task("squad", data_dir, base=site.url, table=table)
    assert _fetched(site) == []


def test_a_cut_transfer_resumes_and_a_killed_one_resumes_from_its_part(hosts, tmp_path):
    site, table = hosts
    site.cut_suffix, site.cut_after, site.cuts_left = ".zip", 300, 1
    fetch_task("cola", str(tmp_path / "a"), base=site.url, table=table, backoff=0)
    ranges = [r for p, r in site.requests if p.endswith("CoLA.zip")]
    assert ranges == [None, "bytes=300-"]
    # no retry left: the command stops in one line, the part stays for the next run
    site.requests.clear()
    site.cuts_left = 1
    stage = tmp_path / "stage"
    with pytest.raises(TransferError, match="run the same command again to resume"):
        fetch_task("cola", str(tmp_path / "b"), base=site.url, table=table, retries=0, staging=str(stage))
    assert (stage / "CoLA.zip.part").stat().st_size == 300
    assert not storage.has_manifest(str(tmp_path / "b" / "CoLA"))
    fetch_task("cola", str(tmp_path / "b"), base=site.url, table=table, staging=str(stage))
    assert [r for p, r in site.requests if p.endswith("CoLA.zip")] == [None, "bytes=300-"]
    assert task_files(str(tmp_path / "b"), "cola")


def test_a_file_that_is_not_the_published_one_is_refused(hosts, tmp_path):
    """The pinned table itself: the tiny file served for SQuAD's is not the published one."""
    site, _ = hosts
    stage = tmp_path / "stage"
    with pytest.raises(TaskChecksumError) as caught:
        fetch_task("squad", str(tmp_path / "tasks"), base=site.url, staging=str(stage))
    message = str(caught.value)
    assert "\n" not in message and "train-v1.1.json" in message and "30,288,272" in message
    assert not list(stage.iterdir()) and not storage.has_manifest(str(tmp_path / "tasks" / "squad"))


def test_ner_from_a_mirror_is_trusted_once_then_held_to_it(tmp_path):
    root = tmp_path / "mirror"
    (root / "conll").mkdir(parents=True)
    for name in ("train.txt", "valid.txt"):
        (root / "conll" / name).write_bytes((FIXTURES / "ner" / name).read_bytes())
    (root / "conll" / "test.txt").write_bytes((FIXTURES / "ner" / "valid.txt").read_bytes())
    data_dir = str(tmp_path / "tasks")
    with serving(root) as site:
        first = fetch_task("ner", data_dir, url=f"{site.url}/conll")
        assert [s["published"] for s in first["config"]["sources"]] == [False] * 3
        assert task_files(data_dir, "ner")
        # the folder is damaged and the mirror now serves another file: refused against the record
        (tmp_path / "tasks" / "ner" / "train.txt").write_text("damaged")
        (root / "conll" / "train.txt").write_text("-DOCSTART- -X- -X- O\n\nOther NNP B-NP B-ORG\n")
        with pytest.raises(TaskChecksumError, match="recorded at its first fetch"):
            fetch_task("ner", data_dir, url=f"{site.url}/conll")
    with pytest.raises(fetch.TaskFetchError, match=r"Reuters.*ner/\{train,valid,test\}.txt"):
        fetch_task("ner", str(tmp_path / "elsewhere"))


def test_cli_tasks_fetch(hosts, tmp_path, monkeypatch):
    from flows.cli.main import app

    site, table = hosts
    monkeypatch.setenv("BERTPIPE_TASKS_URL", site.url)
    monkeypatch.setattr(fetch, "SOURCES", {**SOURCES, **table})
    root = tmp_path / "data"
    args = ["tasks", "fetch", "cola", "mrpc", "--preset", "bert-base-128", "--set", f"storage_root={root}",
            "--staging", str(tmp_path / "stage")]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert (root / "tasks" / "CoLA" / "train.tsv").exists() and (root / "tasks" / "MRPC" / "dev.tsv").exists()
    # the preset reads where it wrote: the fetched tasks pass the preflight
    cfg = load_config("bert-base-128", sets=[f"storage_root={root}", "finetune.tasks=[cola, mrpc]"])
    from bert_core.preflight import task_data

    assert task_data(cfg, "mrpc") and task_data(cfg, "cola")
    again = CliRunner().invoke(app, args)
    assert again.exit_code == 0 and "already fetched and verified" in again.output
    # `glue` is every GLUE task; the pinned checksum of one the site serves wrongly stops it in one line
    _on_site(site.root, SOURCES["sst2"].sources[0].url, _glue_zip("SST-2"))
    bad = CliRunner().invoke(app, ["tasks", "fetch", "glue", "--to", str(tmp_path / "glue"),
                                   "--staging", str(tmp_path / "stage")])
    assert bad.exit_code == 1 and "sst2:" in bad.output.strip().splitlines()[-1]
    assert (tmp_path / "glue" / "CoLA" / "_MANIFEST.json").exists()
    assert not (tmp_path / "glue" / "SST-2" / "_MANIFEST.json").exists()
