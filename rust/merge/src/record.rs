//! The part of a call record the merge reads, decoded straight from msgpack.
//!
//! The Python side encodes `list[CallRecord]` with msgspec (a map per record, tagged with
//! "type"); serde ignores every field we do not name here, so records can grow freely.

use serde::Deserialize;

use crate::error::{MergeError, Result};

#[derive(Debug, Clone, Deserialize)]
pub struct Call {
    pub rollout_id: String,
    pub prompt_ids: Vec<i64>,
    pub completion_ids: Vec<i64>,
    pub completion_logprobs: Vec<f64>,
    pub policy_version: i64,
}

pub fn decode_calls(payload: &[u8]) -> Result<Vec<Call>> {
    rmp_serde::from_slice(payload)
        .map_err(|e| MergeError::new(format!("cannot decode call records from msgpack: {e}")))
}
