"""The keys DeepSpeed reads from its config, learnt from DeepSpeed's own code at run time.

    python -c "from bert_core.pretrain.ds_keys import known_keys; print(sorted(known_keys()[()]))"

DeepSpeed parses its config with plain ``dict`` look-ups for some sections and pydantic models
(``extra="forbid"``) for others, and ignores a key that no look-up asks for. ``known_keys`` builds
``DeepSpeedConfig`` once over a dict that records every key asked of it (the top level), then once
per top-level key with a probe section in it: a pydantic section refuses the probe and names its
model (whose fields and aliases are the sub-keys, nested models followed), a plain section records
the sub-keys it asks for, and a key DeepSpeed has removed raises its own message. A key that holds
free-form values (``optimizer.params``, ``pipeline``) has no known sub-keys and is not looked into.
"""

from __future__ import annotations

import difflib
import functools
import typing
from types import UnionType
from typing import Any

_PROBE = "__bertpipe_probe__"


def check_keys(overrides: dict[str, Any], prefix: str = "pretrain.deepspeed") -> list[str]:
    """One ``path: why`` per key of ``overrides`` that DeepSpeed does not read (or has removed),
    naming the closest key it does read."""
    known = known_keys()
    removed = removed_keys()
    problems: list[str] = []

    def walk(node: dict[str, Any], path: tuple[str, ...]) -> None:
        keys = known.get(path)
        if not keys:  # free-form below here
            return
        for key, value in node.items():
            where = ".".join((prefix, *path, key))
            if not path and key in removed:
                problems.append(f"{where}: DeepSpeed {_version()} refuses it: {removed[key]}")
            elif key not in keys:
                close = difflib.get_close_matches(key, sorted(keys), n=1, cutoff=0.6)
                hint = (f"did you mean {'.'.join((prefix, *path, close[0]))}?" if close
                        else f"{'.'.join((prefix, *path))} has: {', '.join(sorted(keys))}")
                problems.append(f"{where}: not a key DeepSpeed {_version()} reads; {hint}")
            elif isinstance(value, dict):
                walk(value, (*path, key))

    walk(overrides, ())
    return problems


@functools.cache
def known_keys() -> dict[tuple[str, ...], frozenset[str]]:
    """Section path (``()`` for the top level) -> the keys DeepSpeed reads there."""
    return _learn()[0]


@functools.cache
def removed_keys() -> dict[str, str]:
    """Top-level key -> DeepSpeed's message, for the sections DeepSpeed has removed."""
    return _learn()[1]


@functools.cache
def _version() -> str:
    import deepspeed

    return deepspeed.__version__


@functools.cache
def _learn() -> tuple[dict[tuple[str, ...], frozenset[str]], dict[str, str]]:
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.config_utils import DeepSpeedConfigModel
    from pydantic import ValidationError

    base = {"train_micro_batch_size_per_gpu": 1}
    asked: set[tuple[str, ...]] = set()
    DeepSpeedConfig(_Recording(base, (), asked))
    top = {p[0] for p in asked if len(p) == 1}
    models = {m.__name__: m for m in _subclasses(DeepSpeedConfigModel)}
    known: dict[tuple[str, ...], frozenset[str]] = {(): frozenset(top)}
    removed: dict[str, str] = {}
    for key in sorted(top):
        asked = set()
        section = _Recording({"type": _PROBE, _PROBE: 1}, (key,), asked)
        try:
            DeepSpeedConfig({**base, key: section})
        except ValidationError as err:
            model = models.get(err.title)
            locs = [e["loc"] for e in err.errors() if e["type"] == "extra_forbidden"]
            if model is not None and locs:
                _model_keys(_model_at(model, locs[0][:-1]), (key,), known)
        except Exception as err:  # noqa: BLE001 (a scalar key refuses a mapping in its own way)
            if type(err).__name__ == "DeepSpeedConfigError" and "removed" in str(err):
                removed[key] = str(err).splitlines()[0]
        sub = {p[1] for p in asked if len(p) == 2 and p[1] != _PROBE}
        if sub:
            known[(key,)] = known.get((key,), frozenset()) | sub
    return known, removed


def _subclasses(cls: type) -> list[type]:
    out = []
    for sub in cls.__subclasses__():
        out += [sub, *_subclasses(sub)]
    return out


def _model_at(model: type, loc: tuple) -> type:
    """The model that holds the last key of an error's ``loc`` (fields followed by name or alias)."""
    for part in loc:
        fields = {n: f for n, f in model.model_fields.items()} | {
            f.alias: f for f in model.model_fields.values() if f.alias}
        inner = _inner_model(fields[part].annotation) if part in fields else None
        if inner is None:
            break
        model = inner
    return model


def _inner_model(annotation: Any) -> type | None:
    """The pydantic model in ``X``, ``X | None``, ``Optional[X]``; None for anything else."""
    from pydantic import BaseModel

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    models = [a for a in typing.get_args(annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
    return models[0] if len(models) == 1 and typing.get_origin(annotation) in (typing.Union, UnionType) else None


def _model_keys(model: type, path: tuple[str, ...], known: dict[tuple[str, ...], frozenset[str]]) -> None:
    """The fields of ``model`` and their aliases as the keys at ``path``, nested models below."""
    keys = set()
    for name, field in model.model_fields.items():
        for key in {name, field.alias} - {None}:
            keys.add(key)
            inner = _inner_model(field.annotation)
            if inner is not None and (*path, key) not in known:
                _model_keys(inner, (*path, key), known)
    known[path] = known.get(path, frozenset()) | keys


class _Recording(dict):
    """A dict that notes every key asked of it (``get``, ``[]``, ``in``, ``in .keys()``)."""

    def __init__(self, data: dict[str, Any], path: tuple[str, ...], asked: set[tuple[str, ...]]) -> None:
        super().__init__(data)
        self._path, self._asked = path, asked

    def _note(self, key: Any) -> None:
        if isinstance(key, str):
            self._asked.add((*self._path, key))

    def get(self, key: Any, default: Any = None) -> Any:
        self._note(key)
        return super().get(key, default)

    def __getitem__(self, key: Any) -> Any:
        self._note(key)
        return super().__getitem__(key)

    def __contains__(self, key: Any) -> bool:
        self._note(key)
        return super().__contains__(key)

    def keys(self) -> Any:
        return _RecordingKeys(self)


class _RecordingKeys:
    def __init__(self, owner: _Recording) -> None:
        self._owner = owner

    def __contains__(self, key: Any) -> bool:
        return key in self._owner

    def __iter__(self) -> Any:
        return iter(dict.keys(self._owner))

    def __len__(self) -> int:
        return dict.__len__(self._owner)
