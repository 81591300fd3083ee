"""flows/refresh.py: the scheduled corpus refresh against a dump site on 127.0.0.1 (real sample dump),
on a real Prefect server (the session's): newest finished dump -> download -> clean."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import threading

import pytest
from test_download import DumpSite

from bert_core import storage
from flows.refresh import candidate_dates


def test_candidate_dates_newest_first_and_never_in_the_future():
    assert candidate_dates(dt.date(2024, 6, 25)) == ["20240620", "20240601", "20240520", "20240501"]
    assert candidate_dates(dt.date(2024, 1, 5)) == ["20240101", "20231220", "20231201"]


def _publish(root, dump, date: str, status: str) -> str:
    name = f"enwiki-{date}-pages-articles1.xml-p10p30302.bz2"
    data = dump.read_bytes()
    sha1 = hashlib.sha1(data).hexdigest()
    folder = root / "enwiki" / date
    folder.mkdir(parents=True)
    (folder / name).write_bytes(data)
    (folder / f"enwiki-{date}-sha1sums.txt").write_text(f"{sha1}  {name}\n")
    (folder / "dumpstatus.json").write_text(json.dumps({"jobs": {"articlesdump": {
        "status": status, "files": {name: {"size": len(data), "url": f"/enwiki/{date}/{name}",
                                           "sha1": sha1}}}}}))
    return name


@pytest.fixture
def site(tmp_path):
    server = DumpSite(tmp_path / "site")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.mark.slow
def test_refresh_takes_the_newest_finished_dump_and_cleans_it(prefect_api, site, samples_dir, tmp_path):
    from bert_core.config import load_config
    from flows.refresh import refresh_corpus

    (dump,) = sorted((samples_dir / "wikipedia").glob("*.xml.bz2"))
    newest, finished, *_ = candidate_dates(dt.datetime.now(dt.timezone.utc).date())
    _publish(site.root, dump, newest, "in-progress")  # still being written: skipped
    name = _publish(site.root, dump, finished, "done")
    cfg = load_config("demo", sets=[f"storage_root={tmp_path / 'data'}", "corpus.books=[]", "corpus.text=[]", "workers=1"])
    corpus = refresh_corpus(cfg, lang="en", base_url=site.url)
    raw = storage.join(str(tmp_path / "data"), "raw", "wikipedia", f"enwiki-{finished}")
    assert storage.read_manifest(raw)["shards"][0]["path"] == name
    manifest = storage.read_manifest(corpus)
    assert manifest["stage"] == "corpus" and manifest["counts"]["wikipedia"]["kept"] > 50
    assert corpus.startswith(storage.join(str(tmp_path / "data"), "corpus") + "/")
    # a second refresh downloads nothing and cleans nothing
    site.requests.clear()
    assert refresh_corpus(cfg, lang="en", base_url=site.url) == corpus
    assert not [p for p, _ in site.requests if p.endswith(".bz2")]
