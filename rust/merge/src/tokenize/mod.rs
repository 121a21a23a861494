//! A byte-level BPE encoder that reproduces HF `tokenizers` exactly (bpe), with the regex-free
//! pre-tokenizer it needs (pretokenize) and the Unicode classes that one reads (bpe_unicode).

pub mod bpe;
mod bpe_unicode;
pub mod pretokenize;
