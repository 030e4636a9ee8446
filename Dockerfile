# qwen35's container images, built by tools/build_image.py (docs/container.md says how to run them).
#
#   cpu:  the NumPy backend and the built-in demo checkpoint (the demo and CI)
#   cuda: CuPy with the CUDA 13 runtime, NVRTC and cuBLAS wheels, and every kernel precompiled to
#         cubins for CUDA_ARCHS, so a container on such a GPU compiles none of our kernels at start
#
# Nothing comes from a container registry: BASE is a debootstrap (minbase) of the build machine's
# Debian release with python3 and python3-venv, imported with `docker import`; everything else comes
# from PyPI. Needs BuildKit (the secret mount below), which Debian's docker.io has built in.
ARG BASE=qwen35-base:bookworm

# ---- builder: a venv with qwen35 and its dependencies, and the demo checkpoint ---------------------
FROM ${BASE} AS builder
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore LANG=C.UTF-8
# /opt/venv is what the image ships: no pip, no setuptools in it; a pip of its own (pip --python)
# installs into it.
RUN python3 -m venv /opt/pip && python3 -m venv --without-pip /opt/venv
COPY pyproject.toml README.md /src/
COPY cuda /src/cuda
COPY engine /src/engine
COPY server /src/server
COPY tools /src/tools
# A TLS-intercepting proxy's CA bundle comes in as the BuildKit secret `ca`: mounted for this RUN
# only, never written to a layer. The pip cache mount only speeds up rebuilds; it is no layer either.
RUN --mount=type=secret,id=ca --mount=type=cache,target=/root/.cache/pip \
    if [ -s /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi; \
    /opt/pip/bin/pip --python /opt/venv/bin/python install /src
# The demo checkpoint is built now, so a container with a read-only root filesystem serves it as is
# (readable by all: it is written as a private temporary directory, then renamed).
RUN QWEN35_CACHE=/opt/qwen35/cache /opt/venv/bin/python -c "from engine.demo import demo_model_dir; demo_model_dir()" \
    && chmod -R a+rX /opt/qwen35/cache

# ---- builder-cuda: + CuPy and the CUDA wheels; the kernels compiled (NVRTC needs no GPU) -----------
FROM builder AS builder-cuda
# cupy-cuda13x (the cuda13 extra) with only the CUDA wheels qwen35 uses: NVRTC (our kernels, CuPy's
# own), cuBLAS (engine/gpu/gemm.py loads libcublasLt) and the runtime's headers and libcudart. Not
# CuPy's [ctk] extra, which adds cuFFT, cuRAND, cuSOLVER and cuSPARSE (about 1 GB more).
RUN --mount=type=secret,id=ca --mount=type=cache,target=/root/.cache/pip \
    if [ -s /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi; \
    /opt/pip/bin/pip --python /opt/venv/bin/python install "/src[cuda13]" \
      "nvidia-cuda-nvrtc==13.*" "nvidia-cublas==13.*" "nvidia-cuda-runtime==13.*"
# Every program of every instance (tools/build_kernels.py), per architecture: the cache's keys hold
# source, options, architecture and NVRTC version, and the image's NVRTC is the one that runs them.
ARG CUDA_ARCHS=90
RUN for arch in ${CUDA_ARCHS}; do \
      /opt/venv/bin/python -m tools.build_kernels --arch "$arch" --dir /opt/qwen35/kernels || exit 1; \
    done

# ---- runtime: what both images share --------------------------------------------------------------
FROM ${BASE} AS runtime
RUN groupadd --system --gid 10001 qwen35 \
    && useradd --system --uid 10001 --gid 10001 --home-dir /nonexistent --no-create-home \
         --shell /usr/sbin/nologin qwen35
# Everything the server may write goes to /tmp (mount a tmpfs or a volume there with --read-only);
# what the image ships (demo checkpoint, cubins) is read from read-only image paths.
ENV PATH=/opt/venv/bin:$PATH LANG=C.UTF-8 HOME=/tmp \
    PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    QWEN35_CACHE=/opt/qwen35/cache CUPY_CACHE_DIR=/tmp/cupy-kernels
COPY tools/healthcheck.py /opt/qwen35/healthcheck.py
USER qwen35
WORKDIR /tmp
EXPOSE 8000
# Docker probes during the start period too and turns healthy at the first 200; the long period only
# keeps a large checkpoint's load from counting as failures.
HEALTHCHECK --interval=5s --timeout=3s --start-period=600s --retries=3 CMD ["python3", "/opt/qwen35/healthcheck.py"]
# SIGTERM (docker stop) aborts every running request, each stream ends with finish_reason "abort",
# and the server exits 0, within an engine step: docker stop's 10 s are plenty. (Before the port
# opens, the server as PID 1 has no SIGTERM handler yet: run with --init to stop a loading one.)
STOPSIGNAL SIGTERM
ENTRYPOINT ["qwen35", "serve"]

# ---- the images ------------------------------------------------------------------------------------
FROM runtime AS cpu
COPY --from=builder /opt/venv /opt/venv
COPY --from=builder /opt/qwen35/cache /opt/qwen35/cache

FROM runtime AS cuda
COPY --from=builder-cuda /opt/venv /opt/venv
COPY --from=builder /opt/qwen35/cache /opt/qwen35/cache
COPY --from=builder-cuda /opt/qwen35/kernels /opt/qwen35/kernels
# QWEN35_KERNEL_CACHE: the shipped cubins, read-only (a kernel not among them is compiled into
# $TMPDIR); the NVIDIA runtime mounts the driver's compute libraries with --gpus.
ENV QWEN35_KERNEL_CACHE=/opt/qwen35/kernels NVIDIA_DRIVER_CAPABILITIES=compute,utility
