"""beam_jobs/dask_runner.py on real Dask clusters: probes of Beam's model that Beam 2.77's own
DaskRunner fails (each marked xfail on it, strict) and ours passes, on an in-process cluster;
then the three jobs on a cluster of two workers that share no disk, against the local runner,
and the same through Beam's portable worker protocol (PortableRunner, external worker pools)."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import apache_beam as beam
import pytest
from apache_beam.metrics import Metrics
from apache_beam.metrics.metric import MetricsFilter
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.transforms.window import GlobalWindows

from beam_jobs.job import counters

OURS = "beam_jobs.dask_runner.DaskRunner"
STOCK = "apache_beam.runners.dask.dask_runner.DaskRunner"
RUNNERS = [OURS, pytest.param(STOCK, marks=pytest.mark.xfail(strict=True, reason="Beam 2.77's DaskRunner"))]


@pytest.fixture(scope="module")
def address():
    from dask.distributed import Client, LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None) as cluster:
        yield cluster.scheduler_address
        for client in list(Client._instances):  # the stock runner leaves its clients open
            client.close()


def run(runner: str, address: str, build) -> beam.runners.runner.PipelineResult:
    p = beam.Pipeline(options=PipelineOptions([f"--runner={runner}", f"--dask_client_address={address}"]))
    build(p)
    result = p.run()
    result.wait_until_finish()
    return result


class Collect(beam.DoFn):
    """Appends each element to a file (a sink: its output is the file)."""

    def __init__(self, path: Path):
        self.path = path

    def process(self, x):
        with open(self.path, "a") as f:
            f.write(json.dumps(x) + "\n")


def collected(path: Path) -> list:
    return sorted(json.loads(line) for line in path.read_text().splitlines()) if path.exists() else []


class SplitOdd(beam.DoFn):
    def process(self, x):
        Metrics.counter("probe", "elements").inc()
        yield beam.pvalue.TaggedOutput("odd", x) if x % 2 else x


@pytest.mark.parametrize("runner", RUNNERS)
def test_each_tagged_output_reaches_only_its_consumers(runner, address, tmp_path) -> None:
    def build(p):
        out = p | beam.Create(range(6)) | beam.ParDo(SplitOdd()).with_outputs("odd", main="even")
        _ = out.even | "Even" >> beam.ParDo(Collect(tmp_path / "even"))
        _ = out.odd | "Odd" >> beam.ParDo(Collect(tmp_path / "odd"))

    run(runner, address, build)
    assert (collected(tmp_path / "even"), collected(tmp_path / "odd")) == ([0, 2, 4], [1, 3, 5])


class SumBundle(beam.DoFn):
    def start_bundle(self):
        self.total = 0

    def process(self, x):
        self.total += x

    def finish_bundle(self):
        yield GlobalWindows.windowed_value(self.total)


@pytest.mark.parametrize("runner", RUNNERS)
def test_outputs_of_finish_bundle_are_kept(runner, address, tmp_path) -> None:
    run(runner, address, lambda p: (p | beam.Create(range(10)) | beam.ParDo(SumBundle())
                                    | beam.CombineGlobally(sum) | beam.ParDo(Collect(tmp_path / "sum"))))
    assert collected(tmp_path / "sum") == [45]


@pytest.mark.parametrize("runner", RUNNERS)
def test_every_sink_runs(runner, address, tmp_path) -> None:
    def build(p):
        _ = p | "First" >> beam.Create([1, 2]) | "A" >> beam.ParDo(Collect(tmp_path / "a"))
        _ = p | "Second" >> beam.Create([3]) | "B" >> beam.ParDo(Collect(tmp_path / "b"))

    run(runner, address, build)
    assert (collected(tmp_path / "a"), collected(tmp_path / "b")) == ([1, 2], [3])


@pytest.mark.parametrize("runner", RUNNERS)
def test_counters_are_committed_to_the_result(runner, address) -> None:
    result = run(runner, address, lambda p: p | beam.Create(range(7)) | beam.ParDo(SplitOdd()))
    found = result.metrics().query(MetricsFilter().with_namespace("probe"))["counters"]
    assert sum(c.committed for c in found) == 7


class Mark(beam.DoFn):
    """Passes elements on; writes a line per bundle, so a recomputed step shows."""

    def __init__(self, path: Path):
        self.path = path

    def process(self, x):
        yield x

    def finish_bundle(self):
        with open(self.path, "a") as f:
            f.write("bundle\n")


@pytest.mark.parametrize("runner", RUNNERS)
def test_a_side_input_is_computed_once(runner, address, tmp_path) -> None:
    def build(p):
        side = p | "Side" >> beam.Create([5]) | "MarkSide" >> beam.ParDo(Mark(tmp_path / "side"))
        _ = (p | "Main" >> beam.Create(range(300))  # several partitions, each reading the side input
             | "Add" >> beam.Map(lambda x, s: x + s, s=beam.pvalue.AsSingleton(side))
             | beam.ParDo(Collect(tmp_path / "main")))

    run(runner, address, build)
    assert collected(tmp_path / "main") == list(range(5, 305))
    assert (tmp_path / "side").read_text().count("bundle") == 1


class BundleId(beam.DoFn):
    def start_bundle(self):
        self.bundle = uuid.uuid4().hex

    def process(self, x):
        yield self.bundle


@pytest.mark.parametrize("runner", RUNNERS)
def test_create_items_are_spread_over_the_workers(runner, address, tmp_path) -> None:
    run(runner, address, lambda p: (p | beam.Create(range(8)) | beam.ParDo(BundleId())
                                    | beam.ParDo(Collect(tmp_path / "bundles"))))
    assert len(set(collected(tmp_path / "bundles"))) >= 2  # more than one task, so more than one worker


# --------------------------------------------------------------------------- the jobs


def test_a_runner_without_metrics_reports_no_counters(address) -> None:
    p = beam.Pipeline(options=PipelineOptions([f"--runner={STOCK}", f"--dask_client_address={address}"]))
    _ = p | beam.Create([1]) | beam.Map(lambda x: x)
    result = p.run()
    result.wait_until_finish()
    assert counters(result, "probe") is None  # where the stock runner's metrics() raises


def test_an_empty_result_fails_in_one_line(tiny_corpus, address, tmp_path) -> None:
    """The stock runner drops what a DoFn emits in finish_bundle and reports no counters: the
    vocab job reads documents and counts no word. The job says so, in one line, and writes no
    manifest."""
    from beam_jobs import build_vocab
    from beam_jobs.job import EmptyResultError
    from bert_core import storage
    from bert_core.config import VocabConfig

    out = tmp_path / "vocab"
    with pytest.raises(EmptyResultError) as err:
        build_vocab.run(VocabConfig(vocab_size=600), str(tiny_corpus), str(out), runner=STOCK,
                    beam_args=[f"--dask_client_address={address}"], shared_storage=True)
    documents = storage.read_manifest(str(tiny_corpus))["counts"]["documents"]
    assert str(err.value).startswith(f"vocab: 0 word counts from {documents} documents of corpus {tiny_corpus}; ")
    assert "\n" not in str(err.value) and documents > 0
    assert not storage.has_manifest(str(out))


def test_a_local_output_on_a_remote_runner_is_refused_before_any_work(tmp_path) -> None:
    from typer.testing import CliRunner

    from flows.cli.main import app

    out = tmp_path / "vocab"
    refused = CliRunner().invoke(app, ["vocab", "--corpus", "gs://bucket/corpus", "--output", str(out),
                                       "--runner", "dask", "--", "--dask_scheduler_file=/nowhere.json"])
    assert refused.exit_code == 1
    assert refused.output.strip() == (
        f"vocab: --output {out} is a local path, which the workers of DaskRunner do not share; give a "
        "URI every worker reaches (--output gs://BUCKET/PREFIX), or set shared_storage: true "
        "(--set shared_storage=true) where it is NFS, gcsfuse or one machine")
    assert not out.exists()


def test_a_runner_among_the_beam_arguments_wins() -> None:
    from beam_jobs.job import resolve_runner

    assert resolve_runner("FnApiRunner", ["--runner=dask", "--x=1"]) == (OURS, ["--x=1"])
    assert resolve_runner("dask", ["--runner", "PortableRunner"]) == ("PortableRunner", [])
    assert resolve_runner("local", []) == ("FnApiRunner", [])


@pytest.fixture(scope="module")
def tiny_corpus(samples_dir, tmp_path_factory) -> Path:
    """Documents from text records (botchan's chapters), cleaned on the local runner."""
    from beam_jobs import clean_corpus
    from bert_core.config import CorpusConfig

    root = tmp_path_factory.mktemp("tiny")
    write_records(samples_dir, root / "records.jsonl", 12)
    out = root / "corpus"
    clean_corpus.run(CorpusConfig(text=[str(root / "records.jsonl")], num_shards=2), str(out), workers=1)
    return out


@pytest.fixture(scope="module")
def vocab_txt(samples_dir) -> Path:
    return samples_dir / "models" / "minilm" / "vocab.txt"


def write_records(samples_dir: Path, path: Path, n: int) -> None:
    """``n`` JSON lines records, each a run of botchan's lines (its text after the licence)."""
    lines = (samples_dir / "books" / "botchan.txt").read_text(encoding="utf-8").splitlines()[40:]
    size = len(lines) // n
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"part{i:03d}", "text": " ".join(lines[i * size:(i + 1) * size])}) + "\n")


# --------------------------------------------------------------------------- the cluster


def stage_digests(folder: Path) -> dict[str, dict]:
    """Every shard's sha256 and every manifest's counts and stats, by path under ``folder``."""
    from bert_core import storage

    found = {}
    for manifest in sorted(folder.rglob(storage.MANIFEST)):
        m = storage.read_manifest(str(manifest.parent))
        shards = {s["path"]: s["sha256"] for s in m["shards"] + m.get("rejects", [])}
        found[str(manifest.parent.relative_to(folder))] = {"shards": shards, "counts": m["counts"],
                                                           "stats": m["stats"]}
    return found


SETS = ["vocab.vocab_size=600", "instances.dupe_factor=1", "corpus.num_shards=2", "shared_storage=true"]


def run_stages(root: Path, records: Path, runner_args: list[str]) -> dict[str, dict]:
    """``bertpipe corpus``, ``vocab`` and ``instances``, as the docs give them, with paths
    relative to ``root`` (the working directory); returns :func:`stage_digests` of each stage."""
    from typer.testing import CliRunner

    from flows.cli.main import app

    common = ["--preset", "demo", *(a for s in SETS for a in ("--set", s)), *runner_args]
    for argv in (["corpus", "--text", str(records.relative_to(root)), "--output", "corpus"],
                 ["vocab", "--corpus", "corpus", "--output", "vocab"],
                 ["instances", "--corpus", "corpus", "--vocab", "vocab", "--output", "instances"]):
        done = CliRunner().invoke(app, [*argv, *common])
        assert done.exit_code == 0, f"bertpipe {argv[0]}: {done.output}"
    return {stage: stage_digests(root / stage) for stage in ("corpus", "vocab", "instances")}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, samples_dir):
    """Two workers, each with a private /tmp and the shared folder mounted in, started in /;
    yields (shared folder with the records, scheduler file)."""
    from tests.clusters import namespaced_cluster, namespaces_refused

    refused = namespaces_refused()
    if refused:
        pytest.skip(refused)
    shared = tmp_path_factory.mktemp("cluster") / "shared"
    shared.mkdir()
    write_records(samples_dir, shared / "records.jsonl", 24)
    with namespaced_cluster(shared) as scheduler_file:
        yield shared, scheduler_file


@pytest.fixture(scope="module")
def local_run(samples_dir, tmp_path_factory) -> dict[str, dict]:
    """The three stages on the local runner (in this process), on the same records."""
    local = tmp_path_factory.mktemp("local")
    write_records(samples_dir, local / "records.jsonl", 24)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(local)
        return run_stages(local, local / "records.jsonl", ["--workers", "1"])


@pytest.mark.slow
def test_three_jobs_on_workers_that_share_no_disk_give_the_local_bytes(cluster, local_run, monkeypatch) -> None:
    """The jobs, given paths relative to the driver's working directory (the workers start in
    /), write every worker's part under the shared folder: the local runner's bytes, counts and
    statistics, and no temporary file left."""
    shared, scheduler_file = cluster
    monkeypatch.chdir(shared)
    got = run_stages(shared, shared / "records.jsonl", ["--runner", "dask", "--", f"--dask_scheduler_file={scheduler_file}"])
    assert got == local_run
    assert local_run["instances"]["."]["counts"]["instances_seq64"] > 0
    assert not list(shared.rglob("_spill")) and not list(shared.rglob("_word_counts"))


@pytest.mark.slow
def test_the_pipeline_runs_its_data_stages_on_the_cluster(prefect_api, cluster, local_run) -> None:
    """``beam_runner: dask`` in the config: the pipeline's corpus, vocab and instances stages
    (Prefect flows, on the test run's Prefect server) run on the cluster and give the local runner's bytes."""
    from bert_core.config import load_config
    from flows.pipeline import data_stages

    shared, scheduler_file = cluster
    cfg = load_config("demo", sets=[*SETS, f"storage_root={shared / 'pipeline'}", "beam_runner=dask",
                                    f"beam_args=[--dask_scheduler_file={scheduler_file}]", "corpus.wikipedia=[]",
                                    "corpus.books=[]", f"corpus.text=[{shared / 'records.jsonl'}]"])
    stages = data_stages(cfg)
    assert {s["status"] for s in stages.values()} == {"completed"}
    assert {name: stage_digests(Path(s["output"])) for name, s in stages.items()} == local_run


@pytest.mark.slow
def test_three_jobs_through_the_portable_worker_protocol_give_the_local_bytes(samples_dir, local_run, tmp_path,
                                                                             monkeypatch) -> None:
    """PortableRunner against Beam's Python job service, the DoFns in SDK harnesses started by
    two external worker pools, each pool in its own mount namespace (private /tmp, the shared
    folder mounted in): the local runner's bytes, counts and statistics. The job service starts
    one harness per job, and the pools take the jobs in turn, so each stage reads what a harness
    in another namespace wrote."""
    from tests.clusters import namespaces_refused, portable_cluster

    refused = namespaces_refused()
    if refused:
        pytest.skip(refused)
    shared = tmp_path / "shared"
    shared.mkdir()
    write_records(samples_dir, shared / "records.jsonl", 24)
    with portable_cluster(shared) as (job_endpoint, pool):
        monkeypatch.chdir(shared)
        got = run_stages(shared, shared / "records.jsonl", [
            "--runner", "PortableRunner", "--", f"--job_endpoint={job_endpoint}", "--environment_type=EXTERNAL",
            f"--environment_config={pool}"])
    assert got == local_run
    for log in sorted((tmp_path / "portable-logs").glob("pool-*.log")):  # every pool ran a harness
        assert "Starting worker with command" in log.read_text(), log
    assert not list(shared.rglob("_spill")) and not list(shared.rglob("_word_counts"))
