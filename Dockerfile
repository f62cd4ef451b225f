# One image for every Blitzmesh service; the compose file picks the module per container.
# Build with docker/build.sh (it stages a local torch CPU wheel, if any, in docker/wheels/).
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

# Set TORCH_INDEX_URL to a CPU-only wheel index to avoid pulling CUDA wheels on CPU hosts.
ARG TORCH_INDEX_URL=""
# pip verifies TLS against the system bundle (a locally made base carries its host's CA).
ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /app
COPY docker/wheels/ /wheels/
COPY pyproject.toml README.md ./
COPY blitzmesh ./blitzmesh
COPY services ./services
COPY bench ./bench
RUN pip install --no-cache-dir --find-links /wheels ${TORCH_INDEX_URL:+--index-url $TORCH_INDEX_URL} torch==2.13.0 \
 && pip install --no-cache-dir --find-links /wheels '.[services]'
