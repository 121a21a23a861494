//! First-fit-decreasing packing of merged sequences into micro-batches of at most `max_tokens`.
//!
//! Works on the flat arrays alone (parent, size, offsets), so it packs either layout. A tree over
//! the budget is split: a node keeps its ancestor chain, its children's subtrees are binned into
//! copies of that chain, and an oversize child recurses. A token repeated by splitting counts its
//! loss (and its extra samples) only at its first occurrence in micro-batch order.

use super::error::{MergeError, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayoutKind {
    Tree,
    Paths,
}

/// Where one micro-batch's tokens come from; mirrors polar_fast.merged.PackPlan.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Plan {
    pub index: Vec<i32>,
    pub parent: Vec<i32>,
    pub size: Vec<i32>,
    pub loss_mask: Vec<u8>,
    pub offsets: Vec<i32>,
    pub extra_ids: Vec<i32>,
    pub extra_index: Vec<i32>,
}

pub struct Input<'a> {
    pub parent: &'a [i32],
    pub size: &'a [i32],
    pub offsets: &'a [i32],
    pub loss_mask: &'a [u8],
    pub extra_index: &'a [i32],
}

pub fn pack_plans(input: &Input, layout: LayoutKind, max_tokens: i64) -> Result<Vec<Plan>> {
    if max_tokens < 1 {
        return Err(MergeError::new(format!("max_tokens must be >= 1, got {max_tokens}")));
    }
    validate(input)?;
    let max = max_tokens as usize;
    let mut units: Vec<Vec<usize>> = Vec::new();
    for w in input.offsets.windows(2) {
        let (a, b) = (w[0] as usize, w[1] as usize);
        if layout == LayoutKind::Paths || b - a <= max {
            if b - a > max {
                return Err(MergeError::new(format!(
                    "a sequence of {} tokens exceeds max_tokens={max}",
                    b - a
                )));
            }
            units.push((a..b).collect());
        } else {
            split(a, input.size, max, &mut units)?;
        }
    }
    let bins = first_fit_decreasing(&units, max, |u| u.len());
    Ok(plans(input, &units, &bins))
}

fn validate(input: &Input) -> Result<()> {
    let n = input.parent.len();
    if input.size.len() != n || input.loss_mask.len() != n {
        return Err(MergeError::new("parent, size and loss_mask must have the same length"));
    }
    let offsets_ok = input.offsets.first().map_or(true, |&o| o == 0)
        && input.offsets.windows(2).all(|w| w[0] < w[1])
        && input.offsets.last().map_or(n == 0, |&o| o as usize == n);
    if !offsets_ok {
        return Err(MergeError::new("offsets must rise strictly from 0 to the number of tokens"));
    }
    for (i, (&s, &p)) in input.size.iter().zip(input.parent).enumerate() {
        if s < 1 || i + s as usize > n || p >= i as i32 || p < -1 {
            return Err(MergeError::new(format!("inconsistent parent/size at token {i}")));
        }
    }
    if input.extra_index.iter().any(|&e| e < 0 || e as usize >= n) {
        return Err(MergeError::new("extra_index points outside the tokens"));
    }
    Ok(())
}

/// Segments of an oversize tree. Depth-first with an explicit stack (paths run to 100k+ tokens):
/// a node's oversize children are split before its fitting children are binned.
fn split(root: usize, size: &[i32], max: usize, out: &mut Vec<Vec<usize>>) -> Result<()> {
    struct Frame {
        node: usize,
        next_child: usize,
        fits: Vec<Vec<usize>>,
    }
    let mut frames: Vec<Frame> = Vec::new();
    let push = |frames: &mut Vec<Frame>, v: usize| -> Result<()> {
        if frames.len() + 1 >= max {
            return Err(MergeError::new(format!(
                "a root-to-leaf path of at least {} tokens exceeds max_tokens={max}",
                frames.len() + 2
            )));
        }
        frames.push(Frame { node: v, next_child: v + 1, fits: Vec::new() });
        Ok(())
    };
    push(&mut frames, root)?;
    while !frames.is_empty() {
        let budget = max - frames.len();
        let frame = frames.last_mut().expect("non-empty");
        let (v, c) = (frame.node, frame.next_child);
        if c < v + size[v] as usize {
            frame.next_child = c + size[c] as usize;
            if size[c] as usize <= budget {
                frame.fits.push(vec![c]);
            } else {
                push(&mut frames, c)?;
            }
            continue;
        }
        let frame = frames.pop().expect("non-empty");
        if frame.fits.is_empty() {
            continue;
        }
        let mut head: Vec<usize> = frames.iter().map(|f| f.node).collect();
        head.push(frame.node);
        for group in first_fit_decreasing(&frame.fits, budget, |u| size[u[0]] as usize) {
            let mut members: Vec<usize> = group.iter().map(|&u| frame.fits[u][0]).collect();
            members.sort_unstable();
            let mut segment = head.clone();
            for c in members {
                segment.extend(c..c + size[c] as usize);
            }
            out.push(segment);
        }
    }
    Ok(())
}

/// Bins of unit indices; units sorted by weight, heaviest first, ties in input order.
fn first_fit_decreasing<F: Fn(&Vec<usize>) -> usize>(units: &[Vec<usize>], capacity: usize, weight: F) -> Vec<Vec<usize>> {
    let mut order: Vec<usize> = (0..units.len()).collect();
    order.sort_by_key(|&u| std::cmp::Reverse(weight(&units[u])));
    let mut bins: Vec<Vec<usize>> = Vec::new();
    let mut loads: Vec<usize> = Vec::new();
    for u in order {
        let w = weight(&units[u]);
        match loads.iter().position(|&load| load + w <= capacity) {
            Some(b) => {
                bins[b].push(u);
                loads[b] += w;
            }
            None => {
                bins.push(vec![u]);
                loads.push(w);
            }
        }
    }
    bins
}

fn plans(input: &Input, units: &[Vec<usize>], bins: &[Vec<usize>]) -> Vec<Plan> {
    let n = input.parent.len();
    let mut owned = vec![false; n];
    // extras of each position, in their original order
    let mut extras_at: Vec<Vec<i32>> = vec![Vec::new(); n];
    for (e, &i) in input.extra_index.iter().enumerate() {
        extras_at[i as usize].push(e as i32);
    }
    let mut plans = Vec::with_capacity(bins.len());
    for bin in bins {
        let mut plan = Plan { offsets: vec![0], ..Default::default() };
        for &u in bin {
            let unit = &units[u];
            let base = plan.index.len();
            for (p, &i) in unit.iter().enumerate() {
                let first = !owned[i];
                owned[i] = true;
                plan.index.push(i as i32);
                plan.loss_mask.push(if first { input.loss_mask[i] } else { 0 });
                let parent = if p == 0 {
                    -1
                } else {
                    (base + unit.partition_point(|&x| (x as i64) < input.parent[i] as i64)) as i32
                };
                plan.parent.push(parent);
                let end = i + input.size[i] as usize;
                plan.size.push((unit.partition_point(|&x| x < end) - p) as i32);
                if first {
                    for &e in &extras_at[i] {
                        plan.extra_ids.push(e);
                        plan.extra_index.push((base + p) as i32);
                    }
                }
            }
            plan.offsets.push(plan.index.len() as i32);
        }
        plans.push(plan);
    }
    plans
}

#[cfg(test)]
mod tests {
    use super::*;

    // One root: 0 -> 1 -> {2 -> 3, 4}
    const PARENT: [i32; 5] = [-1, 0, 1, 2, 1];
    const SIZE: [i32; 5] = [5, 4, 2, 1, 1];
    const MASK: [u8; 5] = [0, 1, 1, 1, 1];

    fn input<'a>(extra: &'a [i32]) -> Input<'a> {
        Input { parent: &PARENT, size: &SIZE, offsets: &[0, 5], loss_mask: &MASK, extra_index: extra }
    }

    #[test]
    fn a_tree_that_fits_stays_whole() {
        let plans = pack_plans(&input(&[]), LayoutKind::Tree, 5).unwrap();
        assert_eq!(plans.len(), 1);
        assert_eq!(plans[0].index, vec![0, 1, 2, 3, 4]);
        assert_eq!(plans[0].size, SIZE.to_vec());
    }

    #[test]
    fn an_oversize_tree_is_split_with_its_ancestors_repeated() {
        let plans = pack_plans(&input(&[1]), LayoutKind::Tree, 4).unwrap();
        assert_eq!(plans.len(), 2);
        assert_eq!(plans[0].index, vec![0, 1, 2, 3]);
        assert_eq!(plans[1].index, vec![0, 1, 4]);
        // the repeated ancestor 1 carries its loss (and its extra) only in the first copy
        assert_eq!(plans[0].loss_mask, vec![0, 1, 1, 1]);
        assert_eq!(plans[1].loss_mask, vec![0, 0, 1]);
        assert_eq!(plans[0].extra_index, vec![1]);
        assert!(plans[1].extra_ids.is_empty());
        assert_eq!(plans[1].parent, vec![-1, 0, 1]);
        assert_eq!(plans[1].size, vec![3, 2, 1]);
    }

    #[test]
    fn too_long_a_path_is_an_error() {
        assert!(pack_plans(&input(&[]), LayoutKind::Tree, 3).is_err());
        assert!(pack_plans(&input(&[]), LayoutKind::Tree, 0).is_err());
    }

    #[test]
    fn bins_fill_first_fit_decreasing() {
        let units = vec![vec![0; 3], vec![0; 5], vec![0; 2], vec![0; 4]];
        let bins = first_fit_decreasing(&units, 7, |u| u.len());
        assert_eq!(bins, vec![vec![1, 2], vec![3, 0]]);
    }

    #[test]
    fn a_deep_tree_splits_without_recursion() {
        // a 200k-token spine with a short branch at the end: the stack must not grow with depth
        let n = 200_000usize;
        let mut parent: Vec<i32> = (0..n as i32).map(|i| i - 1).collect();
        parent.push(n as i32 - 2);
        let mut size: Vec<i32> = (0..n as i32).map(|i| n as i32 + 1 - i).collect();
        size[n - 1] = 1;
        size.push(1);
        let mask = vec![1u8; n + 1];
        let input = Input { parent: &parent, size: &size, offsets: &[0, n as i32 + 1], loss_mask: &mask, extra_index: &[] };
        let plans = pack_plans(&input, LayoutKind::Tree, n as i64 + 1).unwrap();
        assert_eq!(plans.len(), 1);
        let plans = pack_plans(&input, LayoutKind::Tree, n as i64).unwrap();
        assert_eq!(plans.len(), 2);
        let owned: usize = plans.iter().map(|p| p.loss_mask.iter().map(|&m| m as usize).sum::<usize>()).sum();
        assert_eq!(owned, n + 1);
    }

    #[test]
    fn inconsistent_arrays_are_rejected() {
        let bad = Input { parent: &PARENT, size: &[9, 4, 2, 1, 1], offsets: &[0, 5], loss_mask: &MASK, extra_index: &[] };
        assert!(pack_plans(&bad, LayoutKind::Tree, 5).is_err());
        let bad = Input { parent: &PARENT, size: &SIZE, offsets: &[0, 4], loss_mask: &MASK, extra_index: &[] };
        assert!(pack_plans(&bad, LayoutKind::Tree, 5).is_err());
    }
}
