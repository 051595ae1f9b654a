# omnirl on NVIDIA GPUs (docs/deploy.md, "Docker (CUDA)"). The entry point is torchrun: everything after the
# image name is torchrun's arguments.
#   docker build -t omnirl .
#   docker run --gpus all --ipc=host -v /path/to/data:/data omnirl \
#       --nproc_per_node 8 scripts/train.py --recipe sd35_flowgrpo_ocr --run.output_dir /data/outputs/ocr
# With no arguments it runs 5 steps of the tiny SD3 recipe on one GPU (a smoke test, no download).
#
# torch is a CUDA build from PyPI that carries its own CUDA libraries, so the host needs only the NVIDIA
# driver and container toolkit; the base image adds the container hooks. Pin a CUDA build of torch with
# --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 (omnirl takes torch 2.11 to 2.14).
FROM nvidia/cuda:12.8.1-base-ubuntu24.04

ARG TORCH_VERSION=2.11.0
ARG TORCH_INDEX_URL=https://pypi.org/simple
# The user the container runs as; 1000 is a workstation's usual first user, so what it writes to a mounted
# volume is theirs (elsewhere: docker run --user "$(id -u):$(id -g)").
ARG OMNIRL_UID=1000

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# libgl1 and libglib are what opencv (pulled in by rapidocr, the OCR reward) loads. Distribution packages
# stay unpinned: the base image's tag fixes the release, and its security updates should come in.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv libgl1 libglib2.0-0t64 \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv \
    && pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"

# Editable, so recipes resolve from /opt/omnirl/yaml (omnirl.config finds yaml/ beside the package).
WORKDIR /opt/omnirl
COPY . .
RUN pip install -e ".[ocr,math]" \
    && python scripts/make_tiny_models.py --out tiny_models --only sd3 \
    && if id -u ubuntu >/dev/null 2>&1; then userdel --remove ubuntu; fi \
    && useradd --create-home --uid "${OMNIRL_UID}" omnirl \
    && chown -R omnirl /opt/omnirl

USER ${OMNIRL_UID}
ENTRYPOINT ["torchrun"]
CMD ["--nproc_per_node", "1", "scripts/train.py", "--recipe", "sd3_tiny_flowgrpo", "--run.steps", "5"]
