"""Storage seam: every read and write of the pipeline goes through here, over fsspec.

Local paths, ``file://``, ``gs://`` (gcsfs), ``s3://`` (s3fs: ``pip install 'bertpipe[s3]'``) and
``memory://`` all work the same.

A folder is trusted only through its ``_MANIFEST.json``, which :func:`write_manifest` writes
last. :func:`read_manifest` refuses a folder without one: its shards are an unfinished write.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import subprocess
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO, Any

import fsspec

from bert_core.config import ConfigError
from bert_core.failures import InfrastructureError, Refusal, is_infrastructure_error

MANIFEST = "_MANIFEST.json"
SCHEMA_VERSION = 1
MANIFEST_SHA256 = "manifest_sha256"  # set by read_manifest: the sha256 of the bytes it read
WRITTEN_URI = "written_uri"  # set by read_manifest: where the folder was when its manifest was written
ROOT_FILE = "_ROOT.json"  # at a storage root: the name its versions give it (root_name)

_FILESYSTEMS: dict[tuple[int, str], fsspec.AbstractFileSystem] = {}


class ManifestError(ValueError, Refusal):
    """A manifest, or a shard it lists, does not hold what the manifest promises."""


class OutputError(ValueError, Refusal):
    """An output folder that cannot be written (under a file, read-only, no space)."""


class NotTextError(ValueError, Refusal):
    """A file that should be UTF-8 text is not."""


class SchemeError(ConfigError):
    """A URI whose scheme no installed fsspec backend serves."""


class UnreachableError(InfrastructureError):
    """Remote storage that does not answer, or answers with a network failure."""


# The package that serves each scheme, for the hint when it is not installed.
BACKENDS = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs",
            "abfss": "adlfs", "hf": "huggingface_hub", "http": "aiohttp", "https": "aiohttp",
            "sftp": "paramiko", "ssh": "paramiko", "hdfs": "pyarrow", "webhdfs": "requests"}
# Backends that bertpipe offers as an extra: pip install 'bertpipe[<extra>]'.
EXTRAS = {"s3fs": "s3"}
# Seconds the first contact with a remote store may take before it counts as unreachable.
REACH_SECONDS = 30.0
_REACHED: set[tuple[int, str]] = set()


class UnfinishedWriteError(FileNotFoundError, Refusal):
    """A folder has no manifest: whatever is in it is an unfinished write and must not be read."""


def split_protocol(uri: str) -> tuple[str, str]:
    """``gs://b/x`` -> ("gs", "b/x"); a plain path -> ("file", absolute path)."""
    uri = str(uri)
    if "://" in uri:
        protocol, path = uri.split("://", 1)
        if protocol == "file":
            return "file", os.path.abspath(path)
        return protocol, path
    return "file", os.path.abspath(os.path.expanduser(uri))


def filesystem(uri: str) -> fsspec.AbstractFileSystem:
    """The filesystem for ``uri``, built once per process (never inherited across a fork).

    Filesystems are created lazily and cached per process: gcsfs is not fork-safe, so a forked
    Beam worker or DataLoader worker builds its own.
    """
    protocol, _ = split_protocol(uri)
    key = (os.getpid(), protocol)
    fs = _FILESYSTEMS.get(key)
    if fs is None:
        fs = backend(uri)(skip_instance_cache=protocol != "memory")
        _FILESYSTEMS[key] = fs
    return fs


def backend(uri: str) -> type[fsspec.AbstractFileSystem]:
    """The fsspec filesystem class for ``uri``'s scheme; :class:`SchemeError` (one line saying what
    to install) when none is installed."""
    protocol = split_protocol(uri)[0]
    try:
        return fsspec.get_filesystem_class(protocol)
    except (ImportError, ValueError) as err:
        package = BACKENDS.get(protocol)
        if package is None:
            raise SchemeError(f"{uri}: no storage backend for {protocol}:// is installed ({err}); install "
                              "the fsspec backend for it, or use a local path or gs://") from None
        extra = EXTRAS.get(package)
        install = f"pip install 'bertpipe[{extra}]'" if extra else f"pip install {package}"
        raise SchemeError(f"{uri}: {protocol}:// needs {package}: {install}") from None


def reach(uri: str) -> None:
    """Refuse remote storage that does not answer within ``BERTPIPE_STORAGE_TIMEOUT`` seconds
    (default 30) or fails with a network error, in one line (:class:`UnreachableError`). Asked on
    the first contact with each store, so a dead network costs seconds, not a backend's retries."""
    protocol, path = split_protocol(uri)
    if protocol in ("file", "memory"):
        return
    store = path.split("/", 1)[0]
    if (os.getpid(), f"{protocol}://{store}") in _REACHED:
        return
    # a missing backend is a SchemeError at once; building the client is timed below
    head = str(uri).split("*", 1)[0].split("?", 1)[0].split("[", 1)[0].rstrip("/")
    probe = backend(uri)._strip_protocol(head) or store  # as the backend names it (http keeps its URL)
    seconds = float(os.environ.get("BERTPIPE_STORAGE_TIMEOUT") or REACH_SECONDS)
    answer = _within(seconds, _info_or_missing, uri, probe)
    if answer is _NO_ANSWER:
        raise UnreachableError(f"{protocol}://{store}: no answer within {seconds:g} s; check the "
                               "network, the endpoint (e.g. STORAGE_EMULATOR_HOST) and the credentials, "
                               "then run again (BERTPIPE_STORAGE_TIMEOUT sets the wait)")
    if isinstance(answer, BaseException):
        if is_infrastructure_error(answer):
            first = " ".join(str(answer).split())[:200]
            raise UnreachableError(f"{protocol}://{store}: {type(answer).__name__}: {first}; check the "
                                   "network, the endpoint and the credentials, then run again") from None
        raise answer
    _REACHED.add((os.getpid(), f"{protocol}://{store}"))


_NO_ANSWER = object()


def _info_or_missing(uri: str, path: str) -> bool:
    # fsspec's exists() answers False for any error, a network failure included; info() tells.
    try:
        filesystem(uri).info(path)
    except FileNotFoundError:
        return False
    return True


def _within(seconds: float, fn: Any, *args: Any) -> Any:
    """``fn(*args)``'s result or exception, or ``_NO_ANSWER`` after ``seconds``. The call runs in a
    daemon thread, so one that never returns does not hold up the process's exit."""
    import queue
    import threading

    box: queue.Queue = queue.Queue(1)

    def call() -> None:
        try:
            box.put(fn(*args))
        except BaseException as err:  # handed to the caller, which decides
            box.put(err)

    threading.Thread(target=call, daemon=True, name="storage-reach").start()
    try:
        return box.get(timeout=seconds)
    except queue.Empty:
        return _NO_ANSWER


def is_local(uri: str) -> bool:
    return split_protocol(uri)[0] == "file"


def to_uri(uri: str) -> str:
    """Canonical form: absolute path for local files, ``proto://path`` otherwise."""
    protocol, path = split_protocol(uri)
    return path if protocol == "file" else f"{protocol}://{path}"


def join(base: str, *parts: str) -> str:
    base = to_uri(base).rstrip("/")
    rest = "/".join(str(p).strip("/") for p in parts if str(p))
    return f"{base}/{rest}" if rest else base


def open_file(uri: str, mode: str = "rb", **kwargs: Any) -> IO[Any]:
    """Open a file for reading or writing; parent folders are created on write."""
    fs = filesystem(uri)
    path = split_protocol(uri)[1]
    if any(m in mode for m in "wa"):
        parent = path.rsplit("/", 1)[0]
        if parent:
            fs.makedirs(parent, exist_ok=True)
    return fs.open(path, mode, **kwargs)


def exists(uri: str) -> bool:
    reach(uri)
    return filesystem(uri).exists(split_protocol(uri)[1])


def makedirs(uri: str) -> None:
    filesystem(uri).makedirs(split_protocol(uri)[1], exist_ok=True)


def remove(uri: str, recursive: bool = True) -> None:
    fs = filesystem(uri)
    path = split_protocol(uri)[1]
    if fs.exists(path):
        fs.rm(path, recursive=recursive)


def unique_name(prefix: str, ext: str) -> str:
    """A temporary file name no other worker or retry picks (``prefix-<uuid4 hex>.ext``): a step
    passes on the names it wrote, so a retried bundle's files are simply never read."""
    return f"{prefix}-{uuid.uuid4().hex}.{ext}"


def _with_protocol(uri: str, path: str) -> str:
    protocol = split_protocol(uri)[0]
    return path if protocol == "file" else f"{protocol}://{path}"


def list_files(uri: str) -> list[str]:
    """Files directly inside a folder, sorted, as URIs of the same protocol."""
    fs = filesystem(uri)
    path = split_protocol(uri)[1]
    if not fs.exists(path):
        return []
    return sorted(_with_protocol(uri, p) for p in fs.ls(path, detail=False) if fs.isfile(p))


def copy_file(src: str, dst: str, chunk: int = 4 << 20) -> None:
    """Copy file ``src`` to ``dst`` (any protocols, streamed)."""
    import shutil

    with open_file(src, "rb") as r, open_file(dst, "wb") as w:
        shutil.copyfileobj(r, w, chunk)


def copy_files(src: str, dst: str, chunk: int = 4 << 20) -> list[str]:
    """Copy the files directly inside folder ``src`` into folder ``dst`` (any protocols,
    streamed); returns the new URIs."""
    out = []
    for uri in list_files(src):
        target = join(dst, uri.rsplit("/", 1)[-1])
        copy_file(uri, target, chunk)
        out.append(target)
    return out


def glob(pattern: str) -> list[str]:
    """Expand a glob (``*``, ``**``, ``?``) into sorted file URIs."""
    reach(pattern)
    fs = filesystem(pattern)
    path = split_protocol(pattern)[1]
    return sorted(_with_protocol(pattern, p) for p in fs.glob(path) if fs.isfile(p))


def size(uri: str) -> int:
    return int(filesystem(uri).size(split_protocol(uri)[1]))


def read_text(uri: str) -> str:
    """A UTF-8 text file whole; a file that is not UTF-8 is refused naming it and the byte."""
    with open_file(uri, "rb") as f:
        data = f.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise NotTextError(f"{to_uri(uri)} is not UTF-8 text (byte {err.start:,} is 0x{data[err.start]:02x}); "
                           "give the right file, or re-encode it as UTF-8") from None


def write_text(uri: str, text: str) -> None:
    with open_file(uri, "wb") as f:
        f.write(text.encode("utf-8"))


def sha256(uri: str, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open_file(uri, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def code_version() -> str:
    """Package version, plus the git commit when running from a checkout."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        ver = version("bertpipe")
    except PackageNotFoundError:  # pragma: no cover - running from a bare source tree
        ver = "0+unknown"
    root = Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, timeout=5, check=True,
        ).stdout.strip()
        return f"{ver}+g{sha}" if sha else ver
    except (OSError, subprocess.SubprocessError):
        return ver


def shard_name(prefix: str, index: int, count: int, ext: str) -> str:
    """``<prefix>-SSSSS-of-NNNNN.<ext>``: the name of shard ``index`` of ``count``, for every stage."""
    return f"{prefix}-{index:05d}-of-{count:05d}.{ext}"


def shard_entry(uri: str, count: int | None = None, **extra: Any) -> dict[str, Any]:
    """One row of a manifest's shard list: relative name, sha256, bytes and record count."""
    entry = {"path": uri.rsplit("/", 1)[-1], "sha256": sha256(uri), "bytes": size(uri)}
    if count is not None:
        entry["count"] = count
    entry.update(extra)
    return entry


def write_manifest(
    folder: str,
    *,
    stage: str,
    config: Any,
    inputs: Iterable[dict[str, Any]] = (),
    shards: Iterable[dict[str, Any]] = (),
    counts: dict[str, Any] | None = None,
    stats: dict[str, Any] | None = None,
    fence: Callable[[str, str], None] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """Write ``_MANIFEST.json``: call it after every shard is closed (and hashed); it marks the
    folder done. ``fence(tmp, final)`` (``bert_core.lease.fence``) moves the manifest into place
    only while the folder's lease is still the writer's; without it the move is plain.

    ``inputs`` are the manifests this stage read (from :func:`read_manifest`): each is named by
    its stage, place, counts and the sha256 of its manifest, so lineage can be followed and
    :func:`check_inputs` can tell when one changed; ``shards`` come from :func:`shard_entry`.
    """
    if hasattr(config, "model_dump"):
        config = config.model_dump(mode="json")
    manifest = {
        "schema_version": SCHEMA_VERSION,
        "stage": stage,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "code_version": code_version(),
        "config": config,
        "inputs": [_input_entry(m) for m in inputs],
        "shards": list(shards),
        "counts": counts or {},
        "stats": stats or {},
        **extra,
    }
    manifest["uri"] = to_uri(folder)
    tmp = join(folder, f"{MANIFEST}.{uuid.uuid4().hex[:16]}.tmp")  # each writer's own name
    write_text(tmp, json.dumps(manifest, indent=2, sort_keys=True))
    if fence is not None:  # the commit is the lease check
        fence(tmp, join(folder, MANIFEST))
        return manifest
    # A rename is atomic on a local disk; on object stores the final object appears whole.
    filesystem(folder).mv(split_protocol(tmp)[1], split_protocol(join(folder, MANIFEST))[1])
    return manifest


def _input_entry(manifest: dict[str, Any]) -> dict[str, Any]:
    entry = {k: manifest.get(k) for k in ("stage", "uri", "version", "created", "counts")}
    if manifest.get(MANIFEST_SHA256):
        entry["sha256"] = manifest[MANIFEST_SHA256]
    return entry


def has_manifest(folder: str) -> bool:
    return exists(join(folder, MANIFEST))


def read_manifest(folder: str) -> dict[str, Any]:
    """The manifest of a finished folder; raises :class:`UnfinishedWriteError` otherwise.

    A folder is found by the path it is given, never by the ``uri`` written inside its manifest,
    so a copied folder reads its own files.
    """
    path = join(folder, MANIFEST)
    if not exists(path):
        hint = "it does not exist" if not exists(folder) else "its shards are an unfinished write"
        raise UnfinishedWriteError(
            f"unfinished write: {to_uri(folder)} has no {MANIFEST} ({hint}); "
            "re-run the stage that produces it"
        )
    with open_file(path, "rb") as f:
        raw = f.read()
    try:
        manifest = json.loads(raw.decode("utf-8"))
    except json.JSONDecodeError as err:
        raise ManifestError(f"{to_uri(path)} is not valid JSON ({err.msg} at line {err.lineno}): the "
                            "manifest is damaged; re-run the stage that produces it") from None
    except UnicodeDecodeError:
        raise ManifestError(f"{to_uri(path)} is not UTF-8 text: the manifest is damaged; "
                            "re-run the stage that produces it") from None
    if not isinstance(manifest, dict) or not {"shards", "schema_version"} & set(manifest):
        raise ManifestError(f"{to_uri(path)} is not a bertpipe manifest; re-run the stage that produces it")
    if manifest.get("schema_version") != SCHEMA_VERSION:
        raise ManifestError(
            f"{path}: schema_version {manifest.get('schema_version')} is not {SCHEMA_VERSION}; "
            "re-run the stage with this version of bertpipe"
        )
    if "shards" not in manifest:
        raise ManifestError(f"{to_uri(path)} is not a bertpipe manifest; re-run the stage that produces it")
    # Where the folder is now, not where it was written: a copied folder never points back.
    manifest[WRITTEN_URI] = str(manifest.get("uri") or to_uri(folder))
    manifest["uri"] = to_uri(folder)
    manifest[MANIFEST_SHA256] = hashlib.sha256(raw).hexdigest()
    return manifest


def manifest_sha256(folder: str) -> str:
    """The sha256 of a folder's ``_MANIFEST.json`` bytes (what an input entry records)."""
    return sha256(join(folder, MANIFEST))


def input_problems(manifest: dict[str, Any], stages: Iterable[str] | None = None) -> list[tuple[str, str]]:
    """The recorded inputs of ``manifest`` (of ``stages``, default all) whose manifest is gone or
    is not the one that was read, as (input, what happened), each looked for where it is now
    (:func:`relocated`). Inputs recorded without a sha256 (raw files, older manifests) cannot be
    checked and are passed over."""
    wanted = None if stages is None else set(stages)
    problems = []
    for entry in manifest.get("inputs", []):
        uri, recorded = entry.get("uri"), entry.get("sha256")
        if not uri or not recorded or (wanted is not None and entry.get("stage") not in wanted):
            continue
        uri = relocated(manifest, uri)
        if not has_manifest(uri):
            problems.append((to_uri(uri), f"is gone (no {MANIFEST})"))
        elif manifest_sha256(uri) != recorded:
            problems.append((to_uri(uri), f"changed (its {entry.get('stage') or 'input'} stage ran "
                                          "again or it was edited)"))
    return problems


def check_inputs(manifest: dict[str, Any], stages: Iterable[str] | None = None) -> None:
    """Raise :class:`ManifestError` (one line) when an input a manifest names changed or is gone
    since the folder was made: the folder no longer matches what it was made from.

    Each input a manifest names carries the sha256 of that input's manifest as it was read.
    """
    problems = input_problems(manifest, stages)
    if problems:
        consumer, stage = manifest.get("uri", "?"), manifest.get("stage", "?")
        (input_uri, what), more = problems[0], len(problems) - 1
        raise ManifestError(f"{consumer}: its input {input_uri} {what} since it was made"
                            f"{f' (and {more} more)' if more else ''}; re-run {stage} for {consumer}, "
                            f"or restore {input_uri}")


def relocated(manifest: dict[str, Any], uri: str) -> str:
    """Where a path that ``manifest`` (from :func:`read_manifest`) recorded is now.

    A manifest records paths as they were when it was written. When its folder has since moved
    with the storage root it lies in (a root copied, synced or mounted elsewhere: the root is the
    nearest folder above holding ``_ROOT.json``), a path inside the root it was written in is the
    same path inside the root it lies in now, and is never read from the old place. Any other
    path is as recorded.
    """
    uri = to_uri(uri)
    written, now = (str(manifest.get(k) or "").rstrip("/") for k in (WRITTEN_URI, "uri"))
    if not written or not now or written == now:
        return uri
    root = find_root(now)
    if root is None:
        return uri
    inside = now[len(root):]  # the folder's place in its root, e.g. /vocab/<version>
    if not written.endswith(inside):
        return uri
    old = written[: len(written) - len(inside)]
    return root + uri[len(old):] if uri == old or uri.startswith(old + "/") else uri


def find_root(folder: str) -> str | None:
    """The storage root ``folder`` lies in: the nearest folder above it (or itself) that holds
    ``_ROOT.json``; None when there is none."""
    parts = split_protocol(folder)[1].rstrip("/").split("/")
    for n in range(len(parts), 0, -1):
        here = _with_protocol(folder, "/".join(parts[:n]) or "/")
        if exists(join(here, ROOT_FILE)):
            return to_uri(here).rstrip("/")
    return None


def root_name(root: str) -> str:
    """The name versions give the storage root ``root``: where it was first written, kept in
    ``<root>/_ROOT.json``, so that a root copied, synced or mounted elsewhere keeps its versions.

    A root without the file is named where the manifests of its stage folders say they were
    written, else where it is, and the file is written then; a root that cannot be written is
    named all the same.
    """
    uri = join(root, ROOT_FILE)
    if exists(uri):
        try:
            return str(json.loads(read_text(uri))["name"])
        except (ValueError, KeyError, TypeError):
            raise ManifestError(f"{uri} is damaged: it names the storage root for its versions; restore "
                                'it, or write {"name": "<where the root was first written>"} into it') from None
    name = _written_under(root) or to_uri(root).rstrip("/")
    try:
        tmp = join(root, unique_name(ROOT_FILE, "tmp"))
        write_text(tmp, json.dumps({"schema_version": SCHEMA_VERSION, "name": name}, indent=2))
        filesystem(root).mv(split_protocol(tmp)[1], split_protocol(uri)[1])
    except OSError:
        pass  # a read-only root: the next run that may write records the name
    return name


def _written_under(root: str) -> str | None:
    """The root the stage folders of ``root`` were written under (``<root>/<stage>/<version>``
    with the ``uri`` their manifest recorded), or None when it holds none."""
    for stage in ("corpus", "vocab", "instances"):
        for uri in glob(join(root, stage, "*", MANIFEST)):
            try:
                written = str(json.loads(read_text(uri)).get("uri") or "").rstrip("/")
            except (ValueError, NotTextError):
                continue
            inside = "/" + "/".join(uri.split("/")[-3:-1])
            if written.endswith(inside):
                return written[: len(written) - len(inside)]
    return None


def shard_uris(folder: str, manifest: dict[str, Any] | None = None) -> list[str]:
    """The shards a manifest lists, as URIs (never a directory listing: stray files are ignored)."""
    manifest = manifest or read_manifest(folder)
    return [join(folder, s["path"]) for s in manifest["shards"]]


CHECKSUM_BYTES = 256 << 20  # inputs up to this size get their sha256 checked at stage start


def shard_problems(folder: str, manifest: dict[str, Any] | None = None,
                   checksums: bool | None = None) -> list[str]:
    """What is wrong with the shards a manifest lists: missing, another size, another sha256.

    Sizes are always compared; sha256 when ``checksums`` (default: when the shards together
    are at most :data:`CHECKSUM_BYTES`). An empty list means every shard is as written.
    """
    manifest = manifest or read_manifest(folder)
    shards = manifest.get("shards", [])
    if checksums is None:
        checksums = sum(s.get("bytes", 0) for s in shards) <= CHECKSUM_BYTES
    stage = manifest.get("stage", "?")
    problems = []
    for entry in shards:
        uri = join(folder, entry["path"])
        if not exists(uri):
            problems.append(f"{to_uri(uri)} is missing")
        elif "bytes" in entry and size(uri) != entry["bytes"]:
            problems.append(f"{to_uri(uri)} has {size(uri)} bytes, the {stage} stage wrote {entry['bytes']}")
        elif checksums and "sha256" in entry and sha256(uri) != entry["sha256"]:
            problems.append(f"{to_uri(uri)} does not match the sha256 the {stage} stage recorded")
    return problems


def check_shards(folder: str, manifest: dict[str, Any] | None = None, checksums: bool | None = None) -> None:
    """Raise :class:`ManifestError` (one line) when a shard is not as its manifest says."""
    problems = shard_problems(folder, manifest, checksums)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ManifestError(f"{problems[0]}{more}: the shard is damaged or was changed after it was "
                            f"written; re-run the stage that produces {to_uri(folder)}, or restore it "
                            "(`bertpipe verify` lists every problem)")


def check_writable(folder: str) -> None:
    """Create ``folder`` and write a probe file in it, or raise :class:`OutputError` (one line)."""
    probe = join(folder, unique_name(".bertpipe-write-test", "tmp"))  # its own: writers may probe at once
    try:
        makedirs(folder)
        write_text(probe, "ok")
        remove(probe, recursive=False)
    except OSError as err:
        why = err.strerror or type(err).__name__
        raise OutputError(f"cannot write to {to_uri(folder)}: {why}; choose a writable --output "
                          "(a folder, not a file, with free space)") from None

