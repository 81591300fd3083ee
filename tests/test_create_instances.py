"""beam_jobs/create_instances.py on real Beam (FnApiRunner), a tiny real-text documents folder,
the real bert-base-uncased vocab; plus the `bertpipe instances/stats` CLI and the Prefect flow."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from beam_jobs import create_instances
from bert_core import storage
from bert_core.config import InstanceConfig, SequenceSpec, load_config
from bert_core.corpus.sentences import split_sentences


@pytest.fixture(scope="module")
def corpus(samples_dir, tmp_path_factory) -> str:
    """40 real news articles split into sentences, plus one document that has no tokens."""
    lines = (samples_dir / "news" / "lee_background.cor").read_text(encoding="utf-8").splitlines()
    docs = [(f"news:{i}", split_sentences(line)) for i, line in enumerate(lines[:40])]
    docs.append(("news:empty", ["   ", "\u200b"]))
    return write_corpus(str(tmp_path_factory.mktemp("corpus")), docs, "news")


def write_corpus(out: str, docs: list[tuple[str, list[str]]], source: str) -> str:
    """A finished corpus stage folder of one shard holding ``(doc_id, sentences)`` documents."""
    shard = storage.join(out, "docs-00000-of-00001.parquet")
    table = pa.table({
        "doc_id": [d for d, _ in docs], "source": [source] * len(docs), "title": [d for d, _ in docs],
        "sentences": pa.array([s for _, s in docs], type=pa.list_(pa.string())),
    })
    with storage.open_file(shard, "wb") as f:
        pq.write_table(table, f)
    storage.write_manifest(out, stage="corpus", config={}, shards=[storage.shard_entry(shard, len(docs))],
                           counts={"documents": len(docs)})
    return out


@pytest.fixture(scope="module")
def vocab_file(samples_dir) -> str:
    return str(samples_dir / "models" / "minilm" / "vocab.txt")


CONFIG = InstanceConfig(
    lengths=[SequenceSpec(max_seq_length=64, max_predictions_per_seq=10),
             SequenceSpec(max_seq_length=128, max_predictions_per_seq=20)],
    dupe_factor=3, num_shards=3, seed=7,
)


@pytest.fixture(scope="module")
def runs(corpus, vocab_file, tmp_path_factory) -> dict[int, str]:
    """The same job with 1 worker (in memory) and 2 worker processes; 4 random-next pools."""
    out = {}
    for workers in (1, 2):
        folder = str(tmp_path_factory.mktemp(f"instances-w{workers}"))
        create_instances.run(CONFIG, corpus, vocab_file, folder, workers=workers, min_docs_per_bucket=10)
        out[workers] = folder
    return out


def test_same_bytes_whatever_the_workers(runs) -> None:
    one, two = (storage.read_manifest(runs[w]) for w in (1, 2))
    assert one["stats"] == two["stats"] and one["counts"] == two["counts"]
    for folder in ("seq64", "seq128", "seq64/eval", "seq128/eval"):  # training and eval shards
        a, b = (storage.read_manifest(storage.join(runs[w], folder)) for w in (1, 2))
        assert [s["sha256"] for s in a["shards"]] == [s["sha256"] for s in b["shards"]]
        assert a["counts"] == b["counts"] and a["stats"] == b["stats"]
        for s in a["shards"]:  # the manifest's hashes are the files'
            assert storage.sha256(storage.join(runs[1], folder, s["path"])) == s["sha256"]


def test_shards_are_balanced_and_follow_the_contract(runs) -> None:
    for length, max_pred in ((64, 10), (128, 20)):
        folder = storage.join(runs[2], f"seq{length}")
        manifest = storage.read_manifest(folder)
        shards = storage.shard_uris(folder, manifest)
        assert [Path(s).name for s in shards] == [f"part-0000{i}-of-00003.parquet" for i in range(3)]
        counts = [s["count"] for s in manifest["shards"]]
        assert max(counts) - min(counts) <= 1 and sum(counts) == manifest["counts"]["instances"] > 50
        rows = []
        for uri in shards:
            table = pq.read_table(uri)
            assert table.schema.field("input_ids").type == pa.list_(pa.int32())
            assert table.schema.field("len_a").type == pa.int32()
            assert table.schema.field("next_sentence_label").type == pa.int8()
            rows += table.to_pylist()
        for r in rows:
            ids = r["input_ids"]
            assert len(ids) <= length and ids[0] == 101 and ids[r["len_a"] - 1] == 102 and ids[-1] == 102
            assert 2 < r["len_a"] < len(ids)
            assert r["next_sentence_label"] in (0, 1)
            assert 1 <= len(r["masked_lm_positions"]) <= max_pred
            assert r["masked_lm_positions"] == sorted(r["masked_lm_positions"])
            assert all(0 < p < len(ids) - 1 for p in r["masked_lm_positions"])
        # rows arrive shuffled: neighbours rarely come from the same place in a document
        firsts = [r["input_ids"][1:4] for r in rows]
        assert len({tuple(f) for f in firsts}) > 0.5 * len(firsts)


def test_manifest_stats_and_rejects(runs) -> None:
    manifest = storage.read_manifest(runs[2])
    assert manifest["stage"] == "instances" and manifest["config"]["dupe_factor"] == 3
    counts = manifest["counts"]
    assert counts == {**counts, "documents_read": 41, "documents_used": 40, "documents_rejected": 1}
    assert 3 <= counts["eval_documents"] <= 20  # min_eval_documents / documents_read = 10 / 41 held out
    rejects = [json.loads(x) for x in storage.read_text(storage.join(runs[2], "rejects.jsonl")).splitlines()]
    assert rejects == [{"source": "documents", "id": "news:empty", "reason": "no_tokens",
                        "detail": "2 sentences, none with a token in this vocab"}]
    for length in (64, 128):
        s = manifest["stats"][f"seq{length}"]
        n = s["counts"]["masked"]
        assert s["instances"] == counts[f"instances_seq{length}"]
        held_out = storage.read_manifest(storage.join(runs[2], f"seq{length}", "eval"))
        assert held_out["split"] == "eval" and len(held_out["shards"]) == 1
        assert held_out["counts"]["instances"] == counts[f"eval_instances_seq{length}"] > 0
        assert 0.12 < held_out["stats"]["masked_fraction"] <= 0.16
        assert 0.12 < s["masked_fraction"] <= 0.16  # round(len * 0.15), capped
        assert abs(s["mask_token_fraction"] - 0.8) < 4 * math.sqrt(0.16 / n)
        assert abs(s["kept_fraction"] - 0.1) < 4 * math.sqrt(0.09 / n)
        assert abs(s["random_token_fraction"] - 0.1) < 4 * math.sqrt(0.09 / n)
        assert 0.4 < s["random_next_fraction"] < 0.75
        assert sum(s["length_histogram"]["counts"]) == s["instances"]
        assert s["mean_length"] > 0.7 * length  # mostly full sequences


def test_cli_without_nsp_dynamic_masking_and_stats(corpus, vocab_file, tmp_path) -> None:
    from flows.cli.main import app

    out = str(tmp_path / "packed")
    sets = ["instances.lengths=[{max_seq_length: 64, max_predictions_per_seq: 10}]",
            "instances.next_sentence_prediction=false", "instances.masking=dynamic",
            "instances.num_shards=3", "instances.shard_multiple_of=2", "instances.dupe_factor=1",
            "workers=1", "pretrain.phases=[{max_seq_length: 64, micro_batch_size: 16, global_batch_size: 32}]"]
    args = ["instances", "--corpus", corpus, "--vocab", vocab_file, "--output", out]
    for s in sets:
        args += ["--set", s]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "seq64:" in result.output and "random_next_fraction" in result.output
    manifest = storage.read_manifest(storage.join(out, "seq64"))
    assert len(manifest["shards"]) == 4  # 3 rounded up to a multiple of 2
    rows = [r for uri in storage.shard_uris(storage.join(out, "seq64")) for r in pq.read_table(uri).to_pylist()]
    assert rows and all(r["next_sentence_label"] == -1 and r["len_a"] == len(r["input_ids"]) for r in rows)
    assert all(r["masked_lm_positions"] == [] == r["masked_lm_ids"] for r in rows)
    assert all(len(r["input_ids"]) <= 64 and 102 not in r["input_ids"][1:-1] for r in rows)

    shown = CliRunner().invoke(app, ["stats", out, "--json"])
    assert shown.exit_code == 0
    assert json.loads(shown.output)["stats"]["seq64"]["instances"] == len(rows)
    missing = CliRunner().invoke(app, ["stats", str(tmp_path / "nothing")])
    assert missing.exit_code == 1 and "unfinished write" in missing.output

    # a finished folder is never rewritten; an unfinished one (its manifest gone) written again with
    # fewer shards keeps no stale shard
    fewer = [*args, "--set", "instances.num_shards=1", "--set", "instances.shard_multiple_of=1"]
    refused = CliRunner().invoke(app, fewer)
    assert refused.exit_code == 2 and "is finished" in refused.output, refused.output
    (tmp_path / "packed" / storage.MANIFEST).unlink()
    again = CliRunner().invoke(app, fewer)
    assert again.exit_code == 0, again.output
    assert sorted(p.name for p in (tmp_path / "packed" / "seq64").iterdir()) == [
        "_MANIFEST.json", "eval", "part-00000-of-00001.parquet"]


@pytest.mark.slow
def test_prefect_flow_publishes_stats_and_skips_a_finished_folder(prefect_api, corpus, vocab_file, runs, tmp_path) -> None:
    from prefect_server import latest_artifacts

    from flows.instances import create_instances as flow

    config = load_config("demo", sets=[
        "workers=1", "instances.dupe_factor=3", "instances.num_shards=3", "instances.seed=7",
        "instances.lengths=[{max_seq_length: 64, max_predictions_per_seq: 10},"
        " {max_seq_length: 128, max_predictions_per_seq: 20}]",
        "instances.next_sentence_prediction=true", "instances.masking=static",
        "pretrain.phases=[{max_seq_length: 128, micro_batch_size: 16, global_batch_size: 32}]"])
    assert config.instances == CONFIG
    # runs[1] was made with the same config and inputs: the flow only publishes its stats
    before = storage.read_manifest(runs[1])["created"]
    assert flow(config, corpus, vocab_file, runs[1]) == runs[1]
    assert storage.read_manifest(runs[1])["created"] == before

    artifacts = latest_artifacts()
    rows = artifacts["instances-stats"]
    # a row per length, shown one column per length (wider than the UI: flows/artifacts.py)
    by_measure = {r["set"]: r for r in rows}
    counts = storage.read_manifest(runs[1])["counts"]
    assert by_measure["instances"] == {"set": "instances", "seq64": counts["instances_seq64"],
                                       "seq128": counts["instances_seq128"]}
    assert by_measure["eval_instances"] == {"set": "eval_instances", "seq64": counts["eval_instances_seq64"],
                                            "seq128": counts["eval_instances_seq128"]}
    assert "instances-lengths" in artifacts


def test_cli_takes_the_job_options_and_passes_the_rest_to_beam(corpus, vocab_file, runs, tmp_path) -> None:
    from flows.cli.main import app

    out = str(tmp_path / "run")
    sets = ["instances.lengths=[{max_seq_length: 64, max_predictions_per_seq: 10},"
            " {max_seq_length: 128, max_predictions_per_seq: 20}]",
            "instances.dupe_factor=3", "instances.num_shards=3", "instances.seed=7",
            "instances.next_sentence_prediction=true", "instances.masking=static",
            "pretrain.phases=[{max_seq_length: 128, micro_batch_size: 16, global_batch_size: 32}]"]
    argv = ["instances", "--corpus", corpus, "--vocab", vocab_file, "--output", out, "--preset", "demo",
            "--workers", "1"]
    for s in sets:
        argv += ["--set", s]
    done = CliRunner().invoke(app, [*argv, "--", "--direct_num_workers=3"])  # Beam options after --
    assert done.exit_code == 0, done.output
    manifest = storage.read_manifest(out)
    assert manifest["config"] == storage.read_manifest(runs[1])["config"]
    for length in (64, 128):  # one random-next pool here, four in `runs`: same config, own bytes
        shards = storage.read_manifest(storage.join(out, f"seq{length}"))["shards"]
        assert len(shards) == 3 and sum(s["count"] for s in shards) > 50


def test_a_vocab_without_specials_is_refused_before_any_work(corpus, tmp_path) -> None:
    bad = tmp_path / "vocab.txt"
    bad.write_text("[PAD]\n[UNK]\nthe\nnews\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"\[CLS\]|\[MASK\]") as err:
        create_instances.run(CONFIG, corpus, str(bad), str(tmp_path / "out"), workers=1)
    assert str(bad) in str(err.value)
    assert not (tmp_path / "out").exists()


def test_output_of_another_stage_is_refused(corpus, vocab_file) -> None:
    with pytest.raises(ValueError, match='is finished \\(its _MANIFEST.json, stage "corpus"'):
        create_instances.run(CONFIG, corpus, vocab_file, corpus, workers=1)
    assert storage.read_manifest(corpus)["stage"] == "corpus"  # left alone


def test_a_shard_that_is_not_documents_names_the_file(tmp_path, vocab_file) -> None:
    folder = str(tmp_path / "corpus")
    shard = storage.join(folder, "docs-00000-of-00001.parquet")
    with storage.open_file(shard, "wb") as f:
        pq.write_table(pa.table({"text": ["hello"]}), f)
    storage.write_manifest(folder, stage="corpus", config={}, shards=[storage.shard_entry(shard, 1)])
    with pytest.raises(Exception, match="docs-00000-of-00001.parquet has no column"):
        create_instances.run(CONFIG, folder, vocab_file, str(tmp_path / "out"), workers=1)
