//! Frontends: where kube-apiserver (or any tunnel client) connects.

pub mod authority;
pub mod connect;
pub mod grpc;
pub mod listen;
pub mod stream;
