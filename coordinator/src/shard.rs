//! Which rank holds which chunk.
//!
//! Chunks go to ranks contiguously in request order, balanced by tokens: the smallest
//! per-rank token load that a left-to-right contiguous split can achieve is found by binary
//! search, then ranks are filled greedily up to it (the classic linear partition), except that
//! once the chunks left are no more than the ranks left each takes a rank of its own: with at
//! least as many chunks as ranks every rank holds one (5 equal chunks on 4 ranks: 0 0 1 2 3,
//! where filling alone gave 0 0 1 1 2 and left rank 3 idle at the same largest load).
//!
//! ```text
//!   tokens:  |--c0--|----c1----|-c2-|---c3---|--c4--|      P = 3
//!   owner:       0       0        1      1       2         (max load minimal)
//! ```
//! More ranks than chunks (trailing ranks hold nothing), uneven chunks all
//! work: a rank that holds nothing still takes part in every collective. Chunk 0 always lands
//! on rank 0, next to the template head (every rank may compute the head as a prefill head;
//! only rank 0 contributes it as a segment).

/// Owner rank of each chunk (request order).
pub fn plan(chunk_tokens: &[usize], ranks: usize) -> Vec<usize> {
    let p = ranks.max(1);
    let count = chunk_tokens.len();
    let fill = |cap: usize| -> Vec<usize> {
        let (mut r, mut load) = (0usize, 0usize);
        chunk_tokens
            .iter()
            .enumerate()
            .map(|(c, &n)| {
                // A new rank when this chunk would pass the cap, or when the chunks left (this
                // one included) are no more than the ranks after this one: each of those then
                // takes one chunk, which is within any feasible cap, so no rank idles while
                // another holds two.
                if load > 0 && (load + n > cap || count - c <= p - 1 - r.min(p - 1)) {
                    r += 1;
                    load = 0;
                }
                load += n;
                r
            })
            .collect()
    };
    let (mut lo, mut hi) = (chunk_tokens.iter().copied().max().unwrap_or(0), chunk_tokens.iter().sum::<usize>());
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if fill(mid).last().is_none_or(|&r| r < p) {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    fill(lo)
}

/// Cache-aware placement: the positional split of [`plan`], then each chunk (largest first;
/// chunk 0 stays on rank 0, beside the head) moves to the rank whose chunk store holds it best
/// (`held[rank][chunk]`: 2 in RAM, 1 on its disk, 0 not at all) when its owner holds it less
/// well and the move keeps that rank within `slack` (a share, e.g. 0.1) above the positional
/// split's largest load; a rank with no room for it may swap it for one of its own chunks that
/// the owner holds at least as well. Among ranks holding it equally well, the least loaded.
/// `slack` 0, one rank, or no store information: the positional split.
pub fn aware(chunk_tokens: &[usize], ranks: usize, held: &[Vec<u8>], slack: f64) -> Vec<usize> {
    let mut owners = plan(chunk_tokens, ranks);
    let p = ranks.max(1);
    if p == 1 || slack <= 0.0 || held.len() != p || held.iter().any(|h| h.len() != chunk_tokens.len()) {
        return owners;
    }
    let mut load = vec![0usize; p];
    for (c, &o) in owners.iter().enumerate() {
        load[o] += chunk_tokens[c];
    }
    let top = load.iter().copied().max().unwrap_or(0);
    let cap = top + (top as f64 * slack).floor() as usize;
    let mut by_size: Vec<usize> = (1..chunk_tokens.len()).collect();
    by_size.sort_by_key(|&c| (std::cmp::Reverse(chunk_tokens[c]), c));
    for c in by_size {
        let (o, n) = (owners[c], chunk_tokens[c]);
        let mut better: Vec<usize> = (0..p).filter(|&r| r != o && held[r][c] > held[o][c]).collect();
        better.sort_by_key(|&r| (std::cmp::Reverse(held[r][c]), load[r], r));
        for r in better {
            if load[r] + n <= cap {
                load[o] -= n;
                load[r] += n;
                owners[c] = r;
                break;
            }
            // Full: a swap with one of r's chunks that `o` holds at least as well (no hit lost).
            let swap = (1..chunk_tokens.len()).find(|&d| {
                let m = chunk_tokens[d];
                owners[d] == r && held[o][d] >= held[r][d] && load[r] - m + n <= cap && load[o] - n + m <= cap
            });
            if let Some(d) = swap {
                let m = chunk_tokens[d];
                load[o] = load[o] - n + m;
                load[r] = load[r] - m + n;
                owners[c] = r;
                owners[d] = o;
                break;
            }
        }
    }
    owners
}

/// The chunks `rank` holds.
pub fn local_chunks(owner: &[usize], rank: usize) -> Vec<usize> {
    owner.iter().enumerate().filter(|(_, &o)| o == rank).map(|(c, _)| c).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aware_placement_follows_the_stores_within_the_slack() {
        let t = [10, 10, 10, 10];
        // Rank 1 holds chunk 1 in RAM, rank 0 holds chunk 2: they swap (loads stay 20 / 20).
        let held = vec![vec![0, 0, 2, 0], vec![0, 2, 0, 0]];
        assert_eq!(aware(&t, 2, &held, 0.1), vec![0, 1, 0, 1]);
        // No slack, one rank, or no information: positional.
        assert_eq!(aware(&t, 2, &held, 0.0), plan(&t, 2));
        assert_eq!(aware(&t, 1, &[vec![2, 2, 2, 2]], 0.5), vec![0, 0, 0, 0]);
        assert_eq!(aware(&t, 2, &[], 0.1), plan(&t, 2));
        // Chunk 0 stays on rank 0 whoever holds it.
        assert_eq!(aware(&t, 2, &[vec![0; 4], vec![2, 0, 0, 0]], 1.0)[0], 0);
        // The slack bounds the imbalance: rank 1 holds everything, may take at most 10% more.
        let all = vec![vec![0; 4], vec![2; 4]];
        let o = aware(&[100, 100, 100, 100], 2, &all, 0.1);
        let on1: usize = o.iter().filter(|&&r| r == 1).count();
        assert_eq!(on1, 2, "200 tokens is the cap's floor of 220: {o:?}");
        let o = aware(&[100, 100, 100, 100], 2, &all, 0.6);
        assert_eq!(o, vec![0, 1, 1, 1], "320 allowed: rank 1 takes a third chunk");
        // RAM beats disk beats nothing; a tie goes to the less loaded rank.
        let held = vec![vec![0, 0, 0, 0, 0, 0], vec![0, 1, 0, 0, 0, 0], vec![0, 2, 0, 0, 0, 0]];
        let o = aware(&[10; 6], 3, &held, 0.5);
        assert_eq!(o[1], 2, "{o:?}");
        // Every chunk has an owner in range, whatever the input.
        let o = aware(&[5, 50, 1, 7, 30], 3, &[vec![2; 5], vec![1; 5], vec![2; 5]], 0.25);
        assert!(o.iter().all(|&r| r < 3) && o[0] == 0, "{o:?}");
    }

    #[test]
    fn contiguous_balanced_and_total() {
        assert_eq!(plan(&[10, 10, 10, 10], 2), vec![0, 0, 1, 1]);
        assert_eq!(plan(&[10, 10, 10, 10], 4), vec![0, 1, 2, 3]);
        assert_eq!(plan(&[10, 10], 4), vec![0, 1], "more ranks than chunks: trailing ranks hold nothing");
        assert_eq!(plan(&[100, 1, 1, 1], 2), vec![0, 1, 1, 1]);
        assert_eq!(plan(&[40, 60], 2), vec![0, 1]);
        assert_eq!(plan(&[5], 3), vec![0]);
        assert_eq!(plan(&[], 3), Vec::<usize>::new());
        // The maximum load is minimal among contiguous splits.
        let sizes = [7, 300, 12, 40, 40, 90, 3];
        let o = plan(&sizes, 3);
        let load = |o: &[usize], r| sizes.iter().zip(o).filter(|(_, &x)| x == r).map(|(n, _)| n).sum::<usize>();
        assert_eq!((0..3).map(|r| load(&o, r)).max(), Some(300));
        for p in 1..6 {
            let o = plan(&[7, 300, 12, 40, 40, 90, 3], p);
            assert!(o.windows(2).all(|w| w[0] <= w[1]), "contiguous: {o:?}");
            assert!(o.iter().all(|&r| r < p));
        }
        assert_eq!(local_chunks(&[0, 0, 1, 1], 1), vec![2, 3]);
    }

    /// The largest load of the best contiguous split, by trying every one (small inputs).
    fn best_max_load(sizes: &[usize], p: usize) -> usize {
        if p == 1 || sizes.len() <= 1 {
            return sizes.iter().sum();
        }
        (1..sizes.len())
            .map(|cut| sizes[..cut].iter().sum::<usize>().max(best_max_load(&sizes[cut..], p - 1)))
            .min()
            .map_or(sizes.iter().sum(), |m| m.min(sizes.iter().sum()))
    }

    #[test]
    fn no_rank_idles_while_another_holds_two_chunks() {
        assert_eq!(plan(&[10; 5], 4), vec![0, 0, 1, 2, 3], "filling alone gave 0 0 1 1 2");
        assert_eq!(plan(&[10; 9], 8), vec![0, 0, 1, 2, 3, 4, 5, 6, 7], "filling alone used 5 of 8 ranks");
        assert_eq!(plan(&[10; 3], 3), vec![0, 1, 2]);
        // Every input up to 7 chunks of sizes from a small set, on 1-6 ranks: contiguous, the
        // best largest load, and every rank holds a chunk when there are enough chunks.
        let mut seed = 0x9e37_79b9_u64;
        for _ in 0..3000 {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let n = (seed % 8) as usize;
            let sizes: Vec<usize> = (0..n).map(|i| [1, 5, 10, 37, 300][((seed >> (8 + 3 * i)) % 5) as usize]).collect();
            for p in 1..=6 {
                let o = plan(&sizes, p);
                assert_eq!(o.len(), n);
                assert!(o.windows(2).all(|w| w[0] <= w[1] && w[1] - w[0] <= 1), "contiguous: {sizes:?} {o:?}");
                assert!(o.iter().all(|&r| r < p), "{sizes:?} on {p}: {o:?}");
                let used = o.last().map_or(0, |&r| r + 1);
                assert_eq!(used, n.min(p), "{sizes:?} on {p}: {o:?}");
                let top =
                    (0..p).map(|r| sizes.iter().zip(&o).filter(|(_, &x)| x == r).map(|(s, _)| s).sum::<usize>()).max();
                assert_eq!(top, Some(best_max_load(&sizes, p)), "{sizes:?} on {p}: {o:?}");
            }
        }
        assert!(local_chunks(&[0, 0], 1).is_empty());
    }
}
