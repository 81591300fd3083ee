"""The refresh loop: the newest finished Wikipedia dump -> corpus -> instances with the current
model's vocab -> pre-training continued from the current model -> the evaluation suite -> the
gate -> promotion in the model registry.

    bertpipe refresh --date 20261201
    bertpipe serve --only refresh/monthly         (the monthly schedule of infra/prefect.yaml)

Each part is the existing stage flow, skipped when its folder is finished; the logic is
``bert_core.refresh`` (its gate and registry); what every part reads is checked first
(``bert_core.preflight``). ``refresh-corpus`` is the first half alone.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from bert_core import storage
from bert_core.config import PipelineConfig, config_hash
from bert_core.preflight import check_refresh, runs_base
from bert_core.refresh.registry import Registry, registry_root
from flows.retry import retry_on_infrastructure
from flows.versions import SKIPPED, corpus_folder, is_done


def candidate_dates(today: dt.date) -> list[str]:
    """Dump dates (1st and 20th) of this month and last month that are not in the future."""
    prev = (today.replace(day=1) - dt.timedelta(days=1)).replace(day=1)
    dates = [today.replace(day=20), today.replace(day=1), prev.replace(day=20), prev]
    return [d.strftime("%Y%m%d") for d in dates if d <= today]


@task(retries=3, retry_delay_seconds=60, retry_condition_fn=retry_on_infrastructure,
      cache_policy=NO_CACHE, task_run_name="find-dump-{lang}")
def find_dump(lang: str, dates: list[str], base_url: str | None) -> str:
    from bert_core.corpus.download import DownloadError, list_dump_files
    from bert_core.refresh.gate import NoDumpError

    logger = get_run_logger()
    reasons = []
    for date in dates:
        try:
            files = list_dump_files(lang, date, base=base_url)
        except DownloadError as err:
            reasons.append(f"{date}: {err}")
            continue
        logger.info("newest finished %swiki dump: %s (%d files)", lang, date, len(files))
        return date
    raise NoDumpError(f"no finished {lang}wiki articles dump among {', '.join(dates)} ({'; '.join(reasons)}); "
                      "give --date of a finished dump, or wait for the current one to finish")


@task(retries=3, retry_delay_seconds=60, retry_condition_fn=retry_on_infrastructure,
      cache_policy=NO_CACHE, task_run_name="download-{lang}wiki-{date}")
def download(lang: str, date: str, to: str, base_url: str | None) -> str:
    from bert_core.corpus.download import download_wikipedia

    # Two refreshes of one dump at once: the download holds the folder's lease, the second waits
    # and reuses what the first verified.
    download_wikipedia(lang, date, to, base=base_url, log=get_run_logger().info)
    return to


def with_dump(config: PipelineConfig, lang: str, date: str | None,
              base_url: str | None) -> tuple[str, PipelineConfig]:
    """Inside a flow: find (unless ``date``) and download a dump; the dump's date and the config
    whose corpus reads it (beside the configured books and text)."""
    dates = [date] if date else candidate_dates(dt.datetime.now(dt.timezone.utc).date())
    date = find_dump(lang, dates, base_url)
    from bert_core.corpus.download import wikipedia_folder

    raw = download(lang, date, wikipedia_folder(config.storage_root, lang, date), base_url)
    corpus_cfg = config.corpus.model_copy(update={"wikipedia": [storage.join(raw, "*.bz2")]})
    return date, config.model_copy(update={"corpus": corpus_cfg})


def refresh_run_name() -> str:
    """``enwiki-20240601``, or ``enwiki-latest`` when the newest finished dump is looked up."""
    from prefect.runtime import flow_run

    p = flow_run.parameters
    return f"{p.get('lang', 'en')}wiki-{p.get('date') or 'latest'}"


@flow(name="refresh-corpus", flow_run_name=refresh_run_name, log_prints=True)
def refresh_corpus(
    config: PipelineConfig, lang: str = "en", date: str | None = None, base_url: str | None = None
) -> str:
    """Download a dump (newest finished one unless ``date``) and clean it; returns the corpus URI."""
    from flows.corpus import clean_corpus

    _, config = with_dump(config, lang, date, base_url)
    output = corpus_folder(config)
    if is_done(output):
        get_run_logger().info("corpus: %s, %s has a manifest", SKIPPED, output)
        return output
    return clean_corpus(config, output)


# --------------------------------------------------------------------------- the whole loop


def loop_run_name() -> str:
    """``refresh/enwiki-20261201``; ``refresh/enwiki-latest`` until the newest dump is found."""
    from prefect.runtime import flow_run

    p = flow_run.parameters
    config = p["config"]
    lang = config.refresh.lang if isinstance(config, PipelineConfig) else config.get("refresh", {}).get("lang", "en")
    return f"refresh/{lang}wiki-{p.get('date') or 'latest'}"


def _rename_run(name: str) -> None:
    from prefect import get_client
    from prefect.runtime import flow_run

    with get_client(sync_client=True) as client:
        client.update_flow_run(flow_run.id, name=name)


@task(cache_policy=NO_CACHE, task_run_name="score-mlm-{label}")
def score_mlm(config: PipelineConfig, label: str, model: str, eval_sets: dict[str, str]) -> dict[str, Any]:
    """Held-out masked-LM scores of ``model`` on each eval set (name -> instances folder)."""
    from bert_core.refresh.gate import eval_length, mlm_scores

    return {name: mlm_scores(model, instances, eval_length(config), config.instances.seed)
            for name, instances in eval_sets.items()}


def run_suite(config: PipelineConfig, version: str, model: str, parent: dict[str, Any] | None,
              instances: str, same_vocab: bool) -> dict[str, Any]:
    """Inside a flow: the suite's scores of the new model and, on the same documents and tasks,
    of the current one (``parent``). Masked-LM scores need a shared vocab; fine-tuning does not."""
    from bert_core.refresh.gate import finetune_scores
    from flows.pipeline import fan_out_finetune
    from flows.versions import finetune_folder

    eval_sets = {"new_dump": instances}
    if parent and same_vocab and parent.get("instances"):  # an imported model has no instances of ours
        eval_sets["previous_dump"] = parent["instances"]
    suite: dict[str, Any] = {"new": {"mlm": score_mlm(config, version, model, eval_sets)}, "current": None}
    if parent:
        suite["current"] = {"mlm": score_mlm(config, parent["version"], parent["model"], eval_sets)
                            if same_vocab else {}}
    if config.finetune.tasks:
        checkpoints = {version: model} | ({parent["version"]: parent["model"]} if parent else {})
        fan_out_finetune(config, checkpoints)
        for label, side in ((version, "new"), (parent and parent["version"], "current")):
            if label:
                suite[side]["finetune"] = finetune_scores(finetune_folder(config, label), config.finetune.tasks)
    suite["definition"] = {"eval_sets": sorted(eval_sets), "tasks": config.finetune.tasks,
                           "seeds": config.finetune.seeds}
    return suite


@flow(name="refresh", flow_run_name=loop_run_name, log_prints=True)
def refresh(config: PipelineConfig, date: str | None = None, base_url: str | None = None) -> dict[str, Any]:
    """Refresh the model on the newest finished dump (or ``date``'s); returns the version, the
    gate's decision and whether it was promoted.

    Each part is skipped when its folder is finished, and a dump already refreshed with these
    settings is found in the registry, so a killed refresh resumes and a second one for the same
    dump computes nothing. With ``refresh.notify_url`` set, the refresh first applies
    :func:`apply_notify_automation`.
    """
    from bert_core.card import run_counts
    from bert_core.refresh.gate import (
        check_corpus_floor,
        continued_config,
        gate,
        model_identity,
    )
    from bert_core.refresh.registry import task_models
    from flows.pipeline import publish_model, stage_once
    from flows.versions import (
        finetune_folder,
        instances_folder,
        pretrain_version,
        unwrap,
        vocab_folder,
    )

    check_refresh(config, date)  # a scheduled run checks too, not only `bertpipe refresh`
    logger = get_run_logger()
    r = config.refresh
    if r.notify_url:
        apply_notify_automation(r.notify_url)
    registry = Registry(registry_root(config.storage_root))
    runs = runs_base(config)
    date, config = with_dump(config, r.lang, date, base_url)
    run_name = f"refresh/{r.lang}wiki-{date}"
    _rename_run(run_name)

    corpus = stage_once("corpus", config, corpus_folder(config), {})["output"]
    check_corpus_floor(storage.read_manifest(corpus), r)
    settings = r.model_dump(mode="json", exclude={"notify_url"})
    done = [v for v in registry.versions() if v.get("corpus") == storage.to_uri(corpus) and v.get("refresh") == settings]
    parent_version = done[-1]["parent"] if done else registry.current()
    parent = registry.get(parent_version) if parent_version else None

    same_vocab = parent is not None and r.vocab == "keep"
    if same_vocab:
        vocab = parent["vocab"]
        storage.read_manifest(vocab)  # refused in one line when the current model's vocab is gone
    else:
        vocab = stage_once("vocab", config, vocab_folder(config, corpus), {"corpus": corpus})["output"]
    instances = stage_once("instances", config, instances_folder(config, corpus, vocab),
                           {"corpus": corpus, "vocab": vocab})["output"]

    init = parent["model"] if same_vocab and r.init == "continue" else None
    train_cfg = continued_config(config) if init else config
    version = config_hash(pretrain_version(train_cfg, instances, vocab), model_identity(init))
    run = storage.join(runs, "pretrain", version)
    stage_once("pretrain", train_cfg, run, {"instances": instances, "init_checkpoint": init})
    model = unwrap(publish_model(run, storage.join(registry.root, version)))["output"]

    if not registry.has(version) or not registry.get(version).get("gate"):
        counts = run_counts(storage.read_manifest(run))
        registry.register({
            "version": version, "parent": parent_version, "line": vocab.rstrip("/").rsplit("/", 1)[-1],
            "model": storage.to_uri(model), "run": storage.to_uri(run), "corpus": storage.to_uri(corpus),
            "vocab": storage.to_uri(vocab), "instances": storage.to_uri(instances), "dump_date": date,
            "lang": r.lang, "init": "continue" if init else "scratch", "run_steps": counts["steps"],
            "steps": counts["steps"] + (parent or {}).get("steps", 0) * bool(init),
            "tokens_seen": counts["tokens"] + (parent or {}).get("tokens_seen", 0) * bool(init),
            "refresh": settings,
        })
        suite = run_suite(config, version, model, parent, instances, same_vocab)
        decision = gate(suite["new"], suite["current"], r)
        registry.register({"version": version, "suite": suite, "gate": decision,
                           "task_models": task_models(finetune_folder(config, version), config.finetune.tasks)})
    else:
        logger.info("refresh: %s, %s was already judged for this dump", SKIPPED, version)
    record = registry.get(version)
    outcome = registry.settle(version)
    logger.info("refresh %s: %s (%s)", version, outcome, record["gate"]["why"])
    publish_refresh_artifacts(registry, record, outcome)
    if outcome == "kept":
        emit_kept(run_name, record, registry.current())
    return {"version": version, "parent": parent_version, "dump_date": date, "outcome": outcome,
            "gate": record["gate"], "current": registry.current()}


def publish_refresh_artifacts(registry: Registry, record: dict[str, Any], outcome: str) -> None:
    """``models-registry``: every version with its lineage and scores; ``refresh-report``: new vs
    current per metric and the decision."""
    from flows.artifacts import line_plot, markdown_image, publish_markdown, publish_table

    aliases = registry.aliases()
    marks = {aliases.get(a): a for a in ("previous", "current") if aliases.get(a)}
    rows = []
    for r in registry.versions():
        mlm = ((r.get("suite") or {}).get("new") or {}).get("mlm", {}).get("new_dump", {})
        rows.append({"alias": marks.get(r["version"], ""), "version": r["version"], "parent": r.get("parent") or "",
                     "dump": r.get("dump_date"), "steps": r.get("steps"), "tokens": r.get("tokens_seen"),
                     "mlm_loss": mlm.get("mlm_loss"), "gate": (r.get("gate") or {}).get("decision", "")})
    publish_table("models-registry", rows, f"Model versions in {registry.root}; current: {aliases['current']}")
    g = record["gate"]
    md = [f"**{record['version']}** (dump {record.get('dump_date')}, parent {record.get('parent') or '-'}): "
          f"**{outcome}**. {g['why']}", "", "| metric | new | current | worse by | band | ok |",
          "|---|---|---|---|---|---|"]
    md += [f"| {x['metric']} | {x['new']:.4f} | {x['current']:.4f} | {x['worse_by']:.4f} | {x['band']:.4f} | "
           f"{'✓' if x['ok'] else '✗'} |" for x in g["rows"]]
    scored = [r for r in rows if r["mlm_loss"] is not None]
    if scored:
        fig = line_plot({"new dump's eval documents": (range(1, len(scored) + 1), [r["mlm_loss"] for r in scored])},
                        "Held-out masked-LM loss of each version", xlabel="version (oldest first)",
                        ylabel="mlm loss")
        md += ["", markdown_image(fig, "suite scores across versions")]
    publish_markdown("refresh-report", "\n".join(md), f"Refresh of {record.get('dump_date')}: new vs current")


# --------------------------------------------------------------------------- notification

NOTIFY = "bertpipe-refresh-notify"  # the automation's name, and its Webhook block's
KEPT_EVENT = "bertpipe.refresh.kept"

# The webhook's JSON body, rendered by the server from the triggering event: a kept refresh
# (its event's payload) or a refresh run that failed or crashed (its state-change event).
NOTIFY_PAYLOAD = (
    '{% if event.event == "' + KEPT_EVENT + '" %}{% set p = event.payload %}'
    '{{ {"outcome": "kept", "run": p.run, "version": p.version, "dump_date": p.dump_date, '
    '"current": p.current, "why": p.why, "text": "bertpipe " ~ p.run ~ ": " ~ p.version ~ '
    '" not promoted, " ~ p.current ~ " stays current: " ~ p.why} | tojson }}'
    '{% else %}{% set state = event.resource["prefect.state-name"] %}'
    '{% set message = event.resource["prefect.state-message"] %}'
    '{{ {"outcome": state | lower, "run": event.resource.name, "why": message, '
    '"text": "bertpipe " ~ event.resource.name ~ ": " ~ state ~ ": " ~ message} | tojson }}'
    '{% endif %}'
)


def notify_trigger():
    """Any run of the ``refresh`` flow that fails, crashes or keeps the current model."""
    from prefect.events.schemas.automations import EventTrigger, Posture

    return EventTrigger(
        expect={KEPT_EVENT, "prefect.flow-run.Failed", "prefect.flow-run.Crashed"},
        match_related={"prefect.resource.role": "flow", "prefect.resource.name": "refresh"},
        posture=Posture.Reactive, threshold=1)


def apply_notify_automation(url: str) -> str:
    """Create or update the automation ``bertpipe-refresh-notify`` (and its Webhook block) so
    that it POSTs to ``url``; idempotent. Returns the automation's id.

    The automation POSTs JSON when a refresh run fails or crashes, and when the gate keeps the
    current model (the flow's ``bertpipe.refresh.kept`` event).
    """
    from prefect import get_client
    from prefect.blocks.webhook import Webhook
    from prefect.events.actions import CallWebhook
    from prefect.events.schemas.automations import AutomationCore

    block_id = Webhook(url=url).save(NOTIFY, overwrite=True)
    automation = AutomationCore(
        name=NOTIFY, description="POST to refresh.notify_url when a refresh fails or keeps the current model.",
        trigger=notify_trigger(), actions=[CallWebhook(block_document_id=block_id, payload=NOTIFY_PAYLOAD)])
    with get_client(sync_client=True) as client:
        found = client.read_automations_by_name(NOTIFY)
        if not found:
            return str(client.create_automation(automation))
        client.update_automation(found[0].id, automation)
        return str(found[0].id)


def emit_kept(run_name: str, record: dict[str, Any], current: str | None) -> None:
    """The event ``bertpipe.refresh.kept``: this run's version was judged and not promoted."""
    from prefect.events import emit_event

    version = record["version"]
    emit_event(KEPT_EVENT, resource={"prefect.resource.id": f"bertpipe.model.{version}",
                                     "prefect.resource.name": version},
               payload={"run": run_name, "version": version, "dump_date": record.get("dump_date"),
                        "current": current, "why": record["gate"]["why"]})
