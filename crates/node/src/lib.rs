//! The dsec node runtime: substrates, templates and layers, sandbox lifecycle and pools.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod agent_client;
pub mod autoscale;
pub mod capacity;
pub mod clock;
pub mod egress;
pub mod lifecycle;
pub mod log;
pub mod member;
pub mod metrics;
pub mod sandbox;
pub mod server;
pub mod snapshot;
pub mod stall;
pub mod store;
pub mod substrate;
pub mod template;
pub mod trajlog;
