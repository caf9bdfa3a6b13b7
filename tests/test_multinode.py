"""Two Ray nodes on this machine (ray.cluster_utils.Cluster), one CPU each, so the export's two
workers must run on different nodes: S3 in, S3 out, nothing shared through a local disk; then
the second node lost mid-export (its raylet and every process it started killed, as when a
machine goes).

Both run on one cluster, in one subprocess, because this test process already belongs to the
session's Ray."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from support.helpers import BUCKET

SCRIPT = """
import json, logging, sys
import psutil, ray
from ray.cluster_utils import Cluster

cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
node = cluster.add_node(num_cpus=1)
cluster.wait_for_nodes()
ray.init(address=cluster.address, logging_level="WARNING")


class LoseTheNode(logging.Handler):
    # armed for the second export: in its own thread, once its workers have loaded and before
    # the gather starts, the second node goes
    armed = False

    def emit(self, record):
        if self.armed and record.getMessage().startswith("plan_files"):
            started = psutil.Process(node.all_processes["raylet"][0].process.pid).children(recursive=True)
            cluster.remove_node(node, allow_graceful=False)
            for process in started:
                try:
                    process.kill()
                except psutil.NoSuchProcess:
                    pass
        elif self.armed and record.name.endswith("failure"):
            print("CLEANUP " + record.getMessage(), flush=True)


hook = LoseTheNode()
logging.getLogger("rayexport").addHandler(hook)
logging.getLogger("rayexport").setLevel(logging.INFO)
try:
    from rayexport.common.errors import ExportError
    from rayexport.orchestration.job import export

    report = export(sys.argv[1], sys.argv[2], workers=2, verify="quick")
    print("REPORT " + json.dumps({"nodes": {worker: where["node"] for worker, where in report.placement.items()},
                                  "cluster_nodes": len(ray.nodes()), "checks": list(report.verification.get("checks", {}))}))
    print("LOST " + node.node_id, flush=True)
    hook.armed = True
    try:
        export(sys.argv[3], sys.argv[4], workers=2, verify="none")
    except ExportError as error:
        print("ERROR " + str(error), flush=True)
finally:
    ray.shutdown()
    cluster.shutdown()
"""


@pytest.fixture(scope="module")
def said(s3_checkpoints, checkpoints, tmp_path_factory):
    """What the script printed, by the first word of each line, and the lost export's DST."""
    lost_destination = tmp_path_factory.mktemp("lost") / "out"
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    command = [sys.executable, "-c", SCRIPT, s3_checkpoints["tied"], f"s3://{BUCKET}/multinode/export",
               checkpoints["tied"].path, str(lost_destination)]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    lines = {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in completed.stdout.splitlines() if " " in line}
    return lines, lost_destination


def test_workers_on_two_nodes_share_nothing_but_s3(said):
    report = json.loads(said[0]["REPORT"])
    assert report["cluster_nodes"] == 2
    assert len(set(report["nodes"].values())) == 2, report["nodes"]  # one worker per node
    assert "tensors" in report["checks"] and "fidelity" in report["checks"]


def test_a_node_lost_mid_export_is_named_with_its_workers_and_nothing_is_committed(said):
    lines, destination = said
    lost = lines["LOST"][:8]
    assert lines["ERROR"].startswith("an export worker died: node ") and lines["ERROR"].endswith(
        f"(node {lost}) was lost mid-export, and with it worker 1; the export was not committed"
    ), lines["ERROR"]
    cleanup = lines["CLEANUP"]  # the lost node's clean-up is not counted as done
    assert "on 1 of 2 node(s); not on " in cleanup and cleanup.endswith(f"(node {lost}) (lost)"), cleanup
    assert not (destination / "export_manifest.json").exists()
