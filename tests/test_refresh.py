"""flows/refresh.py: the scheduled refresh against a dump site on 127.0.0.1 (real sample dump), on
the tests' shared real Prefect server: newest finished dump -> download -> clean, then the whole
loop; its webhook notifications land in a receiver on 127.0.0.1, its runs and artifacts are
opened in a real browser."""

from __future__ import annotations

import bz2
import datetime as dt
import hashlib
import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from test_ui_browser import _need_browser, _shoot

from bert_core import storage
from flows.refresh import candidate_dates


def test_candidate_dates_newest_first_and_never_in_the_future():
    assert candidate_dates(dt.date(2024, 6, 25)) == ["20240620", "20240601", "20240520", "20240501"]
    assert candidate_dates(dt.date(2024, 1, 5)) == ["20240101", "20231220", "20231201"]


def _publish(root, dump, date: str, status: str) -> str:
    name = f"enwiki-{date}-pages-articles1.xml-p10p30302.bz2"
    data = dump.read_bytes()
    sha1 = hashlib.sha1(data).hexdigest()
    folder = root / "enwiki" / date
    folder.mkdir(parents=True)
    (folder / name).write_bytes(data)
    (folder / f"enwiki-{date}-sha1sums.txt").write_text(f"{sha1}  {name}\n")
    (folder / "dumpstatus.json").write_text(json.dumps({"jobs": {"articlesdump": {
        "status": status, "files": {name: {"size": len(data), "url": f"/enwiki/{date}/{name}",
                                           "sha1": sha1}}}}}))
    return name


class Receiver(ThreadingHTTPServer):
    """A webhook receiver on 127.0.0.1: the JSON body of every POST, in order."""

    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), _Hook)
        self.posts: list[dict] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/hook"

    def wait_for(self, match, timeout: float = 60) -> tuple[dict, float]:
        """The first POST ``match`` accepts, and the seconds waited for it."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            found = [p for p in self.posts if match(p)]
            if found:
                return found[0], time.monotonic() - start
            time.sleep(0.5)
        raise AssertionError(f"no matching POST to {self.url} within {timeout}s; got {self.posts}")


class _Hook(BaseHTTPRequestHandler):
    server: Receiver

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.server.posts.append(json.loads(body))
        self.send_response(204)
        self.end_headers()


@pytest.fixture
def receiver(prefect_api):
    """A receiver; afterwards the notify automation is deleted, so no later test posts to it."""
    from prefect import get_client

    from flows.refresh import NOTIFY

    server = Receiver()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()
    with get_client(sync_client=True) as client:
        for automation in client.read_automations_by_name(NOTIFY):
            client.delete_automation(automation.id)


@pytest.mark.slow
def test_refresh_takes_the_newest_finished_dump_and_cleans_it(prefect_api, site, samples_dir, tmp_path):
    from bert_core.config import load_config
    from flows.refresh import refresh_corpus

    (dump,) = sorted((samples_dir / "wikipedia").glob("*.xml.bz2"))
    newest, finished, *_ = candidate_dates(dt.datetime.now(dt.timezone.utc).date())
    _publish(site.root, dump, newest, "in-progress")  # still being written: skipped
    name = _publish(site.root, dump, finished, "done")
    cfg = load_config("demo", sets=[f"storage_root={tmp_path / 'data'}", "corpus.books=[]", "corpus.text=[]", "workers=1"])
    corpus = refresh_corpus(cfg, lang="en", base_url=site.url)
    raw = storage.join(str(tmp_path / "data"), "downloads", "wikipedia", f"enwiki-{finished}")
    assert storage.read_manifest(raw)["shards"][0]["path"] == name
    manifest = storage.read_manifest(corpus)
    assert manifest["stage"] == "corpus" and manifest["counts"]["wikipedia"]["kept"] > 50
    assert corpus.startswith(storage.join(str(tmp_path / "data"), "corpus") + "/")
    # a second refresh downloads nothing and cleans nothing
    site.requests.clear()
    assert refresh_corpus(cfg, lang="en", base_url=site.url) == corpus
    assert not [p for p, _ in site.requests if p.endswith(".bz2")]


# --------------------------------------------------------------------------- the whole loop

MONTHS = ("20261101", "20261201")
EDIT = " The article was revised for the new month, and this sentence was added to it."


def _monthly_dumps(sample) -> tuple[str, str]:
    """Two months of one wiki from the real sample: month two edits every third page of month one
    and adds new pages (articles of 4-30 kB, redirects left out, to stay small)."""
    text = bz2.decompress(sample.read_bytes()).decode("utf-8")
    head, body = text.split("<page>", 1)
    pages = ["<page>" + p.replace("</mediawiki>", "") for p in body.split("<page>")]
    pages = [p for p in pages if "<redirect" not in p and 4_000 <= len(p) <= 30_000]
    old, new = pages[:24], pages[24:]
    edited = [p.replace("</text>", EDIT + "</text>", 1) if i % 3 == 0 else p for i, p in enumerate(old)]
    return head + "".join(old) + "</mediawiki>\n", head + "".join(edited + new) + "</mediawiki>\n"


def _publish_xml(root, xml: str, date: str) -> None:
    folder = root / "enwiki" / date
    folder.mkdir(parents=True)
    data = bz2.compress(xml.encode("utf-8"))
    name = f"enwiki-{date}-pages-articles1.xml-p1p99.bz2"
    (folder / name).write_bytes(data)
    sha1 = hashlib.sha1(data).hexdigest()
    (folder / f"enwiki-{date}-sha1sums.txt").write_text(f"{sha1}  {name}\n")
    (folder / "dumpstatus.json").write_text(json.dumps({"jobs": {"articlesdump": {
        "status": "done", "files": {name: {"size": len(data), "url": f"/enwiki/{date}/{name}", "sha1": sha1}}}}}))


def _refresh_config(tasks, root, *sets: str):
    from bert_core.config import load_config

    return load_config("demo", sets=[
        f"storage_root={root}", "corpus.books=[]", "corpus.text=[]", "workers=1",
        "vocab.vocab_size=1000", "instances.dupe_factor=1", "instances.num_shards=1",
        "instances.min_eval_documents=4", "instances.lengths=[{max_seq_length: 64, max_predictions_per_seq: 10}]",
        "pretrain.procs_per_node=1", "pretrain.log_every=1", "pretrain.checkpoint_every=100",
        "pretrain.phases=[{max_seq_length: 64, max_steps: 4, global_batch_size: 8, micro_batch_size: 8, "
        "warmup_steps: 1, learning_rate: 3.0e-3}]",
        "finetune.tasks=[sentiment]", "finetune.seeds=[1, 2]", f"finetune.data_dir={tasks}",
        "finetune.max_train_examples=32", "finetune.epochs=[1]", "finetune.learning_rates=[1.0e-3]",
        "finetune.extra_checkpoints=[]", "finetune.random_init_baseline=false", "finetune.by_checkpoint={}",
        "refresh.max_steps=3", "refresh.warmup_steps=1", "refresh.mlm_loss_band=0.5",
        "refresh.finetune_band=100", *sets])


def _manifests(root) -> dict[str, float]:
    return {str(p): p.stat().st_mtime for p in root.rglob("_MANIFEST.json")}


@pytest.mark.slow
def test_the_monthly_refresh_continues_judges_and_promotes(prefect_api, site, receiver, samples_dir, sentiment_tasks,
                                                           tmp_path):
    from prefect import get_client, tags
    from prefect_server import pipeline_artifact, pipeline_flow_runs
    from typer.testing import CliRunner

    from bert_core.refresh.registry import Registry, registry_root
    from flows.cli.main import app
    from flows.refresh import refresh

    (sample,) = sorted((samples_dir / "wikipedia").glob("*.xml.bz2"))
    for date, xml in zip(MONTHS, _monthly_dumps(sample), strict=True):
        _publish_xml(site.root, xml, date)
    root = tmp_path / "data"
    cfg = _refresh_config(sentiment_tasks, root)
    registry = Registry(registry_root(str(root)))

    first = refresh(cfg, date=MONTHS[0], base_url=site.url)
    assert (first["outcome"], first["parent"]) == ("promoted", None)
    tag = f"refresh-test-{uuid.uuid4().hex[:8]}"
    with tags(tag):
        second = refresh(cfg, date=MONTHS[1], base_url=site.url)
    v1, v2 = registry.get(first["version"]), registry.get(second["version"])
    # the second version continues the first, on the first one's vocab
    assert v2["parent"] == v1["version"] and v2["init"] == "continue" and v2["vocab"] == v1["vocab"]
    assert (v1["steps"], v2["steps"]) == (4, 4 + 3) and v2["tokens_seen"] > v1["tokens_seen"] > 0
    assert v2["corpus"] != v1["corpus"] and v2["dump_date"] == MONTHS[1]
    # the suite scores both models on the same documents and tasks
    new, cur = v2["suite"]["new"], v2["suite"]["current"]
    assert set(new["mlm"]) == set(cur["mlm"]) == {"new_dump", "previous_dump"}
    assert new["mlm"]["new_dump"]["instances"] == cur["mlm"]["new_dump"]["instances"] > 0
    assert set(new["finetune"]) == set(cur["finetune"]) == {"sentiment"} and new["finetune"]["sentiment"]["n"] == 2
    # each version keeps the task model fine-tuned from it, which predict can run
    for v in (v1, v2):
        sentiment = v["task_models"]["sentiment"]
        assert sentiment["score"] == new["finetune"]["sentiment"]["mean"] if v is v2 else sentiment["score"] > 0
        assert sentiment["model"] == f"{root}/finetune/{v['version']}/sentiment/model"
        assert storage.exists(f"{sentiment['model']}/config.json")
    # the gate follows the thresholds, and the alias moves with it
    rows = v2["gate"]["rows"]
    assert {r["metric"] for r in rows} == {"mlm_loss:new_dump", "mlm_loss:previous_dump", "finetune:sentiment"}
    assert all(r["ok"] == (r["worse_by"] <= r["band"]) for r in rows)
    assert v2["gate"]["decision"] == ("promote" if all(r["ok"] for r in rows) else "keep") == "promote"
    assert registry.aliases()["current"] == v2["version"] and registry.aliases()["previous"] == v1["version"]
    # the UI: the run named by its dump, the registry artifact with both versions
    with get_client(sync_client=True) as client:
        assert [r.name for name, r in pipeline_flow_runs(client, tag) if name == "refresh"] == [
            f"refresh/enwiki-{MONTHS[1]}"]
        table = pipeline_artifact(client, tag, "models-registry")
        assert [(r["version"], r["alias"]) for r in table] == [(v1["version"], "previous"), (v2["version"], "current")]
        assert "**promoted**" in pipeline_artifact(client, tag, "refresh-report")

    # a rerun for the same month computes nothing
    before = _manifests(root)
    again = refresh(cfg, date=MONTHS[1], base_url=site.url)
    assert again["version"] == v2["version"] and _manifests(root) == before

    # a refresh made worse on purpose (a huge rate) is kept out, the webhook hears of it, and
    # rollback restores the previous
    bad_cfg = _refresh_config(sentiment_tasks, root, "refresh.learning_rate=30.0", f"refresh.notify_url={receiver.url}")
    bad = refresh(bad_cfg, date=MONTHS[1], base_url=site.url)
    assert bad["parent"] == v2["version"] and bad["outcome"] == "kept" and registry.current() == v2["version"]
    assert "mlm_loss:new_dump" in registry.get(bad["version"])["gate"]["why"]
    post, waited = receiver.wait_for(lambda p: p.get("version") == bad["version"])
    print(f"webhook POST {waited:.1f}s after the kept refresh ended")
    assert (post["outcome"], post["run"], post["current"]) == ("kept", f"refresh/enwiki-{MONTHS[1]}", v2["version"])
    assert post["why"] == bad["gate"]["why"] and len(receiver.posts) == 1
    result = CliRunner().invoke(app, ["models", "rollback", "--set", f"storage_root={root}"])
    assert result.exit_code == 0 and registry.current() == v1["version"]

    # what a user sees in the browser: the refresh run by its dump's name, the registry artifact
    # of the second refresh with both versions
    _need_browser()
    with get_client(sync_client=True) as client:
        (run,) = [r for name, r in pipeline_flow_runs(client, tag) if name == "refresh"]
        artifact = pipeline_artifact(client, tag, "models-registry", parsed=False)
    name = f"refresh/enwiki-{MONTHS[1]}"
    assert name in _shoot(f"{prefect_api.ui}/flows/flow/{run.flow_id}", tmp_path / "refresh.png", name)
    text = _shoot(f"{prefect_api.ui}/artifacts/artifact/{artifact.id}", tmp_path / "registry.png", v2["version"])
    assert v1["version"] in text and "current" in text and "previous" in text, text[:2000]


# --------------------------------------------------------------------------- the gate and its inputs


def _scores(loss: float, old_loss: float, score: float, sd: float) -> dict:
    return {"mlm": {"new_dump": {"mlm_loss": loss}, "previous_dump": {"mlm_loss": old_loss}},
            "finetune": {"sentiment": {"mean": score, "sd": sd, "n": 3}}}


def test_the_gate_promotes_unless_a_metric_is_worse_beyond_its_band():
    from bert_core.config import RefreshConfig
    from bert_core.refresh.gate import gate

    cfg = RefreshConfig(mlm_loss_band=0.05, finetune_band=1.0)
    current = _scores(3.00, 3.00, 80.0, 0.5)
    assert gate(_scores(9.0, 9.0, 0.0, 0.0), None, cfg)["decision"] == "promote"  # the first of its line
    assert gate(_scores(3.04, 2.90, 78.6, 0.4), current, cfg)["decision"] == "promote"  # inside every band
    forgot = gate(_scores(2.90, 3.06, 80.0, 0.5), current, cfg)
    assert forgot["decision"] == "keep" and forgot["why"].startswith("mlm_loss:previous_dump 3.06 vs current 3")
    noisy = gate(_scores(2.90, 2.90, 77.0, 2.5), current, cfg)  # 3 points down, but seeds spread by 2.5
    assert noisy["decision"] == "promote"
    assert gate(_scores(2.90, 2.90, 77.0, 0.5), current, cfg)["decision"] == "keep"


def test_a_small_corpus_is_refused_and_a_continued_run_is_rewarmed():
    from bert_core.config import load_config
    from bert_core.refresh.gate import CorpusFloorError, check_corpus_floor, continued_config

    cfg = load_config("demo", sets=["refresh.max_steps=30", "refresh.warmup_steps=3", "refresh.learning_rate=1e-4"])
    with pytest.raises(CorpusFloorError, match="3 documents, below refresh.min_documents=100"):
        check_corpus_floor({"uri": "c", "counts": {"documents": 3}}, cfg.refresh.model_copy(update={"min_documents": 100}))
    (phase,) = continued_config(cfg).pretrain.phases
    first = cfg.pretrain.phases[0]
    assert (phase.max_steps, phase.warmup_steps, phase.learning_rate) == (30, 3, 1e-4)
    assert (phase.max_seq_length, phase.global_batch_size) == (first.max_seq_length, first.global_batch_size)


def test_a_refresh_without_a_finished_dump_says_so_in_one_line(prefect_api, site, receiver, samples_dir,
                                                                sentiment_tasks, tmp_path):
    from prefect import get_client
    from typer.testing import CliRunner

    from bert_core.config import ConfigError, load_config
    from flows.cli.main import app
    from flows.refresh import NOTIFY, apply_notify_automation

    result = CliRunner().invoke(app, ["refresh", "--date", MONTHS[0], "--base-url", site.url,
                                      "--set", f"storage_root={tmp_path}", "--set", f"refresh.notify_url={receiver.url}",
                                      # every other input there (wherever the command runs), so the dump is what is missing
                                      "--set", "corpus.books=[]", "--set", "corpus.text=[]",
                                      "--set", f"finetune.data_dir={sentiment_tasks}",
                                      "--set", "finetune.tasks=[sentiment]",
                                      "--set", f"finetune.extra_checkpoints=[{samples_dir}/models/minilm]"])
    assert result.exit_code == 1 and len(result.output.strip().splitlines()) == 1
    assert result.output.startswith(f"no finished enwiki articles dump among {MONTHS[0]}")
    # the failed run reaches the webhook (the automation the refresh applied on the shared test server)
    post, waited = receiver.wait_for(lambda p: p.get("outcome") == "failed")
    print(f"webhook POST {waited:.1f}s after the refresh failed")
    assert post["run"] == f"refresh/enwiki-{MONTHS[0]}" and "no finished enwiki articles dump" in post["why"]
    # applying it again updates the one automation; a URL that is not http(s) is refused
    with get_client(sync_client=True) as client:
        (automation,) = client.read_automations_by_name(NOTIFY)
        assert apply_notify_automation(receiver.url) == str(automation.id)
        assert len(client.read_automations_by_name(NOTIFY)) == 1
    with pytest.raises(ConfigError, match="refresh.notify_url: String should match pattern"):
        load_config("demo", sets=["refresh.notify_url=hooks.example.com/x"])


@pytest.mark.slow
def test_two_refreshes_of_one_month_at_once_register_one_version(prefect_api, site, samples_dir, sentiment_tasks,
                                                                 tmp_path):
    """A schedule and a manual `bertpipe refresh` of the same month on one root at the same moment:
    both finish, the month becomes one version, and every folder with a manifest verifies."""
    import os
    import subprocess
    import sys

    import yaml

    from bert_core.refresh.registry import Registry, registry_root

    (sample,) = sorted((samples_dir / "wikipedia").glob("*.xml.bz2"))
    _publish_xml(site.root, _monthly_dumps(sample)[0], MONTHS[0])
    root = tmp_path / "data"
    path = tmp_path / "refresh.yaml"
    path.write_text(yaml.safe_dump(_refresh_config(sentiment_tasks, root).model_dump(mode="json")))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PREFECT_API_URL": prefect_api.api}
    procs = [subprocess.Popen([sys.executable, "-m", "flows.cli", "refresh", "--date", MONTHS[0], "--base-url",
                               site.url, "--config", str(path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env=env) for _ in range(2)]
    results = [(p.wait(900), p.stdout.read()) for p in procs]
    for code, text in results:
        assert code == 0, text[-3000:]
    registry = Registry(registry_root(str(root)))
    (version,) = registry.versions()
    assert registry.current() == version["version"]
    folders = sorted({p.parent for p in root.rglob(storage.MANIFEST)})
    tops = [f for f in folders if not any(o != f and o in f.parents for o in folders)]
    for folder in tops:
        out = subprocess.run([sys.executable, "-m", "flows.cli", "verify", str(folder)], capture_output=True,
                             text=True, env=env)
        assert out.returncode == 0, out.stdout + out.stderr
