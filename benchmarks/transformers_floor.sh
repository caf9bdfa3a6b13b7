#!/usr/bin/env bash
# Proof of pyproject.toml's floor `transformers>=4.50`, in a few minutes, printing one line:
# "transformers_floor: PASS|FAIL transformers=... reload_dtype=... reload_peak_mib=... seconds=...".
# It builds a second virtualenv ($FLOOR_VENV, default /tmp/rayexport-transformers-floor) with
# transformers==4.50.*, torch==2.13.0 and this project, then exports the demo checkpoint with
# `--dtype bfloat16 --verify full` on a local Ray of its own and checks, from the run's report,
# that verification passed and the reload check loaded the weights as bfloat16 (transformers
# below 4.56 reads `torch_dtype`, not `dtype`) and loaded the tokenizer. Not part of CI: the
# install alone takes minutes. The full log goes to $FLOOR_LOG (default /tmp/transformers_floor.log).
set -uo pipefail
cd "$(dirname "$0")/.."
venv="${FLOOR_VENV:-/tmp/rayexport-transformers-floor}"
log="${FLOOR_LOG:-/tmp/transformers_floor.log}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
fail() { echo "transformers_floor: FAIL $1"; tail -n 20 "$log" >&2; exit 1; }

start=$(date +%s)
{
    python3 -m venv "$venv" &&
    "$venv/bin/python" -m pip install --quiet --upgrade pip &&
    "$venv/bin/pip" install --quiet torch==2.13.0 &&
    "$venv/bin/pip" install --quiet "transformers==4.50.*" -e .
} >"$log" 2>&1 || fail "cannot build the virtualenv $venv"
installed=$(date +%s)

# RAY_ADDRESS unset: a cluster started by another environment would run the workers in its Python.
env -u RAY_ADDRESS timeout 540 "$venv/bin/python" -m rayexport.run --demo --dst "$work/export" \
    --dtype bfloat16 --verify full --report "$work/report.json" >>"$log" 2>&1 || fail "the demo export failed"
finished=$(date +%s)

"$venv/bin/python" - "$work/report.json" "$((installed - start))" "$((finished - installed))" <<'EOF' || fail "see above"
import json
import sys

import torch
import transformers

report = json.load(open(sys.argv[1]))
reload = report["verification"]["checks"]["reload"]
peak = {name: round(value / 2**20) for name, value in report["peak_rss_bytes"].items()}
passed = report["verification"]["passed"] and reload.get("dtype") == "bfloat16" and reload.get("tokenizer")
print(
    f"transformers_floor: {'PASS' if passed else 'FAIL'} transformers={transformers.__version__} "
    f"torch={torch.__version__} verified={report['verification']['level']} reload_dtype={reload.get('dtype')} "
    f"tokenizer={reload.get('tokenizer')} reload_peak_mib={peak.get('reload')} "
    f"actor_peak_mib={peak} verify_s={report['seconds']['verify_files'] + report['seconds']['reload']:.1f} install_s={sys.argv[2]} export_s={sys.argv[3]}"
)
sys.exit(0 if passed else 1)
EOF
