# ssd-serve image for KubeRay (k8s/) and for `docker run` on one machine.
#
#   CPU (default; the bundled demo pair is in the image, no volume needed):
#     docker build -t ssd-serve:latest .
#   CUDA (the gpu-70b overlay expects ssd-serve:cuda):
#     docker build -t ssd-serve:cuda \
#       --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
#
# The project's own .venv (made by `make install`) provides python, `ray` and `serve`: every
# Ray node of the cluster runs this image, so the raylet and every worker it starts use this
# venv and import serve_app from /app.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
FROM ${PYTHON_IMAGE}

# TORCH_SPEC is the Makefile's; TORCH_INDEX_URL picks the build (cpu, cu128, ...). Torch goes in
# first, from that index, so `make install` finds it and keeps it (pyproject asks a range only).
ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# Must equal rayClusterConfig.rayVersion in k8s/ (KubeRay picks probe and start flags by it;
# tests/test_k8s_manifests.py checks the two agree). pyproject allows a range; this pins it.
ARG RAY_VERSION=2.60.0

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# make: `make install`. wget: KubeRay's default exec probes for older rayVersion values use it.
RUN apt-get update \
    && apt-get install -y --no-install-recommends make wget ca-certificates \
    && rm -rf /var/lib/apt/lists/*

# A fixed numeric uid, so runAsNonRoot in the manifests can be verified by the kubelet.
RUN useradd --create-home --uid 1000 --shell /bin/bash ray

WORKDIR /app

# Its own layer: the largest download, reused while only the sources change.
RUN python -m venv .venv \
    && .venv/bin/pip install --index-url "${TORCH_INDEX_URL}" "${TORCH_SPEC}"

COPY . .

# make install: the rest of the dependencies (editable install of ssd, actors, serve_app) and the
# gRPC stubs that serveConfigV2's grpc_servicer_functions import.
RUN echo "ray==${RAY_VERSION}" > /tmp/ray-pin.txt \
    && PIP_CONSTRAINT=/tmp/ray-pin.txt make install TORCH_SPEC="${TORCH_SPEC}" \
    && rm /tmp/ray-pin.txt

ENV VIRTUAL_ENV=/app/.venv \
    PATH=/app/.venv/bin:${PATH} \
    NUMBA_CACHE_DIR=/app/.numba-cache \
    NUMBA_CPU_NAME=generic
# The draft's processing on the host runs numba-compiled loops (ssd/processing/host_draft_adjustments.py):
# compiled here, once, for a generic x86-64 CPU (so the cache fits every node, not only the
# builder's), into a cache the runtime user reads, instead of in every pod's first drafting process.
RUN python -c "from ssd.processing.host_draft_adjustments import compile_loops; compile_loops()" \
    && chmod -R a+rwX /app/.numba-cache
# KubeRay starts Ray with `/bin/bash -lc`: a login shell, whose /etc/profile resets PATH on
# Debian. This puts the venv back in front for those shells too.
RUN echo 'export PATH="/app/.venv/bin:$PATH"' > /etc/profile.d/ssd-serve-venv.sh

# Fail the build, not the pod, when what the manifests name is missing: the app builder, both
# gRPC servicer functions, and the ray CLI that KubeRay runs.
RUN ray --version \
    && python -c "import serve_app.app, serve_app._proto.ssd_serve_pb2_grpc, grpc_health.v1.health_pb2_grpc" \
    && bash -lc 'command -v ray | grep -q "^/app/.venv/bin/ray$"'

USER 1000
ENV HOME=/home/ray
EXPOSE 8000 9000 8080 8265 6379
# Standalone (no KubeRay): a local Ray cluster serving the demo pair. KubeRay replaces this
# command with its own `ray start`.
CMD ["ssd", "serve", "--host", "0.0.0.0"]
