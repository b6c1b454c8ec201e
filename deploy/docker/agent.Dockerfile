# syntax=docker/dockerfile:1
# The provider agent in a container, for hosts that run the NVIDIA container toolkit. (The
# usual way is deploy/install-agent.sh: a virtual environment and a systemd unit on the host.)
#
#   docker build -f deploy/docker/agent.Dockerfile -t gpumarket/agent:0.1.0 .
#   docker volume create gpumarket-agent
#   docker run --rm -v gpumarket-agent:/var/lib/gpumarket/agent gpumarket/agent:0.1.0 \
#       enroll --master https://gpumarket.example.com --token TOKEN
#   docker run -d --restart unless-stopped --init --gpus all --name gpumarket-agent \
#       -v gpumarket-agent:/var/lib/gpumarket/agent gpumarket/agent:0.1.0      (= agent run)
#
# --init reaps the workloads' orphaned processes (the agent would otherwise be PID 1). Stopping
# this container stops its workloads with it; the agent's own restarts (on the host) do not.
# The base image is pinned by its exact version tag; see platform.Dockerfile about digests.

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
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

# ---- runtime -----------------------------------------------------------------------------
FROM python:3.11.13-slim-bookworm

LABEL org.opencontainers.image.title="gpumarket-agent" \
      org.opencontainers.image.description="gpumarket provider agent: reports the host's GPUs over NVML and runs rentals" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.vendor="gpumarket" \
      org.opencontainers.image.documentation="docs/operations.md#production-deployment" \
      org.opencontainers.image.base.name="docker.io/library/python:3.11.13-slim-bookworm"

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-index --find-links=/wheels /wheels/gpumarket-*.whl

RUN groupadd --system --gid 10001 gpumarket \
    && useradd --system --uid 10001 --gid 10001 --home-dir /var/lib/gpumarket --no-create-home \
       --shell /usr/sbin/nologin gpumarket \
    && mkdir -p /var/lib/gpumarket/agent \
    && chown -R 10001:10001 /var/lib/gpumarket \
    && chmod 0700 /var/lib/gpumarket/agent

# The NVIDIA container toolkit mounts the driver's libnvidia-ml (NVML: "utility") into the
# container and exposes the GPUs named here; "compute" adds libcuda for the rentals' workloads,
# which run as the agent's child processes in this container.
ENV NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    GPUMARKET_DATA_DIR=/var/lib/gpumarket/agent

# Key, certificate, identity, the spool of unacknowledged messages and the workloads' folders:
# losing this volume means enrolling again and losing unsent telemetry.
VOLUME ["/var/lib/gpumarket/agent"]

WORKDIR /var/lib/gpumarket
USER 10001:10001

# No HEALTHCHECK: the agent serves no port. It exits (and the restart policy starts it again)
# when it cannot go on; a lost relay is retried with back-off by the agent itself.
ENTRYPOINT ["gpumarket", "agent"]
CMD ["run"]
