"""The images' command line, run as it is in a subprocess of the test's own environment (no Docker engine): it
creates its keys, brings up a one-node cluster whose every port listens on loopback, serves the app on 0.0.0.0
(HTTP and gRPC only) and answers a completion with the key it created; SIGTERM (`docker stop`) stops it all."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
import yaml

from deploy.infra.container import KEY_FILES, main
from deploy.infra.local_cluster import read_state, running_processes
from tests.fixtures.tiny_models import build_tiny_model
from tests.k8s.manifests import ROOT
from tests.k8s.test_docker import DOCKERFILES, instructions

LOOPBACK = {"127.0.0.1", "::ffff:127.0.0.1", "::1"}


def image_command(path: Path) -> tuple[list[str], list[str]]:
    """The image's ENTRYPOINT and CMD (JSON forms), `python` being this environment's."""
    steps = dict(instructions(path))
    entrypoint, cmd = json.loads(steps["ENTRYPOINT"]), json.loads(steps["CMD"])
    return [sys.executable if w == "python" else w for w in entrypoint], cmd


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_the_images_default_arguments_name_a_config_that_loads(path: Path) -> None:
    from cluster.config import load_config

    entrypoint, cmd = image_command(path)
    assert entrypoint[1:] == ["-m", "deploy.infra.container"] and cmd[0] == "--config"
    load_config(ROOT / cmd[1])  # the image's WORKDIR holds the repository's layout


def test_a_keys_folder_where_none_can_be_made_is_a_clear_error(tmp_path: Path, capsys) -> None:
    (tmp_path / "file").write_text("")  # a folder under a file cannot exist, whoever runs this (root included)
    assert main(["--keys", str(tmp_path / "file" / "keys"), "--state", str(tmp_path / "state.json")]) == 2
    err = capsys.readouterr().err
    assert "lacks the key files" in err and "api-keys" in err and not (tmp_path / "state.json").exists()


@pytest.mark.slow  # a Ray cluster and Serve of its own: a minute or more
def test_the_images_command_line_serves_on_the_apps_ports_only(tmp_path: Path) -> None:
    target = build_tiny_model("llama", tmp_path / "target", max_position_embeddings=256)
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({
        "engine": {"model": {"target": str(target), "name": "tiny"}, "speculation": {"policy": "off"},
                   "cache": {"block_size": 4, "num_blocks": 128}},
        "fleet": {"instances": 1, "instance_num_cpus": 1}}))
    http, grpc = free_port(), free_port()
    keys, state = tmp_path / "keys", tmp_path / "cluster.json"
    entrypoint, _ = image_command(DOCKERFILES[0])
    # `docker run IMAGE --config ...` replaces CMD; the ports and state are the test's (other tests run beside it)
    argv = entrypoint + ["--config", str(config), "--keys", str(keys), "--state", str(state),
                         "--http-port", str(http), "--grpc-port", str(grpc), "--num-cpus", "4", "--timeout", "400"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    serving = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("specfleet is serving"):
                serving.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 600
        while not serving.wait(1.0):  # the entrypoint prints its line once the app runs; it must not exit before
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)[-4000:]
        for name in KEY_FILES.values():
            assert stat.S_IMODE((keys / name).stat().st_mode) == 0o600
        key = (keys / KEY_FILES["api"]).read_text().split()[0]
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0}
        r = httpx.post(f"http://127.0.0.1:{http}/v1/completions", json=body, timeout=120,
                       headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
        assert httpx.post(f"http://127.0.0.1:{http}/v1/completions", json=body, timeout=60).status_code == 401
        cluster = read_state(state)
        listening = set()
        for p in running_processes(cluster):
            try:
                listening |= {(c.laddr.ip, c.laddr.port) for c in p.net_connections("inet")
                              if c.status == psutil.CONN_LISTEN}
            except psutil.Error:
                pass
        exposed = {port for ip, port in listening if ip not in LOOPBACK}
        assert exposed == {http, grpc}, sorted(listening)  # the app's ports on every interface, nothing else
        assert cluster.nodes[0].ports["gcs"] in {port for _, port in listening}
        pids = [p.pid for p in running_processes(cluster)]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0, "".join(lines)[-4000:]
        deadline = time.monotonic() + 60
        while any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in pids):
            assert time.monotonic() < deadline, "the cluster outlived the entrypoint"
            time.sleep(0.5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        if state.exists():
            subprocess.run([sys.executable, "-m", "deploy.cli", "cluster", "down", "--state", str(state)],
                           cwd=ROOT, timeout=120, capture_output=True)
