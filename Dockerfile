# The shoal image: coordinators, node agents, workers and the CLI all run from it.
#   docker build -t shoal:local .     (compose.yaml builds it for you)
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# torch first, in its own layer: it is by far the largest and changes least often. From the
# index TORCH_INDEX names, and only torch (with its own dependencies) from there: by default
# PyTorch's CPU index, so the image holds the CPU build (nothing in compose gives a container
# a GPU; PyPI's torch for Linux x86_64 is the CUDA build, several GB of nvidia-* wheels).
# For GPU nodes select a CUDA build:
#   docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu130 -t shoal:cuda .
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN pip install --index-url "${TORCH_INDEX}" torch==2.13.0

# Then the project. .dockerignore keeps .env, .venv, .git and caches out of the context.
COPY . .
# The code stays owned by root: the runtime user cannot modify what it runs.
RUN pip install . \
    && useradd --create-home --uid 10001 --user-group shoal

USER shoal
ENV SHOAL_HOME=/home/shoal/.shoal

# compose.yaml sets the command per service (shoal coordinator / agent / submit ...).
CMD ["shoal", "--help"]
