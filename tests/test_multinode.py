"""Two Ray nodes on this machine (ray.cluster_utils.Cluster), one CPU each, so the export's two
workers must run on different nodes: S3 in, S3 out, nothing shared through a local disk; and a
node lost mid-export (its raylet and every process it started killed, as when a machine goes).

Each runs in a subprocess because this test process already belongs to the session's Ray."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from support.helpers import BUCKET

SCRIPT = """
import json, sys
import ray
from ray.cluster_utils import Cluster

cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
cluster.add_node(num_cpus=1)
cluster.wait_for_nodes()
ray.init(address=cluster.address, logging_level="WARNING")
try:
    from rayexport.orchestration.job import export

    report = export(sys.argv[1], sys.argv[2], workers=2, verify="quick")
    print("REPORT " + json.dumps({"nodes": {worker: where["node"] for worker, where in report.placement.items()}, "cluster_nodes": len(ray.nodes()),
                                  "checks": list(report.verification.get("checks", {}))}))
finally:
    ray.shutdown()
    cluster.shutdown()
"""


def test_workers_on_two_nodes_share_nothing_but_s3(s3_checkpoints):
    destination = f"s3://{BUCKET}/multinode/export"
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    completed = subprocess.run([sys.executable, "-c", SCRIPT, s3_checkpoints["tied"], destination],
                               capture_output=True, text=True, timeout=300, env=env)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    line = next(line for line in completed.stdout.splitlines() if line.startswith("REPORT "))
    report = json.loads(line.removeprefix("REPORT "))
    assert report["cluster_nodes"] == 2
    assert len(set(report["nodes"].values())) == 2, report["nodes"]  # one worker per node
    assert "tensors" in report["checks"] and "fidelity" in report["checks"]


LOST_NODE_SCRIPT = """
import logging, sys
import psutil, ray
from ray.cluster_utils import Cluster

cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
node = cluster.add_node(num_cpus=1)
cluster.wait_for_nodes()
ray.init(address=cluster.address, logging_level="WARNING")
print("LOST " + node.node_id, flush=True)


class LoseTheNode(logging.Handler):
    # in the export's own thread, once its workers have loaded and before the gather starts
    def emit(self, record):
        if record.getMessage().startswith("plan_files"):
            started = psutil.Process(node.all_processes["raylet"][0].process.pid).children(recursive=True)
            cluster.remove_node(node, allow_graceful=False)
            for process in started:
                try:
                    process.kill()
                except psutil.NoSuchProcess:
                    pass
        elif record.name.endswith("failure"):
            print("CLEANUP " + record.getMessage(), flush=True)


logging.getLogger("rayexport").addHandler(LoseTheNode())
logging.getLogger("rayexport").setLevel(logging.INFO)
try:
    from rayexport.common.errors import ExportError
    from rayexport.orchestration.job import export

    try:
        export(sys.argv[1], sys.argv[2], workers=2, verify="none")
    except ExportError as error:
        print("ERROR " + str(error), flush=True)
finally:
    ray.shutdown()
    cluster.shutdown()
"""


def test_a_node_lost_mid_export_is_named_with_its_workers_and_nothing_is_committed(checkpoints, tmp_path):
    destination = tmp_path / "out"
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    completed = subprocess.run([sys.executable, "-c", LOST_NODE_SCRIPT, checkpoints["tied"].path, str(destination)],
                               capture_output=True, text=True, timeout=300, env=env)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    said = {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in completed.stdout.splitlines() if " " in line}
    lost = said["LOST"][:8]
    assert said["ERROR"].startswith("an export worker died: node ") and said["ERROR"].endswith(
        f"(node {lost}) was lost mid-export, and with it worker 1; the export was not committed"
    ), said["ERROR"]
    cleanup = said["CLEANUP"]  # the lost node's clean-up is not counted as done
    assert "on 1 of 2 node(s); not on " in cleanup and cleanup.endswith(f"(node {lost}) (lost)"), cleanup
    assert not (destination / "export_manifest.json").exists()
