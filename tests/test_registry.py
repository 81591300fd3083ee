"""bert_core/refresh/registry.py and ``bertpipe models``: versions with lineage, aliases moved whole and
last, a lock so two promotions never both win, and ``models:current`` wherever a checkpoint goes."""

from __future__ import annotations

import json
import threading

import pytest
from typer.testing import CliRunner

from bert_core import storage
from bert_core.refresh.registry import Registry, RegistryError, registry_root, resolve_checkpoint
from flows.cli.main import app

WORDS = ["the", "cat", "sat", "on", "mat", "a", "dog", "ran"]


def _model(root, version: str, seed: int) -> str:
    """A whole model folder (a tiny random BERT, transformers layout, with its manifest)."""
    from bert_core.config import load_config
    from bert_core.model.checkpoint import save_pretrained
    from bert_core.pretrain.in_process import random_init
    from bert_core.pretrain.run_folder import model_config

    vocab = root / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    cfg = load_config("demo", sets=["model.hidden_size=16", "model.num_attention_heads=2",
                                    "model.intermediate_size=32", "model.num_hidden_layers=1",
                                    "model.size=custom"])
    out = storage.join(registry_root(str(root)), version)
    save_pretrained(random_init(model_config(cfg, len(WORDS) + 5), seed), out, vocab_file=str(vocab))
    files = storage.list_files(out)
    storage.write_manifest(out, stage="model", config={"seed": seed},
                           shards=[storage.shard_entry(f) for f in files])
    return out


@pytest.fixture
def two(tmp_path):
    """A registry with versions v1 and v2 (v2's parent v1), v1 current."""
    reg = Registry(registry_root(str(tmp_path)))
    for version, parent, seed in (("v1", None, 1), ("v2", "v1", 2)):
        reg.register({"version": version, "parent": parent, "model": _model(tmp_path, version, seed),
                      "dump_date": "20261101" if version == "v1" else "20261201", "steps": seed * 10})
    reg.promote("v1", expect_current=None)
    return tmp_path, reg


def _cli(root, *args: str):
    return CliRunner().invoke(app, [*args, "--set", f"storage_root={root}"])


def test_promote_rollback_and_the_aliases(two):
    root, reg = two
    assert reg.aliases()["current"] == "v1" and reg.aliases()["previous"] is None
    assert reg.promote("v2", expect_current="v1")["previous"] == "v1"
    assert resolve_checkpoint("models:current", str(root)) == reg.get("v2")["model"]
    assert resolve_checkpoint("models:v1", str(root)) == reg.get("v1")["model"]
    assert resolve_checkpoint("/some/folder", str(root)) == "/some/folder"  # a plain folder as given
    listed = _cli(root, "models", "list")
    assert listed.exit_code == 0
    rows = {line.split()[0]: line for line in listed.output.splitlines()[1:]}
    assert rows["current"].split()[1] == "v2" and rows["previous"].split()[1] == "v1"
    shown = _cli(root, "models", "show", "current")
    assert json.loads(shown.output)["parent"] == "v1"
    rolled = _cli(root, "models", "rollback")
    assert rolled.exit_code == 0 and reg.current() == "v1" and reg.aliases()["history"] == ["v1"]
    refused = _cli(root, "models", "rollback")
    assert refused.exit_code == 1 and "nothing to roll back to" in refused.output
    assert _cli(root, "models", "promote", "v2").exit_code == 0 and reg.current() == "v2"


def test_the_registry_points_only_at_whole_models(two):
    root, reg = two
    model = reg.get("v2")["model"]
    with open(storage.join(model, "model.safetensors"), "ab") as f:
        f.write(b"x")  # damaged after it was written
    with pytest.raises(RegistryError, match="cannot promote v2: .*model.safetensors"):
        reg.promote("v2", expect_current="v1")
    # A refresh that recorded its decision but died before the aliases moved: current is untouched.
    reg.register({"version": "v2", "gate": {"decision": "promote"}})
    assert reg.current() == "v1"
    storage.remove(storage.join(reg.get("v1")["model"], storage.MANIFEST))
    result = CliRunner().invoke(app, ["features", "--checkpoint", "models:current", "--input", "x.txt",
                                      "--output", "y.parquet", "--set", f"storage_root={root}"])
    assert result.exit_code == 1
    assert result.output.strip().endswith("is not whole (no _MANIFEST.json); restore it, or `bertpipe "
                                          "models rollback`")


def test_a_registry_of_a_newer_schema_is_refused_in_one_line(two):
    root, reg = two
    aliases = storage.join(reg.folder, "aliases.json")
    data = json.loads(storage.read_text(aliases))
    storage.write_text(aliases, json.dumps({**data, "schema_version": 99}))
    result = _cli(root, "models", "list")
    assert result.exit_code == 1 and len(result.output.strip().splitlines()) == 1
    assert "written by a newer bertpipe (registry schema 99" in result.output


def test_two_promotions_at_once_never_both_win(two):
    root, reg = two
    reg.register({"version": "v3", "parent": "v1", "model": _model(root, "v3", 3)})
    outcomes: dict[str, str] = {}

    def promote(version: str) -> None:
        try:
            Registry(reg.root).promote(version, expect_current="v1")
            outcomes[version] = "promoted"
        except RegistryError as err:
            outcomes[version] = str(err)

    threads = [threading.Thread(target=promote, args=(v,)) for v in ("v2", "v3")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [v for v, o in outcomes.items() if o == "promoted"]
    assert len(winners) == 1 and reg.current() == winners[0] and reg.aliases()["previous"] == "v1"
    (loser,) = set(outcomes) - set(winners)
    assert "another refresh promoted it" in outcomes[loser]
    # A held lock is waited for, then refused in one line.
    with reg.lock("a refresh"):
        with pytest.raises(RegistryError, match="is locked by .*a refresh"):
            with reg.lock("another", wait_s=0.2):
                pass
    with reg.lock("after"):  # released
        pass


def test_features_and_finetune_take_models_current(two, tmp_path, samples_dir):
    root, reg = two
    text = tmp_path / "in.txt"
    text.write_text("the cat sat on the mat\na dog ran\n")
    out = tmp_path / "f.parquet"
    result = CliRunner().invoke(app, ["features", "--checkpoint", "models:current", "--input", str(text),
                                      "--output", str(out), "--set", f"storage_root={root}"])
    assert result.exit_code == 0, result.output
    assert "kept 2" in result.output and out.exists()
    unknown = CliRunner().invoke(app, ["finetune", "--task", "sentiment", "--data", str(samples_dir / "tasks"),
                                       "--checkpoint", "models:v9", "--output", str(tmp_path / "ft"),
                                       "--set", f"storage_root={root}"])
    assert unknown.exit_code == 1
    assert "model version 'v9' is not in the registry" in unknown.output


def test_fine_tuning_a_registered_model_records_its_task_model(two, tmp_path, samples_dir):
    from conftest import sentiment_slice

    root, reg = two
    tasks = sentiment_slice(samples_dir, tmp_path / "tasks")
    output = tmp_path / "ft"
    done = CliRunner().invoke(app, ["finetune", "--task", "sentiment", "--data", str(tasks), "--checkpoint",
                                    "models:current", "--output", str(output), "--seeds", "1",
                                    "--learning-rates", "1e-3", "--batch-sizes", "16", "--epochs", "1",
                                    "--set", "finetune.max_seq_length=16", "--set", f"storage_root={root}"])
    assert done.exit_code == 0, done.output
    entry = reg.get("v1")["task_models"]["sentiment"]
    assert entry["model"] == f"{output}/sentiment/model" and entry["seed"] == 1 and entry["metric"] == "accuracy"
    assert storage.read_manifest(str(output / "sentiment"))["model"]["path"] == "model"
    listed = _cli(root, "models", "list").output
    assert f"sentiment    accuracy {entry['score']:.1f}" in listed


def test_a_decided_promotion_that_crashed_is_finished_and_a_rollback_is_not_undone(two):
    root, reg = two
    # the gate said promote, then the process died before the aliases moved
    reg.register({"version": "v2", "gate": {"decision": "promote", "why": "better"}})
    assert reg.current() == "v1"
    assert reg.settle("v2") == "promoted" and reg.current() == "v2" and reg.get("v2")["promoted"]
    reg.rollback()
    assert reg.settle("v2") == "promoted" and reg.current() == "v1"  # a person's rollback stands


def test_records_name_the_roots_folders_by_their_place_in_it(two):
    import shutil

    root, reg = two
    reg.register({"version": "v2", "corpus": str(root / "corpus" / "c1"), "vocab": "/elsewhere/vocab"})
    stored = json.loads(storage.read_text(reg.record_uri("v2")))
    assert (stored["model"], stored["corpus"], stored["vocab"]) == ("models/v2", "corpus/c1", "/elsewhere/vocab")
    # a record of an older bertpipe names its folders by absolute paths in the root it was written in
    stored["model"], stored["instances"] = str(root / "models" / "v2"), str(root / "instances" / "i1")
    storage.write_text(reg.record_uri("v2"), json.dumps(stored))
    copy = root.parent / f"{root.name}-moved"
    shutil.copytree(root, copy)
    moved = Registry(registry_root(str(copy)))
    record = moved.get("v2")
    assert (record["model"], record["instances"]) == (f"{copy}/models/v2", f"{copy}/instances/i1")
    assert (record["corpus"], record["vocab"]) == (f"{copy}/corpus/c1", "/elsewhere/vocab")
    assert moved.model("current") == f"{copy}/models/v1"
    assert moved.register({"version": "v2", "steps": 3})["model"] == f"{copy}/models/v2"
    assert json.loads(storage.read_text(moved.record_uri("v2")))["instances"] == "instances/i1"



def test_task_models_are_listed_under_their_version_and_move_with_the_root(two):
    import shutil

    root, reg = two
    sst2 = {"model": str(root / "finetune" / "v2" / "sst2" / "model"), "metric": "accuracy", "score": 91.25,
            "split": "dev (also used for selection)", "setting": "lr3e-5-bs32-ep3", "seed": 2}
    reg.register({"version": "v2", "task_models": {"sst2": sst2}})
    stored = json.loads(storage.read_text(reg.record_uri("v2")))
    assert stored["task_models"]["sst2"]["model"] == "finetune/v2/sst2/model"  # by its place in the root
    listed = _cli(root, "models", "list")
    assert listed.exit_code == 0, listed.output
    lines = listed.output.splitlines()
    row = next(i for i, line in enumerate(lines) if " v2 " in line)
    assert "sst2" in lines[row + 1] and "accuracy 91.2" in lines[row + 1] and "seed 2" in lines[row + 1]
    assert lines[row + 1].endswith(f"{root}/finetune/v2/sst2/model")
    copy = root.parent / f"{root.name}-moved"
    shutil.copytree(root, copy)
    assert Registry(registry_root(str(copy))).get("v2")["task_models"]["sst2"]["model"] == \
        f"{copy}/finetune/v2/sst2/model"
