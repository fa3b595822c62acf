//! The problem document (RFC 9457 `application/problem+json`) every API error is answered
//! with: a stable [`ErrorCode`] a client can act on, and a detail for people.

use serde::{Deserialize, Serialize};

use crate::ErrorCode;

/// The problem document.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Problem {
    /// `https://dsec.dev/errors/<code>`.
    #[serde(rename = "type")]
    pub kind: String,
    /// Short summary of the code.
    pub title: String,
    /// HTTP status.
    pub status: u16,
    /// Stable code.
    pub code: ErrorCode,
    /// Detail.
    pub detail: String,
    /// Request id.
    pub request_id: String,
}
