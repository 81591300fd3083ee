import json

import pytest

from bert_core import storage


@pytest.fixture(params=["local", "file", "memory"])
def root(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "out")
    if request.param == "file":
        return f"file://{tmp_path}/out"
    return f"memory://bertpipe-test-{id(request)}/out"


def test_write_read_list_and_manifest(root):
    shard = storage.join(root, "part-00000-of-00001.txt")
    storage.write_text(shard, "hello\n")
    assert storage.exists(shard)
    assert [u.rsplit("/", 1)[-1] for u in storage.list_files(root)] == ["part-00000-of-00001.txt"]
    with pytest.raises(storage.UnfinishedWriteError, match="unfinished write"):
        storage.read_manifest(root)
    entry = storage.shard_entry(shard, count=1)
    assert entry["sha256"] == "5891b5b522d5df086d0ff0b110fbd9d21bb4fc7163af34d08286a2e846f6be03"
    storage.write_manifest(root, stage="test", config={"a": 1}, shards=[entry], counts={"read": 1})
    m = storage.read_manifest(root)
    assert m["stage"] == "test" and m["counts"] == {"read": 1} and m["schema_version"] == 1
    assert m["code_version"]
    assert storage.shard_uris(root, m) == [shard]
    # the manifest is the last file and no temporary is left behind
    assert sorted(u.rsplit("/", 1)[-1] for u in storage.list_files(root)) == [
        "_MANIFEST.json", "part-00000-of-00001.txt"]


def test_glob_and_join(tmp_path):
    for name in ["a.txt", "b.txt", "c.md"]:
        (tmp_path / name).write_text(name)
    assert [p.rsplit("/", 1)[-1] for p in storage.glob(str(tmp_path / "*.txt"))] == ["a.txt", "b.txt"]
    assert storage.join("gs://bucket/x/", "y", "z.parquet") == "gs://bucket/x/y/z.parquet"
    assert storage.split_protocol("gs://b/p") == ("gs", "b/p")


def test_manifest_of_missing_folder_says_so(tmp_path):
    with pytest.raises(storage.UnfinishedWriteError, match="does not exist"):
        storage.read_manifest(str(tmp_path / "nothing"))


def test_newer_schema_is_refused(tmp_path):
    (tmp_path / "_MANIFEST.json").write_text(json.dumps({"schema_version": 99}))
    with pytest.raises(ValueError, match="schema_version 99"):
        storage.read_manifest(str(tmp_path))


def test_filesystem_is_rebuilt_after_fork():
    import os

    fs = storage.filesystem("/tmp")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: a fresh instance, not the parent's
        os.write(w, b"1" if storage.filesystem("/tmp") is not fs else b"0")
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(r, 1) == b"1"


def test_inputs_are_recorded_with_their_manifest_sha256_and_checked(root):
    source, made = storage.join(root, "corpus"), storage.join(root, "vocab")
    storage.write_manifest(source, stage="corpus", config={})
    read = storage.read_manifest(source)
    assert read["manifest_sha256"] == storage.sha256(storage.join(source, storage.MANIFEST))
    storage.write_manifest(made, stage="vocab", config={}, inputs=[read])
    manifest = storage.read_manifest(made)
    (entry,) = manifest["inputs"]
    assert entry["uri"] == storage.to_uri(source) and entry["sha256"] == read["manifest_sha256"]
    storage.check_inputs(manifest)  # unchanged: nothing to say
    storage.write_manifest(source, stage="corpus", config={"again": True})  # the stage ran again
    assert storage.input_problems(manifest) == [(storage.to_uri(source), "changed (its corpus stage ran "
                                                 "again or it was edited)")]
    assert storage.input_problems(manifest, stages=["books"]) == []
    with pytest.raises(storage.ManifestError, match=f"re-run vocab for {made}, or restore {source}"):
        storage.check_inputs(manifest)
    storage.remove(source)
    with pytest.raises(storage.ManifestError, match=f"its input {source} is gone"):
        storage.check_inputs(manifest)


def test_a_copied_folder_is_read_where_it_is_now(tmp_path):
    import shutil

    storage.write_manifest(str(tmp_path / "a"), stage="corpus", config={})
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    shutil.rmtree(tmp_path / "a")
    assert storage.read_manifest(str(tmp_path / "b"))["uri"] == str(tmp_path / "b")


def test_a_moved_root_reads_what_its_manifests_recorded_where_it_is_now(tmp_path):
    import shutil

    old, new, outside = tmp_path / "data", tmp_path / "elsewhere" / "copy", tmp_path / "books"
    assert storage.root_name(str(old)) == str(old)  # a new root is named where it is, and keeps it
    corpus, vocab = storage.join(str(old), "corpus", "c1"), storage.join(str(old), "vocab", "v1")
    storage.write_text(storage.join(str(outside), "vocab.txt"), "[PAD]\n")
    storage.write_manifest(corpus, stage="corpus", config={})
    storage.write_manifest(vocab, stage="vocab", config={}, inputs=[storage.read_manifest(corpus)],
                           vocab_file=storage.join(vocab, "vocab.txt"), given=str(outside / "vocab.txt"))
    shutil.copytree(old, new)
    shutil.move(old, tmp_path / "away")
    old.write_text("moved\n")  # nothing can be read under the old place

    manifest = storage.read_manifest(storage.join(str(new), "vocab", "v1"))
    assert manifest["written_uri"] == vocab and manifest["uri"] == f"{new}/vocab/v1"
    assert storage.relocated(manifest, manifest["vocab_file"]) == f"{new}/vocab/v1/vocab.txt"
    assert storage.relocated(manifest, manifest["given"]) == str(outside / "vocab.txt")  # outside the root
    assert storage.input_problems(manifest) == []  # its input found in the copy, unchanged
    storage.remove(f"{new}/corpus/c1")
    assert storage.input_problems(manifest) == [(f"{new}/corpus/c1", "is gone (no _MANIFEST.json)")]
    assert storage.root_name(str(new)) == str(old)  # the copy keeps its name, so its versions
    assert storage.find_root(f"{new}/vocab/v1") == str(new)


def test_a_root_without_its_name_is_named_where_its_stages_were_written(tmp_path):
    import shutil

    old, new = tmp_path / "data", tmp_path / "copy"
    storage.write_manifest(storage.join(str(old), "corpus", "c1"), stage="corpus", config={})
    shutil.copytree(old, new)
    assert storage.root_name(str(new)) == str(old)
    assert json.loads((new / storage.ROOT_FILE).read_text())["name"] == str(old)
    assert storage.root_name(str(tmp_path / "fresh")) == str(tmp_path / "fresh")
