//! The integration tests, one binary (each area a module, as each was a
//! binary of its own before): the real binaries, the image's files and other
//! people's clients, on loopback and in network namespaces the tests create.
//! One binary links the world once instead of twenty-three times.

mod support;

mod certificates;
mod cri_pods;
mod drain;
mod egress_grpc;
mod egress_http_connect;
mod faults;
mod flags;
mod grpc_clients;
mod ha;
mod ha_node;
mod handover;
mod image;
mod keepalive;
mod leases;
mod limits;
mod logs;
mod manifests;
mod metrics;
mod node_capture;
mod node_identity;
mod node_policy;
mod partition;
mod pod_capture;
mod profiling;
mod resume;
mod shutdown;
mod soak;
mod strategies;
mod token_auth;
mod upstream_parity;
