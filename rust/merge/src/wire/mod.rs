//! Bytes the proxy reads and writes on every call: JSON spans of a resent conversation
//! (jsonscan), and id lists encoded as MessagePack or JSON exactly as msgspec writes them (ints).
//! Checksums come from crc32fast directly (lib.rs).

pub mod ints;
pub mod jsonscan;
