"""``bertpipe server``: a local Prefect server (API + UI).

    bertpipe server                      # on http://127.0.0.1:4200
    bertpipe server --port 4300
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Annotated

import typer

# A local server that never phones home and gives slow machines time to start.
SERVER_ENV = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
}


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
