//! The one error type of the crate. lib.rs maps it to `polar_fast.errors.MergeError`; nothing in
//! the crate panics on bad input, because a PanicException would tear down the caller's TaskGroup.

use std::fmt;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MergeError(pub String);

impl MergeError {
    pub fn new(message: impl Into<String>) -> Self {
        MergeError(message.into())
    }
}

impl fmt::Display for MergeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for MergeError {}

pub type Result<T> = std::result::Result<T, MergeError>;
