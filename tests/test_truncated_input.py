"""An input file cut short fails the corpus stage in one line and leaves no manifest: the real
sample dump and real JSON lines cut, run through the real command line and real Beam; the
download refuses a cut ``.bz2`` whose sha1 matches; a refresh of a cut dump stops before
pre-training."""

from __future__ import annotations

import bz2
import gzip
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_download import DATE, NAME, _site_tree

from beam_jobs import clean_corpus
from bert_core import storage
from bert_core.config import CorpusConfig
from bert_core.corpus import documents as D
from bert_core.corpus.download import CutFileError, download_wikipedia
from bert_core.corpus.dumps import WorkItem, plan_reads, read_pages

ROOT = Path(__file__).resolve().parent.parent


def bertpipe(*args: str) -> subprocess.CompletedProcess:
    """The real command line in its own process: what a user sees, Beam's output included."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], capture_output=True, text=True,
                          env=env, timeout=600, cwd=ROOT)


def cut_rejects(folder: Path) -> list[dict]:
    return [r for p in sorted(folder.glob("rejects-*.jsonl")) for line in p.read_text().splitlines()
            if (r := json.loads(line))["reason"] == D.TRUNCATED_INPUT]


@pytest.fixture(scope="module")
def cut_dump(samples_dir, tmp_path_factory) -> Path:
    """The real sample dump with its last third of bytes gone (no bz2 end-of-stream marker)."""
    (dump,) = sorted((samples_dir / "wikipedia").glob("*.xml.bz2"))
    data = dump.read_bytes()
    path = tmp_path_factory.mktemp("cut") / "enwiki-cut.xml.bz2"
    path.write_bytes(data[: len(data) * 2 // 3])
    return path


def pages_in(path: Path) -> int:
    """Pages a whole-file read of ``path`` gets before the cut (no splitting into work items)."""
    return sum(kind == "page" for kind, _ in read_pages(WorkItem(str(path), "whole")))


def test_a_cut_dump_fails_the_corpus_in_one_line_naming_the_file_and_the_pages_read(cut_dump, tmp_path) -> None:
    assert len(plan_reads(str(cut_dump))) > 2  # the file is read as several work items
    pages = pages_in(cut_dump)
    assert pages > 50
    out = tmp_path / "corpus"
    done = bertpipe("corpus", "--wikipedia", str(cut_dump), "--output", str(out), "--workers", "1")
    said = done.stdout + done.stderr
    assert done.returncode == 1, said
    last = said.strip().splitlines()[-1]
    assert last.startswith(f"{cut_dump} is cut short at byte {cut_dump.stat().st_size:,}: the bz2 stream ends")
    assert f"{pages:,} pages were read before the cut" in last
    assert "download the file again or drop it from the inputs" in last
    assert "Traceback" not in said
    assert not (out / storage.MANIFEST).exists()
    # the reject names the pages of the whole file, though the item that met the end read none of them
    (reject,) = cut_rejects(out)
    assert reject["source"] == D.WIKIPEDIA and reject["id"].startswith(f"{cut_dump}@")
    assert reject["detail"] == (f"{cut_dump} is cut short at byte {cut_dump.stat().st_size:,}: the bz2 stream "
                                f"ends before its end-of-stream marker; {pages:,} pages were read before the cut")


def cut_json_lines(samples_dir: Path, folder: Path) -> Path:
    """300 real JSON lines, gzipped, with the last third of the bytes gone."""
    lines = (samples_dir / "text" / "tweets.jsonl").read_bytes().splitlines(keepends=True)[:300]
    packed = gzip.compress(b"".join(lines))
    cut = folder / "tweets.jsonl.gz"
    cut.write_bytes(packed[: len(packed) * 2 // 3])
    return cut


def test_cut_json_lines_fail_the_corpus_in_one_line(samples_dir, tmp_path) -> None:
    cut = cut_json_lines(samples_dir, tmp_path)
    out = tmp_path / "corpus"
    done = bertpipe("corpus", "--text", str(cut), "--output", str(out), "--workers", "1")
    said = done.stdout + done.stderr
    assert done.returncode == 1, said
    last = said.strip().splitlines()[-1]
    assert last.startswith(f"{cut} ends inside its compressed stream after line ")
    line = int(last.split("after line ")[1].split(":")[0])
    assert 0 < line < 300
    assert "download the file again or drop it from the inputs" in last and "Traceback" not in said
    assert not (out / storage.MANIFEST).exists()
    (reject,) = cut_rejects(out)
    assert reject["id"] == "text:tweets" and reject["detail"] in last


def test_allow_truncated_keeps_what_was_read_and_warns_per_file(cut_dump, samples_dir, tmp_path, caplog) -> None:
    cut = cut_json_lines(samples_dir, tmp_path)
    out = tmp_path / "corpus"
    cfg = CorpusConfig(wikipedia=[str(cut_dump)], text=[str(cut)], allow_truncated=True)
    with caplog.at_level(logging.WARNING, logger="beam_jobs.clean_corpus"):
        manifest = clean_corpus.run(cfg, str(out), workers=1)
    for source in (D.WIKIPEDIA, D.TEXT):
        c = manifest["counts"][source]
        assert c["rejected_by_reason"][D.TRUNCATED_INPUT] == 1 and c["kept"] > 0
        assert c["kept"] + c["rejected"] == c["read"]
    assert manifest["counts"][D.WIKIPEDIA]["read"] == pages_in(cut_dump) + 1  # the cut is one record read
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and all(w.endswith("; the corpus keeps only what was read (corpus.allow_truncated=true)")
                                      for w in warnings)
    (dump_warning,) = [w for w in warnings if w.startswith(f"{cut_dump} is cut short")]
    assert f"{pages_in(cut_dump):,} pages were read before the cut" in dump_warning
    assert [w for w in warnings if w.startswith(f"{cut} ends inside its compressed stream after line ")]


def test_the_download_refuses_a_cut_bz2_whose_sha1_matches(site, cut_dump, tmp_path) -> None:
    _site_tree(site.root, cut_dump)  # the listing's sha1 is the cut file's own
    out, stage = str(tmp_path / "raw"), tmp_path / "stage"
    with pytest.raises(CutFileError, match=f"{NAME}: the file is cut short .{cut_dump.stat().st_size:,} bytes, no "
                                           "bz2 end-of-stream marker. although its sha1 matches"):
        download_wikipedia("en", DATE, out, base=site.url, staging=str(stage))
    assert not (tmp_path / "raw" / NAME).exists() and not storage.has_manifest(out)
    assert not (stage / (NAME + ".part")).exists()


def _publish_cut_xml(root: Path, sample: Path, date: str) -> str:
    """A finished dump on the site whose XML breaks off inside a page, compressed whole (its bz2
    stream ends as it should, its sha1 is its own): only the corpus stage can tell."""
    import hashlib

    xml = bz2.decompress(sample.read_bytes())
    data = bz2.compress(xml[: len(xml) * 2 // 3], 1)
    name = f"enwiki-{date}-pages-articles1.xml-p10p30302.bz2"
    folder = root / "enwiki" / date
    folder.mkdir(parents=True)
    (folder / name).write_bytes(data)
    sha1 = hashlib.sha1(data).hexdigest()
    (folder / f"enwiki-{date}-sha1sums.txt").write_text(f"{sha1}  {name}\n")
    (folder / "dumpstatus.json").write_text(json.dumps({"jobs": {"articlesdump": {
        "status": "done", "files": {name: {"size": len(data), "url": f"/enwiki/{date}/{name}", "sha1": sha1}}}}}))
    return name


@pytest.mark.slow
def test_a_refresh_of_a_cut_dump_stops_at_the_corpus_in_one_line(prefect_api, site, samples_dir, tmp_path) -> None:
    from typer.testing import CliRunner

    from bert_core.refresh.registry import Registry, registry_root
    from flows.cli.main import app

    (sample,) = sorted((samples_dir / "wikipedia").glob("*.xml.bz2"))
    name = _publish_cut_xml(site.root, sample, DATE)
    data = tmp_path / "data"
    result = CliRunner().invoke(app, ["refresh", "--date", DATE, "--base-url", site.url,
                                      "--set", f"storage_root={data}", "--set", "corpus.books=[]",
                                      "--set", "corpus.text=[]", "--set", "workers=1",
                                      # the suite's inputs, wherever the command runs: the dump is what is wrong
                                      "--set", f"finetune.data_dir={samples_dir}/tasks",
                                      "--set", f"finetune.extra_checkpoints=[{samples_dir}/models/minilm]"])
    assert result.exit_code == 1, result.output
    last = result.output.strip().splitlines()[-1]
    assert name in last and "the XML ends inside a <page>" in last and "pages were read before the cut" in last
    assert "download the file again or drop it from the inputs" in last
    # nothing is marked done after the download: no corpus, no later stage, no model version
    assert storage.has_manifest(str(data / "downloads" / "wikipedia" / f"enwiki-{DATE}"))
    assert [p.parent.parent.name for p in data.glob(f"**/{storage.MANIFEST}")] == ["wikipedia"]
    registry = Registry(registry_root(str(data)))
    assert registry.current() is None and not registry.versions()
