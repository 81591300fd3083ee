"""The one rule for retries (bert_core/failures.py) on the errors the stages really raise."""

from __future__ import annotations

import errno
import subprocess

import pytest

from bert_core.failures import is_comm_error, is_infrastructure_error, refusal


def test_retry_only_infrastructure_errors():
    from bert_core.config import ConfigError
    from bert_core.corpus.download import ChecksumError, DownloadError, TransferError
    from bert_core.model.checkpoint import CheckpointError
    from bert_core.pretrain.data import InstanceDataError
    from bert_core.pretrain.launch import LaunchConfigError, LaunchError, LaunchInfraError
    from bert_core.storage import ManifestError, UnfinishedWriteError

    retried = [ConnectionResetError(104, "reset"), TimeoutError("read timed out"),
               RuntimeError("torch.distributed.DistNetworkError: rendezvous timeout after 900 s"),
               subprocess.CalledProcessError(1, ["deepspeed"], stderr=b"gloo connectFullMesh timeout"),
               TransferError("GET http://x/y: HTTP 503"), LaunchInfraError("exit -9", -9, []),
               OSError(errno.EHOSTUNREACH, "no route")]
    never = [ConfigError("pretrain.nodes: bad"), ValueError("max_seq_length too long"),
             UnfinishedWriteError("no manifest"), DownloadError("HTTP 404, connection reset"), ChecksumError("sha1 mismatch, connection reset"),
             KeyError("input_ids"), subprocess.CalledProcessError(2, ["deepspeed"], stderr=b"bad arg"),
             LaunchConfigError("bad input, connection reset", 2, []), LaunchError("exit 1", 1, []),
             CheckpointError("truncated"), InstanceDataError("bad shard"), ManifestError("bad json"),
             OSError(errno.ENOSPC, "No space left on device", "/run/ckpt"), None]
    assert [is_infrastructure_error(e) for e in retried] == [True] * len(retried)
    assert [is_infrastructure_error(e) for e in never] == [False] * len(never)
    wrapped = RuntimeError("stage failed")
    wrapped.__cause__ = ConnectionRefusedError(111, "refused")
    assert is_infrastructure_error(wrapped)


def test_refusal_is_one_line_and_finds_a_full_disk_among_the_causes():
    from bert_core.config import ConfigError

    assert refusal(ConfigError("pretrain.nodes:\n  must be >= 1")) == "pretrain.nodes: must be >= 1"
    full = RuntimeError("checkpoint write failed")
    full.__cause__ = OSError(errno.ENOSPC, "No space left on device", "/runs/x/step4")
    message = refusal(full)
    assert message is not None and message.startswith("/runs/x/step4: No space left on device; free space")
    assert refusal(RuntimeError("a bug")) is None
    assert not is_infrastructure_error(full)


@pytest.mark.parametrize("message, comm", [
    ("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234", True),
    ("NCCL communicator was aborted", True),
    ("DistBackendError: something", True),
    ("index 7 is out of bounds for dimension 0", False),
])
def test_comm_errors_of_a_rank(message, comm):
    assert is_comm_error(RuntimeError(message)) is comm
