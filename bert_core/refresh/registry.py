"""The model registry: every model version with its lineage, scores and gate decision, and the
aliases ``current`` and ``previous``, in storage (a local folder or ``gs://``).

    bertpipe models list
    bertpipe finetune --checkpoint models:current ...

Every file is written whole (a temporary file, then a rename), so a reader sees the old file or
the new one; the layout is :class:`Registry`'s, the rules for moving an alias :meth:`Registry.promote`'s.
A record names what the storage root holds by its place in the root, so a root copied, synced or
mounted elsewhere reads its own models and data, never the place it was copied from.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import socket
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from bert_core import storage
from bert_core.card import write_card
from bert_core.failures import Refusal

SCHEMA_VERSION = 1
PREFIX = "models:"  # models:current, models:previous, models:<version>
ALIASES = ("current", "previous")
FOLDER = "_registry"
LOCK_WAIT_S = 60.0  # how long a promotion waits for another one to finish
LOCK_STALE_S = 600.0  # a lock this old outlived its holder (the aliases move in seconds)
PATHS = ("model", "run", "corpus", "vocab", "instances")  # the record fields that name folders


class RegistryError(Refusal):
    """The registry cannot do what was asked: unknown version, a model that is not whole, a
    newer schema, a lock held by another promotion, or ``current`` moved meanwhile."""


def registry_root(storage_root: str) -> str:
    """Where the registry of a storage root lives: ``<storage_root>/models``."""
    return storage.join(storage_root, "models")


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def _write_whole(uri: str, data: dict[str, Any]) -> None:
    tmp = f"{uri}.{uuid.uuid4().hex}.tmp"
    storage.write_text(tmp, json.dumps(data, indent=2, sort_keys=True))
    storage.filesystem(uri).mv(storage.split_protocol(tmp)[1], storage.split_protocol(uri)[1])


def _read(uri: str) -> dict[str, Any]:
    try:
        data = json.loads(storage.read_text(uri))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise RegistryError(f"{uri} is not valid JSON: the registry file is damaged; restore it "
                            "from a backup or remove it") from None
    schema = data.get("schema_version") if isinstance(data, dict) else None
    if not isinstance(schema, int):
        raise RegistryError(f"{uri} is not a bertpipe registry file (no schema_version)")
    if schema > SCHEMA_VERSION:
        raise RegistryError(f"{uri}: written by a newer bertpipe (registry schema {schema}, this one "
                            f"reads {SCHEMA_VERSION}); upgrade bertpipe to read this registry")
    return data


def task_models(folder: str, tasks: list[str]) -> dict[str, dict[str, Any]]:
    """The task models a checkpoint's fine-tuning folder holds: task -> its chosen model's folder,
    the headline metric, its final score (0-100, mean over seeds), setting and seed. A task without
    a published model (a feature-based one, or every job failed) is left out."""
    from bert_core.finetune import get_task

    found: dict[str, dict[str, Any]] = {}
    for name in (get_task(t).name for t in tasks):
        task_folder = storage.join(folder, name)
        if not storage.has_manifest(task_folder):
            continue
        manifest = storage.read_manifest(task_folder)
        chosen = manifest.get("model")
        if not chosen:
            continue
        summary = manifest["stats"]["summary"][name]
        found[name] = {"model": storage.join(task_folder, chosen["path"]), "metric": get_task(name).metric,
                       "split": summary["final_label"], "score": (summary.get("final") or {}).get("mean"),
                       "setting": chosen["setting"], "seed": chosen["seed"]}
    return found


def model_problems(model: str) -> list[str]:
    """Why a model folder is not whole (no manifest, a shard missing or changed); empty if whole."""
    if not storage.has_manifest(model):
        return [f"{model} has no {storage.MANIFEST} (an unfinished or removed model)"]
    return storage.shard_problems(model)


class Registry:
    """The registry under ``root`` (``registry_root(storage_root)``).

    Layout, under ``<storage_root>/models/``::

        <version>/                  the model (transformers layout) with its _MANIFEST.json
        _registry/versions/<version>.json
                                    one record: parent, corpus, vocab and instances, dump date,
                                    steps and tokens seen, the suite's scores, the gate's decision
        _registry/aliases.json      current, previous and the history of current; written last
        _registry/lock              held while the aliases move

    A record names a folder inside the storage root (``root``'s parent) by its path in the
    root (``models/<version>``, ``corpus/<version>``), any other folder by its URI. A record that
    names folders by URIs inside the root it was written in (its model lies at
    ``<that root>/models/<version>``) is read as naming them in the root it lies in now.
    """

    def __init__(self, root: str) -> None:
        self.root = storage.to_uri(root).rstrip("/")
        self.folder = storage.join(self.root, FOLDER)
        self.storage_root = self.root.rsplit("/", 1)[0]

    # ----------------------------------------------------------------- paths

    def _resolved(self, record: dict[str, Any]) -> dict[str, Any]:
        """``record`` with every folder it names (its task models' too) as a URI where that folder is now."""
        old = self._written_in(record)

        def now(value: str) -> str:
            if "://" not in value and not os.path.isabs(value):
                return storage.join(self.storage_root, value)
            if old and (value == old or value.startswith(old + "/")):
                return self.storage_root + value[len(old):]
            return value

        return self._mapped(record, now)

    def _written_in(self, record: dict[str, Any]) -> str | None:
        """The storage root a record that names its model by URI was written in."""
        model, tail = str(record.get("model") or ""), f"/{self.root.rsplit('/', 1)[1]}/{record.get('version')}"
        return model[: -len(tail)] if ("://" in model or os.path.isabs(model)) and model.endswith(tail) else None

    def _stored(self, record: dict[str, Any]) -> dict[str, Any]:
        """``record`` as written: folders inside the storage root by their path in it."""
        def inside(value: str) -> str:
            uri = storage.to_uri(value)
            return uri[len(self.storage_root) + 1:] if uri.startswith(self.storage_root + "/") else uri

        return self._mapped(record, inside)

    @staticmethod
    def _mapped(record: dict[str, Any], fn: Any) -> dict[str, Any]:
        """``record`` with ``fn`` applied to every folder it names: ``PATHS`` and each task model's."""
        out = {**record, **{key: fn(record[key]) for key in PATHS if record.get(key)}}
        if record.get("task_models"):
            out["task_models"] = {t: {**e, "model": fn(e["model"])} for t, e in record["task_models"].items()}
        return out

    # ----------------------------------------------------------------- reading

    def record_uri(self, version: str) -> str:
        return storage.join(self.folder, "versions", f"{version}.json")

    def versions(self) -> list[dict[str, Any]]:
        """Every record, oldest first, its folders where they are now."""
        uris = [u for u in storage.list_files(storage.join(self.folder, "versions")) if u.endswith(".json")]
        return sorted((self._resolved(_read(u)) for u in uris), key=lambda r: (r.get("created", ""), r["version"]))

    def has(self, version: str) -> bool:
        return storage.exists(self.record_uri(version))

    def get(self, version: str) -> dict[str, Any]:
        if not self.has(version):
            known = ", ".join(r["version"] for r in self.versions()) or "none yet"
            raise RegistryError(f"model version {version!r} is not in the registry {self.root} "
                                f"(registered: {known}); `bertpipe models list` shows them")
        return self._resolved(_read(self.record_uri(version)))

    def aliases(self) -> dict[str, Any]:
        """``{"current": v | None, "previous": v | None, "history": [...]}``."""
        uri = storage.join(self.folder, "aliases.json")
        if not storage.exists(uri):
            return {"schema_version": SCHEMA_VERSION, "current": None, "previous": None, "history": []}
        return _read(uri)

    def current(self) -> str | None:
        return self.aliases()["current"]

    def model(self, ref: str) -> str:
        """The model folder of ``current``, ``previous`` or a version; refused when it is unset,
        unknown or not whole."""
        version = self.aliases().get(ref) if ref in ALIASES else ref
        if version is None:
            raise RegistryError(f"models:{ref}: the registry {self.root} has no {ref} model yet; "
                                "run `bertpipe refresh` or `bertpipe models promote VERSION`")
        model = self.get(version)["model"]
        if not storage.has_manifest(model):
            raise RegistryError(f"models:{ref} is {version}, whose folder {model} is not whole (no "
                                f"{storage.MANIFEST}); restore it, or `bertpipe models rollback`")
        return model

    # ----------------------------------------------------------------- writing

    def register(self, record: dict[str, Any]) -> dict[str, Any]:
        """Add or update a version's record (``version`` and ``model`` required); returns it as
        :meth:`get` does."""
        old = self.get(record["version"]) if self.has(record["version"]) else {}
        merged = {**old, **record, "schema_version": SCHEMA_VERSION,
                  "created": old.get("created") or _now(), "updated": _now()}
        _write_whole(self.record_uri(record["version"]), self._stored(merged))
        resolved = self._resolved(self._stored(merged))
        self._card(resolved)
        return resolved

    def _card(self, record: dict[str, Any]) -> None:
        """The model card in a whole model's folder, quoting its record (scores, gate, promotion)."""
        if record.get("model") and storage.has_manifest(record["model"]):
            write_card(record["model"], record)

    def promote(self, version: str, expect_current: str | None | bool = False) -> dict[str, Any]:
        """Make ``version`` current (the old current becomes previous); returns the aliases.

        ``expect_current``: the current model the caller judged against (None: there was none);
        refused when another promotion moved ``current`` meanwhile. ``False`` skips that check
        (a person promoting by hand).

        The aliases move only to a model whose folder is whole (its manifest and every shard as
        written), inside the lock, and only when ``current`` is still the model the caller judged
        against: two refreshes never both promote, and a crash before the aliases are written leaves
        ``current`` at the old model.
        """
        record = self.get(version)
        problems = model_problems(record["model"])
        if problems:
            raise RegistryError(f"cannot promote {version}: {problems[0]}; the registry points "
                                "only at whole models")
        with self.lock(f"promote {version}"):
            aliases = self.aliases()
            if aliases["current"] == version:
                return aliases
            if expect_current is not False and aliases["current"] != expect_current:
                raise RegistryError(
                    f"cannot promote {version}: it was judged against {expect_current or 'no model'}, "
                    f"but current is now {aliases['current']} (another refresh promoted it); run the "
                    "refresh again to judge against the new current")
            history = [*aliases["history"], version]
            moved = self._move(history, f"promote {version}")
        self._card({**record, "promoted": record.get("promoted") or moved["moved"]})
        return moved

    def add_task_models(self, version: str, found: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """Record the task models fine-tuned from ``version`` (:func:`task_models`), beside the
        ones it already has (a task fine-tuned again replaces its entry)."""
        old = self.get(version).get("task_models") or {}
        return self.register({"version": version, "task_models": {**old, **found}})

    def settle(self, version: str) -> str:
        """Carry out the gate's recorded decision for ``version``: "promoted" or "kept". A promotion
        that crashed before the aliases moved is finished; one rolled back by hand is not redone."""
        record = self.get(version)
        if (record.get("gate") or {}).get("decision") != "promote":
            return "kept"
        if not record.get("promoted"):
            self.promote(version, expect_current=record.get("parent"))
            self.register({"version": version, "promoted": _now()})
        return "promoted"

    def rollback(self) -> dict[str, Any]:
        """Make ``previous`` current again; refused when there is no previous model."""
        with self.lock("rollback"):
            aliases = self.aliases()
            history = list(aliases["history"])
            if len(history) < 2:
                raise RegistryError(f"nothing to roll back to: the registry {self.root} has no previous "
                                    "model (`bertpipe models list` shows the versions)")
            gone = history.pop()
            problems = model_problems(self.get(history[-1])["model"])
            if problems:
                raise RegistryError(f"cannot roll back to {history[-1]}: {problems[0]}")
            return self._move(history, f"rollback from {gone}")

    def _move(self, history: list[str], why: str) -> dict[str, Any]:
        aliases = {"schema_version": SCHEMA_VERSION, "current": history[-1],
                   "previous": history[-2] if len(history) > 1 else None, "history": history,
                   "moved": _now(), "why": why}
        _write_whole(storage.join(self.folder, "aliases.json"), aliases)
        return aliases

    # ----------------------------------------------------------------- the lock

    @contextmanager
    def lock(self, purpose: str, wait_s: float = LOCK_WAIT_S) -> Iterator[None]:
        """Held while the aliases move: another holder is waited for up to ``wait_s``, then refused;
        a lock older than ``LOCK_STALE_S`` is a crashed holder's and is taken over."""
        uri = storage.join(self.folder, "lock")
        token = {"owner": f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}",
                 "purpose": purpose, "since": time.time()}
        deadline = time.monotonic() + wait_s
        while not _create_exclusive(uri, json.dumps(token)):
            holder = _lock_holder(uri)
            if holder is not None and time.time() - holder.get("since", 0) > LOCK_STALE_S:
                storage.remove(uri, recursive=False)
                continue
            if time.monotonic() >= deadline:
                who = f"{holder.get('owner')} ({holder.get('purpose')})" if holder else "another process"
                raise RegistryError(f"the registry {self.root} is locked by {who}; wait for it to "
                                    f"finish, or remove {uri} if that process is gone")
            time.sleep(0.5)
        try:
            yield
        finally:
            if (_lock_holder(uri) or {}).get("owner") == token["owner"]:
                storage.remove(uri, recursive=False)


def _create_exclusive(uri: str, text: str) -> bool:
    """Create ``uri`` holding ``text`` unless it exists, in one conditional step
    (:func:`bert_core.lease.create_exclusive`: ``O_EXCL`` locally, a generation precondition on GCS)."""
    from bert_core.lease import create_exclusive

    return create_exclusive(uri, text)


def _lock_holder(uri: str) -> dict[str, Any] | None:
    try:
        return json.loads(storage.read_text(uri))
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def registered_version(checkpoint: str, storage_root: str) -> str | None:
    """The registered version a checkpoint argument names (``models:current`` or
    ``models:<version>``); None for a plain folder."""
    if not str(checkpoint).startswith(PREFIX):
        return None
    ref = checkpoint[len(PREFIX):]
    return Registry(registry_root(storage_root)).aliases().get(ref) if ref in ALIASES else ref


def resolve_checkpoint(checkpoint: str, storage_root: str) -> str:
    """The folder a checkpoint argument names: ``models:current``, ``models:previous`` or
    ``models:<version>`` through the registry of ``storage_root``; anything else as given."""
    if not str(checkpoint).startswith(PREFIX):
        return checkpoint
    ref = checkpoint[len(PREFIX):]
    if not ref:
        raise RegistryError(f"{checkpoint!r}: name a model, e.g. models:current or models:<version>")
    return Registry(registry_root(storage_root)).model(ref)
