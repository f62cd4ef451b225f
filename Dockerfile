# One image for every Blitzmesh service; the compose file picks the module per container.
FROM python:3.11-slim

# Set TORCH_INDEX_URL to a CPU-only wheel index to avoid pulling CUDA wheels on CPU hosts.
ARG TORCH_INDEX_URL=""
WORKDIR /app
COPY pyproject.toml README.md ./
COPY blitzmesh ./blitzmesh
COPY services ./services
COPY bench ./bench
RUN pip install --no-cache-dir ${TORCH_INDEX_URL:+--index-url $TORCH_INDEX_URL} torch==2.13.0 \
 && pip install --no-cache-dir '.[services]'
ENV PYTHONUNBUFFERED=1
