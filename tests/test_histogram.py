"""bert_core/histogram.py: histograms stored as edges and counts, read back in numeric order,
old label dicts included."""

from __future__ import annotations

import json

import pytest

from bert_core.histogram import Histogram, bin_index, is_histogram
from bert_core.instances.stats import InstanceStats

SENTENCE_EDGES = (1, 2, 5, 10, 20, 50, 100, None)


def test_values_fall_in_their_bins_and_labels_say_which() -> None:
    h = Histogram.of([1, 3, 4, 12, 99, 100, 5000], SENTENCE_EDGES)
    assert h.counts == (1, 2, 0, 1, 0, 1, 2)
    assert h.labels() == ["1", "2-4", "5-9", "10-19", "20-49", "50-99", "100+"]
    assert h.format() == "1: 1, 2-4: 2, 5-9: 0, 10-19: 1, 20-49: 0, 50-99: 1, 100+: 2"
    assert h.total() == 7
    with pytest.raises(ValueError, match="0 is outside"):
        bin_index(0, SENTENCE_EDGES)
    with pytest.raises(ValueError, match="9 is outside"):
        bin_index(9, (1, 5, 9))


def test_stored_form_survives_sorted_json_keys() -> None:
    # the manifest writer sorts keys: labels as keys came back "10-19" before "2-4"
    h = Histogram.of(range(1, 300), SENTENCE_EDGES)
    back = Histogram.from_json(json.loads(json.dumps(h.to_json(), sort_keys=True)))
    assert back == h and back.labels()[:3] == ["1", "2-4", "5-9"]
    assert Histogram.from_bins(SENTENCE_EDGES, {1: 4, 6: 2}).counts == (0, 4, 0, 0, 0, 0, 2)
    assert h.merge(h).counts == tuple(2 * c for c in h.counts)
    with pytest.raises(ValueError, match="other edges"):
        h.merge(Histogram.empty((1, 2, None)))


def test_old_label_dicts_read_back_in_numeric_order() -> None:
    corpus = Histogram.from_json({"10-19": 3, "100+": 1, "2-4": 5, "<2": 2})  # sorted as text
    assert corpus.items() == [("0-1", 2), ("2-4", 5), ("5-9", 0), ("10-19", 3), ("20-99", 0), ("100+", 1)]
    vocab = Histogram.from_json({"10": 1, "2": 5, "1": 3})
    assert vocab.items() == [("1", 3), ("2", 5), ("3-9", 0), ("10", 1)]
    assert is_histogram({"1-8": 3, "9-16": 4}) and is_histogram(vocab.to_json())
    assert not is_histogram({"min": 1, "max": 3}) and not is_histogram({})
    with pytest.raises(ValueError, match="overlapping"):
        Histogram.from_json({"1-10": 1, "5-9": 2})


def test_instance_stats_store_their_length_histogram_as_data_and_read_old_manifests() -> None:
    stats = InstanceStats(max_seq_length=64)
    for n in (5, 8, 9, 64):
        stats.add(list(range(n)), [], [], 0, mask_id=103)
    summary = stats.summary()["length_histogram"]
    assert summary["edges"] == [1, 9, 17, 25, 33, 41, 49, 57, 65]
    assert summary["counts"] == [2, 1, 0, 0, 0, 0, 0, 1]
    assert Histogram.from_json(summary).labels()[:2] == ["1-8", "9-16"]
    stored = json.loads(json.dumps(stats.to_dict(), sort_keys=True))
    assert InstanceStats.from_dict(stored) == stats
    old = {**stored, "length_histogram": {"0": 2, "8": 1, "56": 1}}  # bin start -> count
    assert InstanceStats.from_dict(old) == stats


def test_stats_command_prints_histograms_in_numeric_order() -> None:
    from flows.cli.manifests import format_stats

    corpus = {"stage": "corpus", "uri": "c", "created": "now", "counts": {"documents": 6},
              "stats": {"sentences_per_doc": Histogram.of([1, 3, 30, 30, 2000, 20000], (1, 2, 5, 10, 20, 50,
                                                                                       100, 1000, None)).to_json(),
                        "chars_per_doc": {"10-19": 1, "2-4": 5}}}  # a manifest of bin labels
    shown = format_stats(json.loads(json.dumps(corpus, sort_keys=True))).splitlines()
    assert "sentences_per_doc: 1: 1, 2-4: 1, 5-9: 0, 10-19: 0, 20-49: 2, 50-99: 0, 100-999: 0, 1000+: 2" in shown
    assert "chars_per_doc: 2-4: 5, 5-9: 0, 10-19: 1" in shown
    stats = InstanceStats(max_seq_length=16)
    stats.add(list(range(9)), [], [], 0, mask_id=103)
    instances = {"stage": "instances", "uri": "i", "created": "now", "counts": {},
                 "stats": {"seq16": stats.summary()}}
    assert "  length_histogram: 9-10: 1" in format_stats(json.loads(json.dumps(instances, sort_keys=True)))
