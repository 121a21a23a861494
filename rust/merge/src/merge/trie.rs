//! The token trie of one group of rollouts and its two flat layouts (see merge_reference.py for
//! the rules, stated once; this file follows them exactly).
//!
//! Nodes live in one Vec; children form an insertion-ordered sibling list, since nearly every
//! node has a single child. Each rollout remembers the node path of its last call: a new call of
//! the same rollout usually extends it, so the shared prefix is found by comparing token slices
//! and only the new suffix walks the trie. In a token trie a prefix names exactly one path, so the
//! shortcut lands where a walk from the root would.

use std::collections::HashMap;

use super::record::Call;

pub const NONE: u32 = u32::MAX;

/// Length of the common prefix. Exact-history prompts extend the previous call, so the whole
/// slice usually matches and one memcmp answers; otherwise 64-token blocks narrow it down.
fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    let n = a.len().min(b.len());
    if a[..n] == b[..n] {
        return n;
    }
    let mut i = 0;
    while i + 64 <= n && a[i..i + 64] == b[i..i + 64] {
        i += 64;
    }
    i + a[i..n].iter().zip(&b[i..n]).take_while(|(x, y)| x == y).count()
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sample {
    pub rollout: u32,
    pub logprob: f32,
    pub version: i32,
}

#[derive(Debug, Clone)]
struct Node {
    token: u32,
    parent: u32,
    depth: u32,
    first_child: u32,
    last_child: u32,
    next_sibling: u32,
    creator: u32,
    sample: Option<Sample>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cause {
    Extend,
    NewRoot,
    InCompletion,
    InPrompt,
    CompletionFork,
    Duplicate,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stats {
    pub n_calls: u64,
    pub n_rollouts: u64,
    pub n_nodes: u64,
    pub n_output_tokens: u64,
    pub n_call_tokens: u64,
    pub n_samples: u64,
    pub n_extra_samples: u64,
    pub n_leaves: u64,
    pub extend: u64,
    pub new_root: u64,
    pub in_completion: u64,
    pub in_prompt: u64,
    pub completion_fork: u64,
    pub duplicate: u64,
}

impl Stats {
    /// Calls whose prompt left the trie somewhere other than at a leaf.
    pub fn n_breaks(&self) -> u64 {
        self.new_root + self.in_completion + self.in_prompt
    }

    fn count(&mut self, cause: Cause) {
        match cause {
            Cause::Extend => self.extend += 1,
            Cause::NewRoot => self.new_root += 1,
            Cause::InCompletion => self.in_completion += 1,
            Cause::InPrompt => self.in_prompt += 1,
            Cause::CompletionFork => self.completion_fork += 1,
            Cause::Duplicate => self.duplicate += 1,
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Extra {
    node: u32,
    sample: Sample,
}

/// A rollout's last inserted call: its tokens and the trie nodes along them.
#[derive(Debug, Default)]
struct LastPath {
    tokens: Vec<u32>,
    nodes: Vec<u32>,
}

#[derive(Debug, Default)]
pub struct Trie {
    nodes: Vec<Node>,
    first_root: u32,
    last_root: u32,
    rollout_ids: Vec<String>,
    rollout_index: HashMap<String, u32>,
    last_path: Vec<LastPath>,
    extras: Vec<Extra>,
    stats: Stats,
}

/// Flat arrays of one layout; field meanings are documented in polar_fast/merged.py.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Layout {
    pub tokens: Vec<i32>,
    pub positions: Vec<i32>,
    pub parent: Vec<i32>,
    pub size: Vec<i32>,
    pub loss_mask: Vec<u8>,
    pub logprobs: Vec<f32>,
    pub versions: Vec<i32>,
    pub rollout: Vec<i32>,
    pub node: Vec<i32>,
    pub offsets: Vec<i32>,
    pub extra_index: Vec<i32>,
    pub extra_rollout: Vec<i32>,
    pub extra_logprob: Vec<f32>,
    pub extra_version: Vec<i32>,
}

impl Layout {
    fn with_capacity(n: usize) -> Self {
        Layout {
            tokens: Vec::with_capacity(n),
            positions: Vec::with_capacity(n),
            parent: Vec::with_capacity(n),
            size: Vec::with_capacity(n),
            loss_mask: Vec::with_capacity(n),
            logprobs: Vec::with_capacity(n),
            versions: Vec::with_capacity(n),
            rollout: Vec::with_capacity(n),
            node: Vec::with_capacity(n),
            ..Default::default()
        }
    }
}

impl Trie {
    pub fn new() -> Self {
        Trie { first_root: NONE, last_root: NONE, ..Default::default() }
    }

    pub fn rollout_ids(&self) -> &[String] {
        &self.rollout_ids
    }

    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    pub fn insert_all(&mut self, calls: &mut [Call]) {
        for call in calls {
            self.insert(call);
        }
    }

    /// Insert one call. The trie keeps `call.tokens` as the rollout's last sequence and hands
    /// back that rollout's previous buffer in its place, so a stream of calls allocates nothing.
    pub fn insert(&mut self, call: &mut Call) {
        let seq = &call.tokens;
        let n_prompt = call.n_prompt;
        let r = self.rollout(&call.rollout_id);
        self.stats.n_calls += 1;
        self.stats.n_call_tokens += seq.len() as u64;
        self.stats.n_samples += (seq.len() - n_prompt) as u64;

        let mut last = std::mem::take(&mut self.last_path[r as usize]);
        let shared = common_prefix(&last.tokens, seq);
        last.nodes.truncate(shared);
        let mut parent = if shared > 0 { last.nodes[shared - 1] } else { NONE };
        let mut left = false;
        for (i, &token) in seq.iter().enumerate() {
            let node = if i < shared {
                last.nodes[i]
            } else {
                let found = self.find_child(parent, token);
                let node = if found != NONE {
                    found
                } else {
                    if !left {
                        let cause = self.cause(parent, i, n_prompt);
                        self.stats.count(cause);
                        left = true;
                    }
                    self.add_child(parent, token, i as u32, r)
                };
                last.nodes.push(node);
                node
            };
            if i >= n_prompt {
                let sample = Sample { rollout: r, logprob: call.logprobs[i - n_prompt], version: call.policy_version };
                let slot = &mut self.nodes[node as usize].sample;
                if slot.is_none() {
                    *slot = Some(sample);
                } else {
                    self.extras.push(Extra { node, sample });
                }
            }
            parent = node;
        }
        if !left {
            self.stats.count(Cause::Duplicate);
        }
        std::mem::swap(&mut last.tokens, &mut call.tokens);
        self.last_path[r as usize] = last;
    }

    fn rollout(&mut self, id: &str) -> u32 {
        if let Some(&r) = self.rollout_index.get(id) {
            return r;
        }
        let r = self.rollout_ids.len() as u32;
        self.rollout_ids.push(id.to_owned());
        self.rollout_index.insert(id.to_owned(), r);
        self.last_path.push(LastPath::default());
        r
    }

    fn first_child_of(&self, parent: u32) -> u32 {
        if parent == NONE {
            self.first_root
        } else {
            self.nodes[parent as usize].first_child
        }
    }

    fn find_child(&self, parent: u32, token: u32) -> u32 {
        let mut child = self.first_child_of(parent);
        while child != NONE {
            let node = &self.nodes[child as usize];
            if node.token == token {
                return child;
            }
            child = node.next_sibling;
        }
        NONE
    }

    fn cause(&self, parent: u32, i: usize, n_prompt: usize) -> Cause {
        let first = self.first_child_of(parent);
        if first == NONE {
            return Cause::Extend;
        }
        if i == 0 {
            return Cause::NewRoot;
        }
        if i >= n_prompt {
            return Cause::CompletionFork;
        }
        let mut child = first;
        while child != NONE {
            let node = &self.nodes[child as usize];
            if node.sample.is_some() {
                return Cause::InCompletion;
            }
            child = node.next_sibling;
        }
        Cause::InPrompt
    }

    fn add_child(&mut self, parent: u32, token: u32, depth: u32, creator: u32) -> u32 {
        let id = self.nodes.len() as u32;
        self.nodes.push(Node {
            token,
            parent,
            depth,
            first_child: NONE,
            last_child: NONE,
            next_sibling: NONE,
            creator,
            sample: None,
        });
        let prev_last = if parent == NONE {
            std::mem::replace(&mut self.last_root, id)
        } else {
            std::mem::replace(&mut self.nodes[parent as usize].last_child, id)
        };
        if prev_last == NONE {
            if parent == NONE {
                self.first_root = id;
            } else {
                self.nodes[parent as usize].first_child = id;
            }
        } else {
            self.nodes[prev_last as usize].next_sibling = id;
        }
        id
    }

    /// Node ids in DFS pre-order: roots, then children, each in insertion order.
    fn preorder(&self) -> Vec<u32> {
        let mut order = Vec::with_capacity(self.nodes.len());
        let mut stack = Vec::new();
        if self.first_root != NONE {
            stack.push(self.first_root);
        }
        while let Some(n) = stack.pop() {
            order.push(n);
            let node = &self.nodes[n as usize];
            if node.next_sibling != NONE {
                stack.push(node.next_sibling);
            }
            if node.first_child != NONE {
                stack.push(node.first_child);
            }
        }
        order
    }

    fn emit(&self, out: &mut Layout, n: u32, parent: i32, size: i32, with_sample: bool) {
        let node = &self.nodes[n as usize];
        out.tokens.push(node.token as i32);
        out.positions.push(node.depth as i32);
        out.parent.push(parent);
        out.size.push(size);
        out.node.push(n as i32);
        match node.sample {
            Some(s) if with_sample => {
                out.loss_mask.push(1);
                out.logprobs.push(s.logprob);
                out.versions.push(s.version);
                out.rollout.push(s.rollout as i32);
            }
            _ => {
                out.loss_mask.push(0);
                out.logprobs.push(0.0);
                out.versions.push(-1);
                out.rollout.push(node.sample.map_or(node.creator, |s| s.rollout) as i32);
            }
        }
    }

    fn push_extras(&self, out: &mut Layout, position_of: &[u32]) {
        for e in &self.extras {
            out.extra_index.push(position_of[e.node as usize] as i32);
            out.extra_rollout.push(e.sample.rollout as i32);
            out.extra_logprob.push(e.sample.logprob);
            out.extra_version.push(e.sample.version);
        }
    }

    /// Every node once, in DFS pre-order; `size` makes the ancestor rule an attention mask.
    pub fn tree(&mut self) -> Layout {
        let order = self.preorder();
        let mut position = vec![NONE; self.nodes.len()];
        for (p, &n) in order.iter().enumerate() {
            position[n as usize] = p as u32;
        }
        let mut sizes = vec![1i32; self.nodes.len()];
        for &n in order.iter().rev() {
            let parent = self.nodes[n as usize].parent;
            if parent != NONE {
                sizes[parent as usize] += sizes[n as usize];
            }
        }
        let mut out = Layout::with_capacity(order.len());
        out.offsets.push(0);
        for (p, &n) in order.iter().enumerate() {
            let parent = self.nodes[n as usize].parent;
            if parent == NONE && p > 0 {
                out.offsets.push(p as i32);
            }
            let parent_pos = if parent == NONE { -1 } else { position[parent as usize] as i32 };
            self.emit(&mut out, n, parent_pos, sizes[n as usize], true);
        }
        if !order.is_empty() {
            out.offsets.push(order.len() as i32);
        }
        self.push_extras(&mut out, &position);
        self.finish_stats(out.tokens.len());
        out
    }

    /// One root-to-leaf sequence per leaf, leaves in DFS order; a repeated node keeps its samples
    /// only in the first path that holds it.
    pub fn paths(&mut self) -> Layout {
        let order = self.preorder();
        let mut first_seen = vec![NONE; self.nodes.len()];
        let mut out = Layout::default();
        out.offsets.push(0);
        let mut chain = Vec::new();
        for &leaf in order.iter().filter(|&&n| self.nodes[n as usize].first_child == NONE) {
            chain.clear();
            let mut n = leaf;
            while n != NONE {
                chain.push(n);
                n = self.nodes[n as usize].parent;
            }
            chain.reverse();
            let start = out.tokens.len();
            let len = chain.len();
            for (j, &n) in chain.iter().enumerate() {
                let first = first_seen[n as usize] == NONE;
                if first {
                    first_seen[n as usize] = (start + j) as u32;
                }
                let parent = if j == 0 { -1 } else { (start + j - 1) as i32 };
                self.emit(&mut out, n, parent, (len - j) as i32, first);
            }
            out.offsets.push((start + len) as i32);
        }
        self.push_extras(&mut out, &first_seen);
        self.finish_stats(out.tokens.len());
        out
    }

    fn finish_stats(&mut self, n_output_tokens: usize) {
        self.stats.n_rollouts = self.rollout_ids.len() as u64;
        self.stats.n_nodes = self.nodes.len() as u64;
        self.stats.n_output_tokens = n_output_tokens as u64;
        self.stats.n_extra_samples = self.extras.len() as u64;
        self.stats.n_leaves = self.nodes.iter().filter(|n| n.first_child == NONE).count() as u64;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(rollout: &str, prompt: &[i64], completion: &[i64]) -> Call {
        let logprobs: Vec<f64> = completion.iter().map(|&t| -(t as f64) / 10.0).collect();
        Call::new(0, rollout.to_owned(), prompt, completion, &logprobs, 3).unwrap()
    }

    fn build(calls: &[Call]) -> Trie {
        let mut trie = Trie::new();
        trie.insert_all(&mut calls.to_vec());
        trie
    }

    #[test]
    fn shared_prefix_is_stored_once() {
        let mut trie = build(&[call("a", &[1, 2, 3], &[4]), call("b", &[1, 2, 3], &[5])]);
        let tree = trie.tree();
        assert_eq!(tree.tokens, vec![1, 2, 3, 4, 5]);
        assert_eq!(tree.parent, vec![-1, 0, 1, 2, 2]);
        assert_eq!(tree.size, vec![5, 4, 3, 1, 1]);
        assert_eq!(tree.loss_mask, vec![0, 0, 0, 1, 1]);
        assert_eq!(tree.rollout[3..], [0, 1]);
        assert_eq!(trie.stats().completion_fork, 1);
    }

    #[test]
    fn completion_reused_as_prompt_keeps_one_sample() {
        let mut trie = build(&[call("a", &[1, 2], &[3, 4]), call("a", &[1, 2, 3, 4, 5], &[6])]);
        let tree = trie.tree();
        assert_eq!(tree.tokens, vec![1, 2, 3, 4, 5, 6]);
        assert_eq!(tree.loss_mask, vec![0, 0, 1, 1, 0, 1]);
        assert_eq!(tree.logprobs[2], -0.3f32);
        assert_eq!(tree.versions, vec![-1, -1, 3, 3, -1, 3]);
        assert_eq!(trie.stats().extend, 2);
        assert_eq!(trie.stats().n_breaks(), 0);
    }

    #[test]
    fn break_causes_are_classified() {
        let mut trie = build(&[
            call("a", &[1, 2], &[3, 4]),
            call("a", &[1, 2, 3, 9], &[7]), // leaves inside the earlier completion
            call("a", &[1, 8], &[7]),       // leaves inside the earlier prompt
            call("a", &[6], &[7]),          // shares nothing
            call("a", &[6], &[7]),          // resampled the same tokens
        ]);
        let s = trie.stats().clone();
        assert_eq!((s.in_completion, s.in_prompt, s.new_root, s.duplicate), (1, 1, 1, 1));
        let tree = trie.tree();
        assert_eq!(tree.offsets, vec![0, 8, 10]);
        assert_eq!(tree.extra_index, vec![9]);
    }

    #[test]
    fn same_token_sampled_by_two_rollouts_becomes_an_extra() {
        let mut trie = build(&[call("a", &[1], &[2, 3]), call("b", &[1], &[2, 4])]);
        let tree = trie.tree();
        assert_eq!(tree.loss_mask, vec![0, 1, 1, 1]);
        assert_eq!(tree.extra_index, vec![1]);
        assert_eq!(tree.extra_rollout, vec![1]);
        assert_eq!(trie.stats().n_extra_samples, 1);
    }

    #[test]
    fn paths_repeat_prefixes_but_count_samples_once() {
        let mut trie = build(&[call("a", &[1], &[2, 3]), call("a", &[1, 2], &[4])]);
        let paths = trie.paths();
        assert_eq!(paths.tokens, vec![1, 2, 3, 1, 2, 4]);
        assert_eq!(paths.offsets, vec![0, 3, 6]);
        assert_eq!(paths.loss_mask, vec![0, 1, 1, 0, 0, 1]);
        assert_eq!(paths.size, vec![3, 2, 1, 3, 2, 1]);
        assert_eq!(paths.node, vec![0, 1, 2, 0, 1, 3]);
    }

    #[test]
    fn shortcut_matches_a_walk_from_the_root() {
        // b's second call walks through a's nodes; a's last path must not mislead it.
        let calls = [
            call("a", &[1, 2], &[3]),
            call("b", &[1, 2], &[3]),
            call("a", &[1, 2, 3, 4], &[5]),
            call("b", &[1, 2, 3, 4], &[6]),
        ];
        let mut trie = build(&calls);
        let tree = trie.tree();
        assert_eq!(tree.tokens, vec![1, 2, 3, 4, 5, 6]);
        assert_eq!(trie.stats().completion_fork, 1);
    }

    #[test]
    fn common_prefix_agrees_with_a_plain_scan() {
        let a: Vec<u32> = (0..300).collect();
        for cut in [0, 1, 63, 64, 65, 200, 299, 300] {
            let mut b = a.clone();
            if cut < b.len() {
                b[cut] = 9999;
            }
            assert_eq!(common_prefix(&a, &b), cut);
            assert_eq!(common_prefix(&a[..cut.min(a.len())], &a), cut.min(a.len()));
        }
    }

    #[test]
    fn bad_input_is_an_error_not_a_panic() {
        assert!(Call::new(0, "a".into(), &[1], &[2], &[], 0).is_err());
        assert!(Call::new(0, "a".into(), &[-1], &[2], &[0.0], 0).is_err());
        assert!(Call::new(0, "a".into(), &[1 << 31], &[2], &[0.0], 0).is_err());
        assert!(Call::new(0, "a".into(), &[1], &[2], &[0.0], 1 << 40).is_err());
    }
}
