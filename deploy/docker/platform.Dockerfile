# syntax=docker/dockerfile:1
# The platform image: every platform service from one image, chosen by the command.
#
#   docker build -f deploy/docker/platform.Dockerfile -t gpumarket/platform:0.1.0 .
#   docker run gpumarket/platform:0.1.0 master        (the default)
#   docker run gpumarket/platform:0.1.0 migrate | access --region eu-west --relay-id relay-eu-west-1
#                                       | dns --zone relays.example.com | worker [--beat] | admin ...
#
# Build context: the repository root (see /.dockerignore). Settings come from GPUMARKET_*
# environment variables (`docker run IMAGE <service> --help` lists them); nothing secret is
# baked in. The base image is pinned by its exact version tag; pin its digest too where your
# registry policy asks for it (`docker buildx imagetools inspect python:3.11.13-slim-bookworm`).

# ---- builder: the gpumarket wheel and a wheel of every dependency -------------------------
FROM python:3.11.13-slim-bookworm AS builder

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1

WORKDIR /src
COPY pyproject.toml README.md ./
COPY gpumarket ./gpumarket
COPY shared ./shared
COPY agent ./agent
COPY access ./access
COPY master ./master
COPY console ./console
COPY billing ./billing
# Every dependency ships manylinux wheels for CPython 3.11 (amd64 and arm64): no compiler needed.
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

# ---- runtime -----------------------------------------------------------------------------
FROM python:3.11.13-slim-bookworm

LABEL org.opencontainers.image.title="gpumarket-platform" \
      org.opencontainers.image.description="gpumarket platform services: master, migrate, access relay, geo DNS, billing workers" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.vendor="gpumarket" \
      org.opencontainers.image.documentation="docs/operations.md#production-deployment" \
      org.opencontainers.image.base.name="docker.io/library/python:3.11.13-slim-bookworm"

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Only the built wheels, never pip's network: the runtime installs exactly what the builder built.
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-index --find-links=/wheels /wheels/gpumarket-*.whl

# The agent wheel, served by the masters at GET /downloads/agent for the provider installer.
# GPUMARKET_AGENT_PACKAGE names this directory rather than the file, whose name carries the
# version (pip needs the real name, so it is not copied to a fixed one): given a directory, the
# master serves the newest gpumarket-*.whl found there.
COPY --from=builder /wheels/gpumarket-*.whl /opt/gpumarket/dist/

# One unprivileged user for every service; the data folders exist and belong to it, so named
# volumes mounted over them start out writable by it.
RUN groupadd --system --gid 10001 gpumarket \
    && useradd --system --uid 10001 --gid 10001 --home-dir /var/lib/gpumarket --no-create-home \
       --shell /usr/sbin/nologin gpumarket \
    && mkdir -p /var/lib/gpumarket/master/ca /var/lib/gpumarket/payouts /etc/gpumarket/relay \
    && chown -R 10001:10001 /var/lib/gpumarket /etc/gpumarket \
    && chmod 0700 /var/lib/gpumarket/master/ca

# Containers listen on every interface; each service reads only its own settings
# (master: HTTP_HOST/HTTP_PORT; access and dns: HOST/PORT).
ENV GPUMARKET_DATA_DIR=/var/lib/gpumarket/master \
    GPUMARKET_HTTP_HOST=0.0.0.0 \
    GPUMARKET_HTTP_PORT=8080 \
    GPUMARKET_HOST=0.0.0.0 \
    GPUMARKET_AGENT_PACKAGE=/opt/gpumarket/dist

WORKDIR /var/lib/gpumarket
USER 10001:10001

# master 8080/tcp; access relay 8443/tcp; geo DNS 5353/udp+tcp (publish it as 53).
EXPOSE 8080/tcp 8443/tcp 5353/udp 5353/tcp

# Liveness of the default command, the master (slim has no curl). Other services replace it:
# deploy/compose.yaml gives each its own check, Kubernetes ignores it and uses the pod probes.
HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/api/v1/health/live' % os.environ.get('GPUMARKET_HTTP_PORT', '8080'), timeout=4)"]

ENTRYPOINT ["gpumarket"]
CMD ["master"]
