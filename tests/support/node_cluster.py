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


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _ray() -> str:
    return os.path.join(os.path.dirname(sys.executable), "ray")


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
        os.makedirs(self.view, exist_ok=True)
        for index, folder in enumerate(self.folders):
            role = ["--head", "--port", self.address.split(":")[1], "--include-dashboard", "false"] if index == 0 else [
                "--address", self.address]
            command = [_ray(), "start", *role, "--num-cpus", str(self.num_cpus), "--object-store-memory", str(200 << 20),
                       "--temp-dir", self.temp_dir, "--block"]
            script = 'mount --bind "$1" "$2" && shift 2 && exec "$@"'
            log = os.path.join(self.temp_dir, f"node{index}.log")
            self.logs.append(log)
            with open(log, "w") as handle:
                self.processes.append(subprocess.Popen(
                    ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", folder, self.view, *command],
                    stdout=handle, stderr=subprocess.STDOUT, env=self.env, start_new_session=True,
                ))
            self._wait_for_nodes(index + 1)
        return self

    def _wait_for_nodes(self, count: int, within_s: float = 90) -> None:
        probe = "import ray; ray.init(logging_level='ERROR'); print(sum(n['Alive'] for n in ray.nodes()))"
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            for process, log in zip(self.processes, self.logs):
                if process.poll() is not None:
                    raise RuntimeError(f"a node's ray start ended ({process.returncode}): {open(log).read()[-2000:]}")
            found = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=self.env, timeout=60)
            if found.returncode == 0 and found.stdout.strip().splitlines()[-1:] == [str(count)]:
                return
            time.sleep(1)
        raise RuntimeError(f"{count} node(s) did not come up within {within_s:.0f} s; see {self.temp_dir}")

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
