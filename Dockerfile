# ctxproxy: slim image, non-root, read-only-root friendly, config validated at build time.
#
#   docker build -t ctxproxy .
#   docker run --read-only -p 8080:8080 -e OPENAI_API_KEY=sk-... \
#     -v ctxproxy-cache:/var/cache/ctxproxy --stop-timeout 35 ctxproxy
#
# BASE_IMAGE: any image with python3 (>= 3.10) and its venv module. The default is the public
# slim Python image; where no registry can be reached, deploy/podman/build-base-image.sh builds
# one from Debian packages (python3, python3-venv, python3-pip) and prints its name.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

# Nothing is written outside the cache volume at run time: no bytecode (compiled at build time
# instead), the summary cache in /var/cache/ctxproxy (mount a volume there), and tiktoken's
# encodings come from the files litellm bundles. Only `--workers N` needs a writable /tmp
# (its metrics directory): add `--tmpfs /tmp` for that.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    LITELLM_LOCAL_MODEL_COST_MAP=True \
    LITELLM_TELEMETRY=False \
    VIRTUAL_ENV=/opt/ctxproxy \
    PATH=/opt/ctxproxy/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    CTXPROXY_HOST=0.0.0.0 \
    CTXPROXY_PORT=8080 \
    CTXPROXY_CACHE_DIR=/var/cache/ctxproxy

WORKDIR /app
# Dependencies first, in their own layer: it changes only with pyproject.toml, so a rebuild after a
# code change takes seconds. A virtual environment, so the same steps work on the slim image and on
# a distribution's Python (which refuses system-wide pip installs, PEP 668).
COPY pyproject.toml LICENSE ./
RUN python3 -m venv "$VIRTUAL_ENV" \
 && mkdir proxy plugins && touch proxy/__init__.py plugins/__init__.py README.md \
 && pip install --quiet . \
 && pip uninstall --quiet --yes ctxproxy \
 && rm -rf proxy plugins build ./*.egg-info README.md
COPY README.md ./
COPY proxy ./proxy
COPY plugins ./plugins
COPY config ./config
RUN pip install --quiet --no-deps . \
 && python -m compileall -q "$VIRTUAL_ENV" >/dev/null \
 && rm -rf build ./*.egg-info \
 && useradd --system --uid 10001 --no-create-home --home-dir /app --shell /usr/sbin/nologin ctxproxy \
 && mkdir -p "$CTXPROXY_CACHE_DIR" && chown ctxproxy "$CTXPROXY_CACHE_DIR" && chmod 0700 "$CTXPROXY_CACHE_DIR" \
 && ctxproxy validate config/ctxproxy.yaml

USER 10001
VOLUME ["/var/cache/ctxproxy"]
EXPOSE 8080
# SIGTERM drains: in-flight requests get server.drain_timeout (30 s) to finish, then exit 0.
# Give the runtime longer than that before it kills (docker/podman stop -t 35, or --stop-timeout).
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=15s --timeout=3s --start-period=10s --retries=3 \
  CMD ["python", "-c", "import os, sys, urllib.request; url = 'http://127.0.0.1:%s/healthz' % os.environ.get('CTXPROXY_PORT', '8080'); sys.exit(0 if urllib.request.urlopen(url, timeout=2).status == 200 else 1)"]
# host and port come from CTXPROXY_HOST / CTXPROXY_PORT (read by the config), so the healthcheck
# always probes the port actually served.
CMD ["ctxproxy", "serve", "--config", "config/ctxproxy.yaml"]
