//! The prefix-trie merge: captured calls in (record), one token trie (trie), its tree or paths
//! layout flattened, and micro-batch plans over it (pack). Plain Rust; lib.rs binds it.

pub mod error;
pub mod pack;
pub mod record;
pub mod trie;
