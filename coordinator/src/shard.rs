//! Which rank holds which chunk.
//!
//! Chunks go to ranks contiguously in request order, balanced by tokens: the smallest
//! per-rank token load that a left-to-right contiguous split can achieve is found by binary
//! search, then ranks are filled greedily up to it (the classic linear partition).
//!
//! ```text
//!   tokens:  |--c0--|----c1----|-c2-|---c3---|--c4--|      P = 3
//!   owner:       0       0        1      1       2         (max load minimal)
//! ```
//! More ranks than chunks (trailing ranks hold nothing), empty ranks and uneven chunks all
//! work: a rank that holds nothing still takes part in every collective. Chunk 0 always lands
//! on rank 0, next to the template head (every rank may compute the head as a prefill head;
//! only rank 0 contributes it as a segment).

/// Owner rank of each chunk (request order).
pub fn plan(chunk_tokens: &[usize], ranks: usize) -> Vec<usize> {
    let p = ranks.max(1);
    let fill = |cap: usize| -> Vec<usize> {
        let (mut r, mut load) = (0usize, 0usize);
        chunk_tokens
            .iter()
            .map(|&n| {
                if load > 0 && load + n > cap {
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

/// The chunks `rank` holds.
pub fn local_chunks(owner: &[usize], rank: usize) -> Vec<usize> {
    owner.iter().enumerate().filter(|(_, &o)| o == rank).map(|(c, _)| c).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

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
        assert!(local_chunks(&[0, 0], 1).is_empty());
    }
}
