# syntax=docker/dockerfile:1.7
# pacerd container image.
#   builder: builds the pacerd wheel and the wheels of its runtime dependencies
#   runtime: python slim, installs only those wheels (no dev or demo extras), runs
#            as an unprivileged user with an exec-form entrypoint (pacerd is PID 1
#            and receives SIGTERM/SIGHUP/SIGUSR1/SIGUSR2 itself; `docker run --init`
#            or compose `init: true` adds zombie reaping).
# Build:  docker build -t pacerd .
# Run:    docker run --init -e PACERD_DATABASE__DSN=... -e PACERD_BROKER__URL=... pacerd

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS builder
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY pacerd/ ./pacerd/
COPY pacerd_demo/ ./pacerd_demo/
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM ${PYTHON_IMAGE} AS runtime
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PACERD_CONFIG=/etc/pacerd/pacerd.toml \
    PACERD_TELEMETRY__HTTP_ADDRESS=0.0.0.0:9464
RUN groupadd --system --gid 10001 pacerd \
    && useradd --system --uid 10001 --gid pacerd --no-create-home \
        --home-dir /nonexistent --shell /usr/sbin/nologin pacerd
# The wheels are bind-mounted from the builder, so they never land in a layer.
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-index --find-links=/wheels pacerd
# Defaults only: the DSN and broker URL (with passwords) come from the environment.
COPY --chmod=0644 config.example.toml /etc/pacerd/pacerd.toml
USER 10001:10001
# /livez, /readyz, /healthz and Prometheus /metrics ([telemetry] http_address, set above).
EXPOSE 9464
STOPSIGNAL SIGTERM
# Liveness only (/livez): the tick loop progressed recently. A lost broker or ledger
# makes pacerd unready (/readyz), not unhealthy: it reconnects by itself, and a
# restart would not help. There is no curl in slim images; urlopen raises (exit 1)
# on a 503 or no answer.
HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9464/livez', timeout=4)"]
ENTRYPOINT ["pacerd"]
CMD ["run", "-c", "/etc/pacerd/pacerd.toml"]
