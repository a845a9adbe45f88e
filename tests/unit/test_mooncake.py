"""Mooncake input refused before anything starts, from the driver's checks in this process:
a loopback hostname on several nodes, a segment too small for the batches held at once, no
master on several nodes, and a missing wheel or library named with what to install."""

from __future__ import annotations

import socket

import pytest

from rl.backends import data_path
from rl.runtime import Runtime
from tests.support.env import compose
from transfer.data.mooncake.client import explain_import_error


def test_loopback_hostname_with_several_nodes_is_refused(tmp_path):
    cfg = compose("transfer=mooncake_tcp", "transfer.local_hostname=127.0.0.1")
    runtime = Runtime("t", str(tmp_path), "/nonexistent")
    with pytest.raises(ValueError, match="a loopback address, but the Ray cluster has 2 nodes"):
        data_path(cfg.transfer).start_services(runtime, num_nodes=2, partition_bytes=1 << 20)


def test_capacity_check_counts_every_batch_held_at_once(tmp_path):
    """One batch fits, three (fully async with rollout.max_inflight_batches=3) do not."""
    with socket.create_server(("127.0.0.1", 0)) as listening:  # an external master's port: nothing is started
        cfg = compose("transfer=mooncake_tcp", "transfer.global_segment_size=16mb",
                      f"transfer.master_server_address=127.0.0.1:{listening.getsockname()[1]}")
        runtime = Runtime("t", str(tmp_path), "/x")
        data_path(cfg.transfer).start_services(runtime, num_nodes=1, partition_bytes=8 << 20, batches_held=1)
    with pytest.raises(ValueError, match=r"3 rollout batches held at once .* need about 25165824 bytes"):
        data_path(cfg.transfer).start_services(runtime, num_nodes=1, partition_bytes=8 << 20, batches_held=3)


def test_no_master_on_several_nodes_says_what_to_start(tmp_path, monkeypatch):
    monkeypatch.delenv("MOONCAKE_MASTER", raising=False)
    cfg = compose("transfer=mooncake_tcp")
    with pytest.raises(ValueError, match="python -m transfer.data.mooncake.master"):
        data_path(cfg.transfer).start_services(Runtime("t", str(tmp_path), "/x"), num_nodes=2,
                                               partition_bytes=1 << 20)


@pytest.mark.parametrize("message,fragment", [
    ("libcuda.so.1: cannot open shared object file", "pip install mooncake-transfer-engine-non-cuda"),
    ("libibverbs.so.1: cannot open shared object file", "apt-get install -y libibverbs1"),
    ("No module named 'mooncake'", "pip install mooncake-transfer-engine-non-cuda"),
])
def test_import_errors_name_the_package(message, fragment):
    assert fragment in str(explain_import_error(ImportError(message)))
