"""Start and stop a ``mooncake_master`` (with its HTTP metadata server).

Used two ways:

* automatically, by a single-machine run without ``MOONCAKE_MASTER``: a master on
  127.0.0.1 on free ports, stopped at exit (also on error: the child dies with its parent);
* by hand, for multi-node runs, on the node that should host it::

      python -m transfer.data.mooncake.master --host 10.0.0.1
      # prints the exports to set on every node before `ray start`, then serves until Ctrl-C
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

from transfer.net import free_port, port_open
from transfer.process import log_tail, start_child, stop


def master_binary() -> str:
    """Path of ``mooncake_master``: the one shipped inside the mooncake wheel, else PATH."""
    try:  # optional dependency
        import mooncake

        path = os.path.join(os.path.dirname(mooncake.__file__), "mooncake_master")
        if os.access(path, os.X_OK):
            return path
    except ImportError:
        pass
    path = shutil.which("mooncake_master")
    if path is None:
        raise RuntimeError("mooncake_master not found: pip install mooncake-transfer-engine-non-cuda "
                           "(CPU machines) or mooncake-transfer-engine-cuda13 (GPU images)")
    return path


class MooncakeMaster:
    def __init__(self, host: str = "127.0.0.1", rpc_port: int | None = None,
                 http_port: int | None = None, metrics_port: int | None = None,
                 log_path: str | None = None, die_with_parent: bool = True,
                 extra_args: list[str] | None = None) -> None:
        self.host = host
        self.rpc_port = rpc_port or free_port(host)
        self.http_port = http_port or free_port(host)
        self.metrics_port = metrics_port or free_port(host)
        self.log_path = log_path or os.path.join("/tmp", f"mooncake_master_{self.rpc_port}.log")
        self.die_with_parent = die_with_parent
        self.extra_args = extra_args or []
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        """``host:port`` of the master RPC service (``master_server_address``)."""
        return f"{self.host}:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        return f"http://{self.host}:{self.http_port}/metadata"

    @property
    def admin_url(self) -> str:
        """Base URL of the master's HTTP admin endpoints (``/get_all_keys``, ``/metrics``)."""
        return f"http://{self.host}:{self.metrics_port}"

    def start(self, timeout_s: float = 15.0) -> "MooncakeMaster":
        cmd = [master_binary(), f"-rpc_address={self.host}", f"-rpc_port={self.rpc_port}",
               "-enable_http_metadata_server=true", f"-http_metadata_server_host={self.host}",
               f"-http_metadata_server_port={self.http_port}", f"-metrics_port={self.metrics_port}",
               *self.extra_args]
        self.proc = start_child(cmd, name="mooncake_master", log_path=self.log_path,
                                ready=self.ready, timeout_s=timeout_s,
                                tie_to_parent=self.die_with_parent)
        return self

    def ready(self) -> bool:
        if not port_open(self.host, self.rpc_port):
            return False
        try:
            urllib.request.urlopen(f"{self.admin_url}/health", timeout=1).read()
            return True
        except (urllib.error.URLError, OSError):
            return False

    def keys(self) -> list[str]:
        """Every key the master holds (through the store, for leak checks)."""
        return list_keys(self.admin_url)

    def log_tail(self, lines: int = 20) -> str:
        return log_tail(self.log_path, lines)

    def stop(self, grace_s: float = 5.0) -> None:
        stop(self.proc, grace_s)


def list_keys(admin_url: str) -> list[str]:
    with urllib.request.urlopen(f"{admin_url.rstrip('/')}/get_all_keys", timeout=5) as r:
        return [k for k in r.read().decode().splitlines() if k.strip()]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Start a Mooncake master for a multi-node run.")
    parser.add_argument("--host", required=True, help="address the other nodes reach this one at")
    parser.add_argument("--rpc-port", type=int, default=50051)
    parser.add_argument("--http-port", type=int, default=8080, help="HTTP metadata server")
    parser.add_argument("--metrics-port", type=int, default=9003, help="admin/metrics HTTP")
    parser.add_argument("--log", default=os.path.join(tempfile.gettempdir(), "mooncake_master.log"),
                        help="the master's output (default: %(default)s, outside the repository)")
    args, extra = parser.parse_known_args(argv)
    master = MooncakeMaster(args.host, args.rpc_port, args.http_port, args.metrics_port,
                            log_path=args.log, die_with_parent=True, extra_args=extra).start()
    print(f"mooncake_master pid {master.proc.pid}, log {args.log}\n"
          f"On every node, before `ray start`:\n"
          f"  export MOONCAKE_MASTER={master.address}\n"
          f"  export MOONCAKE_METADATA_SERVER={master.metadata_server}\n"
          f"Serving; Ctrl-C stops it.", flush=True)
    try:
        while master.proc.poll() is None:
            time.sleep(1)
        sys.exit(f"mooncake_master exited with code {master.proc.returncode}:\n{master.log_tail()}")
    except KeyboardInterrupt:
        master.stop()


if __name__ == "__main__":
    main()
