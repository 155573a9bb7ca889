# One image with every konnectivity-rs binary: proxy-server, proxy-agent,
# konnectivity-cni (the chained CNI plugin proxy-agent install-cni copies to
# the node) and proxy-test-client. The manifests pick the binary by command.
#
#   docker build -t konnectivity-rs:dev .
#
# Built against Debian bookworm's glibc and run on bookworm-slim, so the
# binaries and the runtime libraries always match.

FROM docker.io/library/rust:1.95-bookworm AS build
WORKDIR /src
# Dependencies first, so source edits do not refetch crates.
COPY Cargo.toml Cargo.lock rust-toolchain.toml ./
COPY proto proto
COPY plumbing plumbing
COPY client client
COPY server server
COPY agent agent
COPY cni-plugin cni-plugin
COPY tests tests
COPY bench bench
RUN cargo build --release --locked \
      -p konnectivity-server -p konnectivity-agent -p konnectivity-cni -p konnectivity-client \
 && mkdir /out \
 && cp target/release/proxy-server target/release/proxy-agent target/release/konnectivity-cni \
       target/release/proxy-test-client /out/ \
 && strip /out/*

FROM docker.io/library/debian:bookworm-slim
# nft: the node agent installs its capture rules with it (in the host's and
# in each pod's network namespace). ca-certificates: system roots for
# agents started without --ca-cert.
RUN apt-get update \
 && apt-get install -y --no-install-recommends nftables ca-certificates \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /out/ /usr/local/bin/
# proxy-server and the egress agent run as any user; the node agent needs
# root with NET_ADMIN and SYS_ADMIN (the manifests say so per workload).
ENTRYPOINT []
CMD ["proxy-server", "--help"]
