"""Build qwen35's container images (the Dockerfile's `cpu` and `cuda` targets) with no container registry.

1. The base image, unless the daemon has it: `debootstrap --variant=minbase` of this machine's Debian
   release with python3 and python3-venv (apt caches, docs and locales removed), `docker import`ed as
   qwen35-base:RELEASE. Needs root and debootstrap (apt-get install debootstrap).
2. `docker build --target T` with BuildKit on the host network (no bridge needed; pip reaches PyPI as
   this machine does). A CA bundle for a TLS-intercepting proxy goes in as the BuildKit secret `ca`,
   which no layer keeps (default: $PIP_CERT or $SSL_CERT_FILE when set; --ca-bundle none: no secret).

    python3 tools/build_image.py [--target cpu] [--target cuda] [--tag qwen35] [--cuda-archs 90]
                                 [--ca-bundle FILE|none] [--release bookworm] [--mirror URL]

Images: TAG:cpu, TAG:cuda. The daemon is $DOCKER_HOST's; the client is Debian's /usr/bin/docker when
present (its BuildKit is built in; a newer client would want the buildx plugin), else `docker`.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MIRROR = "http://deb.debian.org/debian"


def default_docker() -> str:
    return os.environ.get("DOCKER") or ("/usr/bin/docker" if Path("/usr/bin/docker").is_file() else "docker")


def os_release() -> str:
    """VERSION_CODENAME of this machine (the base image is the same Debian release)."""
    for line in Path("/etc/os-release").read_text().splitlines():
        if line.startswith("VERSION_CODENAME="):
            return line.split("=", 1)[1].strip('"')
    raise SystemExit("no VERSION_CODENAME in /etc/os-release: give --release")


def default_ca() -> str | None:
    for var in ("PIP_CERT", "SSL_CERT_FILE"):
        if os.environ.get(var) and Path(os.environ[var]).is_file():
            return os.environ[var]
    return None


def _run(cmd: list, **kw) -> subprocess.CompletedProcess:
    print("+", " ".join(map(str, cmd)), flush=True)
    return subprocess.run([str(c) for c in cmd], check=True, **kw)


def _slim(root: Path) -> None:
    """What a container never uses: downloaded .debs, package lists, docs (copyrights kept), man
    pages, translations."""
    for pattern in ("var/cache/apt/archives/*.deb", "var/cache/apt/*.bin", "var/lib/apt/lists/*_*",
                    "usr/share/man/*", "usr/share/info/*", "usr/share/locale/*"):
        for p in root.glob(pattern):
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    for p in (root / "usr/share/doc").glob("*/*"):
        if p.name != "copyright":
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()


def build_base(docker: str, tag: str, release: str, mirror: str) -> None:
    if subprocess.run([docker, "image", "inspect", tag], capture_output=True).returncode == 0:
        print(f"base image {tag}: already there", flush=True)
        return
    if os.geteuid() != 0:
        raise SystemExit("debootstrap needs root (or build the base image elsewhere and load it as " + tag + ")")
    if shutil.which("debootstrap") is None:
        raise SystemExit("debootstrap not found: apt-get install -y debootstrap")
    with tempfile.TemporaryDirectory(prefix="qwen35-rootfs-") as tmp:
        rootfs, log = Path(tmp) / "rootfs", Path(tmp) / "debootstrap.log"
        print(f"+ debootstrap --variant=minbase --include=python3,python3-venv {release} ... {mirror}", flush=True)
        # In two stages, so that the second one's dpkg runs with force-unsafe-io (no fsync per file: a
        # fifth off the build's slowest step; a root that is then tarred needs no crash safety).
        unsafe_io = rootfs / "etc/dpkg/dpkg.cfg.d/qwen35-unsafe-io"
        with open(log, "w") as f:
            for cmd in (["debootstrap", "--foreign", "--variant=minbase", "--include=python3,python3-venv", release,
                         str(rootfs), mirror], ["chroot", str(rootfs), "/debootstrap/debootstrap", "--second-stage"]):
                if cmd[0] == "chroot":
                    unsafe_io.parent.mkdir(parents=True, exist_ok=True)
                    unsafe_io.write_text("force-unsafe-io\n")
                r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
                if r.returncode:
                    raise SystemExit(f"{' '.join(cmd[:2])} failed ({r.returncode}):\n{log.read_text()[-3000:]}")
        unsafe_io.unlink()
        _slim(rootfs)
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "--numeric-owner", "-c", "."], stdout=subprocess.PIPE)
        _run([docker, "import", "--change", "ENV LANG=C.UTF-8", "-", tag], stdin=tar.stdout,
             stdout=subprocess.DEVNULL)
        if tar.wait():
            raise SystemExit("tar of the debootstrap root failed")


def build_target(docker: str, target: str, tag: str, base: str, ca: str | None, cuda_archs: str) -> None:
    cmd = [docker, "build", "--network=host", "--progress=plain", "--target", target, "-t", f"{tag}:{target}",
           "--build-arg", f"BASE={base}", "--build-arg", f"CUDA_ARCHS={cuda_archs}"]
    if ca:
        cmd += ["--secret", f"id=ca,src={ca}"]
    _run(cmd + [ROOT], env=dict(os.environ, DOCKER_BUILDKIT="1"))


def image_size(docker: str, image: str) -> int:
    out = subprocess.run([docker, "image", "inspect", "-f", "{{.Size}}", image], check=True, capture_output=True,
                         text=True).stdout
    return int(out)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", action="append", choices=["cpu", "cuda"], help="repeatable (default: cpu)")
    ap.add_argument("--tag", default="qwen35", help="image name: TAG:cpu, TAG:cuda")
    ap.add_argument("--cuda-archs", default="90", help="compute capabilities to precompile, e.g. '90 100'")
    ap.add_argument("--ca-bundle", default=default_ca(),
                    help="extra CA bundle for the build's downloads, as a BuildKit secret ('none': no secret; "
                         "default: $PIP_CERT or $SSL_CERT_FILE)")
    ap.add_argument("--release", default=None, help="Debian release of the base (default: this machine's)")
    ap.add_argument("--mirror", default=MIRROR, help="Debian mirror for debootstrap")
    ap.add_argument("--docker", default=default_docker(), help="docker client")
    a = ap.parse_args(argv)
    release = a.release or os_release()
    base = f"{a.tag}-base:{release}"
    ca = None if a.ca_bundle in (None, "", "none") else a.ca_bundle
    out = {"base": base, "seconds": {}, "bytes": {}}
    t0 = time.monotonic()
    build_base(a.docker, base, release, a.mirror)
    out["seconds"]["base"] = time.monotonic() - t0
    for target in a.target or ["cpu"]:
        t0 = time.monotonic()
        build_target(a.docker, target, a.tag, base, ca, a.cuda_archs)
        out["seconds"][target] = time.monotonic() - t0
    for image in [base] + [f"{a.tag}:{t}" for t in a.target or ["cpu"]]:
        out["bytes"][image] = image_size(a.docker, image)
    for image, n in out["bytes"].items():
        print(f"{image}: {n / 1e6:.0f} MB", flush=True)
    print("build seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in out["seconds"].items()), flush=True)
    return out


if __name__ == "__main__":
    try:
        main()
    except subprocess.CalledProcessError as e:
        sys.exit(f"failed ({e.returncode}): {' '.join(map(str, e.cmd))}")
