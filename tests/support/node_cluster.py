"""A Ray cluster of several nodes on this machine whose nodes each have a disk of their own: every
node's `ray start --block` runs in a mount namespace of its own (`unshare --mount`, as root), with
that node's folder bind-mounted onto one shared path, so every process Ray starts on a node sees
only that node's files there, as on machines without a shared filesystem.

It is a cluster apart from the session's Ray, with its own temp dir (so it never becomes another
program's "current cluster"), and `stop()` ends only the processes it started: each node's
`ray start --block`, which takes its node's processes with it."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Callable

# Token authentication for the cluster and its drivers: the head writes ~/.ray/auth_token if
# there is none, and the other nodes and drivers read it.
AUTH_ENV = {"RAY_AUTH_MODE": "token"}


def mount_namespaces_refused() -> str | None:
    """Why this machine cannot give a process a private bind mount, or None when it can."""
    if shutil.which("unshare") is None:
        return "unshare is not installed"
    with tempfile.TemporaryDirectory() as scratch:
        target = os.path.join(scratch, "target")
        os.mkdir(target)
        probe = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "mount", "--bind", scratch, target],
            capture_output=True, text=True,
        )
    if probe.returncode != 0:
        return f"mount namespaces are not permitted here: {probe.stderr.strip() or probe.returncode}"
    return None


# Joins the cluster once and returns when argv[1] nodes are alive (one driver, not one per poll).
PROBE = """
import sys, time
import ray

ray.init(logging_level="ERROR")
while sum(node["Alive"] for node in ray.nodes()) < int(sys.argv[1]):
    time.sleep(0.1)
"""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _ray() -> str:
    return os.path.join(os.path.dirname(sys.executable), "ray")


def _tail(log: str) -> str:
    with open(log) as handle:
        return handle.read()[-2000:]


def _succeeded(probe: subprocess.Popen, log: str) -> bool:
    """Whether the probe has ended well; an error if it has ended otherwise."""
    if probe.poll() not in (None, 0):
        raise RuntimeError(f"the probe joining the cluster ended ({probe.returncode}): {_tail(log)}")
    return probe.returncode == 0


class NodeCluster:
    """Ray nodes, the first the head, where node i sees `folders[i]` at `view`."""

    def __init__(self, view: str, folders: list[str], num_cpus: int = 2) -> None:
        self.view, self.folders, self.num_cpus = view, folders, num_cpus
        self.temp_dir = tempfile.mkdtemp(prefix="rxn-")
        self.address = f"127.0.0.1:{_free_port()}"
        self.processes: list[subprocess.Popen] = []
        self.logs: list[str] = []

    @property
    def env(self) -> dict[str, str]:
        """The environment of a driver that joins this cluster."""
        env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
        return {**env, **AUTH_ENV, "RAY_ADDRESS": self.address}

    def start(self) -> "NodeCluster":
        """Start the head, then, once its GCS listens, the other nodes all at once; return when
        every node is alive."""
        os.makedirs(self.view, exist_ok=True)
        for index, folder in enumerate(self.folders):
            # The head's log monitor sends every node's logs to the drivers (the nodes share one
            # session folder), so the others have none; each node's agent has a port of its own
            # (a second agent on the default port retries for seconds, then goes without).
            role = ["--head", "--port", self.address.split(":")[1], "--include-dashboard", "false"] if index == 0 else [
                "--address", self.address, "--include-log-monitor", "false"]
            command = [_ray(), "start", *role, "--num-cpus", str(self.num_cpus), "--object-store-memory", str(200 << 20),
                       "--dashboard-agent-listen-port", str(_free_port()), "--temp-dir", self.temp_dir, "--block"]
            script = 'mount --bind "$1" "$2" && shift 2 && exec "$@"'
            log = os.path.join(self.temp_dir, f"node{index}.log")
            self.logs.append(log)
            with open(log, "w") as handle:
                self.processes.append(subprocess.Popen(
                    ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", folder, self.view, *command],
                    stdout=handle, stderr=subprocess.STDOUT, env=self.env, start_new_session=True,
                ))
            if index == 0:
                self._wait_until(self._gcs_listens, "the head's GCS did not listen")
        log = os.path.join(self.temp_dir, "probe.log")
        with open(log, "w") as handle:
            probe = subprocess.Popen([sys.executable, "-c", PROBE, str(len(self.folders))],
                                     stdout=handle, stderr=subprocess.STDOUT, env=self.env)
        try:
            self._wait_until(lambda: _succeeded(probe, log), f"{len(self.folders)} node(s) did not come up")
        finally:
            if probe.poll() is None:
                probe.kill()
                probe.wait()
        return self

    def _gcs_listens(self) -> bool:
        with socket.socket() as connection:
            connection.settimeout(1)
            return connection.connect_ex(("127.0.0.1", int(self.address.split(":")[1]))) == 0

    def _wait_until(self, done: Callable[[], bool], failure: str, within_s: float = 90) -> None:
        """Poll `done` until it holds; a node's `ray start` that ends first, or `within_s`
        passing, is an error naming `failure`."""
        deadline = time.monotonic() + within_s
        while not done():
            for process, log in zip(self.processes, self.logs):
                if process.poll() is not None:
                    raise RuntimeError(f"a node's ray start ended ({process.returncode}): {_tail(log)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{failure} within {within_s:.0f} s; see {self.temp_dir}")
            time.sleep(0.1)

    def stop(self) -> None:
        """End each node's `ray start --block` (by pid), which ends its node's processes."""
        for process in reversed(self.processes):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        shutil.rmtree(self.temp_dir, ignore_errors=True)
