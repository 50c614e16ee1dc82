# ctxproxy: slim image, non-root, config validated at build time.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    LITELLM_LOCAL_MODEL_COST_MAP=True \
    LITELLM_TELEMETRY=False \
    CTXPROXY_HOST=0.0.0.0 \
    CTXPROXY_CACHE_DIR=/var/cache/ctxproxy

WORKDIR /app
COPY pyproject.toml README.md LICENSE ./
COPY proxy ./proxy
COPY plugins ./plugins
COPY config ./config
RUN pip install . \
 && useradd --system --uid 10001 --home-dir /app ctxproxy \
 && mkdir -p /var/cache/ctxproxy && chown ctxproxy /var/cache/ctxproxy && chmod 0700 /var/cache/ctxproxy \
 && ctxproxy validate config/ctxproxy.yaml

USER ctxproxy
EXPOSE 8080
HEALTHCHECK --interval=15s --timeout=3s --start-period=10s --retries=3 \
  CMD python -c "import urllib.request,sys; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=2).status == 200 else 1)"
CMD ["ctxproxy", "serve", "--config", "config/ctxproxy.yaml", "--host", "0.0.0.0", "--port", "8080"]
