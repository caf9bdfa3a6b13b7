"""The deployment files: Ray job runtime environments (jobs/), the KubeRay RayJob and the
Kubernetes CronJob (infra/), and the local stack scripts (infra/local-up.sh, local-down.sh).

The manifests are parsed and their required fields checked here; they are never applied to a
Kubernetes cluster. The local scripts are run for real: a Ray head and a moto S3 server on
127.0.0.1, then torn down, with nothing left running."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterable

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
JOBS = ROOT / "jobs"
INFRA = ROOT / "infra"
RUNTIME_ENVS = [JOBS / "export.yaml", JOBS / "watch.yaml"]
RAYJOB = INFRA / "rayjob-export.yaml"
CRONJOB = INFRA / "cronjob-watch.yaml"
MANIFESTS = [RAYJOB, CRONJOB]
SCRIPTS = [INFRA / "local-up.sh", INFRA / "local-down.sh"]
READMES = [JOBS / "README.md", INFRA / "README.md"]
# The user's pages, whose commands must run as shown too.
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
ALL_FILES = RUNTIME_ENVS + MANIFESTS + SCRIPTS + READMES

WATCHER_FLAGS = ("--watch", "--pattern", "--dst-template")
WATCHER_PACE = ("--once", "--interval")  # one pass (cron) or a poll
SECRET_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "RAY_AUTH_TOKEN")
MOTO_DUMMY = "moto-local-dummy"  # the key pair local-up.sh hands to moto, which accepts any


def load(path: Path) -> dict:
    documents = list(yaml.safe_load_all(path.read_text()))
    assert len(documents) == 1, f"{path.name}: expected one YAML document, found {len(documents)}"
    assert isinstance(documents[0], dict), f"{path.name}: top level is not a mapping"
    return documents[0]


def name(path: Path) -> str:
    return str(path.relative_to(ROOT))


# --- commands: every `python -m rayexport.run ...` the files show or run ------------------------


def _text_commands(path: Path) -> list[list[str]]:
    """Commands shown in code blocks and comments: a line starting with `ray job submit` or
    `python -m rayexport.run` (comment markers dropped), `\\` continuations joined, and holding
    `python -m rayexport.run`. Prose that merely names the module is not a command."""
    lines = [line.strip() for line in path.read_text().splitlines()]
    lines = [line[1:].strip() if line.startswith("#") else line for line in lines]
    commands, index = [], 0
    while index < len(lines):
        line = lines[index]
        if line.startswith(("ray job submit", "python -m rayexport.run")):
            while line.endswith("\\") and index + 1 < len(lines):
                index += 1
                line = line[:-1] + " " + lines[index]
            tokens = shlex.split(line, comments=True)  # a shell drops a trailing comment
            if "rayexport.run" in tokens:
                commands.append(tokens[tokens.index("rayexport.run") + 1 :])
        index += 1
    return commands


def _rayjob_command() -> list[str]:
    tokens = shlex.split(load(RAYJOB)["spec"]["entrypoint"])
    assert tokens[:3] == ["python", "-m", "rayexport.run"], tokens
    return tokens[3:]


def _cronjob_container() -> dict:
    containers = load(CRONJOB)["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def _cronjob_argv() -> list[str]:
    container = _cronjob_container()
    return [str(part) for part in container.get("command", []) + container.get("args", [])]


def _cronjob_command() -> list[str]:
    argv = _cronjob_argv()
    entrypoint = argv[argv.index("--") + 1 :]
    assert entrypoint[:3] == ["python", "-m", "rayexport.run"], entrypoint
    return entrypoint[3:]


def all_commands() -> list[tuple[str, list[str]]]:
    found = [(name(path), command) for path in RUNTIME_ENVS + READMES + PAGES for command in _text_commands(path)]
    found.append((name(RAYJOB), _rayjob_command()))
    found.append((name(CRONJOB), _cronjob_command()))
    return found


def is_watcher(command: list[str]) -> bool:
    return any(token.split("=")[0] in WATCHER_FLAGS for token in command)


def check_against_parser(commands: list[tuple[str, list[str]]]) -> None:
    from rayexport.run import build_parser

    parser = build_parser()
    known = {option for action in parser._actions for option in action.option_strings}
    for where, command in commands:
        flags = [token.split("=")[0] for token in command if token.startswith("--")]
        unknown = sorted(set(flags) - known)
        assert not unknown, f"{where}: rayexport.run has no option {unknown}: {shlex.join(command)}"
        try:
            parser.parse_args(command)
        except SystemExit as error:  # argparse rejects a value (a choice, a type)
            pytest.fail(f"{where}: rayexport.run rejects {shlex.join(command)} (exit {error.code})")


def test_every_file_shows_its_command():
    commands = all_commands()
    for path in RUNTIME_ENVS + [JOBS / "README.md", RAYJOB, CRONJOB]:
        assert any(where == name(path) for where, _ in commands), f"{name(path)}: no rayexport.run command"
    export = [command for _, command in commands if not is_watcher(command)]
    watch = [command for _, command in commands if is_watcher(command)]
    assert export and watch
    for command in export:
        assert ("--src" in command and "--dst" in command) or "--demo" in command, command
    for command in watch:
        assert all(flag in command for flag in WATCHER_FLAGS), f"a watcher command without all of {WATCHER_FLAGS}: {command}"
        assert any(flag in command for flag in WATCHER_PACE), f"a watcher command without one of {WATCHER_PACE}: {command}"
        assert command[command.index("--pattern") + 1] == "global_step_*/actor"
        assert "{step}" in command[command.index("--dst-template") + 1]


def test_export_commands_use_existing_flags():
    check_against_parser([(where, command) for where, command in all_commands() if not is_watcher(command)])


def test_watcher_commands_use_existing_flags():
    check_against_parser([(where, command) for where, command in all_commands() if is_watcher(command)])


# --- Ray job runtime environments ---------------------------------------------------------------


@pytest.mark.parametrize("path", RUNTIME_ENVS, ids=lambda path: path.name)
def test_runtime_env(path):
    env = load(path)
    assert set(env) <= {"working_dir", "excludes", "pip", "env_vars"}, sorted(env)
    assert env["working_dir"] == "."  # submitted from the repository root
    packages = env["pip"]["packages"]
    # rayexport itself, built from the uploaded working_dir with pyproject.toml's dependencies
    assert "${RAY_RUNTIME_ENV_CREATE_WORKING_DIR}" in packages
    # torch pinned to the version the README installs
    readme_pin = re.search(r"pip install (torch==[0-9][0-9A-Za-z.+-]*)", (ROOT / "README.md").read_text()).group(1)
    assert readme_pin in packages, (readme_pin, packages)
    env_vars = env.get("env_vars", {})
    assert all(isinstance(key, str) and isinstance(value, str) for key, value in env_vars.items()), env_vars
    leaked = sorted(set(env_vars) & set(SECRET_ENV))
    assert not leaked, f"{path.name}: credentials in a runtime_env (stored with the job, shown by `ray job list`): {leaked}"
    # what `ray job submit --runtime-env FILE` does with the file, then Ray's own validation
    from ray.dashboard.modules.dashboard_sdk import parse_runtime_env_args
    from ray.runtime_env import RuntimeEnv

    parsed = RuntimeEnv(**parse_runtime_env_args(runtime_env=str(path)))
    assert parsed.working_dir() == "."
    assert parsed.pip_config()["packages"] == packages


def test_runtime_envs_agree():
    export, watch = (load(path) for path in RUNTIME_ENVS)
    assert export == watch, "jobs/export.yaml and jobs/watch.yaml are meant to differ only in comments"


# --- Kubernetes manifests -----------------------------------------------------------------------


def _env_entries(containers: Iterable[dict]) -> list[dict]:
    return [entry for container in containers for entry in container.get("env", [])]


def check_secret_env(where: str, entries: list[dict]) -> None:
    for entry in entries:
        if entry["name"] in SECRET_ENV:
            assert "value" not in entry, f"{where}: {entry['name']} has a literal value"
            ref = entry["valueFrom"]["secretKeyRef"]
            assert ref["name"] and ref["key"], entry


def test_rayjob():
    job = load(RAYJOB)
    assert job["apiVersion"] == "ray.io/v1"
    assert job["kind"] == "RayJob"
    assert job["metadata"]["name"]
    spec = job["spec"]
    assert "rayexport.run" in spec["entrypoint"]
    assert spec["shutdownAfterJobFinishes"] is True
    assert isinstance(spec["ttlSecondsAfterFinished"], int) and spec["ttlSecondsAfterFinished"] >= 0
    cluster = spec["rayClusterSpec"]
    assert cluster["rayVersion"]
    assert cluster["authOptions"]["mode"] == "token"
    head = cluster["headGroupSpec"]
    groups = cluster["workerGroupSpecs"]
    assert groups, "no worker group"
    for group in [head, *groups]:
        # KubeRay's rayStartParams is a map of strings: `num-cpus: 0` is refused, "0" is not
        assert all(isinstance(value, str) for value in group["rayStartParams"].values()), group["rayStartParams"]
        containers = group["template"]["spec"]["containers"]
        assert containers and all(container["name"] and container["image"] for container in containers)
    for group in groups:
        assert group["groupName"]
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"], group["groupName"]
    head_env = _env_entries(head["template"]["spec"]["containers"])
    check_secret_env(name(RAYJOB), head_env + _env_entries(c for g in groups for c in g["template"]["spec"]["containers"]))
    from_secret = {entry["name"] for entry in head_env if "secretKeyRef" in entry.get("valueFrom", {})}
    assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= from_secret, "the head runs the driver: it needs the S3 credentials"


def test_cronjob():
    cron = load(CRONJOB)
    assert cron["apiVersion"] == "batch/v1"
    assert cron["kind"] == "CronJob"
    assert cron["metadata"]["name"]
    spec = cron["spec"]
    assert len(spec["schedule"].split()) == 5, spec["schedule"]
    assert spec["concurrencyPolicy"] == "Forbid"
    pod = spec["jobTemplate"]["spec"]["template"]["spec"]
    assert pod["restartPolicy"] in ("Never", "OnFailure")
    argv = _cronjob_argv()
    command = " ".join(argv)
    assert "ray job submit" in command and "--watch" in command, command
    # Forbid only keeps passes apart while `ray job submit` waits for its job
    assert "--no-wait" not in argv
    address = argv[argv.index("--address") + 1]
    assert re.fullmatch(r"http://[a-z0-9.-]+-head-svc(\.[a-z0-9.-]+)?:8265", address), address
    env = {entry["name"]: entry for entry in _cronjob_container().get("env", [])}
    # RAY_API_SERVER_ADDRESS / RAY_ADDRESS would override --address in `ray job submit`
    assert not {"RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"} & set(env)
    # the client sends the token only with RAY_AUTH_MODE=token in its own environment
    assert env["RAY_AUTH_MODE"]["value"] == "token"
    assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]["key"] == "auth_token"
    check_secret_env(name(CRONJOB), list(env.values()))


def test_images_match_the_ray_version():
    version = load(RAYJOB)["spec"]["rayClusterSpec"]["rayVersion"]
    assert _cronjob_container()["image"].startswith(f"rayproject/ray:{version}"), "the submitter's ray CLI should match the cluster"


# --- no credentials anywhere --------------------------------------------------------------------

LITERAL_SECRET = re.compile(
    r"\b(AWS_SECRET_ACCESS_KEY|AWS_SESSION_TOKEN|RAY_AUTH_TOKEN|aws_secret_access_key|aws_session_token)\b"
    r"\s*[=:]\s*[\"']?([^\s\"'`]+)"
)


@pytest.mark.parametrize("path", ALL_FILES, ids=name)
def test_no_credentials(path):
    text = path.read_text()
    assert not re.search(r"\b(AKIA|ASIA)[0-9A-Z]{16}\b", text), "an AWS access key id"
    assert "-----BEGIN" not in text, "a private key"
    assert not re.search(r"(?<![A-Za-z0-9/+=_.-])[A-Za-z0-9/+]{40}(?![A-Za-z0-9/+=_.-])", text), "a 40-character secret-like string"
    assert not re.search(r"\b[0-9a-f]{64}\b", text), "a 64-hex-digit token"
    for match in LITERAL_SECRET.finditer(text):
        value = match.group(2)
        # a placeholder ($VAR, <...>, {...}, ...), a lookup (os.environ[...]) or moto's dummy
        placeholder = value[0] in "$<{." or value.startswith(("os.environ", "os.getenv")) or value == MOTO_DUMMY
        assert placeholder, f"{match.group(1)} is given a literal value: {match.group(0)!r}"


# --- shell scripts ------------------------------------------------------------------------------


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda path: path.name)
def test_script_syntax(path):
    assert path.read_text().startswith("#!/usr/bin/env bash\n")
    assert os.access(path, os.X_OK), f"{name(path)} is not executable"
    result = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    addresses = set(re.findall(r"\b\d{1,3}(?:\.\d{1,3}){3}\b", path.read_text()))
    assert addresses <= {"127.0.0.1"}, f"non-loopback addresses: {addresses}"


# --- the local stack, for real ------------------------------------------------------------------


def _read_env_file(path: Path) -> dict:
    values = {}
    for line in path.read_text().splitlines():
        if line.startswith("export "):
            key, _, value = line[len("export ") :].partition("=")
            values[key] = value
    return values


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            state = handle.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"


def _marked(state_dir: str) -> list[int]:
    """Live processes whose environment carries local-up.sh's mark for this stack."""
    mark = f"RAYEXPORT_LOCAL_STACK={state_dir}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as handle:
                environ = handle.read().split(b"\0")
        except OSError:
            continue
        if mark in environ and _alive(int(entry)):
            found.append(int(entry))
    return found


def _session_members(sid: int) -> list[int]:
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":  # fields: state, ppid, pgrp, session
            members.append(int(entry))
    return members


def _port_open(url: str) -> bool:
    host, port = url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
    with socket.socket() as probe:
        probe.settimeout(1)
        return probe.connect_ex((host, int(port))) == 0


def _job_status(api: str, token: str, job_id: str) -> str:
    request = urllib.request.Request(f"{api}/api/jobs/{job_id}", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.load(response)["status"]


def test_local_up_and_down(monkeypatch, checkpoints):
    """infra/local-up.sh starts a Ray head (token auth) and moto on 127.0.0.1; an export
    submitted with `ray job submit` and the printed variables succeeds and verifies; without
    RAY_AUTH_MODE the same client is refused; infra/local-down.sh, run while a job still runs,
    leaves no process of the stack behind."""
    bin_dir = Path(sys.executable).parent
    if not (bin_dir / "ray").exists() and not shutil.which("ray"):
        pytest.skip("ray is not installed")
    if not shutil.which("setsid"):
        pytest.skip("setsid is not installed")
    for variable in ("NO_PROXY", "no_proxy"):  # loopback requests from this test skip any proxy
        monkeypatch.setenv(variable, ",".join(filter(None, ["127.0.0.1,localhost", os.environ.get(variable)])))
    started = time.monotonic()
    state_dir = tempfile.mkdtemp(prefix="rxl-", dir="/tmp" if os.path.isdir("/tmp") else None)
    base_env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("AWS_", "RAY_AUTH_")) and key not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")
    }
    base_env.update(
        PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        RAYEXPORT_LOCAL_DIR=state_dir,
        RAYEXPORT_LOCAL_CPUS="1",
        PYTHON=sys.executable,
    )
    pids: dict[str, int] = {}
    down = None

    def run(command, env, timeout=120):
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)

    try:
        up = run(["bash", str(INFRA / "local-up.sh")], base_env)
        assert up.returncode == 0, up.stdout + up.stderr
        pids = {part: int(Path(state_dir, f"{part}.pid").read_text()) for part in ("ray", "moto")}
        assert all(_alive(pid) for pid in pids.values())
        printed = _read_env_file(Path(state_dir, "env.sh"))
        api, endpoint = printed["RAY_API_SERVER_ADDRESS"], printed["AWS_ENDPOINT_URL"]
        assert api.startswith("http://127.0.0.1:") and endpoint.startswith("http://127.0.0.1:")
        assert printed["RAY_AUTH_MODE"] == "token"
        token_file = Path(printed["RAY_AUTH_TOKEN_PATH"])
        assert token_file.stat().st_mode & 0o777 == 0o600
        token = token_file.read_text().strip()

        with urllib.request.urlopen(f"{api}/api/authentication_mode", timeout=10) as response:
            assert json.load(response) == {"authentication_mode": "token"}
        import boto3

        s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                          aws_access_key_id=printed["AWS_ACCESS_KEY_ID"], aws_secret_access_key=printed["AWS_SECRET_ACCESS_KEY"])
        s3.head_bucket(Bucket="rayexport-local")

        # A real export as jobs/README.md shows it: `ray job submit -- python -m rayexport.run`,
        # S3 to S3 on the stack's endpoint, then checked from here.
        source = Path(checkpoints["tied"].path)
        for path in source.rglob("*"):
            if path.is_file():
                s3.upload_file(str(path), "rayexport-local", f"ckpt/{path.relative_to(source)}")
        job_vars = {key: printed[key] for key in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
        exported = run(
            ["ray", "job", "submit", "--submission-id", "rx-export", "--runtime-env-json",
             json.dumps({"env_vars": job_vars}), "--", "python", "-m", "rayexport.run",
             "--src", "s3://rayexport-local/ckpt", "--dst", "s3://rayexport-local/export", "--workers", "1", "--verify", "quick"],
            {**base_env, **printed}, timeout=300,
        )
        assert exported.returncode == 0, exported.stdout[-3000:] + exported.stderr[-3000:]
        assert _job_status(api, token, "rx-export") == "SUCCEEDED"
        from rayexport.verify import verify_uri

        checked = verify_uri("s3://rayexport-local/export", storage_options={
            "endpoint_url": endpoint, "key": printed["AWS_ACCESS_KEY_ID"], "secret": printed["AWS_SECRET_ACCESS_KEY"],
        })
        assert checked["level"] == "quick" and "tensors" in checked["checks"]

        # What jobs/README.md says: the client sends no token without RAY_AUTH_MODE=token.
        no_mode = {**base_env, "RAY_API_SERVER_ADDRESS": api}
        refused = run(["ray", "job", "list"], no_mode, timeout=60)
        assert refused.returncode != 0
        assert "Missing authentication token" in refused.stdout + refused.stderr

        # With the printed variables: a job that is still running when the stack goes down.
        submit = run(["ray", "job", "submit", "--no-wait", "--submission-id", "rx-sleeper", "--", "sleep", "600"],
                     {**base_env, **printed}, timeout=60)
        assert submit.returncode == 0, submit.stdout + submit.stderr
        deadline = time.monotonic() + 60
        while _job_status(api, token, "rx-sleeper") != "RUNNING":
            assert time.monotonic() < deadline, "the job did not start"
            time.sleep(0.5)
        assert _marked(state_dir), "no process carries the stack's mark"

        down = run(["bash", str(INFRA / "local-down.sh")], base_env)
        assert down.returncode == 0, down.stdout + down.stderr
        assert not any(_alive(pid) for pid in pids.values())
        assert not any(_session_members(pid) for pid in pids.values())
        assert not _marked(state_dir), "processes of the stack are still running"
        assert not _port_open(api) and not _port_open(endpoint)
        assert not os.path.exists(state_dir)
    finally:
        if down is None or down.returncode != 0:
            run(["bash", str(INFRA / "local-down.sh")], {**base_env, "RAYEXPORT_LOCAL_KEEP": "1"})
            for pid in [*pids.values(), *_marked(state_dir)]:  # last resort, ours only
                for member in _session_members(pid) or ([pid] if _alive(pid) else []):
                    try:
                        os.kill(member, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        shutil.rmtree(state_dir, ignore_errors=True)
    assert time.monotonic() - started < 240, "the local stack took too long to start, export and stop"
