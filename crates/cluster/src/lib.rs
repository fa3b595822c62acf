//! dsec's cluster layer (docs/design.md, *Cluster*): nodes register in etcd under a lease and
//! publish what they hold; stateless gateways read that table, place creates and route calls
//! to a sandbox's node by the node number its id carries.
//!
//! - [`etcd`]: a small client of etcd's v3 API through its JSON gateway (`/v3/kv/*`,
//!   `/v3/lease/*`): no generated code, the same API the gRPC clients speak.
//! - [`model`]: what a node publishes ([`model::NodeReport`]) and the keys it lives under.
//! - [`place`]: the placement score (pool hit, layer affinity, free capacity, a tenant's spread).
//! - [`ids`]: the node number in a sandbox id.
//! - [`sim`]: simulated nodes that register and take placements without sandboxes (scale
//!   tests).
//! - [`autoscale`]: the node count the cluster should have, for an external autoscaler.

pub mod autoscale;
pub mod etcd;
pub mod gateway;
pub mod ids;
pub mod model;
pub mod place;
pub mod sim;
