"""The fault battery: bad inputs, damaged stage outputs and wrong settings, each met with one
line that names the file or field and the fix (never a traceback), and records that are
rejected, not lost (kept + rejected = read)."""

from __future__ import annotations

import bz2
import gzip
import json
import os
import random
import re
import shutil
import string
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from beam_jobs import clean_corpus, create_instances
from bert_core import storage
from bert_core.config import CorpusConfig, InstanceConfig, SequenceSpec, load_config
from bert_core.corpus import documents as D
from bert_core.corpus.dumps import plan_reads
from bert_core.corpus.sentences import split_sentences
from bert_core.model.checkpoint import CheckpointError
from bert_core.pretrain import errors, loop
from bert_core.pretrain.data import InstanceDataError, vocab_file_of
from flows.cli.main import app

PROSE = ("The river runs through the old town. It was first mapped in 1820 by a surveyor, who "
         "walked its banks for three years. Today it feeds two lakes and a canal. ")


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


def assert_one_line(result, code: int, *needles: str) -> None:
    """The command failed with ``code`` and said so in one line holding every needle."""
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    assert len(lines) == 1, result.output
    for needle in needles:
        assert needle in lines[0], lines[0]


def book_text(title: str, chapters: int = 12) -> str:
    return f"{title}\n\n" + "\n\n".join(f"Chapter {i}. {PROSE}" for i in range(chapters))


def counts_add_up(manifest: dict, source: str) -> dict:
    c = manifest["counts"][source]
    assert c["kept"] + c["rejected"] == c["read"]
    return c


# --------------------------------------------------------------------------- corpus inputs


def test_corrupt_gzip_book_is_one_reject_and_the_other_books_are_kept(tmp_path) -> None:
    books = tmp_path / "books"
    books.mkdir()
    (books / "good.txt").write_text(book_text("A good book"))
    packed = gzip.compress(book_text("Another book").encode())
    (books / "broken.txt.gz").write_bytes(packed[:20] + b"\x00garbage\xff" * 50 + packed[-8:])
    nul = book_text("With NULs", chapters=60)  # the NUL lies past the head that marks binary files
    (books / "nul.txt").write_text(nul[:9000] + nul[9000:].replace("old town", "old\x00 town", 1))
    out = tmp_path / "corpus"
    clean_corpus.run(CorpusConfig(books=[str(books / "*")], dedup_near=False), str(out), workers=1)
    manifest = storage.read_manifest(str(out))
    c = counts_add_up(manifest, "books")
    assert (c["read"], c["kept"], c["rejected"]) == (3, 2, 1)
    assert c["rejected_by_reason"] == {D.UNREADABLE_FILE: 1}
    rejects = [json.loads(line) for f in out.glob("rejects-*.jsonl") for line in f.read_text().splitlines()]
    assert "broken.txt.gz" in rejects[0]["detail"]
    sentences = [s for uri in storage.shard_uris(str(out)) for d in D.read_documents(uri) for s in d["sentences"]]
    assert sentences and not any("\x00" in s for s in sentences)


def test_utf16_bz2_dump_larger_than_a_split_is_read_not_thrown_away(tmp_path) -> None:
    rng = random.Random(0)  # distinct words: the dump must stay large once compressed

    def prose() -> str:
        return " ".join(" ".join("".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9)))
                                 for _ in range(12)).capitalize() + "." for _ in range(20))

    pages = "".join(
        f"  <page>\n    <title>River {i}</title>\n    <ns>0</ns>\n    <id>{i}</id>\n"
        f"    <revision><id>1</id><text xml:space=\"preserve\">{prose()}</text></revision>\n  </page>\n"
        for i in range(1, 400))
    xml = ('<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/" version="0.10" xml:lang="en">\n'
           + pages + "</mediawiki>\n")
    dump = tmp_path / "utf16.xml.bz2"
    dump.write_bytes(bz2.compress(xml.encode("utf-16"), 1))  # level 1: many 100 kB blocks
    assert dump.stat().st_size > 256 << 10
    assert [item.kind for item in plan_reads(str(dump))] == ["whole"]
    out = tmp_path / "corpus"
    clean_corpus.run(CorpusConfig(wikipedia=[str(dump)]), str(out), workers=1)
    c = counts_add_up(storage.read_manifest(str(out)), "wikipedia")
    assert (c["read"], c["kept"]) == (399, 399)


def test_single_line_page_is_rejected_not_split_into_many_sentences(tmp_path) -> None:
    giant = "Word. " * 30_000  # one 180k-character paragraph of one-word "sentences"
    pages = "".join(
        f"  <page>\n    <title>{title}</title>\n    <ns>0</ns>\n    <id>{i}</id>\n"
        f"    <revision><id>1</id><text xml:space=\"preserve\">{text}</text></revision>\n  </page>\n"
        for i, (title, text) in enumerate([("Giant", giant), ("River", PROSE * 3)], 1))
    dump = tmp_path / "dump.xml"
    dump.write_text('<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/" version="0.10">\n'
                    + pages + "</mediawiki>\n")
    out = tmp_path / "corpus"
    clean_corpus.run(CorpusConfig(wikipedia=[str(dump)]), str(out), workers=1)
    c = counts_add_up(storage.read_manifest(str(out)), "wikipedia")
    assert (c["read"], c["kept"], c["rejected_by_reason"]) == (2, 1, {D.LINE_TOO_LONG: 1})


def test_an_empty_folder_is_called_empty_not_missing(tmp_path) -> None:
    (tmp_path / "books").mkdir()
    result = invoke("corpus", "--books", str(tmp_path / "books"), "--output", str(tmp_path / "o"))
    assert_one_line(result, 2, "books", "the folder is empty")
    result = invoke("corpus", "--books", str(tmp_path / "nowhere"), "--output", str(tmp_path / "o"))
    assert_one_line(result, 2, "nowhere", "does not exist")


def test_local_runs_take_a_free_port_unless_one_is_set() -> None:
    import socket

    from bert_core.config import PretrainConfig
    from bert_core.pretrain.launch import master_port

    cfg = PretrainConfig()
    assert cfg.master_port is None
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        ports = {master_port(cfg) for _ in range(5)}
        assert busy not in ports and all(p > 0 for p in ports)
    assert master_port(cfg.model_copy(update={"master_port": 29600})) == 29600
    assert master_port(cfg.model_copy(update={"launcher": "no_ssh"})) == 29500


# --------------------------------------------------------------------------- config


@pytest.mark.parametrize("args, needles", [
    (["--set", "pretrain.phases.7.max_steps=1"], ["pretrain.phases", "2 item(s)"]),
    (["--set", "pretrain.phases.x.lr=1"], ["pretrain.phases is a list", "pretrain.phases.0"]),
    (["--set", "workers.foo=1"], ["workers is a single value", "'foo'"]),
    (["--set", "corpus.wikipedia=*.bz2"], ["corpus.wikipedia", "quote it"]),
    (["--set", "nosuch=1"], ["nosuch: unknown key"]),
])
def test_bad_set_is_one_line_naming_the_key(args, needles) -> None:
    assert_one_line(invoke("config", "show", *args), 2, *needles)


def test_bad_config_files_are_one_line_naming_the_file(tmp_path) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("pretrain: [1,\n")
    assert_one_line(invoke("config", "show", "--config", str(broken)), 2, "broken.yaml", "not valid YAML", "line")
    listed = tmp_path / "list.yaml"
    listed.write_text("- 1\n- 2\n")
    assert_one_line(invoke("config", "show", "--config", str(listed)), 2, "list.yaml", "mapping of sections")


def test_bad_literal_option_is_one_line(tmp_path) -> None:
    result = invoke("corpus", "--books", str(tmp_path / "*.txt"), "--text-format", "foo", "--output", str(tmp_path / "o"))
    assert_one_line(result, 2, "text_format", "'none' or 'google'")


@pytest.mark.parametrize("command", ["corpus", "vocab", "instances"])
def test_misspelled_option_of_a_beam_stage_is_refused(command, tmp_path) -> None:
    result = invoke(command, "--corpus-x", "a", "--output", str(tmp_path / "o"))
    assert result.exit_code == 2
    assert "No such option" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "o").exists()


# --------------------------------------------------------------------------- stage boundaries


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("faults")
    (root / "book.txt").write_text(book_text("A book"))
    clean_corpus.run(CorpusConfig(books=[str(root / "book.txt")]), str(root / "corpus"), workers=1)
    return root / "corpus"


def test_truncated_corpus_shard_is_named_at_the_next_stage_and_by_verify(small_corpus, tmp_path) -> None:
    corpus = tmp_path / "corpus"
    shutil.copytree(small_corpus, corpus)
    shard = next(corpus.glob("docs-*.parquet"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    result = invoke("vocab", "--corpus", str(corpus), "--output", str(tmp_path / "vocab"))
    assert_one_line(result, 1, shard.name, "corpus stage wrote", "re-run")
    checked = invoke("verify", str(corpus))
    assert checked.exit_code == 1 and shard.name in checked.output
    assert invoke("verify", str(small_corpus)).exit_code == 0


def test_bit_flipped_shard_fails_its_checksum(small_corpus, tmp_path) -> None:
    corpus = tmp_path / "corpus"
    shutil.copytree(small_corpus, corpus)
    shard = next(corpus.glob("docs-*.parquet"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(storage.ManifestError, match="sha256"):
        storage.check_shards(str(corpus))


def test_manifest_cut_in_half_is_one_line(small_corpus, tmp_path) -> None:
    corpus = tmp_path / "corpus"
    shutil.copytree(small_corpus, corpus)
    manifest = corpus / storage.MANIFEST
    manifest.write_text(manifest.read_text()[:200])
    assert_one_line(invoke("stats", str(corpus)), 1, "_MANIFEST.json", "not valid JSON", "re-run")


# --------------------------------------------------------------------------- outputs


def test_unwritable_output_is_one_line_and_leaves_no_temporary_files(small_corpus, samples_dir, tmp_path) -> None:
    book = tmp_path / "book.txt"
    book.write_text(book_text("A book"))
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")
    result = invoke("corpus", "--books", str(book), "--output", str(a_file / "corpus"))
    assert_one_line(result, 1, "cannot write to", "a-file", "--output")
    result = invoke("vocab", "--corpus", str(small_corpus), "--output", str(a_file / "vocab"))
    assert_one_line(result, 1, "cannot write to", "a-file")
    result = invoke("instances", "--corpus", str(small_corpus), "--vocab",
                    str(samples_dir / "models" / "minilm" / "vocab.txt"), "--output", str(a_file / "instances"))
    assert_one_line(result, 1, "cannot write to", "a-file")
    read_only = tmp_path / "read-only"
    read_only.mkdir()
    read_only.chmod(0o555)
    try:
        if not os.access(read_only, os.W_OK):  # root may write anywhere: then only the cases above
            result = invoke("corpus", "--books", str(book), "--output", str(read_only / "corpus"))
            assert_one_line(result, 1, "cannot write to", "read-only")
    finally:
        read_only.chmod(0o755)


def test_truncated_model_weights_name_the_file(samples_dir, tmp_path) -> None:
    model = tmp_path / "model"
    shutil.copytree(samples_dir / "models" / "minilm", model)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100_000])
    result = invoke("features", "--checkpoint", str(model), "--input",
                    str(samples_dir / "tasks" / "conll" / "ground_truth.txt"), "--output", str(tmp_path / "f.parquet"))
    assert_one_line(result, 1, "model.safetensors", "damaged", "again")


# ---- pre-training
# Real 2-rank DeepSpeed runs of a tiny model. One finished run (3 steps, a checkpoint at every
# step) is shared; each case damages its own copy.

PRETRAIN_SETS = [
    "model.hidden_size=64", "model.num_attention_heads=2", "model.intermediate_size=128",
    "model.num_hidden_layers=1", "model.hidden_dropout_prob=0", "model.attention_probs_dropout_prob=0",
    "instances.lengths=[{max_seq_length: 64, max_predictions_per_seq: 10}]",
    "pretrain.phases=[{max_seq_length: 64, max_steps: 3, global_batch_size: 8, micro_batch_size: 4, "
    "learning_rate: 0.003, warmup_steps: 1}]",
    "pretrain.log_every=1", "pretrain.checkpoint_every=1",
]


def pretrain(instances: str | Path, run: Path, *sets: str):
    args = [a for s in [*PRETRAIN_SETS, *sets] for a in ("--set", s)]
    return invoke("pretrain", "--instances", str(instances), "--output", str(run), *args)


def assert_stopped(result, code: int, *needles: str) -> None:
    """The run failed with ``code``; its last line says why, holding every needle; no traceback."""
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == code, result.output[-3000:]
    assert "Traceback" not in result.output, result.output[-3000:]
    for needle in needles:
        assert needle in lines[-1], lines[-1]


class Planted:
    """A pickle that writes a file when unpickled: what a hostile ``.pt`` on a shared mount does."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('ran')",)


def unfinished_copy(run: Path, to: Path) -> Path:
    """The finished run without its manifest and export: a run to resume."""
    shutil.copytree(run, to)
    (to / storage.MANIFEST).unlink()
    shutil.rmtree(to / "hf")
    return to


@pytest.fixture(scope="module")
def pretrain_instances(tmp_path_factory, samples_dir) -> Path:
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from test_data import make_instances

    return Path(make_instances(tmp_path_factory.mktemp("pretrain-faults"), samples_dir, num_shards=2, max_docs=20))


@pytest.fixture(scope="module")
def finished_run(pretrain_instances, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("finished") / "run"
    result = pretrain(pretrain_instances, run)
    assert result.exit_code == 0, result.output[-3000:]
    assert (run / "checkpoints" / "phase1" / "latest").read_text() == "step3"
    return run


@pytest.mark.slow
def test_rerun_into_a_finished_run_with_another_config_is_refused(pretrain_instances, finished_run) -> None:
    result = pretrain(pretrain_instances, finished_run, "pretrain.phases.0.learning_rate=0.001")
    assert_one_line(result, 2, str(finished_run), "pretrain.phases", "0.003", "0.001", "new --output")
    same = pretrain(pretrain_instances, finished_run, "pretrain.master_port=29999")  # a port is no change
    assert same.exit_code == 0 and "finished already" in same.output


@pytest.mark.slow
def test_broken_checkpoints_fall_back_and_a_planted_pickle_never_runs(
        pretrain_instances, finished_run, tmp_path) -> None:
    import torch

    run = unfinished_copy(finished_run, tmp_path / "run")
    ckpt = run / "checkpoints" / "phase1"
    (ckpt / "latest").write_text("garbage\x00\x17")
    marker = tmp_path / "code-ran"
    torch.save({"module": Planted(marker)}, ckpt / "step3" / "mp_rank_00_model_states.pt")
    proof = tmp_path / "proof"  # the plant is real: an unguarded load runs it
    torch.save({"module": Planted(proof)}, tmp_path / "proof.pt")
    torch.load(tmp_path / "proof.pt", weights_only=False)
    assert proof.exists()
    step2 = ckpt / "step2" / "mp_rank_00_model_states.pt"
    step2.write_bytes(step2.read_bytes()[: step2.stat().st_size // 2])

    result = pretrain(pretrain_instances, run)
    assert result.exit_code == 0, result.output[-3000:]
    assert not marker.exists()  # no code from the run folder ran
    out = result.output
    assert "latest names 'garbage" in out
    assert f"skipped checkpoint {ckpt}/step3: holds pickled objects that are not weights" in out
    assert f"skipped checkpoint {ckpt}/step2: cannot be read" in out
    assert f"resumed at step 1 from {ckpt}/step1" in out and "Traceback" not in out
    assert storage.has_manifest(str(run)) and (ckpt / "latest").read_text() == "step3"
    # the resumed steps log the rate they used, as the uninterrupted run did (not 0.0)
    lr = {r["step"]: r["lr"] for r in read_train_rows(finished_run)}
    again = {r["step"]: r["lr"] for r in read_train_rows(run)}
    assert again == pytest.approx(lr) and again[2] > 0


def read_train_rows(run: Path) -> list[dict]:
    from bert_core.pretrain.metrics import read_metrics, train_rows

    return train_rows(read_metrics(str(run)))


@pytest.mark.slow
def test_no_checkpoint_that_loads_is_one_line(pretrain_instances, finished_run, tmp_path) -> None:
    run = unfinished_copy(finished_run, tmp_path / "run")
    ckpt = run / "checkpoints" / "phase1"
    (ckpt / "latest").write_text("step9")  # names a step that is not there
    for step in (1, 2, 3):
        model = ckpt / f"step{step}" / "mp_rank_00_model_states.pt"
        model.write_bytes(model.read_bytes()[:1000])
    result = pretrain(pretrain_instances, run)
    assert_stopped(result, 2, f"{ckpt}: no checkpoint loads", "step3 cannot be read", "delete it")
    assert "'step9', not a saved step" in result.output


@pytest.mark.slow
def test_full_disk_at_a_checkpoint_fails_once_and_never_becomes_latest(pretrain_instances, tmp_path) -> None:
    from bert_core import lease

    run = tmp_path / "run"
    planted = threading.Event()

    def fill_the_disk() -> None:  # under the names the run's attempt writes step2 with, once it has them
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            held = lease.read(str(run)) if run.exists() else None
            if held is not None:
                step2 = Path(lease.staging(str(run), held.attempt), "checkpoints", "phase1", "step2")
                step2.mkdir(parents=True, exist_ok=True)
                (step2 / "mp_rank_00_model_states.pt").symlink_to("/dev/full")  # this file's disk is full
                planted.set()
                return
            time.sleep(0.01)

    threading.Thread(target=fill_the_disk, daemon=True).start()
    result = pretrain(pretrain_instances, run)
    assert planted.is_set()
    step2 = run / "checkpoints" / "phase1" / "step2"
    assert_stopped(result, 2, f"{step2}: cannot write the checkpoint", "free space")
    assert "run the same command again" not in result.output  # not an infrastructure retry
    assert (run / "checkpoints" / "phase1" / "latest").read_text() == "step1"


@pytest.mark.slow
def test_truncated_instance_shard_is_a_data_error_not_a_retry(pretrain_instances, tmp_path) -> None:
    instances = tmp_path / "instances"
    shutil.copytree(pretrain_instances, instances)
    shard = sorted((instances / "seq64").glob("*.parquet"))[1]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    result = pretrain(instances, tmp_path / "run")
    assert_stopped(result, 2, shard.name)
    assert "run the same command again" not in result.output


# --------------------------------------------------------------------------- stage inputs


CONFIG = InstanceConfig(lengths=[SequenceSpec(max_seq_length=64, max_predictions_per_seq=10)],
                        dupe_factor=1, num_shards=2, seed=3)


def write_corpus(samples_dir: Path, folder: Path) -> Path:
    """A corpus folder of 30 real news articles, split into sentences."""
    lines = (samples_dir / "news" / "lee_background.cor").read_text(encoding="utf-8").splitlines()
    docs = [(f"news:{i}", split_sentences(line)) for i, line in enumerate(lines[:30])]
    shard = storage.join(str(folder), "docs-00000-of-00001.parquet")
    table = pa.table({
        "doc_id": [d for d, _ in docs], "source": ["news"] * len(docs), "title": [d for d, _ in docs],
        "sentences": pa.array([s for _, s in docs], type=pa.list_(pa.string())),
    })
    with storage.open_file(shard, "wb") as f:
        pq.write_table(table, f)
    storage.write_manifest(str(folder), stage="corpus", config={}, shards=[storage.shard_entry(shard, len(docs))],
                           counts={"documents": len(docs)})
    return folder


def write_vocab(folder: Path, tokens: list[str], num_unused: int) -> Path:
    """A vocab stage folder (what `bertpipe vocab --output folder` leaves) holding ``tokens``."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.txt").write_text("".join(t + "\n" for t in tokens))
    storage.write_manifest(str(folder), stage="vocab",
                           config={"lowercase": True, "strip_accents": None, "num_unused": num_unused})
    return folder


@pytest.fixture(scope="module")
def tokens(samples_dir) -> list[str]:
    return (samples_dir / "models" / "minilm" / "vocab.txt").read_text().splitlines()


@pytest.fixture(scope="module")
def retrained(samples_dir, tokens, tmp_path_factory) -> dict[str, Path]:
    """Instances made with a vocab, then another vocab (fewer [unused] tokens, so every later id
    moves) trained into the same folder: the silent wrong model, set up."""
    root = tmp_path_factory.mktemp("retrained")
    corpus = write_corpus(samples_dir, root / "corpus")
    vocab = write_vocab(root / "vocab", tokens, num_unused=994)
    instances = root / "instances"
    create_instances.run(CONFIG, str(corpus), str(vocab), str(instances), workers=1)
    made_with = storage.read_manifest(str(instances))
    assert made_with["vocab_file"] == str(vocab / "vocab.txt")
    assert made_with["vocab_sha256"] == storage.sha256(str(vocab / "vocab.txt"))
    assert vocab_file_of(str(instances)) == str(vocab / "vocab.txt")
    storage.check_inputs(made_with)  # the inputs are as they were read
    write_vocab(vocab, [t for t in tokens if not t.startswith("[unused")], num_unused=0)
    return {"root": root, "corpus": corpus, "vocab": vocab, "instances": instances}


def test_instances_record_the_manifests_they_read(retrained) -> None:
    manifest = storage.read_manifest(str(retrained["instances"]))
    recorded = {entry["stage"]: entry for entry in manifest["inputs"]}
    assert recorded["corpus"]["uri"] == str(retrained["corpus"])
    assert recorded["corpus"]["sha256"] == storage.manifest_sha256(str(retrained["corpus"]))
    assert recorded["vocab"]["sha256"] != storage.manifest_sha256(str(retrained["vocab"]))  # re-trained


def test_a_retrained_vocab_is_refused_by_pretraining_in_one_line(retrained, tmp_path, capsys) -> None:
    instances, vocab_txt = str(retrained["instances"]), str(retrained["vocab"] / "vocab.txt")
    with pytest.raises(InstanceDataError, match="not the vocab the instances were made with") as err:
        vocab_file_of(instances)
    assert vocab_txt in str(err.value) and f"{instances}/_MANIFEST.json" in str(err.value)
    assert f"re-run instances for {instances}" in str(err.value)
    # the changed vocab manifest says the same, stage by stage
    with pytest.raises(storage.ManifestError) as changed:
        storage.check_inputs(storage.read_manifest(instances))
    assert str(changed.value) == (
        f"{instances}: its input {retrained['vocab']} changed (its vocab stage ran again or it was "
        f"edited) since it was made; re-run instances for {instances}, or restore {retrained['vocab']}")
    # each rank's entry point: one line for the launcher, exit 2 (data: no retry), no traceback
    config = tmp_path / "pretrain_config.json"
    config.write_text(json.dumps(load_config("demo", None, PRETRAIN_SETS).model_dump(mode="json")))
    code = loop.main(["--config", str(config), "--instances", instances, "--output", str(tmp_path / "run")])
    err_lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == errors.CONFIG_ERROR_EXIT and len(err_lines) == 1
    assert err_lines[0].startswith(errors.CONFIG_ERROR_PREFIX) and vocab_txt in err_lines[0]
    assert instances in err_lines[0] and not (tmp_path / "run").exists()


@pytest.mark.slow
def test_bertpipe_pretrain_on_a_retrained_vocab_stops_with_a_data_error(retrained, tmp_path) -> None:
    result = pretrain(retrained["instances"], tmp_path / "run")
    assert_stopped(result, 2, str(retrained["vocab"] / "vocab.txt"), str(retrained["instances"]),
                   "re-run instances")
    assert "run the same command again" not in result.output  # not an infrastructure retry


def test_export_refuses_a_vocab_other_than_the_runs(samples_dir, tokens, tmp_path) -> None:
    import torch

    from bert_core.model.bert import BertForPreTraining
    from bert_core.model.checkpoint import save_pretrained

    run, vocab = tmp_path / "run", samples_dir / "models" / "minilm" / "vocab.txt"
    cfg = load_config("demo", None, PRETRAIN_SETS).model.model_copy(update={"vocab_size": len(tokens)})
    torch.manual_seed(0)
    save_pretrained(BertForPreTraining(cfg), str(run / "hf"), vocab_file=str(vocab))
    storage.write_manifest(str(run), stage="pretrain", config={}, vocab_file=str(vocab),
                           vocab_sha256=storage.sha256(str(run / "hf" / "vocab.txt")))
    other = write_vocab(tmp_path / "other", [t for t in tokens if not t.startswith("[unused")], 0)
    result = invoke("export", str(run / "hf"), "--output", str(tmp_path / "out"),
                    "--vocab", str(other / "vocab.txt"))
    assert_one_line(result, 1, str(other / "vocab.txt"), f"{run}/_MANIFEST.json", "not the vocab",
                    f"--vocab {run}/hf/vocab.txt")
    assert not (tmp_path / "out").exists()
    from bert_core.model.export import export_checkpoint

    with pytest.raises(CheckpointError, match="not the vocab the model was trained with"):
        export_checkpoint(str(run / "hf"), str(tmp_path / "out"), vocab_file=str(other / "vocab.txt"))
    out = export_checkpoint(str(run / "hf"), str(tmp_path / "out"))  # its own vocab ships
    assert (Path(out) / "vocab.txt").read_bytes() == vocab.read_bytes()


def test_a_copied_corpus_folder_works_from_its_new_place(retrained, tokens, tmp_path) -> None:
    first, moved = tmp_path / "first", tmp_path / "moved"
    shutil.copytree(retrained["corpus"], first)
    shutil.copytree(first, moved)
    shutil.rmtree(first)  # the old place is gone; its manifest inside still names it
    assert json.loads((moved / storage.MANIFEST).read_text())["uri"] == str(retrained["corpus"])
    vocab = write_vocab(tmp_path / "vocab", tokens, num_unused=994)
    manifest = create_instances.run(CONFIG, str(moved), str(vocab), str(tmp_path / "instances"), workers=1)
    corpus_input = next(entry for entry in manifest["inputs"] if entry["stage"] == "corpus")
    assert corpus_input["uri"] == str(moved)
    assert manifest["counts"]["documents_read"] == 30 and manifest["counts"]["instances_seq64"] > 0
    storage.check_inputs(manifest)
    assert vocab_file_of(str(tmp_path / "instances")) == str(vocab / "vocab.txt")


# --------------------------------------------------------------------------- fine-tuning inputs


REPO = Path(__file__).resolve().parents[1]


def features(checkpoint: Path, input_: Path, output: Path):
    return invoke("features", "--checkpoint", str(checkpoint), "--input", str(input_),
                  "--output", str(output), "--threads", "1")


def read_rejects(output: Path) -> list[dict]:
    lines = Path(f"{output}.rejects.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


# --------------------------------------------------------------------------- features


def test_features_with_every_sentence_rejected_is_one_line_and_writes_the_rejects(samples_dir, tmp_path):
    conll = tmp_path / "valid.txt"  # a CoNLL name, but its last column holds no tags
    conll.write_text("EU rejects German call\n\nPeter Blackburn\n\nBrussels 1996-08-22\n")
    out = tmp_path / "features.parquet"
    result = features(samples_dir / "models" / "minilm", conll, out)
    assert_one_line(result, 1, str(conll), "none of its 3 sentences was kept", "bad_tag 3",
                    f"{out}.rejects.jsonl", "--format text")
    rejects = read_rejects(out)
    read = int(re.search(r"none of its (\d+) sentences", result.output).group(1))
    assert 0 + len(rejects) == read == 3  # kept + rejected = read
    assert {r["source"] for r in rejects} == {str(conll)} and [r["id"] for r in rejects] == [1, 3, 5]
    assert {r["reason"] for r in rejects} == {"bad_tag"}
    assert not out.exists()


def test_features_of_an_empty_file_is_one_line(samples_dir, tmp_path):
    empty = tmp_path / "sentences.txt"
    empty.write_text("\n  \n")
    out = tmp_path / "features.parquet"
    result = features(samples_dir / "models" / "minilm", empty, out)
    assert_one_line(result, 1, str(empty), "no sentences", "one sentence a line")
    assert read_rejects(out) == [] and not out.exists()  # kept 0 + rejected 0 = read 0


def test_features_of_a_file_that_is_not_utf8_is_one_line(samples_dir, tmp_path):
    latin1 = tmp_path / "sentences.txt"
    latin1.write_bytes("Zoë went to Malmö .\n".encode("latin-1"))
    result = features(samples_dir / "models" / "minilm", latin1, tmp_path / "features.parquet")
    assert_one_line(result, 1, str(latin1), "not UTF-8", "as UTF-8")


def test_features_with_some_sentences_rejected_prints_and_stores_counts(samples_dir, tmp_path):
    conll = tmp_path / "valid.txt"
    conll.write_text("EU NNP B-NP B-ORG\nrejects VBZ B-VP O\n\nGerman JJ B-NP MISC\n\n"
                     "Peter NNP B-NP B-PER\n")
    out = tmp_path / "features.parquet"
    result = features(samples_dir / "models" / "minilm", conll, out)
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output
    assert f"{conll}: read 3, kept 2, rejected 1" in result.output and "bad_tag: 1" in result.output
    assert f"rejects in {out}.rejects.jsonl" in result.output
    counts = json.loads(pq.read_schema(out).metadata[b"bertpipe"])["counts"]
    assert counts["kept"] + counts["rejected"] == counts["read"] == 3
    assert pq.read_table(out).num_rows == counts["kept"] == 2
    (reject,) = read_rejects(out)
    assert (reject["source"], reject["id"], reject["reason"]) == (str(conll), 4, "bad_tag")


# --------------------------------------------------------------------------- conlleval


def conlleval(path: Path) -> SimpleNamespace:
    """``python -m bert_core.finetune.conlleval FILE`` as ``invoke`` reports a command."""
    done = subprocess.run([sys.executable, "-m", "bert_core.finetune.conlleval", str(path)],
                          capture_output=True, text=True, cwd=REPO)
    return SimpleNamespace(exit_code=done.returncode, output=done.stdout + done.stderr)


def conlleval_pl(samples_dir: Path, path: Path) -> subprocess.CompletedProcess:
    with open(path, "rb") as f:
        return subprocess.run(["perl", str(samples_dir / "tasks" / "conll" / "conlleval.pl")],
                              stdin=f, capture_output=True)


def test_conlleval_refuses_a_crlf_file_as_conlleval_pl_does(samples_dir, tmp_path):
    crlf = tmp_path / "predictions.txt"
    crlf.write_bytes(b"EU B-ORG B-ORG\r\nrejects O O\r\n\r\nPeter B-PER B-PER\r\n")
    assert conlleval_pl(samples_dir, crlf).returncode != 0  # the original stops on it too
    assert_one_line(conlleval(crlf), 1, str(crlf), "CR LF", "convert the file to LF line endings")


def test_conlleval_scores_a_trailing_space_as_conlleval_pl_does(samples_dir, tmp_path):
    spaced = tmp_path / "predictions.txt"
    spaced.write_text("EU B-ORG B-ORG \nrejects O O\n\nPeter B-PER B-PER  \nBlackburn I-PER O\n")
    official = conlleval_pl(samples_dir, spaced)
    ours = conlleval(spaced)
    assert ours.exit_code == official.returncode == 0, ours.output
    assert ours.output == official.stdout.decode()
    assert "found: 2 phrases; correct: 1." in ours.output
