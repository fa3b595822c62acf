//! Warm pools.
