//! Wire types shared by every dsec process boundary.
//!
//! * [`frame`]: the framed, versioned codec spoken between the node and `dsec-agent` (a socketpair
//!   for the container substrate, a virtio channel for VM substrates). Decoding is defensive: every
//!   length is bounded and every failure is a typed [`frame::FrameError`].
//! * [`agent`]: the request/event messages carried inside frames.
//! * [`exec`]: exec requests and results, the same types the HTTP API exposes.
//! * [`body`]: the API's small request bodies (tenants, batches, processes, sessions, files).
//! * [`sandbox`]: the sandbox API's types: substrates, states, the create spec, the sandbox view.
//! * [`problem`]: the problem document every API error is answered with.
//! * [`error`]: stable error codes that a trainer can act on without parsing text.
//! * [`limits`]: a sandbox's resource limits, as the create spec carries them.
//!
//! This crate depends on serde only (no tokio) so that the static agent stays small.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod agent;
pub mod body;
pub mod error;
pub mod exec;
pub mod frame;
pub mod limits;
pub mod network;
pub mod problem;
pub mod sandbox;

pub use error::ErrorCode;
