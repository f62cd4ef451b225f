# One image for every Blitzmesh service; the compose file picks the module per container.
# Build with docker/build.sh (it stages a local torch CPU wheel, if any, in docker/wheels/).
# The dependencies are installed before the source is copied, so a change to the code rebuilds
# only the last two layers: torch and the rest come from Docker's cache on a machine that built
# the image once.
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
RUN pip install --no-cache-dir --find-links /wheels ${TORCH_INDEX_URL:+--index-url $TORCH_INDEX_URL} torch==2.13.0
COPY pyproject.toml ./
RUN python3 -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; print("\n".join(p["dependencies"] + p["optional-dependencies"]["services"]))' > /tmp/requirements.txt \
 && pip install --no-cache-dir --find-links /wheels -r /tmp/requirements.txt
COPY README.md ./
COPY blitzmesh ./blitzmesh
COPY services ./services
RUN pip install --no-cache-dir --no-deps .
