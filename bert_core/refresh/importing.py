"""Import a transformers-layout BERT checkpoint (a public model such as MiniLM, BERT-base, SciBERT)
as a version of a storage root's model line, so that the refresh continues it on your own text.

    bertpipe models import samples/models/minilm
    bertpipe refresh --date 20261201              (continues models:current, on its vocab)

The checkpoint is loaded into our pre-training model (masked-LM and next-sentence heads it lacks
start from a fixed seed, so every reader of the version sees the same model) and written as
``models/<version>/`` with its manifest and card. Its vocab becomes ``vocab/<version>/``, written
as the vocab stage writes one (``vocab.txt``, ``tokenizer.json``, a manifest recording the
casing), which the instances stage accepts. The version is registered, with no parent, and made
current. Both folders are written under their lease and named by their content: importing the
same checkpoint again changes nothing.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from bert_core import lease, storage
from bert_core.config import VocabConfig, config_hash
from bert_core.failures import Refusal
from bert_core.model.bert import BertForPreTraining
from bert_core.model.checkpoint import CheckpointError, load_into, load_pretrained, save_pretrained
from bert_core.refresh.registry import Registry, registry_root
from bert_core.vocab.tokenization import Tokenizer, parse_vocab, vocab_problems

HEAD_SEED = 0  # the init of heads a checkpoint lacks: fixed, so the version is one model


class ModelImportError(Refusal):
    """A folder that cannot be imported as a model version."""


def _check_folder(path: str) -> None:
    if not storage.exists(path):
        raise ModelImportError(f"{path} does not exist; give a transformers-layout model folder "
                           "(config.json, model.safetensors, vocab.txt)")
    if not storage.exists(storage.join(path, "config.json")):
        raise ModelImportError(f"{path} has no config.json: not a transformers-layout model folder")
    vocab = storage.join(path, "vocab.txt")
    if not storage.exists(vocab):
        raise ModelImportError(f"{path} has no vocab.txt, so the line would have no vocab to make instances "
                           "with; copy the model's WordPiece vocab.txt beside its config.json")
    problems = vocab_problems(parse_vocab(storage.read_text(vocab), source=storage.to_uri(vocab)))
    if problems:
        raise ModelImportError(f"{storage.to_uri(vocab)} is not a usable BERT vocab: {'; '.join(problems)}")


def import_vocab(path: str, storage_root: str) -> str:
    """``vocab/<version>/`` of the storage root from a model folder's ``vocab.txt`` and casing
    (``tokenizer_config.json`` or ``tokenizer.json``); returns its URI."""
    tokenizer = Tokenizer.from_pretrained_dir(path)
    source = storage.join(path, "vocab.txt")
    cfg = VocabConfig(vocab_file=storage.to_uri(source), vocab_size=max(128, tokenizer.vocab_size),
                      lowercase=tokenizer.lowercase, strip_accents=tokenizer.strip_accents,
                      max_input_chars_per_word=tokenizer.max_input_chars_per_word)
    output = storage.join(storage_root, "vocab", config_hash("imported-vocab", storage.sha256(source),
                                                              tokenizer.settings()))
    with lease.hold(output, "vocab") as held:
        if held.finished or storage.has_manifest(output):
            return output
        tokenizer.save(output)
        files = [storage.shard_entry(storage.join(output, name)) for name in ("vocab.txt", "tokenizer.json")]
        held.check()
        storage.write_manifest(output, fence=lease.fence(output, held.attempt),
                               stage="vocab", config=cfg.model_dump(mode="json") | tokenizer.settings(),
                               shards=files, counts={"vocab_size": tokenizer.vocab_size, "vocab_size_requested": None,
                                                     "trained": False},
                               imported_from=storage.to_uri(path))
    return output


def import_model(path: str, storage_root: str) -> dict[str, Any]:
    """Import the checkpoint at ``path`` into ``storage_root``'s registry and make it current;
    returns its registry record."""
    path = storage.to_uri(path).rstrip("/")
    _check_folder(path)
    cfg, state = load_pretrained(path)
    vocab = import_vocab(path, storage_root)
    tokenizer = Tokenizer.from_pretrained_dir(vocab)
    if (cfg.vocab_size or 0) < tokenizer.vocab_size:
        raise ModelImportError(f"{path}/config.json: vocab_size={cfg.vocab_size} but vocab.txt has "
                           f"{tokenizer.vocab_size} tokens; the embedding has no row for some of them")
    registry = Registry(registry_root(storage_root))
    storage.root_name(storage_root)  # the root keeps its name if it is moved later
    weights = [u for u in storage.list_files(path) if u.rsplit("/", 1)[-1].startswith(("model", "pytorch_model"))]
    version = config_hash("imported", storage.sha256(storage.join(path, "config.json")),
                          sorted(storage.sha256(u) for u in weights), storage.manifest_sha256(vocab))
    output = storage.join(registry.root, version)
    with lease.hold(output, "model") as held:
        if not (held.finished or storage.has_manifest(output)):
            torch.manual_seed(HEAD_SEED)
            model = BertForPreTraining(cfg)
            try:
                load_into(model, state, source=path)
            except CheckpointError as err:
                raise ModelImportError(str(err)) from None
            save_pretrained(model, output, vocab_file=storage.join(vocab, "vocab.txt"),
                            lowercase=tokenizer.lowercase)
            files = [f for f in storage.list_files(output) if f.rsplit("/", 1)[-1] not in (storage.MANIFEST, lease.LEASE, lease.LOCK)]
            held.check()
            storage.write_manifest(output, fence=lease.fence(output, held.attempt),
                                   stage="model", config={"imported_from": path, "head_seed": HEAD_SEED},
                                   inputs=[storage.read_manifest(vocab)],
                                   shards=[storage.shard_entry(f) for f in files], counts={"files": len(files)},
                                   source_config=json.loads(storage.read_text(storage.join(path, "config.json"))))
    record = registry.register({
        "version": version, "parent": None, "line": vocab.rstrip("/").rsplit("/", 1)[-1],
        "model": storage.to_uri(output), "vocab": storage.to_uri(vocab), "init": "import",
        "imported_from": path, "steps": 0, "tokens_seen": 0,
        "gate": {"decision": "promote", "why": f"imported from {path} by hand: the start of a line", "rows": []},
    })
    if registry.current() != version:
        registry.promote(version)
        record = registry.register({"version": version, "promoted": registry.aliases()["moved"]})
    return record
