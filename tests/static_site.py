"""A static file server on 127.0.0.1 for the download tests: HTTP ``Range``, a request log, and
transfers that can be cut short. The Wikimedia dump site of tests/test_download.py and the task
data hosts of tests/test_tasks_fetch.py are folders it serves."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class StaticSite(ThreadingHTTPServer):
    """Serves the files under ``root``; ``cuts_left`` transfers of a file ending in ``cut_suffix``
    drop the connection after ``cut_after`` bytes."""

    daemon_threads = True

    def __init__(self, root: Path):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.root = root
        self.requests: list[tuple[str, str | None]] = []  # (path, Range header)
        self.cut_after: int | None = None  # bytes sent before the connection drops
        self.cuts_left = 0
        self.cut_suffix = ".bz2"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    server: StaticSite

    def log_message(self, *args):  # keep pytest output clean
        pass

    def do_GET(self):
        self.server.requests.append((self.path, self.headers.get("Range")))
        path = self.server.root / self.path.lstrip("/")
        if not path.is_file():
            self.send_error(404)
            return
        data = path.read_bytes()
        start, status = 0, 200
        if rng := self.headers.get("Range"):
            start = int(rng.removeprefix("bytes=").split("-")[0])
            if start >= len(data):
                self.send_error(416)
                return
            status = 206
        body = data[start:]
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.end_headers()
        if path.name.endswith(self.server.cut_suffix) and self.server.cuts_left > 0:
            self.server.cuts_left -= 1
            self.wfile.write(body[: self.server.cut_after])
            self.wfile.flush()
            self.close_connection = True
            return
        self.wfile.write(body)


@contextmanager
def serving(root: Path) -> Iterator[StaticSite]:
    """A :class:`StaticSite` of ``root`` running for the block."""
    server = StaticSite(root)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
