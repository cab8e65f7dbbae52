# syntax=docker/dockerfile:1
#
# tollgate's container image: built the way CI builds (`cargo build --release --locked`, the
# committed Cargo.lock), run as a non-root user on a read-only root filesystem.
#
#   docker build -t tollgate:0.1.0 .
#   docker run --rm --read-only -p 50051:50051 -p 9464:9464 tollgate:0.1.0
#
# Two stages: the Rust toolchain builds the binary; the runtime is Debian slim (the same Debian
# release as the builder, so the glibc the binary was linked against is there) with the CA
# certificates for rediss:// and /bin/sleep for the Kubernetes preStop pause. tests/it/deploy/
# checks this file's structure and that the binary needs no library beyond the base image's.

# The toolchain CI uses; Cargo.toml's rust-version (1.88) is the floor.
FROM rust:1.95-bookworm AS builder
WORKDIR /src
COPY . .
# The cache mounts keep the crates.io downloads and compiled dependencies between builds.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --bin tollgate \
    && install -D -m 0755 target/release/tollgate /out/tollgate

FROM debian:bookworm-slim AS runtime
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/*
COPY --from=builder /out/tollgate /usr/local/bin/tollgate
# A numeric user (Kubernetes' runAsNonRoot can only verify numbers); 65532 is the "nonroot"
# user of distroless images. Nothing is written at run time: the root filesystem may be read-only.
USER 65532:65532
# ext_proc gRPC + grpc.health.v1; admin HTTP (/metrics, /healthz, /readyz).
EXPOSE 50051 9464
ENTRYPOINT ["/usr/local/bin/tollgate"]
