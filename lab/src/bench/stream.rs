//! `bench stream`: a stream of questions over a corpus whose documents are asked about with
//! Zipf-distributed popularity, several documents per question in retrieval order, on thread
//! ranks whose chunk stores live through the stream: the chunk-store hit rate and TTFT with
//! positional placement (`--slack 0`) against cache-aware placement (issue 52, item 4).

use crate::Result;
use flowprefill_coordinator::{Context, Job, Request, RunOptions, ThreadRanks};
use flowprefill_kernels::Device;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// The document of the untimed first question: not in the corpus (generated prose never says
/// this), so that it leaves the head in the stores and nothing of the corpus.
const OUTSIDE: &str = "This note is asked about once, before the stream, and never again.";

/// One question's lookups of document chunks over every rank, (RAM hits, disk hits, misses):
/// each rank's own less its head lookup, a RAM hit once the stores hold the head.
fn doc_lookups(ranks: &[flowprefill_coordinator::RankStats]) -> (u64, u64, u64) {
    let (mut ram, mut disk, mut miss) = (0u64, 0u64, 0u64);
    for s in ranks {
        ram += s.cache_hits.saturating_sub(s.cache_disk_hits).saturating_sub(1);
        disk += s.cache_disk_hits;
        miss += s.cache_misses;
    }
    (ram, disk, miss)
}

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

/// One configuration's stream: chunk-store lookups of the documents' chunks, and TTFT.
pub struct Row {
    /// Ranks.
    pub ranks: usize,
    /// Cache-aware slack.
    pub slack: f64,
    /// Questions asked.
    pub queries: usize,
    /// Documents' chunks found in RAM.
    pub ram: u64,
    /// Documents' chunks found on disk.
    pub disk: u64,
    /// Documents' chunks not found (prefilled).
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

/// The question every job asks.
const QUERY: &str = "Which place is named most often in these documents?";

/// Asks every question of `questions` over `corpus` on `world` with options `base` at `slack`,
/// after one untimed question over a document outside the corpus, which leaves every rank's
/// store holding the head (the template before the documents, the same for every question).
/// Each rank looks the head up once per question, a hit from then on: those lookups are taken
/// out, so that the counts are the documents' chunks alone.
pub fn run(
    world: &mut ThreadRanks<Device>,
    corpus: &[String],
    questions: &[Vec<usize>],
    base: &RunOptions,
    slack: f64,
) -> Result<Row> {
    let (mut ram, mut disk, mut miss) = (0u64, 0u64, 0u64);
    let mut ttft = Vec::with_capacity(questions.len());
    let opts = RunOptions { cache_slack: slack, ..base.clone() };
    let job = |docs: Vec<String>| Job {
        request: Request {
            conversation: Default::default(),
            context: Context::Documents(docs),
            query: QUERY.into(),
            system: None,
            answer_prefix: None,
        },
        options: opts.clone(),
    };
    world.run(&job(vec![OUTSIDE.into()]), &mut |_| true)?;
    for q in questions {
        let r = world.run(&job(q.iter().map(|&d| corpus[d].clone()).collect()), &mut |_| true)?;
        let (r_ram, r_disk, r_miss) = doc_lookups(&r.rank_stats);
        (ram, disk, miss) = (ram + r_ram, disk + r_disk, miss + r_miss);
        ttft.push(r.ttft.as_secs_f64() * 1e3);
    }
    let mean = ttft.iter().sum::<f64>() / ttft.len() as f64;
    let median = crate::median(&mut ttft);
    Ok(Row { ranks: world.size(), slack, queries: questions.len(), ram, disk, miss, mean, median })
}

#[cfg(test)]
mod tests {
    use super::*;
    use flowprefill_coordinator::RankStats;

    #[test]
    fn the_head_lookup_of_every_rank_is_not_counted() {
        let rank = |hits: u64, disk: u64, misses: u64| RankStats {
            cache_hits: hits,
            cache_disk_hits: disk,
            cache_misses: misses,
            ..RankStats::default()
        };
        // Rank 0: the head and one chunk in RAM, one chunk on disk, two prefilled; rank 1: the
        // head alone found, one chunk prefilled.
        assert_eq!(doc_lookups(&[rank(3, 1, 2), rank(1, 0, 1)]), (1, 1, 3));
        let row = Row { ranks: 2, slack: 0.0, queries: 1, ram: 1, disk: 1, miss: 3, mean: 1.0, median: 1.0 };
        assert_eq!(row.csv(), "2,0,1,5,1,1,3,0.4000,1.0,1.0");
    }
}
