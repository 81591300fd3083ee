"""flows/artifacts.py, and against the session's real Prefect server on 127.0.0.1."""

from __future__ import annotations

import base64
import io

import pytest

from flows import artifacts


def _png_bytes(url: str) -> bytes:
    prefix = "data:image/png;base64,"
    assert url.startswith(prefix)
    return base64.b64decode(url[len(prefix):], validate=True)


def test_png_data_url_is_a_real_png_of_the_figure():
    from PIL import Image

    fig = artifacts.line_plot({"loss": ([0, 1, 2, 3], [9.0, 7.5, 6.0, 5.5])}, title="loss")
    png = _png_bytes(artifacts.png_data_url(fig))
    image = Image.open(io.BytesIO(png))
    assert image.format == "PNG"
    # 6 x 3.2 inches at 80 dpi, minus the tight bounding box trim
    assert 300 < image.width <= 480 and 150 < image.height <= 256


def test_histogram_takes_values_or_a_stored_histogram():
    from PIL import Image

    from bert_core.histogram import Histogram

    stored = Histogram.of([64, 64, 96, 128, 128, 128], edges=(1, 33, 65, 97, 129)).to_json()
    for fig in (artifacts.histogram([1, 2, 2, 3, 3, 3], "len", "tokens", bins=3),
                artifacts.histogram(stored, "len", "tokens")):
        bars = fig.axes[0].patches
        assert sorted(round(p.get_height()) for p in bars) == [1, 2, 3]
        assert Image.open(io.BytesIO(_png_bytes(artifacts.png_data_url(fig)))).format == "PNG"
    labels = [t.get_text() for t in fig.axes[0].get_xticklabels()]
    assert labels == ["33-64", "65-96", "97-128"]  # the empty first bin left out


def test_length_bins_are_drawn_in_numeric_order_after_a_json_round_trip():
    import json

    from bert_core.histogram import Histogram

    # a manifest of bin labels, read back from JSON with sorted keys: "10-19" before "2-4"
    bins = json.loads(json.dumps({"<2": 1, "2-4": 5, "5-9": 7, "10-19": 3, "20-49": 2,
                                  "100-199": 4, "1000+": 6}, sort_keys=True))
    assert list(bins)[:3] == ["10-19", "100-199", "1000+"]
    fig = artifacts.histogram(bins, "Sentences per document", "sentences")
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert labels == ["0-1", "2-4", "5-9", "10-19", "20-49", "50-99", "100-199", "200-999", "1000+"]
    assert [round(p.get_height()) for p in ax.patches] == [1, 5, 7, 3, 2, 0, 4, 0, 6]
    # the stored form keeps its order through the same round trip
    stored = Histogram.from_json(bins).to_json()
    back = json.loads(json.dumps(stored, sort_keys=True))
    fig = artifacts.histogram(back, "Sentences per document", "sentences")
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == labels


def test_numbers_keep_four_significant_digits():
    assert [artifacts.round_number(v) for v in (0.8444219, 9.876543, 1234.5678, 2.5e-05, 123456.7, 0.0)] == \
        [0.8444, 9.877, 1235, 2.5e-05, 123457, 0.0]
    assert artifacts.round_number(float("nan")) == "nan"


def test_empty_columns_are_hidden_and_wide_tables_fit():
    # pre-training metrics on CPU: MFU is None in every row, so the column is left out
    rows = [{"kind": "train", "phase": 1, "step": s, "loss": 10 - s / 3, "mlm_loss": 9.0, "mlm_acc": 0.1,
             "nsp_loss": 0.69, "nsp_acc": 0.5, "lr": 1e-4, "seq_per_s": 12.3456, "tokens_per_s": 1234.567,
             "mfu": None} for s in range(1, 13)]
    parts = artifacts.table_parts(rows)
    assert len(parts) == 2 and all(len(part) == 12 for part in parts)
    columns = [list(part[0]) for part in parts]
    assert all(len(c) <= artifacts.MAX_COLUMNS and c[:3] == ["kind", "phase", "step"] for c in columns)
    assert sorted(columns[0][3:] + columns[1][3:]) == sorted(
        ["loss", "mlm_loss", "mlm_acc", "nsp_loss", "nsp_acc", "lr", "seq_per_s", "tokens_per_s"])
    assert parts[0][0]["loss"] == 9.667 and parts[1][0]["tokens_per_s"] == 1235

    # few rows, many columns: one column per row instead
    stats = [{"set": name, "instances": n, "eval_instances": 3, "tokens": 10 * n, "mean_length": 55.123,
              "masked_fraction": 0.1498765, "mask_token": 0.8, "kept": 0.1, "random_token": 0.1,
              "random_next": 0.5} for name, n in (("seq64", 120), ("seq128", 60))]
    (table,) = artifacts.table_parts(stats)
    assert table[0] == {"set": "instances", "seq64": 120, "seq128": 60}
    assert {"set": "masked_fraction", "seq64": 0.1499, "seq128": 0.1499} in table and len(table) == 9

    narrow = [{"reason": "too_short", "docs": 3}, {"reason": "redirect", "note": 0.5}]
    assert artifacts.table_parts(narrow) == [[{"reason": "too_short", "docs": 3, "note": None},
                                              {"reason": "redirect", "docs": None, "note": 0.5}]]


def test_bad_key_is_refused_before_reaching_the_server():
    with pytest.raises(ValueError, match="lowercase letters"):
        artifacts.publish_markdown("Pretrain_Report", "x")


def test_artifacts_are_stored_intact_on_a_real_server(prefect_api):
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    fig = artifacts.histogram([3, 5, 5, 8], "Instance length", "tokens", bins=4)
    image_md = "# Report\n\n" + artifacts.markdown_image(fig, "lengths") + "\n"

    @flow
    def report() -> str:
        artifacts.publish_table("test-counts", [{"reason": "too_short", "docs": 3},
                                                {"reason": "redirect", "docs": 100, "note": 0.1234567}])
        artifacts.publish_markdown("test-report", image_md, "with a picture")
        first = artifacts.progress("test-progress", 0.25, "starting")
        second = artifacts.progress("test-progress", 1.5, "done")  # clamped to 100 %
        assert first == second
        from prefect.runtime import flow_run
        return flow_run.id

    run_id = report()

    def latest(key: str):
        with get_client(sync_client=True) as client:
            return client.read_artifacts(
                artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))

    (md,) = latest("test-report")
    assert md.type == "markdown" and md.data == image_md and str(md.flow_run_id) == run_id
    assert _png_bytes(md.data.split("(", 1)[1].rstrip(")\n"))[:8] == b"\x89PNG\r\n\x1a\n"
    (table,) = latest("test-counts")
    import json
    rows = json.loads(table.data) if isinstance(table.data, str) else table.data
    assert rows == [{"reason": "too_short", "docs": 3, "note": None},
                    {"reason": "redirect", "docs": 100, "note": 0.1235}]
    (prog,) = latest("test-progress")  # one artifact, updated in place
    assert prog.type == "progress" and float(prog.data) == 100.0 and prog.description == "done"
