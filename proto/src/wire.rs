//! Generated prost messages and tonic services (client and server halves).

#![allow(clippy::all, missing_docs)]
include!(concat!(env!("OUT_DIR"), "/_.rs"));
