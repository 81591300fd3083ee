"""Beam imported without the client libraries of connectors no job here uses.

``import apache_beam`` imports the clients of its Google Cloud Storage, BigQuery, Pub/Sub and
MongoDB connectors whether or not a job uses them, a fifth of its import time. The jobs read and
write through fsspec (``bert_core/storage.py``), never through Beam's own IO, so Beam is imported
here as in an installation without those clients, a case Beam supports: each such import is
guarded and the connector is skipped (its warnings are
dropped). A runner whose workers are not this machine's processes
stages its files through Beam's filesystems, so it gets the skipped connectors back first
(:func:`connectors_restored`). Nothing changes where Beam was imported before this module.
"""

from __future__ import annotations

import gc
import importlib
import importlib.abc
import logging
import sys

# The client libraries skipped while Beam is imported (each with its submodules).
SKIPPED = ("google.cloud.storage", "google.cloud.bigquery", "google.cloud.bigquery_storage_v1",
           "google.cloud.pubsub", "pymongo", "bson")
# Beam's modules that need them, imported again when a runner needs them.
CONNECTORS = ("apache_beam.io.gcp.gcsfilesystem",)


class _Skipped(importlib.abc.MetaPathFinder):
    """Finds none of :data:`SKIPPED`, as where they are not installed."""

    def find_spec(self, name, path=None, target=None):  # noqa: ANN001, ANN201 - importlib's protocol
        if any(name == skipped or name.startswith(skipped + ".") for skipped in SKIPPED):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


def import_beam() -> None:
    """Import Beam without :data:`SKIPPED`, unless it is imported already."""
    if "apache_beam" in sys.modules:
        return
    finder = _Skipped()
    collecting = gc.isenabled()  # the import makes tens of thousands of objects, none of them garbage
    gc.disable()
    io_log = logging.getLogger("apache_beam.io")  # it warns of each connector it skips
    level = io_log.level
    sys.meta_path.insert(0, finder)
    io_log.setLevel(logging.ERROR)
    try:
        importlib.import_module("apache_beam")
    finally:
        sys.meta_path.remove(finder)
        io_log.setLevel(level)
        if collecting:
            gc.enable()


def connectors_restored() -> None:
    """Import the connectors of :data:`CONNECTORS` that :func:`import_beam` skipped (Beam's
    filesystems find a connector once its module is imported); where their clients are not
    installed, Beam goes on without them, as it would anyway."""
    for name in CONNECTORS:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError:
            pass
