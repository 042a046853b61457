//! Invariants of the chunked engine on the real model (run with --release):
//! ratio 1.0 == full prefill for every selector and geometry; ratio 0 == concatenated chunk
//! caches; one chunk == full prefill for every method; reordering one chunk changes nothing;
//! geometries select different tokens at 0.15; a second query reuses the chunk caches.

use flowprefill_coordinator::{Engine, Geometry, Method, Request, RunOptions};
use flowprefill_tests::{default_model, engine, rel_diff, small_docs};
use flowprefill_worker::attend::AppendAttend;
use flowprefill_worker::kv::{KeyForm, KvCache};
use flowprefill_worker::model::Logits;
use flowprefill_worker::steps::prefill_chunk;
use flowprefill_worker::{Backend, Cpu};

/// First-token logits of two exact-in-math paths (different blocking/merge order), relative
/// to the logit range.
const ENGINE_LOGIT_TOL: f32 = 2e-4;

const SELECTORS: [Method; 6] =
    [Method::Infoflow, Method::Prophet, Method::Cacheblend, Method::Epic, Method::Cacheclip, Method::Random];

fn request(docs: Vec<String>) -> Request {
    flowprefill_tests::gate_question(docs)
}

fn run(e: &Engine<Cpu>, req: &Request, opts: RunOptions) -> flowprefill_coordinator::RunResult {
    e.run(req, &RunOptions { max_new_tokens: 8, ..opts }, &mut |_| true).expect("run")
}

#[test]
fn ratio_one_is_full_prefill_for_every_selector_and_geometry() {
    let e = engine();
    let req = request(small_docs());
    let full = run(&e, &req, RunOptions { method: Method::Full, ..Default::default() });
    for m in SELECTORS {
        let r = run(&e, &req, RunOptions { method: m, ratio: 1.0, ..Default::default() });
        assert_eq!(r.n_selected(), r.n_context_tokens, "{m}: everything is recomputed");
        let d = rel_diff(&r.first_logits, &full.first_logits);
        assert!(d <= ENGINE_LOGIT_TOL, "{m} at ratio 1.0: relative logit difference {d}");
        assert_eq!(r.answer, full.answer, "{m}");
    }
    for g in Geometry::ALL {
        let r = run(&e, &req, RunOptions { method: Method::Infoflow, ratio: 1.0, geometry: g, ..Default::default() });
        let d = rel_diff(&r.first_logits, &full.first_logits);
        assert!(d <= ENGINE_LOGIT_TOL, "geometry {}: {d}", g.name());
    }
}

#[test]
fn ratio_zero_is_the_concatenation_of_chunk_caches() {
    let e = engine();
    let lm = default_model();
    let model = &lm.model;
    let be = model.backend();
    let cfg = model.config();
    let docs = small_docs();
    let req = request(docs);
    let r = run(&e, &req, RunOptions { method: Method::None, ..Default::default() });
    assert_eq!(r.n_selected(), 0);
    for m in SELECTORS {
        // Ratio 0 of any selector is `none` with the same prefix mode (CacheClip: shared).
        let z = run(&e, &req, RunOptions { method: m, ratio: 0.0, ..Default::default() });
        let none =
            run(&e, &req, RunOptions { method: Method::None, prefix: Some(m.default_prefix()), ..Default::default() });
        assert_eq!(z.n_selected(), 0, "{m}");
        assert!(z.first_logits == none.first_logits, "{m} at ratio 0 differs from `none`");
    }

    // Built independently: one concatenated cache of [head, chunk0 behind head, chunk1, chunk2
    // alone], rotated to global positions, then the prompt over it.
    let layout = flowprefill_coordinator::layout::Layout::build(lm, &req).unwrap();
    let p = layout.head.len() as u32;
    let head = prefill_chunk(model, &[], &layout.head, 0).unwrap();
    let head_rot = head.placed(be, model.rope(), head.positions(), cfg.n_kv_heads).unwrap();
    let mut parts = vec![head];
    for (c, toks) in layout.chunks.iter().enumerate() {
        parts.push(
            if c == 0 { prefill_chunk(model, &[&head_rot], toks, p) } else { prefill_chunk(model, &[], toks, 0) }
                .unwrap(),
        );
    }
    let mut concat = KvCache::new(be, cfg.n_layers, cfg.kv_dim(), KeyForm::Rotated).unwrap();
    let mut pos = 0u32;
    for part in &parts {
        let global: Vec<u32> = (pos..pos + part.len() as u32).collect();
        pos += part.len() as u32;
        let placed = part.placed(be, model.rope(), &global, cfg.n_kv_heads).unwrap();
        // Appending a forward-free "prefill": copy rows layer by layer.
        for l in 0..cfg.n_layers {
            let layer = concat.layer_mut(l);
            be.append(&mut layer.k, &placed.layer(l).k).unwrap();
            be.append(&mut layer.v, &placed.layer(l).v).unwrap();
        }
        let mut all = concat.positions().to_vec();
        all.extend(global);
        concat = KvCache::from_parts(
            be,
            (0..cfg.n_layers)
                .map(|l| {
                    let x = concat.layer(l);
                    flowprefill_worker::kv::LayerKv { k: x.k.clone(), v: x.v.clone() }
                })
                .collect(),
            all,
            KeyForm::Rotated,
            cfg.kv_dim(),
        )
        .unwrap();
    }
    let prompt_pos: Vec<u32> = (pos..pos + layout.prompt.len() as u32).collect();
    let mut att = AppendAttend::new(be, &mut concat, &prompt_pos).unwrap();
    let out = model.forward(&layout.prompt, &prompt_pos, &mut att, Logits::Last).unwrap();
    att.commit().unwrap();
    let d = rel_diff(out.last(), &r.first_logits);
    assert!(d <= ENGINE_LOGIT_TOL, "none vs concatenated caches: {d}");
}

#[test]
fn one_chunk_is_full_prefill_for_every_method_and_reorder_changes_nothing() {
    let e = engine();
    let docs = small_docs();
    let req = request(vec![docs[1].clone()]);
    let full = run(&e, &req, RunOptions { method: Method::Full, ..Default::default() });
    // KV Packet wraps even one chunk in soft rows (and needs an adapter): not a prefill of the
    // same tokens. Lookahead needs an adapter (tests/tests/suite/lookahead.rs gives it one).
    for m in Method::ALL.into_iter().filter(|&m| !matches!(m, Method::Kvpacket | Method::Lookahead)) {
        let r = run(&e, &req, RunOptions { method: m, ratio: 0.15, ..Default::default() });
        let d = rel_diff(&r.first_logits, &full.first_logits);
        assert!(d <= ENGINE_LOGIT_TOL, "{m} with one chunk: {d}");
    }
    let plain = run(&e, &req, RunOptions { method: Method::Infoflow, ..Default::default() });
    let reordered = run(&e, &req, RunOptions { method: Method::Infoflow, reorder: true, ..Default::default() });
    assert_eq!(reordered.order, vec![0]);
    assert_eq!(reordered.selected_rows, plain.selected_rows);
    assert!(reordered.first_logits == plain.first_logits, "reorder of one chunk changed the logits");
}

/// Reordering moves the chunk the question is about next to the prompt, wherever it was: four
/// documents of one topic each, the vault's code in one of them. Before the sink of a chunk
/// prefilled from position 0 left its importance (`reorder::without_sink`), the order was
/// [0, 3, 1, 2] for every needle (chunk 0, behind the head, has no sink and always went first).
#[test]
fn reorder_puts_the_chunk_the_question_is_about_last() {
    let e = engine();
    let topics = [
        "The mill on the east river grinds barley every autumn and the miller keeps careful books of each sack.",
        "Sheep graze on the northern hills where the shepherds count the flock twice a day in spring.",
        "The old lighthouse warns ships away from the rocks; its keeper trims the wick each evening.",
        "Merchants bring cloth and copper to the square market, where prices are called out at noon.",
    ];
    for needle in 0..topics.len() {
        let docs = topics
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let t = format!("{t} ");
                if i == needle {
                    format!("{}The secret code of the vault is 8841. {}", t.repeat(2), t.repeat(3))
                } else {
                    t.repeat(5)
                }
            })
            .collect();
        let req = Request {
            conversation: Default::default(),
            context: flowprefill_coordinator::Context::Documents(docs),
            query: "What is the secret code of the vault?".into(),
            system: None,
            answer_prefix: None,
        };
        let r = run(&e, &req, RunOptions { method: Method::Infoflow, reorder: true, ..Default::default() });
        assert_eq!(r.order.last(), Some(&needle), "needle in chunk {needle}: order {:?}", r.order);
    }
}

fn jaccard(a: &[Vec<usize>], b: &[Vec<usize>]) -> f64 {
    let (mut inter, mut union) = (0usize, 0usize);
    for (x, y) in a.iter().zip(b) {
        let i = x.iter().filter(|r| y.contains(r)).count();
        inter += i;
        union += x.len() + y.len() - i;
    }
    inter as f64 / union.max(1) as f64
}

#[test]
fn geometries_select_different_tokens_at_015() {
    let e = engine();
    let req = request(small_docs());
    let sel: Vec<(Geometry, Vec<Vec<usize>>)> = Geometry::ALL
        .iter()
        .map(|&g| {
            (g, run(&e, &req, RunOptions { method: Method::Infoflow, geometry: g, ..Default::default() }).selected_rows)
        })
        .collect();
    for i in 0..sel.len() {
        for j in i + 1..sel.len() {
            let jac = jaccard(&sel[i].1, &sel[j].1);
            eprintln!("{} vs {}: Jaccard {jac:.3}", sel[i].0.name(), sel[j].0.name());
            assert!(
                jac < 0.9,
                "{} and {} select nearly the same tokens (Jaccard {jac})",
                sel[i].0.name(),
                sel[j].0.name()
            );
        }
    }
}

#[test]
fn second_query_reuses_chunk_caches_and_answers_like_a_cold_run() {
    let e = engine();
    let docs = small_docs();
    let req = request(docs.clone());
    let first = run(&e, &req, RunOptions::default());
    assert_eq!((first.cache_hits, first.cache_misses), (0, 4), "head + 3 chunks prefilled");
    let q2 = Request { query: "Which town is mentioned first?".into(), ..req.clone() };
    let warm = run(&e, &q2, RunOptions::default());
    assert_eq!((warm.cache_hits, warm.cache_misses), (4, 0), "no chunk prefill the second time");
    let cold_engine = engine();
    let cold = run(&cold_engine, &q2, RunOptions::default());
    assert_eq!(cold.cache_misses, 4);
    assert_eq!(warm.answer, cold.answer);
    assert_eq!(warm.selected_rows, cold.selected_rows);
    assert!(warm.first_logits == cold.first_logits, "reused caches gave different logits");
    assert!(warm.phases.get("chunk_prefill") < cold.phases.get("chunk_prefill"));
    // A follow-up turn about the same documents reads the same chunk caches: the conversation
    // after the question is in the prompt, not in front of the chunks.
    let turn = |role, text: &str| flowprefill_coordinator::Turn { role, text: text.into() };
    let mut follow = q2.clone();
    follow.conversation.after = vec![
        turn(flowprefill_coordinator::Role::Assistant, &warm.answer),
        turn(flowprefill_coordinator::Role::User, "And which town is mentioned last?"),
    ];
    let next = run(&e, &follow, RunOptions::default());
    assert_eq!((next.cache_hits, next.cache_misses), (4, 0), "a follow-up prefilled a chunk again");
    assert_eq!(next.n_context_tokens, warm.n_context_tokens);
    assert!(next.n_prompt_tokens > warm.n_prompt_tokens + 10, "{} -> {}", warm.n_prompt_tokens, next.n_prompt_tokens);
    // A fresh job on the warm engine is cold (`bench ttft`'s cold rows): it reads no cache,
    // keeps none, and answers as the cold engine did; the store is as it was.
    let entries = e.store().stats().entries;
    let fresh = run(&e, &q2, RunOptions { fresh: true, ..RunOptions::default() });
    assert_eq!((fresh.cache_hits, fresh.cache_misses), (0, 4), "a fresh job read a cache");
    assert!(fresh.first_logits == cold.first_logits && fresh.answer == cold.answer);
    assert_eq!(e.store().stats().entries, entries, "a fresh job kept its caches");
    // `full` with eviction keeps its context's cache for the next eviction; a fresh job
    // neither reads nor keeps it.
    let evict = flowprefill_coordinator::request::Evict {
        policy: flowprefill_coordinator::request::EvictPolicy::Snapkv,
        budget: 64,
    };
    let full = RunOptions { method: Method::Full, max_new_tokens: 2, evict: Some(evict), ..RunOptions::default() };
    run(&e, &q2, full.clone());
    let kept = run(&e, &q2, full.clone());
    assert_eq!(kept.cache_hits, 1, "full's context cache reused");
    let entries = e.store().stats().entries;
    let fresh = run(&e, &q2, RunOptions { fresh: true, ..full });
    assert_eq!((fresh.cache_hits, fresh.cache_misses), (0, 1));
    assert_eq!(e.store().stats().entries, entries);
}

#[test]
fn bad_requests_say_what_to_change() {
    let e = engine();
    let docs = small_docs();
    let err = |req: &Request, opts: RunOptions| {
        let e = e.run(req, &opts, &mut |_| true).expect_err("a bad request fails");
        assert_eq!(e.class(), flowprefill_coordinator::ErrorClass::Caller, "{e}");
        e.to_string()
    };
    let m = err(&request(vec![docs[0].clone(), "  ".into()]), RunOptions::default());
    assert!(m.contains("--doc #2: the document is empty"), "{m}");
    let m = err(&Request { query: " ".into(), ..request(docs.clone()) }, RunOptions::default());
    assert!(m.contains("--query: is missing"), "{m}");
    for ratio in [-0.1, 1.5, f64::NAN] {
        let m = err(&request(docs.clone()), RunOptions { ratio, ..Default::default() });
        assert!(m.contains("outside [0, 1]"), "{ratio}: {m}");
    }
    let huge = vec![docs[0].repeat(80)];
    let m = err(&request(huge), RunOptions::default());
    assert!(m.contains("context window is 8192"), "{m}");
    let m = "magic".parse::<Method>().unwrap_err().to_string();
    assert!(m.contains("unknown method `magic`") && m.contains("infoflow"), "{m}");
    let m = err(&request(vec![]), RunOptions::default());
    assert!(m.contains("no documents"), "{m}");
}

/// K/V rows recomputed under the global layout against a full prefill's, relative to the range
/// of the full prefill's layer (the same math in another blocking and merge order; measured
/// at most 2.4e-7 on SmolLM2, 2026-11-28).
const RECOMPUTED_KV_TOL: f32 = 1e-5;

/// CacheBlend recomputes every context token through its check layer and keeps those rows
/// (LMCache's blender: the first layers fully recomputed, only the selected tokens after): the
/// probe leaves layers 0..=1 of every chunk equal to a full prefill's, layer 2 as cached, and
/// its deviation is `||V_full - V_cached||^2` at layer 1.
#[test]
fn cacheblend_probe_leaves_its_first_layers_recomputed_for_every_token() {
    let lm = default_model();
    let model = &lm.model;
    let be = model.backend();
    let cfg = model.config();
    let kvd = cfg.kv_dim();
    let req = request(small_docs());
    let layout = flowprefill_coordinator::layout::Layout::build(lm, &req).unwrap();
    let p = layout.head.len() as u32;
    let head = prefill_chunk(model, &[], &layout.head, 0).unwrap();
    let head_rot = head.placed(be, model.rope(), head.positions(), cfg.n_kv_heads).unwrap();
    let mut chunks = Vec::new();
    let mut all_tokens = layout.head.clone();
    let mut offsets = Vec::new();
    for (c, toks) in layout.chunks.iter().enumerate() {
        let kv = if c == 0 { prefill_chunk(model, &[&head_rot], toks, p) } else { prefill_chunk(model, &[], toks, 0) };
        let start = all_tokens.len() as u32;
        let global: Vec<u32> = (start..start + toks.len() as u32).collect();
        chunks.push(kv.unwrap().placed(be, model.rope(), &global, cfg.n_kv_heads).unwrap());
        offsets.push(start as usize);
        all_tokens.extend_from_slice(toks);
    }
    let full = prefill_chunk(model, &[], &all_tokens, 0).unwrap();
    let full = full.placed(be, model.rope(), full.positions(), cfg.n_kv_heads).unwrap();
    let rows_of = |kv: &KvCache<Cpu>, l: usize, v: bool| {
        let layer = kv.layer(l);
        be.download(if v { &layer.v } else { &layer.k }).unwrap()
    };
    // The full prefill's rows of chunk `c` at layer `l`.
    let full_rows = |c: usize, l: usize, v: bool| {
        let all = rows_of(&full, l, v);
        all[offsets[c] * kvd..(offsets[c] + layout.chunks[c].len()) * kvd].to_vec()
    };
    let before: Vec<Vec<Vec<f32>>> = chunks.iter().map(|kv| (0..3).map(|l| rows_of(kv, l, true)).collect()).collect();
    // Before: a chunk prefilled alone has other layer-1 values than under the whole context.
    let stale = (1..chunks.len()).map(|c| rel_diff(&before[c][1], &full_rows(c, 1, true))).fold(0f32, f32::max);
    assert!(
        stale > 20.0 * RECOMPUTED_KV_TOL,
        "chunk-local layer 1 is already global ({stale}): the test shows nothing"
    );

    let mut targets = Vec::new();
    let mut tokens = Vec::new();
    for (c, toks) in layout.chunks.iter().enumerate() {
        for (row, &t) in toks.iter().enumerate() {
            targets.push(flowprefill_worker::steps::Target { segment: 1 + c, row });
            tokens.push(t);
        }
    }
    let all: Vec<u32> = (p..p + layout.n_context() as u32).collect();
    let sel = flowprefill_worker::steps::Selection { targets: &targets, tokens: &tokens, all_positions: &all };
    let mut comm = flowprefill_comm::local::LocalComm::group(1).pop().unwrap();
    let dev = flowprefill_worker::steps::value_deviation(
        model,
        &mut comm,
        Some(&head_rot),
        &mut chunks,
        &sel,
        1,
        &mut || Ok(()),
    )
    .unwrap();

    let mut at = 0;
    for (c, kv) in chunks.iter().enumerate() {
        for l in 0..2 {
            for v in [false, true] {
                let d = rel_diff(&rows_of(kv, l, v), &full_rows(c, l, v));
                assert!(
                    d <= RECOMPUTED_KV_TOL,
                    "chunk {c} layer {l} {}: {d} from the full prefill",
                    ["K", "V"][v as usize]
                );
            }
        }
        assert!(rows_of(kv, 2, true) == before[c][2], "chunk {c}: layer 2 is the cached one, untouched");
        // The deviation is measured against the cached rows, before they were overwritten.
        let want: Vec<f32> = before[c][1]
            .chunks(kvd)
            .zip(full_rows(c, 1, true).chunks(kvd))
            .map(|(a, b)| a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum())
            .collect();
        let got = &dev[at..at + want.len()];
        at += want.len();
        let d = rel_diff(got, &want);
        assert!(d <= 10.0 * RECOMPUTED_KV_TOL, "chunk {c}: deviation {d} from ||V_full - V_cached||^2");
    }
    assert_eq!(at, dev.len());
}
