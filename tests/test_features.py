"""Frozen feature extraction: layer choices, first-word-piece alignment (checked against
transformers' BertModel on the real MiniLM weights), long sentences, Parquet output."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from bert_core.finetune.features import LAYER_CHOICES, combine_layers, extract_file, word_features
from bert_core.model.bert import BertModel
from bert_core.vocab.tokenization import load_tokenizer

SENTENCES = [["Rockwell", "International", "said", "Tuesday", "it", "signed", "a", "contract", "."],
             ["Soubirous", "appeared", "in", "Lourdes", "in", "1858", "."]]


@pytest.fixture(scope="module")
def minilm(samples_dir):
    torch.set_num_threads(1)
    path = str(samples_dir / "models" / "minilm")
    return path, BertModel.from_pretrained(path), load_tokenizer(path)


def test_combine_layers_definitions():
    hs = tuple(torch.full((1, 2, 3), float(i)) for i in range(7))  # embeddings + 6 layers
    assert combine_layers(hs, "embeddings")[0, 0, 0] == 0
    assert combine_layers(hs, "last")[0, 0, 0] == 6
    assert combine_layers(hs, "second_to_last")[0, 0, 0] == 5
    assert combine_layers(hs, "sum_last_four")[0, 0, 0] == 3 + 4 + 5 + 6
    assert combine_layers(hs, "all")[0, 0, 0] == sum(range(1, 7))
    cat = combine_layers(hs, "concat_last_four")
    assert cat.shape == (1, 2, 12) and cat[0, 0, ::3].tolist() == [3, 4, 5, 6]
    with pytest.raises(ValueError, match="choose one of"):
        combine_layers(hs, "middle")


@pytest.mark.parametrize("layers", ["last", "sum_last_four", "concat_last_four"])
def test_word_features_equal_transformers_hidden_states_at_first_pieces(minilm, layers):
    from transformers import BertModel as HFBertModel

    path, model, tok = minilm
    hf = HFBertModel.from_pretrained(path).eval()
    feats = word_features(model, tok, SENTENCES, layers=layers)
    split_words = 0
    for words, ours in zip(SENTENCES, feats, strict=True):
        pieces = tok.encode_words(words)
        ids = [tok.cls_id, *[p for w in pieces for p in w], tok.sep_id]
        firsts = np.cumsum([1] + [len(w) for w in pieces[:-1]])  # position of each word's first piece
        split_words += sum(len(w) > 1 for w in pieces)
        with torch.no_grad():
            hs = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
        ref = combine_layers(hs, layers)[0, firsts].numpy()
        assert ours.shape == ref.shape
        np.testing.assert_allclose(ours, ref, atol=2e-4, rtol=1e-4)
    assert split_words > 0  # the check covers words split into several pieces


def test_long_sentences_are_windowed_not_truncated(minilm):
    _, model, tok = minilm
    long = [f"word{i}" for i in range(60)]  # ~3 pieces a word: far more than 32
    (feats,) = word_features(model, tok, [long], layers="last", max_seq_length=32)
    assert feats.shape == (60, 384)
    assert np.all(np.abs(feats).sum(axis=1) > 0)  # every word got a vector


def test_extract_file_text_and_conll_to_parquet(minilm, tmp_path):
    import pyarrow.parquet as pq

    path, _, _ = minilm
    text = tmp_path / "sentences.txt"
    text.write_text("\n".join(" ".join(s) for s in SENTENCES) + "\n\n")
    counts = extract_file(path, str(text), str(tmp_path / "t.parquet"), layers="sum_last_four", threads=1)
    table = pq.read_table(tmp_path / "t.parquet")
    assert counts == {"read": 2, "kept": 2, "rejected": 0, "rejected_by_reason": {}}
    assert table.column_names == ["sentence_id", "words", "features"]
    assert table["words"].to_pylist() == SENTENCES
    meta = json.loads(table.schema.metadata[b"bertpipe"])
    assert meta["layers"] == "sum_last_four" and meta["dim"] == 384 and meta["counts"] == counts
    assert (tmp_path / "t.parquet.rejects.jsonl").read_text() == ""
    conll = tmp_path / "valid.txt"
    conll.write_text("-DOCSTART- -X- -X- O\n\nEU NNP B-NP B-ORG\nrejects VBZ B-VP O\n\n")
    extract_file(path, str(conll), str(tmp_path / "c.parquet"), layers="concat_last_four", threads=1)
    table = pq.read_table(tmp_path / "c.parquet")
    assert table["tags"].to_pylist() == [["B-ORG", "O"]]
    assert np.array(table["features"][0].as_py()).shape == (2, 4 * 384)
    assert set(LAYER_CHOICES) >= {"last", "sum_last_four", "concat_last_four", "all"}


def test_extract_file_writes_rejects_and_counts_that_add_up(minilm, tmp_path):
    import pyarrow.parquet as pq

    path, _, _ = minilm
    conll = tmp_path / "valid.txt"
    conll.write_text("EU NNP B-NP B-ORG\nrejects VBZ B-VP O\n\n"
                     "German JJ B-NP B-MISC\ncall NN I-NP MISC\nto TO B-VP 0\n\n"  # two bad tags
                     "Peter NNP B-NP B-PER\nBlackburn NNP I-NP I-PER\n")
    out = tmp_path / "c.parquet"
    counts = extract_file(path, str(conll), str(out), threads=1)
    assert counts == {"read": 3, "kept": 2, "rejected": 1, "rejected_by_reason": {"bad_tag": 1}}
    assert counts["kept"] + counts["rejected"] == counts["read"]
    table = pq.read_table(out)
    assert table["words"].to_pylist() == [["EU", "rejects"], ["Peter", "Blackburn"]]
    meta = json.loads(table.schema.metadata[b"bertpipe"])
    assert meta["counts"] == counts and meta["rejects"] == f"{out}.rejects.jsonl"
    (reject,) = [json.loads(line) for line in (tmp_path / "c.parquet.rejects.jsonl").read_text().splitlines()]
    assert reject["source"] == str(conll) and reject["id"] == 5 and reject["reason"] == "bad_tag"
    assert "call NN I-NP MISC" in reject["detail"] and "2 bad lines" in reject["detail"]
