//! Deterministic top-k selection over scores.

use std::cmp::Ordering;

/// Total order used everywhere a top-k is cut: higher score first, then lower index.
/// NaN scores rank below every number.
pub fn rank_order(a: (f32, usize), b: (f32, usize)) -> Ordering {
    let key = |s: f32| if s.is_nan() { f32::NEG_INFINITY } else { s };
    key(b.0).total_cmp(&key(a.0)).then(a.1.cmp(&b.1))
}

/// Indices of the `k` highest scores (ties: lower index wins), returned in ascending index
/// order. `k` larger than the input returns every index.
pub fn top_k(scores: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<(f32, usize)> = scores.iter().copied().zip(0..).collect();
    let k = k.min(idx.len());
    if k == 0 {
        return Vec::new();
    }
    if k < idx.len() {
        idx.select_nth_unstable_by(k - 1, |a, b| rank_order(*a, *b));
        idx.truncate(k);
    }
    let mut out: Vec<usize> = idx.into_iter().map(|(_, i)| i).collect();
    out.sort_unstable();
    out
}

/// `round(ratio * n)` clamped to `[0, n]`: the number of tokens a ratio selects; at least one
/// for a ratio above 0 (a small ratio of a short context no longer runs as `none` in silence).
pub fn count_for_ratio(ratio: f64, n: usize) -> usize {
    let k = ((ratio * n as f64).round().max(0.0) as usize).min(n);
    if ratio > 0.0 && n > 0 {
        k.max(1)
    } else {
        k
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ratio_above_0_selects_at_least_one_token() {
        assert_eq!(count_for_ratio(0.002, 200), 1, "0.4 rounds to 0");
        assert_eq!(count_for_ratio(0.15, 200), 30);
        assert_eq!(count_for_ratio(0.0, 200), 0);
        assert_eq!(count_for_ratio(-0.0, 200), 0);
        assert_eq!(count_for_ratio(0.5, 0), 0);
        assert_eq!(count_for_ratio(1.0, 7), 7);
    }

    #[test]
    fn picks_highest_with_index_tiebreak() {
        let s = [0.5, 0.9, 0.5, 0.1, 0.9, f32::NAN];
        assert_eq!(top_k(&s, 2), vec![1, 4]);
        assert_eq!(top_k(&s, 3), vec![0, 1, 4]);
        assert_eq!(top_k(&s, 0), Vec::<usize>::new());
        assert_eq!(top_k(&s, 10), vec![0, 1, 2, 3, 4, 5]);
        assert_eq!(top_k(&[1.0; 6], 3), vec![0, 1, 2]);
    }

    #[test]
    fn ratio_counts() {
        assert_eq!(count_for_ratio(0.15, 100), 15);
        assert_eq!(count_for_ratio(1.0, 7), 7);
        assert_eq!(count_for_ratio(0.0, 7), 0);
        assert_eq!(count_for_ratio(0.5, 3), 2);
    }
}
