# syntax=docker/dockerfile:1
#
# Specgate gateway + engine image.
#
#   docker build -t specgate:0.1.0-cpu .
#   docker build --build-arg TORCH_VARIANT=cu130 -t specgate:0.1.0-cu130 .
#
# TORCH_VARIANT names a PyTorch wheel index (https://download.pytorch.org/whl/<variant>):
# "cpu", or a CUDA tag that index publishes for TORCH_VERSION. CUDA wheels carry their own
# CUDA runtime libraries, so the same slim Python base serves both; GPU nodes need only the
# NVIDIA driver and device plugin. PIP_INDEX_URL / PIP_EXTRA_INDEX_URL and BASE_IMAGE may
# point at internal mirrors for builds without internet access.
#
# Models are never baked in: mount them at /models (see deploy/helm/specgate).

ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS builder

ARG TORCH_VERSION=2.13.0
ARG TORCH_VARIANT=cpu
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/${TORCH_VARIANT}
# Debian bookworm's; a base image of another release names its own.
ARG GCC_VERSION=4:12.2.0-3
ARG LIBC_DEV_VERSION=2.36-9+deb12u14

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# A C compiler for the engine's CPU kernels (engine/kernels: decode attention, small
# products), built below.
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
       "gcc=${GCC_VERSION}" "libc6-dev=${LIBC_DEV_VERSION}" \
    && rm -rf /var/lib/apt/lists/*

# torch first, from the index that matches the variant, so `pip install .` keeps it.
RUN python -m venv /opt/venv \
    && pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

WORKDIR /src
COPY pyproject.toml README.md ./
COPY engine ./engine
COPY gateway ./gateway
COPY migrations ./migrations
COPY bench ./bench
# The runtime stage has no compiler: the kernels are built here, portable (x86-64-v3: AVX2 and
# FMA), into the installed package (-P: the installed copy, not /src's, is the one built).
RUN pip install --no-cache-dir . \
    && pip check \
    && python -P -m engine.kernels.build --portable

FROM ${BASE_IMAGE} AS runtime

ARG SPECGATE_UID=10001

LABEL org.opencontainers.image.title="specgate" \
      org.opencontainers.image.description="On-premises, compliance-aware LLM gateway with a speculative-decoding engine" \
      org.opencontainers.image.licenses="Apache-2.0"

RUN groupadd --system --gid "${SPECGATE_UID}" specgate \
    && useradd --system --uid "${SPECGATE_UID}" --gid specgate --no-create-home \
       --home-dir /var/lib/specgate --shell /usr/sbin/nologin specgate \
    && mkdir -p /models /var/lib/specgate \
    && chown specgate:specgate /var/lib/specgate

COPY --from=builder /opt/venv /opt/venv

# Nothing is fetched at run time: the Hugging Face libraries stay offline and caches live in
# the writable data directory (the root filesystem is read-only under the Helm chart).
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/var/lib/specgate \
    HF_HOME=/var/lib/specgate/huggingface \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    SPECGATE_DATA_DIR=/var/lib/specgate

VOLUME ["/models", "/var/lib/specgate"]
WORKDIR /var/lib/specgate
USER ${SPECGATE_UID}:${SPECGATE_UID}
EXPOSE 8000

# Model loading can take minutes; the start period covers it. urllib raises on a non-2xx status.
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=4)"]

ENTRYPOINT ["specgate"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
