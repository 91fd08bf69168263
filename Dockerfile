# MiniMax H3 browser app on a CUDA runtime image.
#   docker build -t h3-app .
#   docker run --gpus all --ipc=host -p 127.0.0.1:7860:7860 -v /path/to/MiniMax-H3:/models:ro -v h3-data:/data h3-app
# No weights are baked in: the checkpoint is mounted at /models. Run with `-e H3_CHECKPOINT=` (empty) to get the
# tiny random-weight demo instead. The container binds 0.0.0.0 so the published port reaches it; publish it on
# 127.0.0.1 (as above) unless other machines should see the app, and add `-e H3_AUTH=user:password` if they do.
ARG CUDA_IMAGE=nvidia/cuda:13.0.1-runtime-ubuntu24.04
FROM ${CUDA_IMAGE}

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*

# The torch wheels bring their own CUDA libraries; the base image supplies the driver-facing runtime layout.
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# The locked sets (exact versions, hashes; see README). requirements-gpu.txt is requirements.txt plus
# FlashAttention-4, the fastest exact attention on Hopper and newer (h3engine.models.attention); without it (or if it
# fails to import) attention runs on torch's cuDNN kernel. `--build-arg WITH_FA4=0` leaves it out.
# `--build-arg WITH_RAY=1` adds Ray Serve (requirements-ray.txt): the image then also runs a Ray node
# (docker/ray-compose.yaml) and `python app.py --ray ADDRESS`.
COPY requirements.txt requirements-gpu.txt requirements-ray.txt /app/
ARG WITH_FA4=1
ARG WITH_RAY=0
RUN if [ "$WITH_FA4" = 1 ]; then lock=requirements-gpu.txt; else lock=requirements.txt; fi \
    && if [ "$WITH_RAY" = 1 ]; then extra="-r /app/requirements-ray.txt"; else extra=""; fi \
    && pip install --require-hashes --no-deps -r /app/$lock $extra

COPY pyproject.toml app.py /app/
COPY h3engine /app/h3engine
COPY kernels /app/kernels
COPY ui /app/ui
COPY assets /app/assets

# Ubuntu images ship a user "ubuntu" with uid 1000; the app runs as its own uid-1000 user instead.
RUN (userdel --remove ubuntu 2>/dev/null || true) \
    && useradd --uid 1000 --user-group --create-home --shell /usr/sbin/nologin h3 \
    && mkdir -p /data /models \
    && chown 1000:1000 /data
USER 1000
WORKDIR /app

ENV H3_CHECKPOINT=/models \
    H3_OUTPUTS=/data/outputs \
    H3_CACHE_DIR=/data/cache \
    GRADIO_TEMP_DIR=/data/gradio \
    H3_HOST=0.0.0.0 \
    H3_PORT=7860 \
    GRADIO_ANALYTICS_ENABLED=False \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1
VOLUME ["/data"]
EXPOSE 7860

# Loading the released checkpoint takes minutes: give it a long start period before failures count.
HEALTHCHECK --interval=30s --timeout=5s --start-period=15m --retries=3 \
    CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:7860/healthz', timeout=4)" || exit 1

CMD ["python", "app.py"]
