"""Operating commands: download a dump, run a Prefect server, serve deployments, run the pipeline.

    bertpipe download wikipedia --date 20240601 --lang en --to ./bertpipe-data/raw/enwiki/20240601
    bertpipe server                      # Prefect server + UI on http://127.0.0.1:4200
    bertpipe serve                       # every deployment of infra/prefect.yaml, with schedules
    bertpipe run --preset demo           # one bert_pipeline run
    bertpipe infra render --preset bert-base-128 --set pretrain.nodes=4 --out build/infra

Prefect is imported inside the commands so ``bertpipe --help`` stays fast.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Annotated

import typer

from flows.cli.options import ConfigOpt, PresetOpt, SetOpt, resolve, user_errors

download_app = typer.Typer(help="Download raw corpora.", no_args_is_help=True)
infra_app = typer.Typer(help="Render infra/ templates from the typed config.", no_args_is_help=True)

# A local server that never phones home and gives slow machines time to start.
SERVER_ENV = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
}


@download_app.command("wikipedia")
def download_wikipedia(
    date: Annotated[str, typer.Option(help="Dump date, YYYYMMDD (see dumps.wikimedia.org).")],
    to: Annotated[str, typer.Option(help="Destination folder or URI (gs://...).")],
    lang: Annotated[str, typer.Option(help="Wiki language code.")] = "en",
    job: Annotated[str, typer.Option(help="articlesdump or articlesmultistreamdump.")] = "articlesdump",
    base_url: Annotated[
        str | None, typer.Option(help="Dump site or mirror (default $BERTPIPE_DUMPS_URL or Wikimedia).")
    ] = None,
    staging: Annotated[str | None, typer.Option(help="Local folder for resumable .part files.")] = None,
    retries: Annotated[int, typer.Option(help="Resume attempts per file.")] = 5,
) -> None:
    """Download the articles files of a Wikipedia dump, verified against the site's sha1 sums."""
    from bert_core.corpus.download import DownloadError
    from bert_core.corpus.download import download_wikipedia as run

    with user_errors(DownloadError):
        manifest = run(lang, date, to, job=job, base=base_url, staging=staging, retries=retries,
                       log=lambda m: typer.echo(m, err=True))
    typer.echo(f"{manifest['counts']['files']} file(s), {manifest['counts']['bytes']} bytes -> {manifest['uri']}")


def server(
    port: Annotated[int, typer.Option(help="Port on 127.0.0.1.")] = 4200,
    host: Annotated[str, typer.Option(help="Bind address; keep 127.0.0.1 unless you mean it.")] = "127.0.0.1",
) -> None:
    """Start a local Prefect server (API + UI) and print its addresses."""
    typer.echo(f"Prefect UI:  http://{host}:{port}\n"
               f"Point flows at it:  export PREFECT_API_URL=http://{host}:{port}/api")
    prefect = Path(sys.executable).with_name("prefect")
    cmd = [str(prefect) if prefect.exists() else "prefect", "server", "start",
           "--host", host, "--port", str(port), "--analytics-off"]
    raise typer.Exit(subprocess.call(cmd, env=server_env(host, port)))


def server_env(host: str, port: int) -> dict[str, str]:
    """The server's environment: the UI in the browser calls the API on this host and port.

    Without ``PREFECT_UI_API_URL`` the UI calls ``PREFECT_API_URL`` (which may name another
    server) or port 4200. A ``PREFECT_UI_API_URL`` the user set (e.g. a public name behind
    ``--host 0.0.0.0``) is kept.
    """
    browser_host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    env = {**os.environ, **SERVER_ENV,
           "PREFECT_SERVER_API_HOST": host, "PREFECT_SERVER_API_PORT": str(port)}
    if not (env.get("PREFECT_UI_API_URL") or env.get("PREFECT_SERVER_UI_API_URL")):
        env["PREFECT_UI_API_URL"] = f"http://{browser_host}:{port}/api"
    return env


def serve(
    prefect_yaml: Annotated[str, typer.Option(help="Deployment definitions.")] = "infra/prefect.yaml",
    only: Annotated[list[str] | None, typer.Option(help="Serve only these deployment names.")] = None,
) -> None:
    """Serve the deployments of prefect.yaml from this process, schedules included (Ctrl-C stops)."""
    from prefect import serve as prefect_serve

    from flows.tools.deployments import runner_deployments

    deployments = runner_deployments(prefect_yaml, only=only)
    typer.echo("serving: " + ", ".join(d.name for d in deployments), err=True)
    prefect_serve(*deployments)


def run(preset: PresetOpt = "demo", config: ConfigOpt = None, set_: SetOpt = None) -> None:
    """Run the whole pipeline once (stages already finished for this config are skipped)."""
    cfg = resolve(preset, config, set_)
    from flows.pipeline import bert_pipeline

    summary = bert_pipeline(cfg)
    for stage, info in summary["stages"].items():
        typer.echo(f"{stage:10s} {info['status']:16s} {info['output']}")


@infra_app.command("render")
def infra_render(
    out: Annotated[str, typer.Option(help="Folder for the rendered files.")] = "build/infra",
    preset: PresetOpt = "demo",
    config: ConfigOpt = None,
    set_: SetOpt = None,
    image: Annotated[str, typer.Option(help="Container image for every pod and Beam worker.")] = "bertpipe:latest",
    namespace: Annotated[str, typer.Option(help="Kubernetes namespace.")] = "bertpipe",
    instances: Annotated[str | None, typer.Option(help="Instances folder the training pods read.")] = None,
    run_dir: Annotated[str | None, typer.Option("--run", help="Run folder the training pods write.")] = None,
) -> None:
    """Render Kubernetes pods, the GPU work pool template, Beam runner overlays and prefect.yaml."""
    from flows.tools.render import InfraSettings, render_all

    cfg = resolve(preset, config, set_)
    settings = InfraSettings(image=image, namespace=namespace, instances=instances, run=run_dir)
    for path in render_all(cfg, settings, out):
        typer.echo(path)


def register(app: typer.Typer) -> None:
    app.add_typer(download_app, name="download")
    app.add_typer(infra_app, name="infra")
    app.command("server")(server)
    app.command("serve")(serve)
    app.command("run")(run)
