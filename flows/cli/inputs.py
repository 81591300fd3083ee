"""What each command's options take, checked before the command does any work.

    bertpipe vocab --corpus out/vocab --output out/v2
    --corpus out/vocab: that folder is a vocab folder (its _MANIFEST.json says stage "vocab"); ...

``INPUTS`` names, for every command and every text option or argument, what it takes (a key of
``bert_core.preflight.TAKES``) or None for a value that is no path; :func:`checked` wraps a
command so that its paths pass ``bert_core.preflight.check_inputs`` first. tests/test_bad_inputs.py
fails for an option without an entry and gives every entry the wrong kind of path.
"""

from __future__ import annotations

import functools
import typing
from collections.abc import Callable
from typing import Any

# Options of every command that reads config.
COMMON: dict[str, str | None] = {"preset": None, "config": "file", "set_": None, "runner": None}

INPUTS: dict[str, dict[str, str | None]] = {
    "corpus": {"output": "folder", "wikipedia": "files", "books": "files", "text": "files",
               "text_field": None, "id_field": None, "title_field": None, "text_format": None},
    "vocab": {"output": "folder", "corpus": "corpus", "vocab_file": "file"},
    "instances": {"corpus": "corpus", "vocab": "vocab", "output": "folder"},
    "pretrain": {"instances": "instances", "output": "folder", "init_checkpoint": "model",
                 "master_addr": None, "hostfile": "file"},
    "export": {"source": "checkpoint", "output": "folder", "vocab": "file", "tag": None},
    "finetune": {"task": None, "data": "tasks", "checkpoint": "model", "output": "folder", "seeds": None,
                 "learning_rates": None, "batch_sizes": None, "epochs": None},
    "features": {"checkpoint": "model", "input_": "file", "output": "file", "layers": None,
                 "input_format": None},
    "predict": {"model": "model", "input_": "file", "output": "file", "field": None},
    "stats": {"uri": "stage"},
    "verify": {"uri": "stage"},
    "plan": {"assume_size": None},
    "run": {},
    "refresh": {"date": None, "base_url": None},
    "server": {"host": None},
    "serve": {"prefect_yaml": "file", "only": None},
    "download wikipedia": {"date": None, "to": "folder", "lang": None, "job": None, "base_url": None,
                           "staging": "folder"},
    "infra render": {"out": "folder", "image": None, "namespace": None, "instances": "instances",
                     "run_dir": "folder"},
    "config show": {},
    "config presets": {},
    "samples fetch": {"directory": "folder"},
    "tasks fetch": {"names": None, "to": "folder", "url": None, "staging": "folder"},
    "models list": {},
    "models show": {"version": None},
    "models promote": {"version": None},
    "models rollback": {},
    "models import": {"path": "model"},
}


def takes(command: str, name: str) -> str | None:
    """What parameter ``name`` of ``command`` takes; None for a value that is no path (and for one
    without an entry, which tests/test_bad_inputs.py refuses)."""
    return COMMON[name] if name in COMMON else INPUTS.get(command, {}).get(name)


def labels(function: Callable[..., Any]) -> dict[str, str]:
    """Parameter name -> how the command line spells it (``--init-checkpoint``, ``SOURCE``)."""
    import typer.models

    out = {}
    for name, hint in typing.get_type_hints(function, include_extras=True).items():
        info = next((m for m in getattr(hint, "__metadata__", ()) if isinstance(m, typer.models.ParameterInfo)), None)
        if isinstance(info, typer.models.ArgumentInfo):
            out[name] = info.metavar or name.rstrip("_").upper()
        elif info is not None:
            # In Annotated[...] typer reads a first argument that starts with "-" as a declaration
            given = (info.default, *(getattr(info, "param_decls", None) or ()))
            decls = [d for d in given if isinstance(d, str) and d.startswith("--")]
            out[name] = decls[0] if decls else "--" + name.rstrip("_").replace("_", "-")
    return out


def checked(command: str, function: Callable[..., None]) -> Callable[..., None]:
    """``function`` whose path parameters are checked against ``INPUTS[command]`` before it runs."""
    spelled = labels(function)

    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> None:
        from bert_core.preflight import check_inputs

        check_inputs([(spelled.get(name, name), value, kind) for name, value in kwargs.items()
                      if (kind := takes(command, name) if name in spelled else None) is not None])
        return function(*args, **kwargs)

    return run
