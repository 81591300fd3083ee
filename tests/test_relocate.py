"""A storage root moves: a root refreshed once, copied to another folder with the original made
unreachable, refreshed there for the same month (nothing computed) and the next (continuing the
copy's own current model), against the dump site on 127.0.0.1 of tests/test_refresh.py."""

from __future__ import annotations

import shutil
import threading

import pytest
from test_download import DumpSite
from test_refresh import MONTHS, _manifests, _monthly_dumps, _publish_xml, _refresh_config

from bert_core import storage


@pytest.fixture
def dumps(tmp_path, samples_dir):
    """The two months of tests/test_refresh.py on a dump site on 127.0.0.1."""
    server = DumpSite(tmp_path / "site")
    (sample,) = sorted((samples_dir / "wikipedia").glob("*.xml.bz2"))
    for date, xml in zip(MONTHS, _monthly_dumps(sample), strict=True):
        _publish_xml(server.root, xml, date)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


def _written_since(root, before: dict[str, float]) -> list:
    """Manifests new or rewritten since ``before``, and every registry file."""
    return sorted([p for p in root.rglob(storage.MANIFEST) if before.get(str(p)) != p.stat().st_mtime]
                  + [p for p in (root / "models" / "_registry").rglob("*.json")])


@pytest.mark.slow
def test_a_copied_root_finds_its_work_and_never_reads_the_old_place(prefect_api, dumps, sentiment_tasks, tmp_path):
    from bert_core.refresh.registry import Registry, registry_root
    from flows.refresh import refresh

    old, copy = tmp_path / "data", tmp_path / "elsewhere" / "copy"
    first = refresh(_refresh_config(sentiment_tasks, old), date=MONTHS[0], base_url=dumps.url)
    assert (first["outcome"], first["parent"]) == ("promoted", None)

    shutil.copytree(old, copy)
    shutil.move(old, tmp_path / "away")
    # A file where the old root was: nothing can be read under it or written into it (not even by
    # root, whom a chmod would not stop).
    old.write_text("the storage root moved to elsewhere/copy\n")
    cfg = _refresh_config(sentiment_tasks, copy)
    registry = Registry(registry_root(str(copy)))

    # the same month: every stage and the judgement found done, no new version
    before = _manifests(copy)
    again = refresh(cfg, date=MONTHS[0], base_url=dumps.url)
    assert (again["version"], again["outcome"], again["current"]) == (first["version"], "promoted", first["version"])
    assert _manifests(copy) == before
    assert [r["version"] for r in registry.versions()] == [first["version"]]

    # the next month continues the copy's current model, reading only the copy
    second = refresh(cfg, date=MONTHS[1], base_url=dumps.url)
    v1, v2 = registry.get(first["version"]), registry.get(second["version"])
    assert v2["parent"] == v1["version"] and v2["init"] == "continue" and v2["vocab"] == v1["vocab"]
    assert (v1["steps"], v2["steps"]) == (4, 4 + 3) and second["outcome"] == "promoted"
    assert set(v2["suite"]["new"]["mlm"]) == {"new_dump", "previous_dump"}
    for record in (v1, v2):
        assert all(record[k].startswith(f"{copy}/") for k in ("model", "run", "corpus", "vocab", "instances"))
    written = _written_since(copy, before)
    assert len(written) > 5
    for path in written:
        assert str(old) not in path.read_text(), f"{path} names the old root {old}"
    assert old.read_text() == "the storage root moved to elsewhere/copy\n"
