"""The container images: tools/build_image.py builds them in a Docker daemon this test starts (and
stops, with everything it built), and the cpu image serves the demo as the issue asks.

When it runs: always under CI (`CI` set), where it installs Debian's docker.io and debootstrap if they
are missing, and fails, with the daemon's own error, if it cannot start one; elsewhere only with
QWEN35_CONTAINER_TEST=1 (it takes minutes and builds images), so a plain `pytest` stays quick.
The cuda image (no GPU needed to build it) is built too, its size printed and its cubins checked
against its own NVRTC; QWEN35_CONTAINER_CUDA=0 leaves it out (about a minute less).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tarfile
import tempfile
import threading
import time
from pathlib import Path

import pytest

from server_util import free_port
from tools import build_image

pytestmark = pytest.mark.container

IN_CI = bool(os.environ.get("CI"))
WANTED = IN_CI or os.environ.get("QWEN35_CONTAINER_TEST") == "1"
DOCKER = build_image.default_docker()


def _ensure_tools() -> None:
    """Debian's docker.io and debootstrap: CI's machine is fresh, and installing is how it gets them."""
    if shutil.which("dockerd") and shutil.which("debootstrap") and shutil.which(DOCKER):
        return
    if os.geteuid() != 0:
        pytest.fail("the container test needs dockerd, docker and debootstrap (apt-get install docker.io debootstrap)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "docker.io", "debootstrap"]):
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if r.returncode:
            pytest.fail(f"{' '.join(cmd)} failed:\n{r.stdout[-2000:]}{r.stderr[-2000:]}")


class Dockerd:
    """A dockerd of the test's own: no iptables, no bridge (containers use the host network), its
    own socket, state and data (so it meets no other daemon); stopping it and deleting the folder
    removes every image, layer and build cache it made."""

    def __init__(self, root: Path):
        self.root = root
        self.host = f"unix://{root}/docker.sock"
        self.log = root / "dockerd.log"

    def __enter__(self) -> "Dockerd":
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "daemon.json").write_text("{}")  # not the machine's /etc/docker/daemon.json
        self.proc = subprocess.Popen(
            ["dockerd", "--iptables=false", "--bridge=none", "--config-file", str(self.root / "daemon.json"),
             "--data-root", str(self.root / "data"), "--exec-root", str(self.root / "exec"),
             "--pidfile", str(self.root / "dockerd.pid"), "-H", self.host],
            stdout=open(self.log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            if subprocess.run([DOCKER, "-H", self.host, "version"], capture_output=True).returncode == 0:
                return self
            time.sleep(0.5)
        self._stop()
        log = self.log.read_text()
        self.__exit__()
        # its errors (containerd's output is interleaved), then how the log ends
        errors = [ln for ln in log.splitlines()
                  if not ln.startswith("time=") or "level=error" in ln or "level=fatal" in ln]
        pytest.fail(f"dockerd did not start (exit {self.proc.returncode}):\n" + "\n".join(errors[-20:])
                    + f"\n... the log ends:\n{log[-1500:]}")

    def _stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __exit__(self, *exc) -> None:
        self._stop()
        # dockerd leaves its network namespace mounted (exec/netns/default): unmount what is left
        # under the folder, deepest first, so that all of it can go
        mounts = [ln.split()[1] for ln in Path("/proc/self/mounts").read_text().splitlines()]
        for mp in sorted((m for m in mounts if m.startswith(f"{self.root}/")), key=len, reverse=True):
            subprocess.run(["umount", mp], capture_output=True)
        shutil.rmtree(self.root)


def docker(*args: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([DOCKER, *args], check=check, capture_output=True, text=True, **kw)


def _wait_healthy(name: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = json.loads(docker("inspect", "-f", "{{json .State}}", name).stdout)
        if not state["Running"]:
            logs = docker("logs", name, check=False)
            pytest.fail(f"container exited ({state['ExitCode']}):\n{(logs.stdout + logs.stderr)[-3000:]}")
        if state.get("Health", {}).get("Status") == "healthy":
            return
        time.sleep(0.5)
    logs = docker("logs", name, check=False)
    pytest.fail(f"not healthy after {timeout} s: {state.get('Health')}\n{(logs.stdout + logs.stderr)[-3000:]}")


def _pem_blocks(text: str) -> set[str]:
    blocks, cur = set(), None
    for line in text.splitlines():
        if line.startswith("-----BEGIN CERTIFICATE-----"):
            cur = []
        elif line.startswith("-----END CERTIFICATE-----") and cur is not None:
            blocks.add("\n".join(cur))
            cur = None
        elif cur is not None:
            cur.append(line.strip())
    return blocks


def _assert_ca_not_in_image(image: str, base: str, ca: str) -> None:
    """The build's CA bundle left nothing in the image: no file is the bundle, and no certificate of it
    that the base image (made before any build step saw the secret) lacks is anywhere in the image."""
    ca_bytes = Path(ca).read_bytes()
    base_bundle = docker("run", "--rm", "--network=none", base, "cat", "/etc/ssl/certs/ca-certificates.crt",
                         check=False).stdout
    extra = [b.encode() for b in _pem_blocks(ca_bytes.decode(errors="replace")) - _pem_blocks(base_bundle)]
    cid = docker("create", image).stdout.strip()
    try:
        exp = subprocess.Popen([DOCKER, "export", cid], stdout=subprocess.PIPE)
        with tarfile.open(fileobj=exp.stdout, mode="r|") as tar:
            for m in tar:
                assert not m.name.lstrip("./").startswith("run/secrets/"), m.name
                if not m.isfile():
                    continue
                data = tar.extractfile(m).read()
                assert data != ca_bytes, f"{m.name} is the build's CA bundle"
                for b in extra:  # a certificate's first base64 line (64 characters) names it well enough
                    assert b.split(b"\n", 1)[0] not in data, f"{m.name} holds a certificate of the build's CA bundle"
        assert exp.wait() == 0
    finally:
        docker("rm", cid, check=False)


def _assert_cubins_complete(image: str) -> None:
    """Every program of every instance is in the image's kernel cache under the key the image's own
    NVRTC gives it: a container on an sm_90 GPU loads them all and compiles none (no GPU needed to
    check: the key is source, options, instance, architecture and NVRTC version)."""
    check = ("from engine.gpu import kernels; "
             "done = [kernels.build(*p, '90', [kernels.cache_dir()]) for p in kernels.every_program()]; "
             "print(len(done), sum(c for _, _, c in done), kernels.cache_dir())")
    # --tmpfs /tmp: CuPy creates its kernel cache directory (CUPY_CACHE_DIR) when it is imported
    out = docker("run", "--rm", "--network=none", "--read-only", "--tmpfs", "/tmp", "--entrypoint", "python3", image,
                 "-c", check)
    n, compiled, where = out.stdout.split()
    assert int(n) > 0 and compiled == "0" and where == "/opt/qwen35/kernels", out.stdout


@pytest.mark.skipif(not WANTED, reason="builds images (minutes): runs under CI, or with QWEN35_CONTAINER_TEST=1")
def test_cpu_image_serves_the_demo(monkeypatch):
    t_start = time.monotonic()
    _ensure_tools()
    from openai import OpenAI  # the test extra's official client

    # a short path: containerd's sockets live under it, and a unix socket's path has at most 107 bytes
    with Dockerd(Path(tempfile.mkdtemp(prefix="qwen35-dockerd-", dir="/tmp"))) as daemon:
        monkeypatch.setenv("DOCKER_HOST", daemon.host)
        targets = ["cpu"] + (["cuda"] if os.environ.get("QWEN35_CONTAINER_CUDA") != "0" else [])
        built = build_image.main([x for t in targets for x in ("--target", t)])
        t_built = time.monotonic()
        sizes = {k: f"{v / 1e6:.0f} MB" for k, v in built["bytes"].items()}
        print(f"image sizes: {sizes}; build seconds: { {k: round(v) for k, v in built['seconds'].items()} }")

        if "cuda" in targets:
            _assert_cubins_complete("qwen35:cuda")
        ca = build_image.default_ca()
        if ca:
            _assert_ca_not_in_image("qwen35:cpu", built["base"], ca)

        port, name = free_port(), f"qwen35-test-{os.getpid()}"
        docker("run", "-d", "--name", name, "--network=host", "--read-only", "qwen35:cpu",
               "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "demo")
        _wait_healthy(name)  # the image's HEALTHCHECK said so (tools/healthcheck.py)
        t_healthy = time.monotonic()

        cfg = json.loads(docker("inspect", name).stdout)[0]
        assert cfg["HostConfig"]["ReadonlyRootfs"] is True
        assert docker("exec", name, "id", "-u").stdout.strip() not in ("", "0")  # not root
        assert docker("exec", name, "touch", "/opt/x", check=False).returncode != 0  # read-only indeed

        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
        c = client.completions.create(model="demo", prompt="hello", max_tokens=8, temperature=0)
        assert c.choices[0].finish_reason == "length" and c.usage.completion_tokens == 8

        # A long streaming chat; SIGTERM (docker stop) once it is under way: the stream still ends
        # properly, with finish_reason "abort", and the server exits 0.
        stream = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=4000, stream=True, extra_body={"ignore_eos": True})
        stopper, finish, n = None, [], 0
        for chunk in stream:
            for ch in chunk.choices:
                n += bool(ch.delta.content)
                if ch.finish_reason:
                    finish.append(ch.finish_reason)
            if n == 3 and stopper is None:
                stopper = threading.Thread(target=docker, args=("stop", "-t", "30", name))
                stopper.start()
        stopper.join()
        assert finish == ["abort"], finish
        state = json.loads(docker("inspect", "-f", "{{json .State}}", name).stdout)
        assert state["ExitCode"] == 0 and not state["OOMKilled"], state
        logs = docker("logs", name)
        assert "engine ready" in logs.stdout + logs.stderr  # the server's log is the container's output
        docker("rm", name)
    print(f"container test: {time.monotonic() - t_start:.0f} s (build {t_built - t_start:.0f} s, "
          f"start to healthy {t_healthy - t_built:.1f} s)")


def test_healthcheck_reads_the_servers_port():
    from tools.healthcheck import address
    assert address(["qwen35", "serve", "/models/m", "--port", "9000"]) == ("127.0.0.1", 9000)
    assert address(["/sbin/docker-init", "--", "qwen35", "serve", "--port=81", "--host", "::1"]) == ("[::1]", 81)
    assert address(["qwen35", "serve", "--host", "0.0.0.0"]) == ("127.0.0.1", 8000)
