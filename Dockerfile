# The image gke and xpk jobs run: this checkout at /maxlm, the working directory, so that
# `python train.py configs/x.yml` means the same in a pod as here. Build one per accelerator:
#   docker build --build-arg ACCEL=tpu -t REGION-docker.pkg.dev/PROJECT/REPO/maxlm:tpu .
#   docker build --build-arg ACCEL=cuda13 -t REGION-docker.pkg.dev/PROJECT/REPO/maxlm:gpu .
FROM python:3.12-slim
ARG ACCEL=tpu
WORKDIR /maxlm
COPY requirements.txt .
RUN pip install --no-cache-dir -r requirements.txt "jax[${ACCEL}]==0.11.2"
COPY . .
