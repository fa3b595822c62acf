//! The dsec node runtime: substrates, templates and layers, sandbox lifecycle and pools.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod template;
