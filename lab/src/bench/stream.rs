//! `bench stream`: a stream of questions over a corpus whose documents are asked about with
//! Zipf-distributed popularity, several documents per question in retrieval order, on thread
//! ranks whose chunk stores live through the stream: the chunk-store hit rate and TTFT with
//! positional placement (`--slack 0`) against cache-aware placement (issue 52, item 4).

use crate::Result;
use flowprefill_coordinator::{Context, Job, Request, RunOptions, ThreadRanks};
use flowprefill_kernels::Device;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// The CSV's header line.
pub const CSV_HEADER: &str =
    "ranks,slack,queries,lookups,ram_hits,disk_hits,misses,hit_rate,ttft_mean_ms,ttft_median_ms";

/// The stream's shape.
#[derive(Clone, Copy, Debug)]
pub struct Stream {
    /// Documents in the corpus.
    pub corpus: usize,
    /// Questions in the stream.
    pub queries: usize,
    /// Documents per question.
    pub docs_per_query: usize,
    /// Zipf exponent of document popularity.
    pub zipf: f64,
    /// Seed of the stream.
    pub seed: u64,
}

/// The questions: each a list of distinct document indices, most popular first drawn.
pub fn questions(a: &Stream) -> Vec<Vec<usize>> {
    let weights: Vec<f64> = (1..=a.corpus).map(|i| 1.0 / (i as f64).powf(a.zipf)).collect();
    let total: f64 = weights.iter().sum();
    let mut rng = StdRng::seed_from_u64(a.seed ^ 0x5eed);
    (0..a.queries)
        .map(|_| {
            let mut picked: Vec<usize> = Vec::with_capacity(a.docs_per_query);
            while picked.len() < a.docs_per_query.min(a.corpus) {
                let mut x = rng.random_range(0.0..total);
                let d = weights.iter().position(|&w| {
                    x -= w;
                    x < 0.0
                });
                let d = d.unwrap_or(a.corpus - 1);
                if !picked.contains(&d) {
                    picked.push(d);
                }
            }
            picked
        })
        .collect()
}

/// The table's header line.
pub fn header() -> String {
    format!(
        "{:>5} {:>6} {:>9} {:>7} {:>7} {:>9} {:>13} {:>15}",
        "ranks", "slack", "lookups", "hits", "misses", "hit rate", "TTFT mean ms", "TTFT median ms"
    )
}

/// One configuration's stream: chunk-store lookups and TTFT.
pub struct Row {
    /// Ranks.
    pub ranks: usize,
    /// Cache-aware slack.
    pub slack: f64,
    /// Questions asked.
    pub queries: usize,
    /// Hits in RAM.
    pub ram: u64,
    /// Hits on disk.
    pub disk: u64,
    /// Misses.
    pub miss: u64,
    /// Mean TTFT (ms).
    pub mean: f64,
    /// Median TTFT (ms).
    pub median: f64,
}

impl Row {
    fn lookups(&self) -> u64 {
        self.ram + self.disk + self.miss
    }

    fn rate(&self) -> f64 {
        (self.ram + self.disk) as f64 / self.lookups().max(1) as f64
    }

    /// The table's line.
    pub fn line(&self) -> String {
        let (p, slack, lookups, miss, mean, med) =
            (self.ranks, self.slack, self.lookups(), self.miss, self.mean, self.median);
        format!(
            "{p:>5} {slack:>6} {lookups:>9} {:>7} {miss:>7} {:>8.1}% {mean:>13.0} {med:>15.0}",
            self.ram + self.disk,
            100.0 * self.rate()
        )
    }

    /// The CSV's line.
    pub fn csv(&self) -> String {
        let (p, slack, lookups, ram, disk, miss) =
            (self.ranks, self.slack, self.lookups(), self.ram, self.disk, self.miss);
        format!(
            "{p},{slack},{},{lookups},{ram},{disk},{miss},{:.4},{:.1},{:.1}",
            self.queries,
            self.rate(),
            self.mean,
            self.median
        )
    }
}

/// Asks every question of `questions` over `corpus` on `world` with options `base` at `slack`.
pub fn run(
    world: &mut ThreadRanks<Device>,
    corpus: &[String],
    questions: &[Vec<usize>],
    base: &RunOptions,
    slack: f64,
) -> Result<Row> {
    let (mut ram, mut disk, mut miss) = (0u64, 0u64, 0u64);
    let mut ttft = Vec::with_capacity(questions.len());
    for q in questions {
        let req = Request {
            context: Context::Documents(q.iter().map(|&d| corpus[d].clone()).collect()),
            query: "Which place is named most often in these documents?".into(),
            system: None,
            answer_prefix: None,
        };
        let opts = RunOptions { cache_slack: slack, ..base.clone() };
        let r = world.run(&Job { request: req, options: opts }, &mut |_| true)?;
        for s in &r.rank_stats {
            ram += s.cache_hits.saturating_sub(s.cache_disk_hits);
            disk += s.cache_disk_hits;
            miss += s.cache_misses;
        }
        ttft.push(r.ttft.as_secs_f64() * 1e3);
    }
    let mean = ttft.iter().sum::<f64>() / ttft.len() as f64;
    let median = crate::median(&mut ttft);
    Ok(Row { ranks: world.size(), slack, queries: questions.len(), ram, disk, miss, mean, median })
}
