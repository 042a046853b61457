//! Cache-aware sharding (`cache_slack`): on several ranks a chunk goes to the rank whose chunk
//! store holds it when the token balance allows, so a second question over the same documents
//! in another order reads them instead of prefilling them on the wrong rank; the answers equal
//! positional placement's (exact scope: N ranks compute what one does), and
//! the forms a store is asked about are the forms the jobs stored (every prefix mode).

use flowprefill_coordinator::layout::Layout;
use flowprefill_coordinator::{Context, Engine, Job, Method, Request, RunOptions, RunResult, ThreadRanks};
use flowprefill_tests::{rel_diff, shared_model, RANKS_LOGIT_TOL};
use std::time::Duration;

/// Four documents of nearly the same length (the positional split puts two on each rank).
fn docs() -> Vec<String> {
    (0..4)
        .map(|i| {
            let mut t = String::new();
            for s in 0..7 {
                t.push_str(&format!(
                    "Warden {i} of the east wall logged {} crates of salt in year {}. ",
                    3 * s + i,
                    1900 + s
                ));
                if i == 2 && s == 3 {
                    t.push_str("The cellar key of the east wall is kept under stone 318. ");
                }
            }
            t
        })
        .collect()
}

fn request(docs: Vec<String>) -> Request {
    Request {
        conversation: Default::default(),
        context: Context::Documents(docs),
        query: "Under which stone is the cellar key of the east wall kept?".into(),
        system: None,
        answer_prefix: None,
    }
}

fn misses(r: &RunResult) -> u64 {
    r.rank_stats.iter().map(|s| s.cache_misses).sum()
}

/// Runs, on a fresh pair of thread ranks (RAM stores only), the documents in order, then the
/// same documents as [d0, d3, d2, d1] (positionally: d3 on rank 0 and d1 on rank 1, the
/// opposite of where the first job left them), with `slack`.
fn second_question(method: Method, slack: f64) -> RunResult {
    let mut world = ThreadRanks::new(shared_model(), 2, 1 << 30, Duration::from_secs(120)).expect("ranks");
    let opts = RunOptions { method, ratio: 0.2, max_new_tokens: 6, cache_slack: slack, ..Default::default() };
    let d = docs();
    let first = world.run(&Job { request: request(d.clone()), options: opts.clone() }, &mut |_| true).expect("first");
    assert_eq!(first.owners, vec![0, 0, 1, 1], "{method}: the positional split of four equal documents");
    let swapped = vec![d[0].clone(), d[3].clone(), d[2].clone(), d[1].clone()];
    world.run(&Job { request: request(swapped), options: opts }, &mut |_| true).expect("second")
}

#[test]
fn chunks_go_where_they_are_held_and_answers_do_not_change() {
    // A selecting method of each prefix mode that keeps chunks apart (InfoFlow: none; the
    // other selectors share its placement and forms), CacheClip's shared prefix, and `none`.
    for method in [Method::Infoflow, Method::None, Method::Cacheclip] {
        let positional = second_question(method, 0.0);
        let aware = second_question(method, 0.1);
        eprintln!(
            "{method}: second question, owners {:?} -> {:?}, misses {} -> {}, answer {:?}",
            positional.owners,
            aware.owners,
            misses(&positional),
            misses(&aware),
            aware.answer
        );
        assert_eq!(positional.owners, vec![0, 0, 1, 1], "{method}: slack 0 is positional");
        assert_eq!(aware.owners, vec![0, 1, 1, 0], "{method}: d3 and d1 go back to their ranks");
        assert!(misses(&positional) >= 2, "{method}: positional placement prefills d3 and d1 again");
        assert_eq!(misses(&aware), 0, "{method}: every chunk read from the store of its rank");
        assert_eq!(aware.tokens, positional.tokens, "{method}: the answer changed with the placement");
        let d = rel_diff(&aware.first_logits, &positional.first_logits);
        assert!(d <= RANKS_LOGIT_TOL, "{method}: first-token logits differ by {d}");
    }
}

/// What `held_levels` asks the store about is what the jobs stored: after a job in each prefix
/// mode, every chunk is held in RAM (2) in that mode's form.
#[test]
fn the_forms_asked_for_are_the_forms_stored() {
    for (method, mode) in [
        (Method::Infoflow, flowprefill_coordinator::PrefixMode::None),
        (Method::Cacheclip, flowprefill_coordinator::PrefixMode::Shared),
        (Method::Star, flowprefill_coordinator::PrefixMode::Anchor),
    ] {
        let engine = Engine::new(shared_model(), 1 << 30);
        let req = request(docs());
        let layout = Layout::for_method(engine.model(), &req, method).expect("layout");
        assert_eq!(engine.held_levels(&layout, mode), vec![0; 4], "{method}: an empty store");
        let opts = RunOptions { method, max_new_tokens: 1, ..Default::default() };
        engine.run(&req, &opts, &mut |_| true).expect("job");
        assert_eq!(engine.held_levels(&layout, mode), vec![2; 4], "{method} ({mode:?}): every chunk in RAM");
    }
}

/// The disk tier's scope tells two models apart by every weight, not by the embedding alone
/// (the adapters' fingerprint): a copy of a model with one byte of its last tensor changed (a
/// fine-tune that keeps the embedding) has the same fingerprint and another content digest.
#[test]
fn the_disk_tier_tells_models_apart_by_every_weight_not_only_the_embedding() {
    use flowprefill_tests::{temp_dir, write_tiny_gguf, TinySpec};
    use flowprefill_worker::{adapter::model_fingerprint, config::ModelConfig, gguf::GgufFile};
    let dir = temp_dir("identity");
    let (a, b) = (dir.join("a.gguf"), dir.join("b.gguf"));
    write_tiny_gguf(&a, &TinySpec::new("llama"));
    let mut bytes = std::fs::read(&a).unwrap();
    let at = bytes.len() - 5;
    bytes[at] ^= 0x10;
    std::fs::write(&b, &bytes).unwrap();
    let ids = |p: &std::path::Path| {
        let f = GgufFile::open(p).unwrap();
        let cfg = ModelConfig::from_gguf(&f).unwrap();
        (model_fingerprint(&cfg, &f.raw_tensor("token_embd.weight").unwrap().bytes), f.content_digest().unwrap())
    };
    let ((fa, da), (fb, db)) = (ids(&a), ids(&b));
    assert_eq!(fa, fb, "the embedding is the same");
    assert_ne!(da, db, "a changed weight changes the digest");
    assert_eq!(ids(&a).1, da, "the same file, the same digest");
    let _ = std::fs::remove_dir_all(dir);
}

/// `bench ttft`'s cold runs on thread ranks with a disk tier: run, forget every chunk cache
/// (fresh ranks), empty the folder, run again; no entry lands in the folder after it was
/// emptied, and the next run reads nothing from disk. Before, `rebuild` left the old followers
/// running, and their disk writers still wrote after the folder was emptied (a "cold" run with
/// disk hits, and a warning that an entry was not written).
#[test]
fn a_cold_run_after_forget_and_clear_reads_nothing_from_the_disk_tier() {
    use flowprefill_coordinator::{DiskTier, World};
    use flowprefill_worker::store::disk;
    // On the build's disk (where fsync takes time), not a RAM-backed temporary folder.
    let nonce = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("cold-disk-{nonce}"));
    std::fs::create_dir_all(&dir).expect("folder");
    let tier = DiskTier { dir: dir.clone(), bytes: 1 << 30 };
    let ranks = ThreadRanks::new(shared_model(), 2, 1 << 30, Duration::from_secs(120))
        .and_then(|w| w.with_disk(Some(tier)))
        .expect("ranks");
    let mut world = World::Threads(ranks);
    let opts = RunOptions { method: Method::None, max_new_tokens: 1, ..Default::default() };
    // Eight documents of about 400 tokens (four on rank 1): megabytes for its disk writer.
    let long = |d: String| [d.clone(), d.replace("Warden", "Keeper"), d.replace("salt", "wool"), d].concat();
    let mut many: Vec<String> = docs().into_iter().map(long).collect();
    many.extend(docs().into_iter().map(|d| long(d.replace("east", "west"))));
    let job = Job { request: request(many), options: opts };
    for i in 0..4 {
        let r = world.run(&job, &mut |_| true).expect("job").expect("a result on thread ranks");
        assert_eq!(r.cache_disk_hits, 0, "run {i}: a cold run read {} chunks from disk", r.cache_disk_hits);
        assert!(r.cache_misses > 0, "run {i}: chunks were prefilled");
        world.forget_caches().expect("forget");
        disk::clear(&dir).expect("clear");
        std::thread::sleep(Duration::from_millis(300));
        let late = disk::list(&dir, None).expect("list").len();
        assert_eq!(late, 0, "run {i}: {late} entries written after the folder was emptied");
    }
    drop(world);
    let _ = std::fs::remove_dir_all(dir);
}
