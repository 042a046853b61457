//! Tests of the memory plans and admission.

use super::*;
use flowprefill_worker::config::Arch;

fn cfg() -> ModelConfig {
    ModelConfig {
        arch: Arch::Llama,
        name: "t".into(),
        n_layers: 4,
        d_model: 64,
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 16,
        ffn_dim: 128,
        vocab_size: 100,
        context_length: 4096,
        rope_base: 10000.0,
        rope_dim: 16,
        rope_linear_factor: 1.0,
        rms_eps: 1e-5,
        tied_embeddings: true,
    }
}

fn none(_: usize, _: usize) -> usize {
    0
}

/// The CPU's target with K/V kept as `kv`.
fn cpu(kv: DType) -> Target<'static> {
    Target {
        kv,
        act: DType::F32,
        scratch: Box::new(none),
        prefill_rows: flowprefill_kernels::PREFILL_ROWS,
        gathered_keys: 0,
    }
}

#[test]
fn the_full_plan_is_the_reserved_cache_and_one_piece() {
    let c = cfg();
    let t = Tokens { head: 10, chunks: vec![1000, 990], prompt: 20 };
    let opts = RunOptions { method: Method::Full, max_new_tokens: 8, ..RunOptions::default() };
    let p = plan(&c, &cpu(DType::F32), &opts, 1, &t);
    let kv = 2 * 4 * 32 * 4 * (2020 + 8);
    assert_eq!(p[0].parts[0], Part { what: "KV cache", bytes: kv });
    assert!(p[0].bytes() > kv);
    // bf16 halves the cache, not the activations.
    let h = plan(&c, &cpu(DType::Bf16), &opts, 1, &t);
    assert_eq!(h[0].parts[0].bytes, kv / 2);
    assert!(h[0].bytes() < p[0].bytes() - kv / 2);
}

/// The copy `attend_over` makes where a backend gathers: in the recomputation (both scopes)
/// and CacheBlend's deviation probe, at most the budget of keys, none without enough sources
/// or on the CPU.
#[test]
fn the_gathered_copy_is_planned_where_attend_over_makes_it() {
    let c = cfg();
    let t = Tokens { head: 10, chunks: vec![500; 8], prompt: 20 };
    let s = Sizes::new(&c, DType::F32, DType::F32);
    let kv_row = 2 * 32 * 4;
    let gathered = |phase: &Phase| phase.parts.iter().find(|p| p.what == "gathered keys").map_or(0, |p| p.bytes);
    let no_scratch = |rows: usize| none(rows, 0);
    for (method, scope, ranks, budget, want_keys) in [
        // Rank 0 of one: the head and 8 chunks, 4,010 keys (the budget cuts them).
        (Method::Infoflow, Scope::Exact, 1, 1000, 1000),
        (Method::Infoflow, Scope::Exact, 1, 1 << 20, 4010),
        (Method::Cacheblend, Scope::Exact, 1, 1 << 20, 4010),
        // Rank 0 of four: the head and 2 chunks, 3 sources: no gathering in the exact scope.
        (Method::Infoflow, Scope::Exact, 4, 1 << 20, 0),
        // The CPU's budget: none.
        (Method::Infoflow, Scope::Exact, 1, 0, 0),
    ] {
        let opts = RunOptions { method, scope, ..RunOptions::default() };
        let plan = Pipeline::new(&opts, &t.chunks, ranks, s.layers);
        let share = Share::new(&s, &no_scratch, budget, &t, &plan, 0);
        let phase = if method == Method::Cacheblend {
            share.probe(&opts, &plan, opts.method.info().probe, t.prompt)
        } else {
            share.recompute(&opts, &plan)
        };
        assert_eq!(gathered(&phase), want_keys * kv_row, "{method:?} {scope:?} on {ranks}, budget {budget}");
    }
    // The sparse scope on rank 1 of four: its 2 chunks, the head's copy and the other ranks'
    // rows (3 sources of them): gathered, with the rows.
    let opts = RunOptions { method: Method::Infoflow, scope: Scope::Sparse, ..RunOptions::default() };
    let plan = Pipeline::new(&opts, &t.chunks, 4, s.layers);
    let share = Share::new(&s, &no_scratch, 1 << 20, &t, &plan, 1);
    // The other ranks' rows at their bound: the whole batch.
    let k = plan.recomputed().min(plan.recompute_batch);
    let want = (share.local_tokens + t.head + k) * kv_row;
    assert_eq!(gathered(&share.recompute(&opts, &plan)), want);
}

/// Ranks sharing a device add up on it: thread ranks (peers = every rank) need the sum of
/// every plan; two MPI processes of a node sharing it, this one's and the largest other's;
/// a device of its own, this one's alone.
#[test]
fn peers_on_one_device_need_their_plans_together() {
    let r = |rank: usize, gib: usize| RankMemory {
        rank,
        phase: "prefill",
        parts: vec![Part { what: "kv", bytes: gib << 30 }],
    };
    let plans = vec![r(0, 5), r(1, 2), r(2, 3), r(3, 1)];
    assert_eq!(shared_need(&plans, 1, 1), 2 << 30);
    assert_eq!(shared_need(&plans, 1, 4), 11 << 30);
    assert_eq!(shared_need(&plans, 1, 2), 7 << 30, "its own and rank 0's");
    assert_eq!(shared_need(&plans, 0, 3), 10 << 30, "its own and ranks 2 and 1");
    // At most every plan, whatever the count of peers.
    assert_eq!(shared_need(&plans, 3, 9), 11 << 30);
}

#[test]
fn more_ranks_need_less_per_rank() {
    let c = cfg();
    let t = Tokens { head: 10, chunks: vec![500; 8], prompt: 20 };
    for method in [Method::Infoflow, Method::Cacheblend, Method::Ring, Method::Star, Method::Prophet] {
        let opts = RunOptions { method, ..RunOptions::default() };
        let one = plan(&c, &cpu(DType::F32), &opts, 1, &t)[0].bytes();
        let four = plan(&c, &cpu(DType::F32), &opts, 4, &t);
        assert_eq!(four.len(), 4);
        let most = four.iter().map(RankMemory::bytes).max().unwrap_or(0);
        assert!(most < one, "{method:?}: {most} on one of 4 ranks, {one} on one");
    }
}

#[test]
fn a_shortfall_names_the_device_the_need_and_what_to_change() {
    let mine = RankMemory { rank: 1, phase: "recompute", parts: vec![Part { what: "placed copies", bytes: 3 << 30 }] };
    let mem = Memory { device: "cuda:1".into(), free: 1 << 30 };
    assert_eq!(fits(&mine, 3 << 30, &Memory { free: 4 << 30, ..mem.clone() }, 0).ok(), Some(0));
    assert_eq!(fits(&mine, 3 << 30, &mem, 2 << 30).ok(), Some(2 << 30));
    let e = fits(&mine, 3 << 30, &mem, 1 << 30).expect_err("does not fit");
    let msg = e.to_string();
    for want in ["3.00 GiB on cuda:1", "rank 1", "recompute", "placed copies 3.00 GiB", "2.00 GiB is free", "bf16"] {
        assert!(msg.contains(want), "{want:?} missing from {msg}");
    }
    assert_eq!(e.class(), flowprefill_comm::ErrorClass::TooLarge);
    assert!(msg.contains("give fewer context tokens, run on more ranks, or keep K/V in bf16"), "{msg}");
}

/// More ranks are advised only where they would make room: not for `full` (rank 0 holds the
/// whole context), not where the ranks share the device (their jobs add up on it).
#[test]
fn a_shortfall_advises_more_ranks_only_where_they_spread_the_job() {
    let mine = RankMemory { rank: 0, phase: "prefill", parts: vec![Part { what: "kv cache", bytes: 3 << 30 }] };
    let mem = Memory { device: "cpu".into(), free: 1 << 30 };
    let refusal = |whole_on_rank_0: bool, peers: usize, kv_bf16: bool| match fits(&mine, 3 << 30, &mem, 0) {
        Err(CoordError::DoesNotFit(mut d)) => {
            (d.whole_on_rank_0, d.peers, d.kv_bf16) = (whole_on_rank_0, peers, kv_bf16);
            (d.more_ranks_help(), d.to_string())
        }
        other => panic!("not a DoesNotFit: {other:?}"),
    };
    let (helps, msg) = refusal(false, 1, false);
    assert!(
        helps && msg.ends_with("give fewer context tokens, run on more ranks, or keep K/V in bf16 (--kv-dtype bf16)")
    );
    let (helps, msg) = refusal(true, 1, false);
    assert!(!helps && !msg.contains("more ranks"), "{msg}");
    assert!(
        msg.ends_with(
            "give fewer context tokens or keep K/V in bf16 (--kv-dtype bf16) (`full` holds the whole context on rank 0)"
        ),
        "{msg}"
    );
    let (helps, msg) = refusal(false, 4, true);
    assert!(!helps && !msg.contains("more ranks") && !msg.contains("--kv-dtype"), "{msg}");
    assert!(msg.ends_with("give fewer context tokens (the job's 4 ranks share the memory of cpu)"), "{msg}");
    let (_, msg) = refusal(true, 2, false);
    assert!(msg.contains("`full` holds the whole context on rank 0; the job's 2 ranks share"), "{msg}");
}
