//! The work accounting against brute-force counts over positions, on a tiny shape.

use super::*;
use flowprefill_coordinator::select::default_score_layers;
use flowprefill_coordinator::shard;

fn brute(q: Range<u64>, k: Range<u64>) -> u64 {
    q.flat_map(|i| k.clone().map(move |j| u64::from(j <= i))).sum()
}

#[test]
fn range_pairs_matches_a_brute_force_count() {
    for qs in 0..12 {
        for qe in qs..14 {
            for ks in 0..12 {
                for ke in ks..14 {
                    assert_eq!(range_pairs(qs..qe, ks..ke), brute(qs..qe, ks..ke), "q {qs}..{qe} k {ks}..{ke}");
                }
            }
        }
    }
    assert_eq!(range_pairs(0..8192, 0..8192), 8192 * 8193 / 2);
}

fn tiny() -> Shape {
    Shape {
        name: "tiny".into(),
        n_layers: 3,
        d_model: 16,
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 4,
        ffn_dim: 24,
        vocab_size: 50,
        ..super::super::shape::builtin("smollm2-135m").expect("built in")
    }
}

fn causal(n: u64) -> u64 {
    (0..n).map(|i| i + 1).sum()
}

fn opts(method: Method) -> RunOptions {
    RunOptions { method, max_new_tokens: 1, ..RunOptions::default() }
}

#[test]
fn full_and_ring_count_every_causal_pair_once() {
    let s = tiny();
    let req = Request { head: 5, chunks: vec![7, 300, 12, 40], prompt: 9, selected: None, cached: Vec::new() };
    let t = 5 + 359 + 9;
    let full = plan(&s, &opts(Method::Full), 1, &req, 4).expect("plans");
    let c = full.rank_counts(0, &s, 2.0, 2.0);
    assert_eq!(c.attn_pair_layers, causal(t) * 3, "full: causal pairs x layers");
    assert_eq!(c.gemm_row_layers, t * 3);
    assert_eq!(c.logit_rows, 1);
    // FLOPs per row: 2 x parameters of a block (fused QKV, O, gate+up, down).
    let params = 16 * (16 + 2 * 8) + 16 * 16 + 3 * 24 * 16;
    assert_eq!(c.gemm_flops, (2 * params * t as usize * 3 + 2 * 16 * 50) as f64);
    assert_eq!(c.attn_flops, 4.0 * (causal(t) * 3) as f64 * 16.0);
    // Weights once per forward and block; the whole cache so far per piece (one piece here).
    assert_eq!(c.weight_bytes, (3 * params * 2 + 16 * 50 * 2) as f64);
    assert_eq!(c.kv_bytes, (t as usize * 3 * 2 * 8 * 2) as f64);
    for p in 1..=5 {
        let ring = plan(&s, &opts(Method::Ring), p, &req, 4).expect("plans");
        let total: u64 = (0..p).map(|r| ring.rank_counts(r, &s, 2.0, 2.0).attn_pair_layers).sum();
        assert_eq!(total, causal(t) * 3, "ring P={p}: every causal pair once");
        let rows: u64 = (0..p).map(|r| ring.rank_counts(r, &s, 2.0, 2.0).gemm_row_layers).sum();
        assert_eq!(rows, t * 3);
        // Each block crosses P-1 links per layer: all of K and V (+ positions) sent P-1 times.
        let sent: u64 = (0..p).map(|r| ring.rank_counts(r, &s, 2.0, 2.0).sent).sum();
        let received: u64 = (0..p).map(|r| ring.rank_counts(r, &s, 2.0, 2.0).received).sum();
        // Rows, then K and V (8 values per row here) each with its type tag.
        let per_block = |n: u64| 4 + 4 * n + 2 * (12 + 4 * n * 8);
        let pieces = zigzag_pieces(t as usize, p);
        let want: u64 =
            pieces.iter().map(|r| per_block((r[0].len() + r[1].len()) as u64)).sum::<u64>() * (p as u64 - 1) * 3;
        assert_eq!((sent, received), (want, want), "ring P={p} bytes");
    }
}

#[test]
fn chunked_counts_match_a_brute_force_over_positions() {
    let s = tiny();
    let chunks = vec![7, 30, 12, 40, 9];
    let (h, m) = (5u64, 6u64);
    let n: usize = chunks.iter().sum();
    for p in 1..=4 {
        for scope in [Scope::Exact, Scope::Sparse] {
            let selected: Vec<usize> = vec![0, 3, 8, 20, 37, 38, 50, 77, 97];
            let req = Request {
                head: h as usize,
                chunks: chunks.clone(),
                prompt: m as usize,
                selected: Some(selected.clone()),
                cached: Vec::new(),
            };
            let o = RunOptions {
                ratio: selected.len() as f64 / n as f64,
                scope,
                recompute_batch: 4,
                ..opts(Method::Infoflow)
            };
            let w = plan(&s, &o, p, &req, 4).expect("plans");
            let phase = |r: usize, name: &str| {
                w.per_rank[r].iter().find(|x| x.phase == name).map(|x| x.counts(&s, 4.0, 4.0)).unwrap_or_default()
            };
            let sum = |name: &str, f: &dyn Fn(&Counts) -> u64| (0..p).map(|r| f(&phase(r, name))).sum::<u64>();
            // Chunk prefill: the head on every rank, chunk 0 behind it, the rest alone.
            let want_chunk: u64 = p as u64 * causal(h)
                + chunks
                    .iter()
                    .enumerate()
                    .map(|(i, &c)| causal(c as u64) + if i == 0 { c as u64 * h } else { 0 })
                    .sum::<u64>();
            assert_eq!(sum(phase::CHUNK_PREFILL, &|c| c.attn_pair_layers), want_chunk * 3, "P={p}");
            // Probe and final prompt: the prompt sees the whole context once and itself on
            // every rank (replicated tail).
            let (a, b) = default_score_layers(3);
            let see_all = m * (h + n as u64) + p as u64 * causal(m);
            assert_eq!(sum(phase::PROBE, &|c| c.attn_pair_layers), see_all * (b as u64 + 1), "P={p}");
            assert_eq!(sum(phase::PROBE, &|c| c.score_pair_layers), m * (h + n as u64) * (b - a + 1) as u64);
            assert_eq!(sum(phase::FINAL_PROMPT, &|c| c.attn_pair_layers), see_all * 3, "P={p}");
            assert_eq!(sum(phase::FINAL_PROMPT, &|c| c.logit_rows), p as u64);
            // Recompute: every selected token through every layer once.
            assert_eq!(sum(phase::RECOMPUTE, &|c| c.gemm_row_layers), selected.len() as u64 * 3);
            let pos: Vec<u64> = selected.iter().map(|&g| h + g as u64).collect();
            let pairs = sum(phase::RECOMPUTE, &|c| c.attn_pair_layers);
            if scope == Scope::Exact {
                // Exact: a selected token at position g sees every key at or before g.
                assert_eq!(pairs, pos.iter().map(|g| g + 1).sum::<u64>() * 3, "exact P={p}");
            } else {
                // Sparse: its own rank's keys and the head, plus every other rank's selected
                // token that precedes it (of its batch and the earlier ones: they are kept).
                let owners = shard::plan(&chunks, p);
                let bounds: Vec<u64> = chunks
                    .iter()
                    .scan(h, |acc, &c| {
                        *acc += c as u64;
                        Some(*acc)
                    })
                    .collect();
                let owner_of = |g: u64| owners[bounds.iter().position(|&b| g < b).unwrap_or(0)];
                let mut want = 0u64;
                for &q in &pos {
                    let r = owner_of(q);
                    for k in 0..=q {
                        let mine = k < h || owner_of(k) == r;
                        let remote = pos.contains(&k) && owner_of(k) != r;
                        want += u64::from(mine || remote);
                    }
                }
                assert_eq!(pairs, want * 3, "sparse P={p}");
            }
        }
    }
}

#[test]
fn packets_are_counted_like_the_wire() {
    use flowprefill_comm::Packet;
    let bytes =
        Packet::new().u32s(&[1, 2, 3]).u32s(&[0]).f32s(&[0.0; 5]).u32s(&[1]).u16s(&[0; 7]).into_bytes().unwrap();
    assert_eq!(message(3, &[(5, 4), (7, 2)]), bytes.len() as u64);
}
