# The CPU image, cmx-ray:0.1.0: Ray's own image with this package and vLLM's CPU build. The
# RayServices (deploy/kuberay/) run it on their head, their CPU hosts and their pools;
# Dockerfile.gpu builds the GPU hosts' image, cmx-ray:0.1.0-gpu.
#
#   docker build -t cmx-ray:0.1.0 .
#     the head, CPU hosts and pools: Ray's x86_64 image, torch's CPU wheel and vLLM's CPU build
#     (the engines extra, as `make install` has it)
#   docker buildx build --platform linux/arm64 -t cmx-ray:0.1.0-arm64 \
#       --build-arg RAY_VARIANT=py311-aarch64 --build-arg EXTRAS= .
#     the BlueField DPUs: Ray publishes its arm64 images under their own tags (-aarch64), and a
#     DPU runs only its host's offload agent, no replica, so no engine
#
# torch goes first, pinned as in the Makefile, from TORCH_INDEX: the CPU wheels (the service's
# tiers run on host memory, docs/GPU.md), on which vLLM's CPU build is pinned.

ARG RAY_VERSION=2.60.0
ARG RAY_VARIANT=py311
FROM rayproject/ray:${RAY_VERSION}-${RAY_VARIANT}

ARG RAY_VERSION
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG EXTRAS=engines

RUN pip install --no-cache-dir --index-url "${TORCH_INDEX}" torch==2.13.0

# The trees pyproject.toml's packages install from (package-dir), owned by the image's user
# (uid 1000, gid 100), who builds them in place (a WORKDIR it made could be root's).
RUN mkdir -p /home/ray/cmx-ray
WORKDIR /home/ray/cmx-ray
COPY --chown=1000:100 pyproject.toml README.md ./
COPY --chown=1000:100 cmx cmx
COPY --chown=1000:100 actors actors
COPY --chown=1000:100 policies policies
COPY --chown=1000:100 api api
COPY --chown=1000:100 deploy deploy

# Ray stays the base image's, the one rayVersion in the RayService names. vLLM pulls in a
# torchvision, a torchaudio and a torchcodec built for other torches: they break transformers'
# imports, and nothing here uses them.
RUN pip install --no-cache-dir ".${EXTRAS:+[${EXTRAS}]}" "ray[serve]==${RAY_VERSION}" \
    && pip uninstall -y torchvision torchaudio torchcodec \
    && python -c "import cmx.actors.service, cmx.deploy.app"
