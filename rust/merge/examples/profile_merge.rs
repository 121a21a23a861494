//! Times the merge's stages on a msgpack payload: `cargo run --release --example profile_merge -- FILE`.
use std::time::Instant;

fn main() {
    let path = std::env::args().nth(1).expect("usage: profile_merge PAYLOAD.msgpack");
    let payload = std::fs::read(path).expect("read payload");
    let t = Instant::now();
    let mut calls = _native::merge::record::decode_calls(&payload).expect("decode");
    let t_decode = t.elapsed();
    let t = Instant::now();
    let mut trie = _native::merge::trie::Trie::new();
    let tokens: usize = calls.iter().map(|c| c.tokens.len()).sum();
    trie.insert_all(&mut calls);
    let t_insert = t.elapsed();
    let t = Instant::now();
    let tree = trie.tree();
    let t_tree = t.elapsed();
    let t = Instant::now();
    let mut reader = _native::merge::record::CallReader::new(&payload).expect("decode");
    let mut trie = _native::merge::trie::Trie::new();
    let mut call = _native::merge::record::Call::default();
    while reader.read_into(&mut call).expect("decode") {
        trie.insert(&mut call);
    }
    let t_stream = t.elapsed();
    println!("{} calls, {} tokens, {} nodes", calls.len(), tokens, tree.tokens.len());
    println!("decode {t_decode:?}  insert {t_insert:?}  tree {t_tree:?}  streamed decode+insert {t_stream:?}");
}
