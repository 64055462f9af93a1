# attnserve server image. Build stage: CUDA toolkit + Ubuntu's gRPC/absl/prometheus-cpp packages;
# runtime stage: the server and the shared libraries it links, as a non-root user.
#   docker build --build-arg CUDA_ARCHS="90a-real;100-real" -t attnserve .
ARG CUDA_VERSION=13.0.0
FROM nvidia/cuda:${CUDA_VERSION}-devel-ubuntu24.04 AS build
ARG CUDA_ARCHS="80-real;90a-real;100-real"
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      cmake ninja-build g++ pkg-config libgrpc++-dev libprotobuf-dev protobuf-compiler \
      protobuf-compiler-grpc libabsl-dev prometheus-cpp-dev libgtest-dev libgmock-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN cmake -S . -B /build -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCHS}" \
    && cmake --build /build --target attnserve \
    && mkdir -p /out/lib \
    && cp /build/bin/attnserve /out/ \
    && ldd /build/bin/attnserve | awk '/=> \//{print $3}' \
       | grep -v -E '/(libc|libm|libdl|librt|libpthread|ld-linux[^/]*)\.so|libcuda\.so' \
       | xargs -r -I{} cp -L {} /out/lib/

FROM ubuntu:24.04 AS runtime
COPY --from=build /out/attnserve /usr/local/bin/attnserve
COPY --from=build /out/lib/ /usr/local/lib/attnserve/
RUN echo /usr/local/lib/attnserve > /etc/ld.so.conf.d/attnserve.conf && ldconfig \
    && useradd --system --uid 10001 --no-create-home attnserve
USER 10001
EXPOSE 50051 9464
ENTRYPOINT ["/usr/local/bin/attnserve", "--listen_address=0.0.0.0:50051", "--metrics_port=9464"]
