# syntax=docker/dockerfile:1
# attnserve server image (deploy/README.md).
#   build stage:   the CUDA devel image; CMake + Ninja with the distribution's gRPC, protobuf,
#                  abseil and prometheus-cpp packages (nothing fetched at configure time).
#   runtime stage: plain Ubuntu of the same release, the server binary and the shared libraries it
#                  links (the CUDA runtime is linked statically; the driver's libcuda comes from
#                  the node through the NVIDIA container toolkit), run as an unprivileged user.
#
#   docker build -t attnserve:0.1.0 .                                   # sm_90a + sm_100
#   docker build --build-arg CUDA_ARCHS=90a-real -t attnserve:0.1.0-sm90a .   # H100/H200 only
ARG CUDA_VERSION=13.0.0
ARG UBUNTU_VERSION=24.04

FROM nvidia/cuda:${CUDA_VERSION}-devel-ubuntu${UBUNTU_VERSION} AS build
# CMAKE_CUDA_ARCHITECTURES: 90a = H100/H200 (Hopper, arch-specific features), 100 = B200 (the
# portable kernels: nothing there needs 100a's). The default is among the builds CI compiles
# (cmake/AttnCuda.cmake).
ARG CUDA_ARCHS="90a-real;100-real"
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# DL3008 (pin apt package versions) is ignored on purpose: the packages are the pinned base
# image release's own, their versions move with its security updates, and exact pins would break
# the build at the first update.
# hadolint ignore=DL3008
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
       cmake ninja-build g++ pkg-config \
       libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc \
       libabsl-dev prometheus-cpp-dev libgtest-dev libgmock-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY CMakeLists.txt CMakePresets.json ./
COPY cmake/ cmake/
COPY proto/ proto/
COPY kernels/ kernels/
COPY server/ server/
COPY bench/ bench/
COPY tests/ tests/
# Fails when the CUDA backend is not configured (the build would quietly produce a CPU-only
# server) or, where cuobjdump is at hand, when a requested architecture has no cubin.
RUN cmake -S . -B /build -G Ninja -DCMAKE_BUILD_TYPE=Release -DATTN_ENABLE_CUDA=ON \
      -DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCHS}" \
      | tee /tmp/configure.log \
    && grep -q "attnserve: CUDA backend ON" /tmp/configure.log \
    && cmake --build /build --target attnserve \
    && if command -v cuobjdump > /dev/null; then \
         cuobjdump --list-elf /build/bin/attnserve > /tmp/cubins.txt; \
         for arch in ${CUDA_ARCHS//;/ }; do \
           grep -q "sm_${arch%-real}\." /tmp/cubins.txt || { echo "no sm_${arch%-real} cubin"; exit 1; }; \
         done; \
       fi \
    && mkdir -p /out/lib \
    && cp /build/bin/attnserve /out/ \
    && ldd /build/bin/attnserve | awk '/=> \//{print $3}' \
       | grep -v -E '/(libc|libm|libdl|librt|libpthread|libstdc\+\+|libgcc_s|ld-linux[^/]*)\.so' \
       | grep -v -E 'libcuda\.so|libnvidia' \
       | xargs -r -I{} cp -L {} /out/lib/

FROM ubuntu:${UBUNTU_VERSION} AS runtime
# (an ARG declared before the first FROM is visible inside a stage only when declared again)
ARG UBUNTU_VERSION
ARG VERSION=0.1.0
ARG REVISION=unknown
LABEL org.opencontainers.image.title="attnserve" \
      org.opencontainers.image.description="Remote paged-attention server: a GPU KV page pool behind gRPC" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.base.name="docker.io/library/ubuntu:${UBUNTU_VERSION}"
COPY --from=build /out/attnserve /usr/local/bin/attnserve
COPY --from=build /out/lib/ /usr/local/lib/attnserve/
RUN echo /usr/local/lib/attnserve > /etc/ld.so.conf.d/attnserve.conf \
    && ldconfig \
    && groupadd --system --gid 10001 attnserve \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin attnserve \
    && /usr/local/bin/attnserve --version > /dev/null
# The NVIDIA container toolkit mounts the driver libraries this asks for. NVIDIA_VISIBLE_DEVICES is
# deliberately not set: the device plugin (Kubernetes) or `docker run --gpus` chooses the GPUs.
ENV NVIDIA_DRIVER_CAPABILITIES=compute,utility
USER 10001:10001
# 50051: gRPC (AttentionService, grpc.health.v1, reflection); 9464: Prometheus /metrics.
EXPOSE 50051 9464
ENTRYPOINT ["/usr/local/bin/attnserve"]
CMD ["--listen_address=0.0.0.0:50051", "--metrics_port=9464", "--backend=cuda"]
