//! The only crate of dsec that contains `unsafe`.
//!
//! Every module wraps a family of Linux system calls in safe functions that own their file
//! descriptors (`OwnedFd`/`BorrowedFd`) and return typed errors. Each `unsafe` block carries a
//! `// SAFETY:` comment naming the invariant it relies on.
#![allow(unsafe_code)]
#![deny(unsafe_op_in_unsafe_fn)]
#![deny(clippy::undocumented_unsafe_blocks)]
#![warn(missing_docs)]

pub mod cgroup;
pub mod fs;
pub mod guest;
pub mod idrange;
pub mod ipc;
pub mod launch;
pub mod layer;
pub mod net;
pub mod netlink;
pub mod proc;
pub mod seccomp;
pub mod spawn;
