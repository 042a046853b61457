//! The pipeline of one job, decided from token counts before any work: which rank holds which
//! chunk, how many tokens are recomputed, whether the selection scores anything (and so runs
//! the probe), the probe's depth, how the chunk prefill and the recomputation are batched, and
//! the [`Step`]s that follow from all that, in order ([`Pipeline::steps`]).
//!
//! The engine runs these steps (each of its phases asks [`Pipeline::runs`] whether it is one);
//! the memory plan ([`crate::memory`]) and the projection (`flowprefill_lab::project::work`,
//! one counting function per step) walk the same description instead of deciding again, so
//! the three cannot drift apart: `tests/tests/suite/projection_counts.rs` checks that the engine
//! times exactly these steps and that the projection counts what the engine runs.

use crate::method::{Build, Probe};
use crate::request::{Method, PrefixMode, RunOptions};
use crate::select::default_score_layers;
use crate::shard;
use crate::timings::phase;
use flowprefill_kernels::topk::count_for_ratio;
use flowprefill_worker::steps::{batches, DEFAULT_BATCH_TOKENS};
use std::ops::Range;

/// What the selection phase does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Selection {
    /// Nothing is recomputed (a method that selects nothing, or a budget of 0).
    Nothing,
    /// Every context token is recomputed (a budget of the whole context: exact).
    Everything,
    /// The policy scores the tokens and the top `budget` are recomputed.
    Scored,
}

/// One step of a chunked job (every method but `full` and `ring`), in the engine's order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// Each rank's chunk caches (the head on every rank): store hits, else prefilled alone in
    /// [`Pipeline::chunk_batches`]. No communication.
    ChunkPrefill,
    /// The prompt scores the chunks over their caches and the layout is reordered (`+reorder`).
    Reorder,
    /// The caches placed at their global positions (one rotation each).
    Place,
    /// The policy scores the context: with the prompt's forward to the last scoring layer over
    /// the placed segments (`probe`), or from its own signal (EPIC, random).
    Score {
        /// Whether the prompt runs a forward (the probe).
        probe: bool,
    },
    /// The global top [`Pipeline::budget`] and the policy's refinement.
    Select,
    /// The selected tokens recomputed at their global positions, [`Pipeline::recompute_batch`]
    /// at a time.
    Recompute,
    /// The prompt over every segment: the first token's logits.
    Prompt,
    /// The segments cut to the KV budget per (layer, KV head) by the prompt's attention
    /// (`--evict`), before the first token is chosen.
    Evict,
}

impl Step {
    /// The engine's timing phase of this step (`--stats`, the metrics, the projection).
    pub fn phase(self) -> &'static str {
        match self {
            Step::ChunkPrefill => phase::CHUNK_PREFILL,
            Step::Reorder => phase::REORDER,
            Step::Place => phase::ASSEMBLE,
            Step::Score { .. } => phase::PROBE,
            Step::Select => phase::SELECTION,
            Step::Recompute => phase::RECOMPUTE,
            Step::Prompt => phase::FINAL_PROMPT,
            Step::Evict => phase::EVICT,
        }
    }
}

/// One job's pipeline.
#[derive(Clone, Debug)]
pub struct Pipeline {
    /// The method.
    pub method: Method,
    /// Ranks.
    pub ranks: usize,
    /// Prefix mode in effect.
    pub prefix: PrefixMode,
    /// Ratio in effect (0 for `none`/`star`, 1 for `full`/`ring`).
    pub ratio: f64,
    /// Context tokens.
    pub n_context: usize,
    /// Tokens the ratio buys (recomputed when the method selects); with a budget by coverage,
    /// the most it may keep (`--max-ratio`).
    pub budget: usize,
    /// A budget by coverage: the share of the score mass the selection reaches, and the fewest
    /// tokens it keeps (`--min-ratio`); the selection phase finds how many between that and
    /// [`Pipeline::budget`].
    pub coverage: Option<(f64, usize)>,
    /// Owner rank of each chunk (request order; all on rank 0 for `full`).
    pub owners: Vec<usize>,
    /// What the selection phase does.
    pub selection: Selection,
    /// Whether the chunks are reordered before placement.
    pub reorder: bool,
    /// Whether the prompt runs a scoring forward over the placed chunks (the probe): the
    /// reordering does, and every scored policy but EPIC's and random's.
    pub probes: bool,
    /// Scoring layers of the probe (first, last), where the policy uses them.
    pub score_layers: (usize, usize),
    /// Selected tokens per recompute forward.
    pub recompute_batch: usize,
    /// Whether the cache is evicted to a budget after the prompt.
    pub evicts: bool,
    /// Tokens of each chunk (request order).
    pub chunk_tokens: Vec<usize>,
    /// How far above the positional split's largest load cache-aware placement may go.
    pub cache_slack: f64,
}

impl Pipeline {
    /// The pipeline of `opts` on `ranks` ranks for chunks of `chunk_tokens` tokens, on a model
    /// of `n_layers` blocks.
    pub fn new(opts: &RunOptions, chunk_tokens: &[usize], ranks: usize, n_layers: usize) -> Self {
        let ranks = ranks.max(1);
        let n_context: usize = chunk_tokens.iter().sum();
        let ratio = opts.effective_ratio();
        let (budget, coverage) = match opts.coverage.filter(|_| opts.method.selects()) {
            Some(c) => {
                let (least, most) = c.bounds(n_context);
                (most, Some((c.share, least)))
            }
            None => (count_for_ratio(ratio, n_context), None),
        };
        // A coverage below 1 cuts somewhere between its bounds: scored unless they meet.
        let whole = coverage.is_none_or(|(share, least)| share >= 1.0 || least >= budget);
        let info = opts.method.info();
        let owners =
            if info.build == Build::Single { vec![0; chunk_tokens.len()] } else { shard::plan(chunk_tokens, ranks) };
        let selection = if budget == 0 || !opts.method.selects() {
            Selection::Nothing
        } else if budget >= n_context && whole {
            Selection::Everything
        } else {
            Selection::Scored
        };
        let scores_with_forward = info.probe != Probe::None;
        let reorder = opts.reorder && !opts.method.is_exact_prefill();
        let probes = reorder || (selection == Selection::Scored && scores_with_forward);
        Self {
            method: opts.method,
            ranks,
            prefix: opts.prefix_mode(),
            ratio,
            n_context,
            budget,
            coverage,
            owners,
            selection,
            reorder,
            probes,
            score_layers: opts.score_layers.unwrap_or_else(|| default_score_layers(n_layers)),
            recompute_batch: opts.recompute_batch.max(1),
            evicts: opts.evict.is_some(),
            chunk_tokens: chunk_tokens.to_vec(),
            cache_slack: opts.cache_slack,
        }
    }

    /// This pipeline with its chunks placed by what the ranks' stores hold (`held[rank][chunk]`,
    /// see [`shard::aware`]) within the job's `cache_slack`; unchanged when `held` is empty, for
    /// `full` (one rank computes) and for the exact prefills.
    pub fn placed_by(mut self, held: &[Vec<u8>]) -> Self {
        if !held.is_empty() && !self.method.is_exact_prefill() {
            self.owners = shard::aware(&self.chunk_tokens, self.ranks, held, self.cache_slack);
        }
        self
    }

    /// The steps of a chunked job, in order (`full` and `ring` run one exact prefill instead).
    pub fn steps(&self) -> Vec<Step> {
        let mut steps = vec![Step::ChunkPrefill];
        if self.reorder {
            steps.push(Step::Reorder);
        }
        steps.push(Step::Place);
        if self.selection == Selection::Scored {
            let probe = self.method.info().probe != Probe::None;
            steps.extend([Step::Score { probe }, Step::Select]);
        }
        if self.recomputed() > 0 {
            steps.push(Step::Recompute);
        }
        steps.push(Step::Prompt);
        if self.evicts {
            steps.push(Step::Evict);
        }
        steps
    }

    /// Whether the job runs `step` (a [`Step::Score`] matches with or without the probe).
    pub fn runs(&self, step: Step) -> bool {
        let same = |s: &Step| std::mem::discriminant(s) == std::mem::discriminant(&step);
        self.steps().iter().any(same)
    }

    /// Tokens recomputed: the budget when the method selects, else none (with a budget by
    /// coverage, the most it may recompute).
    pub fn recomputed(&self) -> usize {
        match self.selection {
            Selection::Nothing => 0,
            Selection::Everything => self.n_context,
            Selection::Scored => self.budget,
        }
    }

    /// Chunks held by `rank` (request order).
    pub fn local_chunks(&self, rank: usize) -> Vec<usize> {
        shard::local_chunks(&self.owners, rank)
    }

    /// `rank`'s chunk-prefill forwards when every chunk misses the store: groups of its chunks
    /// (ids), each one batched forward (the worker's greedy batching by tokens).
    pub fn chunk_batches(&self, rank: usize, chunk_tokens: &[usize]) -> Vec<Vec<usize>> {
        let local = self.local_chunks(rank);
        let lens: Vec<usize> = local.iter().map(|&c| chunk_tokens[c]).collect();
        batches(&lens, DEFAULT_BATCH_TOKENS).into_iter().map(|r: Range<usize>| local[r].to_vec()).collect()
    }

    /// Whether chunk `c` is prefilled behind the template head (the first chunk always; every
    /// chunk with the shared prefix).
    pub fn behind_head(&self, c: usize) -> bool {
        self.prefix == PrefixMode::Shared || c == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(method: Method, ratio: f64) -> RunOptions {
        RunOptions { method, ratio, ..RunOptions::default() }
    }

    #[test]
    fn selection_follows_the_budget_and_the_method() {
        let chunks = [100, 100, 56];
        let p = Pipeline::new(&opts(Method::Infoflow, 0.15), &chunks, 2, 30);
        // round(0.15 x 256 = 38.4)
        assert_eq!((p.budget, p.selection, p.probes), (38, Selection::Scored, true));
        assert_eq!(p.recomputed(), 38);
        assert_eq!(p.owners, shard::plan(&chunks, 2));
        let p = Pipeline::new(&opts(Method::Infoflow, 1.0), &chunks, 2, 30);
        assert_eq!((p.selection, p.probes, p.recomputed()), (Selection::Everything, false, 256));
        let p = Pipeline::new(&opts(Method::Infoflow, 0.0), &chunks, 2, 30);
        assert_eq!((p.selection, p.probes, p.recomputed()), (Selection::Nothing, false, 0));
        let p = Pipeline::new(&opts(Method::None, 0.5), &chunks, 2, 30);
        assert_eq!((p.ratio, p.selection, p.probes), (0.0, Selection::Nothing, false));
        let p = Pipeline::new(&opts(Method::Epic, 0.15), &chunks, 2, 30);
        assert_eq!((p.selection, p.probes), (Selection::Scored, false));
        let p = Pipeline::new(&RunOptions { reorder: true, ..opts(Method::Epic, 0.15) }, &chunks, 2, 30);
        assert!(p.probes, "reordering scores the chunks with the prompt");
        let p = Pipeline::new(&opts(Method::Full, 0.15), &chunks, 4, 30);
        assert_eq!((p.owners, p.ratio, p.selection, p.probes), (vec![0, 0, 0], 1.0, Selection::Nothing, false));
        assert_eq!(Pipeline::new(&opts(Method::Infoflow, 0.15), &chunks, 1, 24).score_layers, default_score_layers(24));
    }

    #[test]
    fn steps_follow_the_decisions() {
        use Step::*;
        let chunks = [100, 100, 56];
        let steps = |o: RunOptions| Pipeline::new(&o, &chunks, 2, 30).steps();
        let scored = [ChunkPrefill, Place, Score { probe: true }, Select, Recompute, Prompt];
        assert_eq!(steps(opts(Method::Infoflow, 0.15)), scored);
        assert_eq!(
            steps(opts(Method::Epic, 0.15)),
            [ChunkPrefill, Place, Score { probe: false }, Select, Recompute, Prompt]
        );
        assert_eq!(steps(opts(Method::Infoflow, 1.0)), [ChunkPrefill, Place, Recompute, Prompt]);
        assert_eq!(steps(opts(Method::Infoflow, 0.0)), [ChunkPrefill, Place, Prompt]);
        assert_eq!(steps(opts(Method::None, 0.5)), [ChunkPrefill, Place, Prompt]);
        let evict = Some(crate::request::Evict { policy: crate::request::EvictPolicy::Snapkv, budget: 64 });
        assert_eq!(steps(RunOptions { evict, ..opts(Method::None, 0.5) }), [ChunkPrefill, Place, Prompt, Evict]);
        let reordered = steps(RunOptions { reorder: true, ..opts(Method::None, 0.15) });
        assert_eq!(reordered, [ChunkPrefill, Reorder, Place, Prompt]);
        let p = Pipeline::new(&RunOptions { reorder: true, ..opts(Method::Epic, 0.15) }, &chunks, 2, 30);
        assert!(p.runs(Reorder) && p.runs(Score { probe: true }) && p.probes);
        let p = Pipeline::new(&opts(Method::Infoflow, 0.0), &chunks, 2, 30);
        assert!(!p.runs(Select) && !p.runs(Recompute) && p.runs(Prompt));
        let phases: Vec<&str> = scored.iter().map(|s| s.phase()).collect();
        assert_eq!(phases, ["chunk_prefill", "assemble", "probe", "selection", "recompute", "final_prompt"]);
    }

    #[test]
    fn chunk_batches_cover_each_rank_once() {
        let chunks = vec![700; 9];
        let p = Pipeline::new(&opts(Method::Infoflow, 0.15), &chunks, 3, 30);
        let mut seen: Vec<usize> = (0..3).flat_map(|r| p.chunk_batches(r, &chunks).concat()).collect();
        seen.sort_unstable();
        assert_eq!(seen, (0..9).collect::<Vec<_>>());
        for r in 0..3 {
            assert!(p.chunk_batches(r, &chunks).iter().all(|b| b.iter().all(|&c| p.owners[c] == r)));
        }
    }
}
