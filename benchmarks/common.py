"""What every benchmark needs: the sample data and the name of the machine it ran on."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def samples() -> Path:
    """The fetched sample data: ``$BERTPIPE_SAMPLES``, else fetched once into the cache."""
    if os.environ.get("BERTPIPE_SAMPLES"):
        return Path(os.environ["BERTPIPE_SAMPLES"])
    from flows.tools.samples import fetch

    base = Path(os.environ.get("BERTPIPE_CACHE", Path.home() / ".cache" / "bertpipe"))
    return fetch(base / "samples", log=lambda m: None)


def machine() -> dict[str, str | int]:
    """What the numbers were measured on (they mean little without it)."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch

    return {
        "cpu": cpu,
        "cores": os.cpu_count() or 0,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "os": platform.platform(terse=True),
    }
