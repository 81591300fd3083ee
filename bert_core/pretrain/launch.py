"""Render and run the DeepSpeed launcher command for pre-training, from the config.

    python -c "from bert_core.config import load_config; from bert_core.pretrain.launch import launcher_argv; print(' '.join(launcher_argv(load_config('demo').pretrain, ['--output', 'runs/x'])))"

``pretrain.launcher`` picks one of three shapes (:func:`launcher_argv`): ``local``, ``hostfile``
or ``no_ssh``. :func:`run_launch` streams the launcher's output and classifies a failed run as
:class:`LaunchConfigError` (fix the input) or :class:`LaunchInfraError` (retry; the run resumes).
"""

from __future__ import annotations

import base64
import contextvars
import functools
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

from bert_core import lease, storage
from bert_core.config import PipelineConfig, PretrainConfig
from bert_core.failures import InfrastructureError, is_infrastructure_exit
from bert_core.pretrain.errors import CONFIG_ERROR_EXIT, CONFIG_ERROR_PREFIX, PretrainConfigError
from bert_core.pretrain.loop import check_instances
from bert_core.pretrain.run_folder import CONFIG_FILE, check_run_config
from bert_core.stopping import end_with_parent, on_stop, stop_group

SCRIPT_MODULE = "bert_core.pretrain"
DEFAULT_MASTER_PORT = 29500  # DeepSpeed's; the multi-node launchers use it unless one is set
HOSTFILE = "hostfile"
# What remote ranks need from the launching shell (DeepSpeed forwards PYTHON* itself).
FORWARDED_ENV = ("OMP_NUM_THREADS", "DS_ACCELERATOR")


class LaunchError(RuntimeError):
    """A pre-training launch failed; ``exit_code`` and the last output lines say how."""

    def __init__(self, message: str, exit_code: int, tail: list[str]) -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.tail = tail


class LaunchConfigError(LaunchError, PretrainConfigError):
    """A rank refused the config or the data: fix the input; a retry would fail the same way."""


class LaunchInfraError(LaunchError, InfrastructureError):
    """Rendezvous timeout, a killed rank, a busy port...: retry, the run resumes from its checkpoint."""


# --------------------------------------------------------------------------- argv


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def master_port(cfg: PretrainConfig) -> int:
    """The rendezvous port: the configured one, else a free one for ``local``, else 29500."""
    if cfg.master_port is not None:
        return cfg.master_port
    return free_port() if cfg.launcher == "local" else DEFAULT_MASTER_PORT


def launcher_argv(
    cfg: PretrainConfig,
    script_args: list[str],
    node_rank: int | None = None,
    hostfile: str | None = None,
) -> list[str]:
    """The launcher command of ``cfg.launcher``, running ``--module bert_core.pretrain <script_args>``.

    - ``local``: N ranks on this machine (on CPU: N gloo ranks), on a free port unless
      ``pretrain.master_port`` is set, so two runs on one machine never collide. It is the command
      ``deepspeed --num_gpus N`` itself runs on one machine (``python -m deepspeed.launcher.launch``
      with the world of ``localhost``), started directly: one Python start-up less per run;
    - ``hostfile``: ``deepspeed --hostfile H --num_nodes n --num_gpus N`` (the launcher reaches the
      other hosts over ssh/pdsh);
    - ``no_ssh``: one launcher per node (Kubernetes pods), each with ``--no_ssh --node_rank r
      --master_addr A --master_port P``. DeepSpeed still wants a hostfile to count the nodes; when
      none is given a ``node{i} slots=N`` file is written into the run folder.
    """
    if cfg.launcher == "local":
        if cfg.nodes != 1:
            raise PretrainConfigError(
                f"pretrain.launcher=local runs on one machine but pretrain.nodes={cfg.nodes}; "
                "use launcher=hostfile (ssh) or launcher=no_ssh (one launcher per node)"
            )
        world = base64.urlsafe_b64encode(json.dumps({"localhost": list(range(cfg.procs_per_node))}).encode())
        return ["python", "-u", "-m", "deepspeed.launcher.launch", f"--world_info={world.decode()}",
                "--master_addr=127.0.0.1", f"--master_port={master_port(cfg)}", "--module",
                "--enable_each_rank_log=None", "--log_level=info", SCRIPT_MODULE, *script_args]
    argv = ["deepspeed"]
    if cfg.launcher == "hostfile":
        argv += ["--hostfile", hostfile or str(cfg.hostfile), "--num_nodes", str(cfg.nodes),
                 "--num_gpus", str(cfg.procs_per_node)]
    else:  # no_ssh
        if node_rank is None or not 0 <= node_rank < cfg.nodes:
            raise PretrainConfigError(
                f"launcher=no_ssh needs --node-rank in [0, {cfg.nodes}) (this node's index); got {node_rank}"
            )
        argv += ["--hostfile", hostfile or str(cfg.hostfile), "--no_ssh", "--node_rank", str(node_rank),
                 "--num_nodes", str(cfg.nodes), "--num_gpus", str(cfg.procs_per_node)]
    argv += ["--master_addr", cfg.master_addr]
    argv += ["--master_port", str(master_port(cfg)), "--module", SCRIPT_MODULE, *script_args]
    return argv


def render_hostfile(cfg: PretrainConfig) -> str:
    """``node{i} slots=N`` lines: enough for ``--no_ssh``, which only counts nodes and slots."""
    return "".join(f"node{i} slots={cfg.procs_per_node}\n" for i in range(cfg.nodes))


def launcher_env(cfg: PretrainConfig, base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env["OMP_NUM_THREADS"] = str(cfg.threads_per_rank)
    env.setdefault("PYTHONUNBUFFERED", "1")
    if cfg.accelerator == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
    # The ranks must import this checkout's bert_core, wherever the launcher is started from.
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env


def _resolve(argv: list[str]) -> list[str]:
    """Run this Python, or the ``deepspeed`` script of its environment (the venv may not be on PATH)."""
    if argv and argv[0] == "python":
        return [sys.executable, *argv[1:]]
    beside = Path(sys.executable).with_name("deepspeed")
    if argv and argv[0] == "deepspeed":
        script = str(beside) if beside.exists() else shutil.which("deepspeed")
        # Installed without its script (pip --target): the launcher's own module does the same.
        return [*([script] if script else [sys.executable, "-m", "deepspeed.launcher.runner"]), *argv[1:]]
    return argv


# --------------------------------------------------------------------------- the CPU comm op


def cpu_comm_op_built() -> bool:
    """Is the op in torch's extension cache? (Looked up without importing torch: the launching
    process stays light; a miss only means the ranks build it themselves.)"""
    cache = os.environ.get("XDG_CACHE_HOME", str(Path.home() / ".cache"))
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR", Path(cache) / "torch_extensions"))
    tag = f"py{sys.version_info.major}{sys.version_info.minor}"
    return any(root.glob(f"{tag}*/deepspeed_shm_comm/*.so")) or any(root.glob("deepspeed_shm_comm/*.so"))


def ensure_cpu_comm_op(log: Callable[[str], None] = print) -> None:
    """Build DeepSpeed's CPU shared-memory comm op once per machine (cached), before any rank starts.

    On CPU, DeepSpeed's first start JIT-compiles a shared-memory all-reduce op (cached in
    ``~/.cache/torch_extensions`` or ``TORCH_EXTENSIONS_DIR``). Building it here, with a log line
    saying so, keeps every rank of the first run from racing to build it.
    """
    if cpu_comm_op_built():
        return
    log("building DeepSpeed CPU comm op once (~60 s, cached in ~/.cache/torch_extensions)...")
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    code = ("from deepspeed.accelerator import get_accelerator; "
            "get_accelerator().create_op_builder('ShareMemCommBuilder').load(verbose=False)")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        # Not fatal: without the op DeepSpeed falls back to plain gloo collectives.
        log(f"could not build the comm op (DeepSpeed will use gloo): {done.stderr.strip()[-500:]}")
    else:
        log("DeepSpeed CPU comm op built")


# --------------------------------------------------------------------------- run


def keep_niceness(pid: int) -> None:
    """Give the launcher's scheduling group this process's niceness.

    The launcher starts under ``setsid``, which on Linux opens a new scheduler autogroup at nice 0,
    and the scheduler shares the CPU between autogroups before it looks at any process's nice
    value: without this, ``nice bertpipe pretrain`` would train at full priority beside everything
    else on the machine.
    """
    niceness = os.nice(0)
    if niceness > 0:
        try:
            Path(f"/proc/{pid}/autogroup").write_text(str(niceness))
        except OSError:  # no autogroups (another OS, or a kernel without them): nice already holds
            pass


def run_launch(
    argv: list[str],
    env: dict[str, str] | None = None,
    on_line: Callable[[str], None] = print,
    cwd: str | None = None,
) -> int:
    """Run the launcher, stream each output line to ``on_line``; 0 on success, else raise.

    Rank 0 prints progress; other ranks stay quiet. A failed run is classified by the failing
    rank's own line, whatever the others report after losing it: :class:`LaunchConfigError`
    when a rank refused the config, data or checkpoints or could not write (a full or read-only
    disk; retrying will not help), :class:`LaunchInfraError` when the infrastructure failed
    (rendezvous timeout, a rank killed, port in use: worth a retry, and the run resumes from its
    last checkpoint); another failure is a plain :class:`LaunchError`.
    """
    tail: deque[str] = deque(maxlen=60)
    config_error = None
    with subprocess.Popen(
        _resolve(argv), env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, bufsize=1, start_new_session=True, preexec_fn=functools.partial(end_with_parent, os.getpid()),
    ) as proc:
        keep_niceness(proc.pid)
        failed: list[BaseException] = []

        def read() -> None:
            nonlocal config_error
            assert proc.stdout is not None
            try:
                for raw in proc.stdout:
                    line = raw.rstrip("\n")
                    tail.append(line)
                    if CONFIG_ERROR_PREFIX in line:
                        config_error = line.split(CONFIG_ERROR_PREFIX, 1)[1].strip()
                    on_line(line)
            except BaseException as err:  # on_line's own; raised below, in the caller's thread
                failed.append(err)

        # Read beside, wait on the launcher here: a rank left behind keeps the pipe open, so
        # the end of its output is not the end of the launch.
        # in the caller's context: on_line may publish to the caller's flow run (Prefect's
        # settings and run context are context variables, which a bare thread does not see)
        reader = threading.Thread(target=contextvars.copy_context().run, args=(read,), daemon=True)
        reader.start()
        try:
            with on_stop(functools.partial(stop_group, proc)):
                code = proc.wait()
        finally:
            # The launcher's session is its own, so nothing ends it with this process: however
            # this one leaves (done, an exception, a stop signal), no rank keeps the device or port.
            stop_group(proc)
        reader.join()
    if failed:
        raise failed[0]
    if code == 0:
        return 0
    lines = list(tail)
    if config_error is not None or code == CONFIG_ERROR_EXIT:
        raise LaunchConfigError(f"pre-training stopped: {config_error or lines[-1:]}", code, lines)
    # A killed rank shows as the launcher's exit code, a lost peer or network in the output.
    if is_infrastructure_exit(code, "\n".join(lines)):
        raise LaunchInfraError(
            f"pre-training launch failed (exit {code}) for an infrastructure reason. Last lines:\n"
            + "\n".join(lines[-8:]) + "\nrun the same command again to resume from the last checkpoint",
            code, lines)
    raise LaunchError(f"pre-training failed (exit {code}). Last lines:\n" + "\n".join(lines[-15:]), code, lines)


def prepare_run(
    config: PipelineConfig,
    instances: str,
    output: str,
    init_checkpoint: str | None = None,
    node_rank: int | None = None,
) -> tuple[list[str], dict[str, str]]:
    """Write ``RUN/pretrain_config.json`` (and a hostfile for no_ssh) and return (argv, env)."""
    pre = config.pretrain
    run = storage.to_uri(output)
    config_uri = storage.join(run, CONFIG_FILE)
    storage.write_text(config_uri, json.dumps(config.model_dump(mode="json"), indent=2))
    hostfile = pre.hostfile
    if pre.launcher == "no_ssh" and not hostfile:
        hostfile = storage.join(run, HOSTFILE)
        storage.write_text(hostfile, render_hostfile(pre))
    env = launcher_env(pre)
    if pre.launcher == "hostfile":
        # ssh/pdsh start remote ranks with a clean environment plus the variables of this file.
        env_file = storage.join(run, ".deepspeed_env")
        storage.write_text(env_file, "".join(f"{k}={env[k]}\n" for k in FORWARDED_ENV if k in env))
        env["DS_ENV_FILE"] = env_file
    script_args = ["--config", config_uri, "--instances", storage.to_uri(instances), "--output", run]
    if init_checkpoint:
        script_args += ["--init-checkpoint", init_checkpoint]
    return launcher_argv(pre, script_args, node_rank=node_rank, hostfile=hostfile), env


def launch_pretraining(
    config: PipelineConfig,
    instances: str,
    output: str,
    init_checkpoint: str | None = None,
    node_rank: int | None = None,
    on_line: Callable[[str], None] = print,
) -> str:
    """The plain entry point (CLI, flow): launch, wait, return the run folder (raises on failure).

    A run folder of another config (finished, or with checkpoints) is refused with a
    :class:`~bert_core.pretrain.errors.PretrainConfigError` naming the settings that differ.
    """
    check_run_config(config, output)
    try:  # refused here, before any rank starts
        check_instances(config, instances, init_checkpoint)
    except (ValueError, FileNotFoundError) as err:
        raise LaunchConfigError(f"pre-training stopped: {err}", CONFIG_ERROR_EXIT, [str(err)]) from None
    if storage.has_manifest(output):
        on_line(f"{storage.to_uri(output)}: finished already ({storage.MANIFEST} present), nothing to do")
        return storage.to_uri(output)
    # One launch at a time writes a run folder: a second waits on its lease (bert_core.lease)
    # and finds it finished, or takes it over and resumes when the first died. With one launcher
    # per node, the first node's holds it for all of them (the others wait for it at rendezvous).
    with lease.hold(output, "pretrain") if not node_rank else nullcontext() as held:
        if storage.has_manifest(output):
            on_line(f"{storage.to_uri(output)}: finished already ({storage.MANIFEST} present), nothing to do")
            return storage.to_uri(output)
        if config.pretrain.accelerator == "cpu":
            ensure_cpu_comm_op(on_line)
        argv, env = prepare_run(config, instances, output, init_checkpoint, node_rank)
        if held is not None:  # rank 0 commits the run's manifest under this lease (lease.fence)
            env = {**env, lease.ATTEMPT_ENV: held.attempt}
        on_line("$ " + " ".join(argv))
        run_launch(argv, env, on_line)
    return storage.to_uri(output)
