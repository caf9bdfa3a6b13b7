"""Two Ray nodes on this machine (ray.cluster_utils.Cluster), one CPU each, so the export's two
workers must run on different nodes: S3 in, S3 out, nothing shared through a local disk.

It runs in a subprocess because this test process already belongs to the session's Ray."""

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
