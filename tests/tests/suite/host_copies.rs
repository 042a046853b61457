//! The distributed steps keep K/V, queries and partial results on the device: per engine
//! phase, a counting backend records every copy between host and device, with the copies a
//! transport stages apart (the thread and MPI communicators move host bytes; a device
//! communicator would not). What the steps themselves may copy: the logits of the row that picks
//! the first token, and the probe's scores (read by the selection on the host). Nothing else,
//! on any rank, in any phase. With a device plane between the ranks (NCCL's contract; here
//! `comm::plane::threads`), the transport stages nothing either: the same copies as above and
//! not one more.

use flowprefill_coordinator::timings::phase;
use flowprefill_coordinator::{Method, RunOptions, Scope};
use flowprefill_tests::counting::{needle_request, run_counted_on, Counting, Ran};
use flowprefill_worker::LoadedModel;
use std::collections::BTreeMap;
use std::sync::Arc;

#[test]
fn distributed_steps_copy_nothing_but_logits_and_scores() {
    let path = flowprefill_tests::default_model_path();
    let lm = Arc::new(LoadedModel::load(&path, Counting::default()).expect("model loads"));
    let vocab = lm.model.config().vocab_size as u64;
    let n_layers = lm.model.config().n_layers;
    let (a, b) = flowprefill_coordinator::select::default_score_layers(n_layers);
    let request = needle_request();
    let cases: Vec<(&str, usize, RunOptions)> = vec![
        ("full", 1, RunOptions { method: Method::Full, ..RunOptions::default() }),
        ("ring P=2", 2, RunOptions { method: Method::Ring, ..RunOptions::default() }),
        ("ring P=3", 3, RunOptions { method: Method::Ring, ..RunOptions::default() }),
        ("infoflow exact P=1", 1, RunOptions::default()),
        ("infoflow exact P=2", 2, RunOptions::default()),
        ("infoflow exact P=3", 3, RunOptions { recompute_batch: 9, ..RunOptions::default() }),
        ("infoflow sparse P=2", 2, RunOptions { scope: Scope::Sparse, ..RunOptions::default() }),
    ];
    let planes = cases.iter().filter(|c| c.1 > 1).map(|(n, r, o)| (*n, *r, o.clone(), true));
    let cases: Vec<(&str, usize, RunOptions, bool)> =
        cases.iter().map(|(n, r, o)| (*n, *r, o.clone(), false)).chain(planes.collect::<Vec<_>>()).collect();
    let mut staged_copies: BTreeMap<&str, BTreeMap<&str, (u64, u64)>> = BTreeMap::new();
    for (name, ranks, opts, plane) in cases {
        let (r, ran) = run_counted_on(&lm, name, ranks, plane, &request, &opts);
        let mut by_phase: BTreeMap<&str, Ran> = BTreeMap::new();
        for (_, p, ran) in ran {
            *by_phase.entry(p).or_default() += ran;
        }
        let over = if plane { ", device plane" } else { "" };
        eprintln!("{name}{over}: phase: downloads (floats), uploads (floats), staged by the transport (floats)");
        for (p, c) in &by_phase {
            eprintln!(
                "  {p:<18} {:>4} ({:>8}) {:>4} ({:>8}) {:>6} ({:>9})",
                c.downloads, c.download_floats, c.uploads, c.upload_floats, c.staged, c.staged_floats
            );
        }
        let context = (r.n_head_tokens + r.n_context_tokens) as u64;
        for (p, c) in &by_phase {
            assert_eq!(c.uploads, 0, "{name}: phase {p} uploaded {} floats", c.upload_floats);
            match *p {
                // One row of logits per rank that computes it.
                phase::PREFILL | phase::FINAL_PROMPT => {
                    assert_eq!(c.download_floats, c.downloads * vocab, "{name}: {p} downloads more than logits")
                }
                // The scores of every context key (head included) on each scoring layer.
                phase::PROBE => assert_eq!(
                    c.download_floats,
                    (b + 1 - a) as u64 * context,
                    "{name}: the probe downloads more than its scores"
                ),
                "(outside phases)" => {}
                _ => assert_eq!(c.downloads, 0, "{name}: phase {p} downloaded {} floats", c.download_floats),
            }
        }
        let staged: u64 = by_phase.values().map(|c| c.staged_floats).sum();
        let copies: BTreeMap<&str, (u64, u64)> =
            by_phase.iter().map(|(p, c)| (*p, (c.downloads, c.download_floats))).collect();
        if plane {
            assert_eq!(staged, 0, "{name}: over a device plane nothing is staged");
            assert_eq!(Some(&copies), staged_copies.get(name), "{name}: the plane changed the steps' own copies");
            continue;
        }
        staged_copies.insert(name, copies);
        if ranks == 1 {
            assert_eq!(staged, 0, "{name}: a world of one stages nothing");
        } else {
            assert!(staged > 0, "{name}: {ranks} ranks exchanged nothing");
        }
    }
}
