"""bert_core/refresh/importing.py and `bertpipe models import`: a public checkpoint (the sample
MiniLM) becomes the current version of a fresh storage root, with its vocab as the line's vocab;
transformers loads the version; the root moves; a refresh continues it on the sample dump and the
suite judges it against itself."""

from __future__ import annotations

import json
import shutil
import threading

import pytest
from typer.testing import CliRunner

from bert_core import storage
from bert_core.refresh.registry import Registry, registry_root


def _import(samples_dir, root):
    from flows.cli.main import app

    result = CliRunner().invoke(app, ["models", "import", str(samples_dir / "models" / "minilm"),
                                      "--set", f"storage_root={root}"])
    assert result.exit_code == 0, result.output
    return Registry(registry_root(str(root)))


def test_an_imported_checkpoint_is_the_current_version_with_its_vocab_and_card(samples_dir, tmp_path):
    root = tmp_path / "data"
    registry = _import(samples_dir, root)
    (record,) = registry.versions()
    assert registry.current() == record["version"] and record["parent"] is None and record["init"] == "import"
    vocab = storage.read_manifest(record["vocab"])
    assert vocab["stage"] == "vocab" and vocab["config"]["lowercase"] is True and vocab["counts"]["vocab_size"] == 30522
    assert (samples_dir / "models" / "minilm" / "vocab.txt").read_text() == \
        (root / "vocab" / record["line"] / "vocab.txt").read_text()
    # the card: architecture, vocab, the source's licence from SOURCES.md, the gate, how to load
    card = (root / "models" / record["version"] / "README.md").read_text()
    assert card.startswith("---\n") and "library_name: transformers" in card
    assert "post-LN" in card and "30,522 tokens, uncased" in card and "Apache-2.0" in card
    assert "gate: **promote**" in card and "AutoModelForPreTraining.from_pretrained(path)" in card
    # importing again changes nothing
    before = {p: p.read_bytes() for p in root.rglob("_MANIFEST.json")}
    again = _import(samples_dir, root)
    assert [r["version"] for r in again.versions()] == [record["version"]]
    assert {p: p.read_bytes() for p in root.rglob("_MANIFEST.json")} == before
    # transformers loads the version as its card says, with the same encoder weights as MiniLM
    import torch
    from transformers import AutoModel, AutoModelForPreTraining, AutoTokenizer

    model = AutoModelForPreTraining.from_pretrained(record["model"])
    tokenizer = AutoTokenizer.from_pretrained(record["model"], trust_remote_code=False)
    original = AutoModel.from_pretrained(str(samples_dir / "models" / "minilm"))
    batch = tokenizer("The cat sat on the mat.", return_tensors="pt")
    with torch.no_grad():
        ours = model.bert(**batch).last_hidden_state
        theirs = original(**batch).last_hidden_state
    assert torch.allclose(ours, theirs, atol=1e-5)
    # the root moves: the registry and the vocab are read where they lie now
    moved = tmp_path / "moved"
    shutil.move(str(root), str(moved))
    there = Registry(registry_root(str(moved)))
    assert there.model("current") == storage.to_uri(str(moved / "models" / record["version"]))
    assert storage.read_manifest(there.get(record["version"])["vocab"])["uri"].startswith(storage.to_uri(str(moved)))


@pytest.mark.slow
def test_a_refresh_continues_the_imported_minilm_and_the_suite_judges_it(prefect_api, samples_dir, sentiment_tasks,
                                                                         tmp_path):
    from test_download import DumpSite
    from test_refresh import MONTHS, _monthly_dumps, _publish_xml, _refresh_config

    from flows.refresh import refresh

    server = DumpSite(tmp_path / "site")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        (sample,) = sorted((samples_dir / "wikipedia").glob("*.xml.bz2"))
        _publish_xml(server.root, _monthly_dumps(sample)[0], MONTHS[0])
        root = tmp_path / "data"
        registry = _import(samples_dir, root)
        imported = registry.current()
        cfg = _refresh_config(sentiment_tasks, root)
        result = refresh(cfg, date=MONTHS[0], base_url=server.url)
    finally:
        server.shutdown()
        server.server_close()
    record = registry.get(result["version"])
    assert record["parent"] == imported and record["init"] == "continue"
    assert record["vocab"] == registry.get(imported)["vocab"]  # the imported vocab is the line's
    new, current = record["suite"]["new"], record["suite"]["current"]
    assert set(new["mlm"]) == set(current["mlm"]) == {"new_dump"}  # the import has no dump of its own
    assert set(new["finetune"]) == set(current["finetune"]) == {"sentiment"}
    assert {r["metric"] for r in record["gate"]["rows"]} == {"mlm_loss:new_dump", "finetune:sentiment"}
    assert result["outcome"] == ("promoted" if record["gate"]["decision"] == "promote" else "kept")
    card = (root / "models" / result["version"] / "README.md").read_text()
    assert f"gate: **{record['gate']['decision']}**" in card and "continued from" in card
    print("SUITE", json.dumps({"version": result["version"], "parent": imported, "outcome": result["outcome"],
                               "new": new, "current": current, "gate": record["gate"]}, indent=1))
