"""Measures of a checkpoint beside fine-tuning: a linear probe on each layer's frozen features,
masked-LM accuracy on held-out text, and the TF-IDF arm's scores.

    linear_probe(checkpoint, train, test, labels)          # test macro-F1 per layer
    heldout_mlm_accuracy(checkpoint, examples)              # share of masked pieces predicted
"""

from __future__ import annotations

import numpy as np

from benchmarks.quality.finetune import scores


def mean_features(checkpoint: str, examples: list, max_seq_length: int = 64) -> list:
    """Frozen mean-pooled features of every layer (embeddings first): one [N, H] array per layer."""
    import torch

    from bert_core.finetune.glue import encode_pairs
    from bert_core.model.bert import BertModel
    from bert_core.vocab.tokenization import load_tokenizer

    torch.set_num_threads(1)
    tokenizer = load_tokenizer(checkpoint)
    model = BertModel.from_pretrained(checkpoint).eval()
    ids = encode_pairs(tokenizer, examples, max_seq_length)["input_ids"]
    layers: list[list] = []
    with torch.no_grad():
        for i in range(0, len(ids), 128):
            chunk = ids[i:i + 128]
            T = max(len(x) for x in chunk)
            batch = torch.tensor([x + [tokenizer.pad_id] * (T - len(x)) for x in chunk])
            mask = (batch != tokenizer.pad_id).float()[..., None]
            out = model(batch, torch.zeros_like(batch), mask[..., 0].long(), output_hidden_states=True)
            for n, h in enumerate(out.hidden_states):
                if len(layers) <= n:
                    layers.append([])
                layers[n].append(((h * mask).sum(1) / mask.sum(1)).numpy())
    return [np.concatenate(parts) for parts in layers]


def linear_probe(checkpoint: str, train: list, test: list, labels: tuple[str, ...]) -> list[float]:
    """Test macro-F1 of a logistic regression on each layer's frozen mean-pooled features."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    y_train, y_test = [labels.index(e.label) for e in train], [labels.index(e.label) for e in test]
    out = []
    for f_train, f_test in zip(mean_features(checkpoint, train), mean_features(checkpoint, test), strict=True):
        scaler = StandardScaler().fit(f_train)
        clf = LogisticRegression(max_iter=2000).fit(scaler.transform(f_train), y_train)
        out.append(scores(y_test, clf.predict(scaler.transform(f_test)).tolist())["macro_f1"])
    return out


def heldout_mlm_accuracy(checkpoint: str, examples: list, seed: int = 0, max_seq_length: int = 64) -> float:
    """Masked-LM accuracy on the task's own text (:func:`masked_lm_accuracy`), each example one sequence."""
    from bert_core.finetune.glue import encode_pairs
    from bert_core.vocab.tokenization import load_tokenizer

    sequences = encode_pairs(load_tokenizer(checkpoint), examples, max_seq_length)["input_ids"]
    return masked_lm_accuracy(checkpoint, sequences, seed)


def masked_lm_accuracy(checkpoint: str, sequences: list[list[int]], seed: int = 0) -> float:
    """The product's masked-LM accuracy (``bert_core.pretrain.evaluate.masked_lm_accuracy``, 15% of
    each sequence's pieces masked with ``seed``) of a checkpoint, in percent."""
    import torch

    from bert_core.model.bert import BertForPreTraining
    from bert_core.pretrain.evaluate import masked_lm_accuracy as product_accuracy
    from bert_core.vocab.tokenization import load_tokenizer

    torch.set_num_threads(1)
    model = BertForPreTraining.from_pretrained(checkpoint)
    counts = product_accuracy(model, sequences, load_tokenizer(checkpoint).mask_id, seed)
    return 100 * counts["mlm_correct"] / max(1, counts["predictions"])


def tfidf_scores(train: list, evaluate: list, labels: tuple[str, ...], c: float) -> dict[str, float]:
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression

    vectorizer = TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True, min_df=1)
    x = vectorizer.fit_transform([e.text_a for e in train])
    clf = LogisticRegression(C=c, max_iter=2000).fit(x, [labels.index(e.label) for e in train])
    pred = clf.predict(vectorizer.transform([e.text_a for e in evaluate])).tolist()
    return scores([labels.index(e.label) for e in evaluate], pred)
