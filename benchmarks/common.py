"""What every benchmark needs: the sample data, a reference's own venv, the machine it ran on, its
rows and where they go, what one command or function costs (wall time, CPU and memory), Welch's
interval, and our model beside transformers' with the same weights and its MLM labels."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the repository root: benchmarks run from it, as modules
ROW_KEYS = ("measure", "ours", "reference", "ratio", "unit")


def cache() -> Path:
    """The bertpipe cache: ``$BERTPIPE_CACHE``, else ``~/.cache/bertpipe``."""
    return Path(os.environ.get("BERTPIPE_CACHE", Path.home() / ".cache" / "bertpipe"))


def samples() -> Path:
    """The fetched sample data: ``$BERTPIPE_SAMPLES``, else fetched once into the cache."""
    if os.environ.get("BERTPIPE_SAMPLES"):
        return Path(os.environ["BERTPIPE_SAMPLES"])
    from flows.tools.samples import fetch

    return fetch(cache() / "samples", log=lambda m: None)


def reference_venv(folder: str, packages: list[str], imports: str) -> Path:
    """The Python of a reference's own venv, ``<cache>/<folder>``, with pinned ``packages`` (from
    the package registry), made on first use: a reference is never a dependency of bertpipe."""
    venv = cache() / folder
    python = venv / "bin" / "python"
    if python.exists() and subprocess.run([str(python), "-c", f"import {imports}"], capture_output=True).returncode == 0:
        return python
    print(f"creating {venv} with {' '.join(packages)} (once)", file=sys.stderr, flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *packages],
                         capture_output=True, text=True)
    if pip.returncode != 0:
        sys.exit(f"cannot install {' '.join(packages)} into {venv}:\n{pip.stderr[-3000:]}")
    return python


def row(measure: str, ours: float | None, reference: float | None, unit: str, ratio: float | None = None,
        digits: int = 3, **extra) -> dict:
    """One row of the table run_all prints: ours and the reference side by side, and their ratio."""
    ours, reference = (None if v is None else round(v, digits) for v in (ours, reference))
    return {"measure": measure, "ours": ours, "reference": reference,
            "ratio": None if ratio is None else round(ratio, max(digits, 3)), "unit": unit, **extra}


def sample_texts(root: Path) -> list[str]:
    """The sample corpus as texts: the Gutenberg book, the news articles, the plays, and the enwiki
    excerpt (its XML, entities decoded)."""
    import bz2
    import html

    texts = [(root / "books" / "botchan.txt").read_text("utf-8"), (root / "news" / "lee_background.cor").read_text("utf-8")]
    texts += [play.read_text("utf-8") for play in sorted((root / "plays").glob("*.md"))]
    return texts + [html.unescape(bz2.decompress(dump.read_bytes()).decode()) for dump in
                    sorted((root / "wikipedia").glob("*.xml.bz2"))]


def write_rows(name: str, rows: list[dict], **extra) -> Path:
    """Print the rows and write ``bench-results/<name>.json`` = {"rows": rows, **extra}, the file
    run_all tabulates."""
    import json

    width = max((len(r["measure"]) for r in rows), default=0)
    for r in rows:
        more = "".join(f"  {k}={v}" for k, v in r.items() if k not in ROW_KEYS)
        print(f"{r['measure']:<{width}}  ours {r['ours']!s:>10}  reference {r['reference']!s:>10}  "
              f"ratio {r['ratio']!s:>6}  {r['unit']}{more}")
    out = Path("bench-results") / f"{name}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"rows": rows, **extra}, indent=2))
    print(f"wrote {out}")
    return out


def distinct_files() -> list[Path]:
    """The distinct real text (:mod:`benchmarks.text.distinct_text`), fetched once, every source in turn."""
    from benchmarks.text.distinct_text import cached, interleaved, text_files

    return interleaved(text_files(cached(log=lambda m: print(m, file=sys.stderr))))


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

    return {"cpu": cpu, "cores": os.cpu_count() or 0, "python": platform.python_version(), "torch": torch.__version__,
            "os": platform.platform(terse=True)}


# --------------------------------------------------------------------------- one command's cost


def process_tree(pid: int) -> list:
    """A process and its descendants (``psutil.Process``), without the forks that have not yet
    run their own program (a child with its parent's command line, such as one about to exec
    ``git``): they share their parent's pages and would count them twice."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return []
    seen: dict[int, dict] = {}  # pid -> its cmdline (None where access is denied) and ppid
    for proc in procs:
        try:
            seen[proc.pid] = proc.as_dict(["cmdline", "ppid"])
        except psutil.Error:
            continue
    return [proc for proc in procs if proc.pid in seen
            and (proc.pid == pid or seen[proc.pid]["cmdline"] != seen.get(seen[proc.pid]["ppid"], {}).get("cmdline"))]


def tree_cpu(pids: list[int]) -> float:
    """CPU seconds so far of these processes, their descendants and the children they reaped."""
    import psutil

    total = 0.0
    for pid in pids:
        for proc in process_tree(pid):
            try:
                t = proc.cpu_times()
                total += t.user + t.system + t.children_user + t.children_system
            except psutil.Error:
                continue
    return total


def measure(argv: list[str], log: Path, env: dict[str, str] | None = None, every: float = 0.2) -> dict[str, float]:
    """Run one command (``env`` added to this one's, output added to ``log``): wall seconds, CPU seconds
    of its process tree (the larger of what ``wait4`` reports for it and its reaped children and
    the sum over every process seen), peak RSS of the tree in MB (the sum over its processes,
    sampled every ``every`` seconds) and the most processes seen at once."""
    import psutil

    peak, cpu_seen = {"rss": 0, "processes": 0}, {}
    start = time.perf_counter()
    with log.open("a") as out:
        proc = subprocess.Popen(argv, env={**os.environ, **(env or {})}, stdout=out, stderr=subprocess.STDOUT)
        done = threading.Event()

        def watch() -> None:
            while not done.is_set():
                rss, procs = 0, process_tree(proc.pid)
                for p in procs:
                    try:
                        with p.oneshot():
                            rss += p.memory_info().rss
                            times = p.cpu_times()
                            cpu_seen[p.pid] = times.user + times.system
                    except psutil.Error:
                        continue
                peak["rss"], peak["processes"] = max(peak["rss"], rss), max(peak["processes"], len(procs))
                done.wait(every)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        _, status, usage = os.wait4(proc.pid, 0)
        done.set()
        watcher.join()
    wall = time.perf_counter() - start
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise RuntimeError(f"{' '.join(argv[:3])} ... exited {code}; last lines of {log}:\n"
                           f"{log.read_text()[-3000:]}")
    cpu = max(usage.ru_utime + usage.ru_stime, sum(cpu_seen.values()))
    return {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "peak_rss_mb": round(peak["rss"] / 1e6, 1),
            "processes": peak["processes"]}


def timed(fn, clock=time.process_time):
    """``fn()`` and the seconds it took by ``clock`` (default: this process's CPU time)."""
    start = clock()
    result = fn()
    return result, clock() - start


# --------------------------------------------------------------------------- statistics, and ours beside transformers


def welch(a: list[float], b: list[float], level: float = 0.95) -> dict[str, float]:
    """mean(a) - mean(b) with its Welch t interval at ``level`` (df by Welch–Satterthwaite), the t
    statistic and its two-sided p-value; NaN where a side has fewer than two values."""
    import math
    import statistics

    from scipy import stats

    gain = statistics.fmean(a) - statistics.fmean(b)
    if len(a) < 2 or len(b) < 2:
        return {"gain": gain, "ci_low": math.nan, "ci_high": math.nan, "df": math.nan, "t": math.nan, "p": math.nan}
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    se = math.sqrt(va + vb)
    if se == 0:
        return {"gain": gain, "ci_low": gain, "ci_high": gain, "df": math.inf, "t": math.nan, "p": math.nan}
    # by hand, not scipy's ttest_ind: its last bits differ, and committed results are compared as text
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    half = float(stats.t.ppf(0.5 + level / 2, df)) * se
    t = gain / se
    return {"gain": gain, "ci_low": gain - half, "ci_high": gain + half, "df": df, "t": t,
            "p": float(2 * stats.t.sf(abs(t), df))}


def make_pair(size: str, vocab_size: int, seed: int = 0, attention_dropout: float | None = None):
    """Our model and transformers' (SDPA attention) with identical weights and config."""
    import torch
    import transformers

    from bert_core.config import ModelConfig
    from bert_core.model.bert import BertForPreTraining
    from bert_core.model.checkpoint import hf_config_from_model

    extra = {} if attention_dropout is None else {"attention_probs_dropout_prob": attention_dropout}
    cfg = ModelConfig(size=size, vocab_size=vocab_size, max_position_embeddings=512, **extra)
    torch.manual_seed(seed)
    ours = BertForPreTraining(cfg)
    hf_cfg = transformers.BertConfig(**{k: v for k, v in hf_config_from_model(cfg).items() if k != "architectures"},
                                     attn_implementation="sdpa")
    ref = transformers.BertForPreTraining(hf_cfg)
    state = ours.state_dict()
    state["cls.predictions.decoder.bias"] = state["cls.predictions.bias"]
    missing, unexpected = ref.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"cls.predictions.decoder.weight"}, (missing, unexpected)
    return cfg, ours.train(), ref.train(), getattr(ref.config, "_attn_implementation", "?")


def hf_labels(batch: dict):
    """An instances batch's masked positions and ids as transformers' ``[B, T]`` MLM labels
    (-100 where nothing is predicted)."""
    import torch

    B, T = batch["input_ids"].shape
    labels = torch.full((B, T), -100, dtype=torch.long)
    real = batch["masked_lm_weights"] > 0
    rows = torch.arange(B)[:, None].expand_as(real)
    labels[rows[real], batch["masked_lm_positions"][real]] = batch["masked_lm_ids"][real]
    return labels
