//! An idle world gives back what its backends keep for reuse (on a GPU, the memory pool's
//! unused reserve, which an idle service held at its last job's peak): rank 0 at each idle
//! tick, every other rank as it hears the tick.

use flowprefill_coordinator::{Job, RunOptions, ThreadRanks};
use flowprefill_tests::counting::{needle_request, Counting};
use flowprefill_worker::LoadedModel;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[test]
fn every_rank_releases_unused_memory_when_the_world_is_idle() {
    let lm = Arc::new(LoadedModel::load(&flowprefill_tests::default_model_path(), Counting::default()).expect("model"));
    // Two thread ranks over one backend: each rank's release is counted there.
    let mut world = ThreadRanks::new(lm.clone(), 2, 1 << 30, Duration::from_secs(60)).expect("ranks");
    let job = Job { request: needle_request(), options: RunOptions { max_new_tokens: 1, ..RunOptions::default() } };
    world.run(&job, &mut |_| true).expect("job");
    let backend = lm.model.backend();
    assert_eq!(backend.released(), 0, "a job releases nothing: the next one reuses it");
    world.idle().expect("idle tick");
    let t = Instant::now();
    while backend.released() < 2 && t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(backend.released(), 2, "rank 0 and rank 1 each release once per tick");
}
