# One image with every konnectivity-rs binary: proxy-server, proxy-agent,
# konnectivity-cni (the chained CNI plugin `proxy-agent install-cni` copies
# to the node) and proxy-test-client. The manifests pick the binary by
# command. hack/image.sh builds it (base images made locally from Debian
# packages when no registry answers), smoke-tests it, and exports its files
# for the tests that run the scenarios from the image.
#
#   DOCKER_BUILDKIT=1 docker build --network host -t konnectivity-rs:dev .
#
# Behind a TLS-inspecting proxy, give cargo the CA bundle that trusts it
# (optional; without it cargo trusts the build image's roots):
#   ... --secret id=ca-bundle,src=/etc/ssl/certs/ca-certificates.crt
#
# Built against Debian bookworm's glibc and run on bookworm-slim, so the
# binaries and the runtime libraries always match. The Rust image's tag is
# the channel of rust-toolchain.toml (hack/image.sh checks they agree).

FROM docker.io/library/rust:1.95.0-bookworm AS build
WORKDIR /src
# The whole workspace: .dockerignore keeps target/, .git and test output
# out, so a new workspace member can never be left behind.
COPY . .
# proxy-server and proxy-agent keep their symbol tables (2.7 MiB each, line
# tables dropped) so that a CPU profile (--enable-profiling) names functions.
# BuildKit cache mounts keep crates.io downloads and the build directory
# from one build to the next on the same machine (a fresh machine starts
# cold); the binaries are copied out of the cached target directory.
ENV CARGO_HOME=/usr/local/cargo
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    --mount=type=secret,id=ca-bundle \
    if [ -s /run/secrets/ca-bundle ]; then export CARGO_HTTP_CAINFO=/run/secrets/ca-bundle; fi \
 && cargo build --release --locked \
      -p konnectivity-server -p konnectivity-agent -p konnectivity-cni -p konnectivity-test-client \
 && mkdir /out \
 && cp target/release/proxy-server target/release/proxy-agent target/release/konnectivity-cni \
       target/release/proxy-test-client /out/ \
 && strip /out/konnectivity-cni /out/proxy-test-client \
 && strip --strip-debug /out/proxy-server /out/proxy-agent

FROM docker.io/library/debian:bookworm-slim
# What the binaries need at run time, and only that (node/src/programs.rs
# lists every program they run): nftables for the node agent's capture
# rules (in the host's and in each pod's network namespace), ca-certificates
# for agents started without --ca-cert.
RUN apt-get update \
 && apt-get install -y --no-install-recommends nftables ca-certificates \
 && apt-get clean \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /out/ /usr/local/bin/
# proxy-server and the egress agent run as any user (the manifests use
# 65532); the node agent needs root with NET_ADMIN and SYS_ADMIN.
ENTRYPOINT []
CMD ["proxy-server", "--help"]
