# kv-slot-tracker service image.
#
#   docker build -t kv-slot-tracker .
#   docker run --rm -p 8091:8091 kv-slot-tracker
#
# Settings come from SLOT_TRACKER_* environment variables (see docs/configuration.md), e.g.
# -e SLOT_TRACKER_REDIS_URL=redis://redis:6379/0 -e SLOT_TRACKER_API_KEY=...
# Check them without starting: docker run --rm -e ... IMAGE kv-slot-tracker --check-config
# Lint: make docker-lint (hadolint). tests/test_packaging.py reproduces these steps without an
# engine (read-only virtualenv, unprivileged user) and builds the image where one runs.

# --- builder: the package and its runtime dependencies in a virtualenv ----------------------
FROM python:3.11-slim-bookworm AS builder

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1

# --upgrade-deps: a current pip resolves and installs the dependencies in half the time of the
# one the base image's venv would bundle
RUN python -m venv --upgrade-deps /opt/venv
ENV PATH=/opt/venv/bin:$PATH

WORKDIR /src
# .dockerignore lets only these into the build context.
COPY pyproject.toml README.md ./
COPY kv_slot_tracker ./kv_slot_tracker
# A regular (not editable) install without the dev extras, with the Kubernetes client of
# worker discovery (off unless configured; deploy/kubernetes/discovery); bytecode is compiled
# here, as the final image's virtualenv is read-only to the service user. The installed
# console script (which, unlike `python -m`, does not import from /src) then runs the
# start-up's own configuration check: an install missing a file fails the build, not the pod.
RUN pip install --no-cache-dir "./[kubernetes]" \
    && python -m compileall -q /opt/venv/lib \
    && kv-slot-tracker --version \
    && kv-slot-tracker --check-config > /dev/null

# --- final: the virtualenv on a clean base, run as an unprivileged user ---------------------
FROM python:3.11-slim-bookworm

ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1

RUN groupadd --system --gid 10001 app \
    && useradd --system --uid 10001 --gid app --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin app

COPY --from=builder /opt/venv /opt/venv

WORKDIR /srv
USER 10001:10001

EXPOSE 8091

# Liveness through GET /health (open even with an API key); honours SLOT_TRACKER_PORT.
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('SLOT_TRACKER_PORT', '8091'), timeout=2)"]

CMD ["python", "-m", "kv_slot_tracker", "--host", "0.0.0.0"]
