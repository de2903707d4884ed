# syntax=docker/dockerfile:1
# One image for every role: the command picks it (`api`, `scheduler`, `worker --app …`,
# `migrate`). The example apps are included (examples.hello:app, examples.shop:app); see
# docs/deploy.md for adding your own jobs.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# --- build: a virtualenv with the locked dependencies (hashes checked) and Jobplane ---------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
RUN python -m venv /opt/jobplane
COPY requirements/runtime.lock requirements/runtime.lock
RUN /opt/jobplane/bin/pip install --require-hashes --only-binary=:all: -r requirements/runtime.lock
COPY pyproject.toml README.md ./
COPY libs libs
COPY services services
# The build backend comes from the lock above: no network, no unpinned build dependency.
RUN /opt/jobplane/bin/pip install --no-deps --no-build-isolation . \
 && /opt/jobplane/bin/python -m compileall -q /opt/jobplane/lib

# --- runtime: the virtualenv, the examples, a non-root user --------------------------------
FROM ${PYTHON_IMAGE} AS runtime
RUN groupadd --system --gid 10001 jobplane \
 && useradd --system --uid 10001 --gid 10001 --home-dir /app --no-create-home \
      --shell /usr/sbin/nologin jobplane
COPY --from=build /opt/jobplane /opt/jobplane
WORKDIR /app
COPY examples /app/examples
ENV PATH=/opt/jobplane/bin:$PATH \
    PYTHONPATH=/app \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    JOBPLANE_LOG_FORMAT=json \
    HEALTHCHECK_URL=http://127.0.0.1:8000/healthz \
    SHOP_OUTBOX=/tmp/shop-outbox.jsonl
USER 10001:10001
# 8000: the api; 9100: the probe server of a worker or scheduler (--health-port 9100).
EXPOSE 8000 9100
# Probes HEALTHCHECK_URL (the role's /healthz); a role without a probe server (migrate)
# sets it empty and is healthy while it runs.
HEALTHCHECK --interval=15s --timeout=5s --start-period=90s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request as r; u = os.environ.get('HEALTHCHECK_URL'); u and r.urlopen(u, timeout=4)"]
ENTRYPOINT ["jobplane"]
CMD ["--help"]
