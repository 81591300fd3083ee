"""bert_core/corpus/download.py against a dump site on 127.0.0.1 (tests/static_site.py) serving the
real sample enwiki dump."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from static_site import StaticSite as DumpSite  # noqa: F401  (the `site` fixture's server)
from typer.testing import CliRunner

from bert_core import storage
from bert_core.corpus.download import (
    ChecksumError,
    DownloadError,
    TransferError,
    download_wikipedia,
    list_dump_files,
)

DATE = "20240601"
NAME = f"enwiki-{DATE}-pages-articles1.xml-p10p30302.bz2"
ONE_FILE = f"enwiki-{DATE}-pages-articles.xml.bz2"


def _site_tree(root: Path, dump: Path, *, sha1: str | None = None, status: str = "done", date: str = DATE) -> str:
    """The dump site's folder of one date: the articles split (one file here) and recombined (the
    same articles in one file), the sha1 list and dumpstatus.json."""
    data = dump.read_bytes()
    real = hashlib.sha1(data).hexdigest()
    split, one = NAME.replace(DATE, date), ONE_FILE.replace(DATE, date)
    folder = root / "enwiki" / date
    folder.mkdir(parents=True)
    (folder / split).write_bytes(data)
    (folder / one).write_bytes(data)
    (folder / f"enwiki-{date}-sha1sums.txt").write_text(
        f"{sha1 or real}  {split}\n{real}  {one}\n"
        f"0000000000000000000000000000000000000000  enwiki-{date}-abstract.xml.gz\n")
    (folder / "dumpstatus.json").write_text(json.dumps({"version": "0.8", "jobs": {
        "articlesdump": {"status": status, "updated": "2024-06-02 10:00:00", "files": {
            split: {"size": len(data), "url": f"/enwiki/{date}/{split}", "sha1": sha1 or real}}},
        "articlesdumprecombine": {"status": "done", "files": {
            one: {"size": len(data), "url": f"/enwiki/{date}/{one}", "sha1": real}}},
        "abstractsdump": {"status": "done", "files": {}}}}))
    return real


def test_full_download_verifies_and_writes_a_manifest(site, dump, tmp_path):
    real = _site_tree(site.root, dump)
    out = str(tmp_path / "raw")
    manifest = download_wikipedia("en", DATE, out, base=site.url, staging=str(tmp_path / "stage"))
    assert (tmp_path / "raw" / NAME).read_bytes() == dump.read_bytes()
    assert manifest["stage"] == "download" and manifest["counts"]["files"] == 1
    assert manifest["shards"][0]["sha1"] == real and manifest["shards"][0]["bytes"] == dump.stat().st_size
    assert storage.read_manifest(out)["config"]["date"] == DATE
    assert not list((tmp_path / "stage").iterdir())  # no part file left behind
    # a second run finds the verified file and fetches nothing but the listings
    site.requests.clear()
    download_wikipedia("en", DATE, out, base=site.url, staging=str(tmp_path / "stage"))
    assert [p for p, _ in site.requests if p.endswith(".bz2")] == []


def test_interrupted_transfer_resumes_with_range(site, dump, tmp_path):
    _site_tree(site.root, dump)
    site.cut_after, site.cuts_left = 300_000, 2  # two broken transfers in a row
    out = str(tmp_path / "raw")
    download_wikipedia("en", DATE, out, base=site.url, staging=str(tmp_path / "stage"), backoff=0)
    assert (tmp_path / "raw" / NAME).read_bytes() == dump.read_bytes()
    ranges = [r for p, r in site.requests if p.endswith(".bz2")]
    assert ranges == [None, "bytes=300000-", "bytes=600000-"]


def test_killed_process_resumes_from_the_part_file(site, dump, tmp_path):
    _site_tree(site.root, dump)
    site.cut_after, site.cuts_left = 500_000, 1
    out, stage = str(tmp_path / "raw"), str(tmp_path / "stage")
    with pytest.raises(TransferError, match="run the same command again to resume"):
        download_wikipedia("en", DATE, out, base=site.url, staging=stage, retries=0)
    assert (tmp_path / "stage" / (NAME + ".part")).stat().st_size == 500_000
    assert not storage.has_manifest(out)
    download_wikipedia("en", DATE, out, base=site.url, staging=stage)
    assert [r for p, r in site.requests if p.endswith(".bz2")] == [None, "bytes=500000-"]
    assert (tmp_path / "raw" / NAME).read_bytes() == dump.read_bytes()


def test_checksum_mismatch_fails_and_keeps_nothing(site, dump, tmp_path):
    _site_tree(site.root, dump, sha1="0" * 40)
    out = str(tmp_path / "raw")
    with pytest.raises(ChecksumError, match=f"{NAME}: sha1 [0-9a-f]{{40}} does not match"):
        download_wikipedia("en", DATE, out, base=site.url, staging=str(tmp_path / "stage"))
    assert not (tmp_path / "raw" / NAME).exists() and not storage.has_manifest(out)
    assert not (tmp_path / "stage" / (NAME + ".part")).exists()


def test_unfinished_or_missing_dump_is_a_clear_error(site, dump):
    _site_tree(site.root, dump, status="in-progress")
    with pytest.raises(DownloadError, match="is 'in-progress', not 'done'"):
        list_dump_files("en", DATE, base=site.url)
    with pytest.raises(DownloadError, match="HTTP 404 .no dump for this date/lang"):
        list_dump_files("de", DATE, base=site.url)
    with pytest.raises(DownloadError, match="expected YYYYMMDD"):
        list_dump_files("en", "2024-06-01", base=site.url)


def test_cli_download_wikipedia(site, dump, tmp_path, monkeypatch):
    from flows.cli.main import app

    _site_tree(site.root, dump)
    monkeypatch.setenv("BERTPIPE_DUMPS_URL", site.url)
    out = tmp_path / "raw"
    result = CliRunner().invoke(app, ["download", "wikipedia", "--date", DATE, "--lang", "en",
                                      "--to", str(out), "--staging", str(tmp_path / "stage")])
    assert result.exit_code == 0, result.output
    assert (out / NAME).stat().st_size == dump.stat().st_size and (out / "_MANIFEST.json").exists()
    bad = CliRunner().invoke(app, ["download", "wikipedia", "--date", "June", "--to", str(out)])
    assert bad.exit_code == 2 and "expected YYYYMMDD" in bad.output  # the option, not the data


def test_a_full_disk_is_not_retried(site, dump, tmp_path):
    """The staging folder is a 64 KiB tmpfs in the download's own mount namespace: the first
    write fails with ENOSPC, and the command says so in one line after one request, no retry."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1) on this machine")
    _site_tree(site.root, dump)
    stage, out = tmp_path / "stage", tmp_path / "raw"
    stage.mkdir()
    script = (f'mount -t tmpfs -o size=64k bertpipe-full "{stage}" && exec "$0" -m flows.cli download wikipedia '
              f'--date {DATE} --to "{out}" --staging "{stage}" --retries 3')
    env = {**os.environ, "BERTPIPE_DUMPS_URL": site.url,
           "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    done = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script, sys.executable],
                          capture_output=True, text=True, env=env, timeout=120)
    if "mount" in done.stderr and "permission denied" in done.stderr.lower():
        pytest.skip(f"mount namespaces are not permitted here: {done.stderr.strip()}")
    failed = [line for line in done.stderr.splitlines() if "No space left on device" in line]
    assert done.returncode == 1, done.stdout + done.stderr
    assert len(failed) == 1 and "free space" in failed[0] and "Traceback" not in done.stderr, done.stderr
    assert "retry" not in done.stderr
    assert [p for p, _ in site.requests if p.endswith(".bz2")] == [f"/enwiki/{DATE}/{NAME}"]
    assert not storage.has_manifest(str(out))


def test_cli_default_destination_is_the_storage_roots_downloads_folder(site, dump, tmp_path, monkeypatch):
    """Without --to the dump lands where the bert-base presets' corpus.wikipedia glob reads it."""
    from bert_core.config import load_config
    from bert_core.corpus.inputs import expand_inputs
    from flows.cli.main import app

    _site_tree(site.root, dump)
    monkeypatch.setenv("BERTPIPE_DUMPS_URL", site.url)
    root = tmp_path / "data"
    result = CliRunner().invoke(app, ["download", "wikipedia", "--date", DATE, "--preset", "bert-base-128",
                                      "--set", f"storage_root={root}"])
    assert result.exit_code == 0, result.output
    folder = root / "downloads" / "wikipedia" / f"enwiki-{DATE}"
    assert storage.read_manifest(str(folder))["shards"][0]["path"] == NAME
    cfg = load_config("bert-base-128", sets=[f"storage_root={root}"])
    assert expand_inputs(cfg.corpus.wikipedia, "wikipedia") == [storage.to_uri(str(folder / NAME))]
    # the recombined form of another dump lands beside it, and the preset's glob matches it too
    _site_tree(site.root, dump, date="20240701")
    one = CliRunner().invoke(app, ["download", "wikipedia", "--date", "20240701", "--job", "articlesdumprecombine",
                                   "--preset", "bert-base-128", "--set", f"storage_root={root}"])
    assert one.exit_code == 0, one.output
    assert expand_inputs(cfg.corpus.wikipedia, "wikipedia") == [storage.to_uri(str(folder / NAME)), storage.to_uri(
        str(root / "downloads" / "wikipedia" / "enwiki-20240701" / "enwiki-20240701-pages-articles.xml.bz2"))]


def test_two_downloads_of_one_dump_at_once_fetch_it_once(site, dump, tmp_path):
    """Two downloads into one folder at the same moment, each with its default staging: one
    fetches, the other waits on the folder's lease and reuses the verified result."""
    import threading

    _site_tree(site.root, dump)
    site.cut_after, site.cuts_left = 200_000, 1  # the first transfer breaks and resumes
    out = str(tmp_path / "raw")
    results, errors = [], []

    def one() -> None:
        try:
            results.append(download_wikipedia("en", DATE, out, base=site.url, backoff=0.2))
        except Exception as err:  # reported below
            errors.append(err)

    threads = [threading.Thread(target=one) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and len(results) == 2
    assert results[0]["shards"] == results[1]["shards"]
    assert (tmp_path / "raw" / NAME).read_bytes() == dump.read_bytes()
    assert [r for p, r in site.requests if p.endswith(".bz2")] == [None, "bytes=200000-"]
    assert not (tmp_path / "raw" / "_LEASE.json").exists()
