//! LookaheadKV (paper 004): the ground truth its lookahead rows learn, how well SnapKV's
//! observation window and the trained lookahead rows predict it, and the training ([`fit`]).
//!
//! The truth is the attention the model's own greedy answer pays every context row, per
//! (layer, KV head): the answer's rows run teacher-forced after the prompt over the context
//! cache, and their attention mass under the exact normaliser is summed over the rows and over
//! the query heads of each KV group (GQA), as the paper aggregates it. SnapKV's prediction is
//! what `--evict snapkv` keeps by: the prompt's last 32 rows, pooled over 7 (the window's own
//! scores are kept too: the training loss compares the lookahead rows' unpooled scores, and
//! SnapKV's baseline is measured on both transforms). For a budget N, per (layer, head):
//! * overlap: the share of the truth's top N that the prediction's top N holds;
//! * recall: the share of the answer's attention mass on the context that the prediction's top
//!   N rows carry (what eviction to N keeps of what the answer will read);
//! * the same recall for the last N context rows (a recency baseline) and for the truth's own
//!   top N (the most any choice of N rows can keep).
//!
//! ```text
//!   context (prefilled once)  |  prompt (SnapKV window: its last 32 rows)  |  answer (truth rows)
//! ```

pub mod fit;

use super::Result;
use flowprefill_comm::local::LocalComm;
use flowprefill_coordinator::layout::Layout;
use flowprefill_coordinator::select::pool_mean;
use flowprefill_coordinator::Request;
use flowprefill_kernels::Backend as _;
use flowprefill_worker::evict::{top_rows, SNAPKV_POOL, SNAPKV_WINDOW};
use flowprefill_worker::generate::{decode_with, prefill_into};
use flowprefill_worker::kv::{KeyForm, KvCache};
use flowprefill_worker::model::Logits;
use flowprefill_worker::sampling::{Sampler, SamplingConfig};
use flowprefill_worker::steps::{HeadScores, LocalSegment, Replicated};
use flowprefill_worker::{Cpu, LoadedModel};

/// Scores of every context row per (layer, KV head): `values[l][h][row]`.
#[derive(Clone, Debug, PartialEq)]
pub struct HeadImportance {
    /// `[layer][kv_head][row]`.
    pub values: Vec<Vec<Vec<f32>>>,
}

impl HeadImportance {
    fn of_one_segment(mut heads: HeadScores) -> Result<Self> {
        let values = heads
            .pop()
            .filter(|_| heads.is_empty())
            .ok_or_else(|| super::TrainError::Model("head scores of one context segment expected".into()))?;
        Ok(Self { values })
    }

    /// Every (layer, head) pair's scores, layer by layer.
    pub fn pairs(&self) -> impl Iterator<Item = &[f32]> {
        self.values.iter().flatten().map(Vec::as_slice)
    }
}

/// One case: the greedy answer, SnapKV's prediction and the truth.
#[derive(Clone, Debug)]
pub struct CaseImportance {
    /// The greedy answer's tokens (without the end token).
    pub answer: Vec<u32>,
    /// Context rows (template head and chunks).
    pub context_rows: usize,
    /// SnapKV's scores (pooled, as eviction pools them).
    pub snapkv: HeadImportance,
    /// SnapKV's window's scores before pooling (the transform of the training loss).
    pub snapkv_window: HeadImportance,
    /// LookaheadKV's scores (pooled), when the model has a lookahead adapter.
    pub lookahead: Option<HeadImportance>,
    /// The answer's attention mass.
    pub truth: HeadImportance,
}

/// Runs one case on the CPU: context prefill, the prompt (SnapKV's scores), greedy decoding of
/// at most `max_answer` tokens, then the answer teacher-forced (the truth). `None` when the
/// answer is empty (nothing reads the context).
pub fn case_importance(lm: &LoadedModel<Cpu>, req: &Request, max_answer: usize) -> Result<Option<CaseImportance>> {
    let layout = Layout::build(lm, req)?;
    let order: Vec<usize> = (0..layout.chunks.len()).collect();
    let tokens = layout.full_tokens(&order);
    let ctx = layout.prompt_start() as usize;
    let model = &lm.model;
    let (be, cfg) = (model.backend(), model.config());
    let empty = || KvCache::new(be, cfg.n_layers, cfg.kv_dim(), KeyForm::Rotated);
    let mut cache = empty()?;
    prefill_into(model, &mut cache, &tokens[..ctx], 0, model.backend().prefill_rows())?;
    let mut comm = LocalComm::group(1).pop().ok_or_else(|| super::TrainError::Model("a world of one rank".into()))?;
    let prompt = &tokens[ctx..];
    let prompt_pos: Vec<u32> = (ctx as u32..tokens.len() as u32).collect();
    // The prompt over the context: SnapKV's window, and the first token.
    let mut tail = empty()?;
    let segs = || vec![LocalSegment::placed(0, &cache)];
    let mut rep = Replicated::new(be, &mut comm, "snapkv", segs(), &mut tail, &prompt_pos, vec![])?
        .with_head_scores(SNAPKV_WINDOW);
    let logits = model.forward(prompt, &prompt_pos, &mut rep, Logits::Last)?.last().to_vec();
    let (_, heads) = rep.commit_with_heads()?;
    let pooled = |mut h: HeadImportance| {
        for s in h.values.iter_mut().flatten() {
            *s = pool_mean(s, SNAPKV_POOL);
        }
        h
    };
    let snapkv_window = HeadImportance::of_one_segment(heads)?;
    let snapkv = pooled(snapkv_window.clone());
    // LookaheadKV's rows after the prompt (their own K/V dropped again).
    let lookahead = match model.lookahead_rows() {
        0 => None,
        n => {
            let next = tokens.len() as u32;
            let pos: Vec<u32> = (next..next + n as u32).collect();
            let mut rep =
                Replicated::new(be, &mut comm, "lookahead", segs(), &mut tail, &pos, vec![])?.with_head_scores(n);
            model.forward_lookahead(&pos, &mut rep, cfg.n_layers, &mut flowprefill_worker::interrupt::never)?;
            Some(pooled(HeadImportance::of_one_segment(rep.discard_with_heads()?)?))
        }
    };
    // Greedy decoding over the context and the prompt's rows.
    let mut sampler = Sampler::new(SamplingConfig::default())?;
    let first = sampler.sample(&logits);
    let mut step = |tok: u32, pos: u32| -> flowprefill_worker::Result<Vec<f32>> {
        let mut rep = Replicated::new(be, &mut comm, "decode", segs(), &mut tail, &[pos], vec![])?;
        let out = model.forward(&[tok], &[pos], &mut rep, Logits::Last)?;
        rep.commit()?;
        Ok(out.last().to_vec())
    };
    let next = tokens.len() as u32;
    let window = cfg.context_length;
    let (answer, _) =
        decode_with(&lm.tokenizer, first, &mut sampler, max_answer, window, next, &mut step, &mut |_| true)?;
    if answer.is_empty() {
        return Ok(None);
    }
    // The answer teacher-forced after the prompt: its rows' attention is the truth.
    let mut forced = prompt.to_vec();
    forced.extend_from_slice(&answer);
    let forced_pos: Vec<u32> = (ctx as u32..(ctx + forced.len()) as u32).collect();
    let mut tail = empty()?;
    let mut comm = LocalComm::group(1).pop().ok_or_else(|| super::TrainError::Model("a world of one rank".into()))?;
    let segs = vec![LocalSegment::placed(0, &cache)];
    let mut rep =
        Replicated::new(be, &mut comm, "truth", segs, &mut tail, &forced_pos, vec![])?.with_head_scores(answer.len());
    model.forward(&forced, &forced_pos, &mut rep, Logits::None)?;
    let (_, heads) = rep.commit_with_heads()?;
    let truth = HeadImportance::of_one_segment(heads)?;
    Ok(Some(CaseImportance { answer, context_rows: ctx, snapkv, snapkv_window, lookahead, truth }))
}

/// How well one choice of N rows matches the truth, averaged over (layer, head) pairs.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct Agreement {
    /// Share of the truth's top N in the prediction's top N.
    pub overlap: f64,
    /// Share of the answer's context attention mass on the prediction's top N.
    pub recall: f64,
    /// The same recall for the last N context rows.
    pub recent_recall: f64,
    /// The truth's own top N: the most N rows can keep.
    pub oracle_recall: f64,
}

/// SnapKV against the truth at budget `n` (every row kept when `n` is the context or more).
pub fn agreement(case: &CaseImportance, n: usize) -> Agreement {
    agreement_of(&case.snapkv, &case.truth, n)
}

/// A prediction against the truth at budget `n`.
pub fn agreement_of(prediction: &HeadImportance, truth: &HeadImportance, n: usize) -> Agreement {
    let mut a = Agreement::default();
    let mut pairs = 0usize;
    for (pred, truth) in prediction.pairs().zip(truth.pairs()) {
        let rows = truth.len();
        let n = n.min(rows);
        let mass: f64 = truth.iter().map(|&x| f64::from(x)).sum();
        if n == 0 || mass <= 0.0 {
            continue;
        }
        let on = |kept: &[usize]| kept.iter().map(|&j| f64::from(truth[j])).sum::<f64>() / mass;
        let best = top_rows(truth, n);
        let chosen = top_rows(pred, n);
        let common = chosen.iter().filter(|j| best.binary_search(j).is_ok()).count();
        let recent: Vec<usize> = (rows - n..rows).collect();
        a.overlap += common as f64 / n as f64;
        a.recall += on(&chosen);
        a.recent_recall += on(&recent);
        a.oracle_recall += on(&best);
        pairs += 1;
    }
    let k = pairs.max(1) as f64;
    Agreement {
        overlap: a.overlap / k,
        recall: a.recall / k,
        recent_recall: a.recent_recall / k,
        oracle_recall: a.oracle_recall / k,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn case(pred: Vec<f32>, truth: Vec<f32>) -> CaseImportance {
        CaseImportance {
            answer: vec![1],
            context_rows: truth.len(),
            snapkv: HeadImportance { values: vec![vec![pred.clone()]] },
            snapkv_window: HeadImportance { values: vec![vec![pred]] },
            lookahead: None,
            truth: HeadImportance { values: vec![vec![truth]] },
        }
    }

    #[test]
    fn agreement_counts_overlap_and_the_mass_kept() {
        // Truth's top 2: rows 1 and 3 (mass 0.5 + 0.3 of 1.0); the prediction picks 1 and 0.
        let c = case(vec![0.9, 1.0, 0.0, 0.1, 0.0], vec![0.1, 0.5, 0.0, 0.3, 0.1]);
        let a = agreement(&c, 2);
        assert!((a.overlap - 0.5).abs() < 1e-9, "{a:?}");
        assert!((a.recall - 0.6).abs() < 1e-6, "{a:?}");
        assert!((a.recent_recall - 0.4).abs() < 1e-6, "{a:?}");
        assert!((a.oracle_recall - 0.8).abs() < 1e-6, "{a:?}");
        // A budget above the context keeps everything.
        let all = agreement(&c, 10);
        assert_eq!((all.overlap, all.oracle_recall), (1.0, 1.0));
        assert!((all.recall - 1.0).abs() < 1e-6 && (all.recent_recall - 1.0).abs() < 1e-6);
    }
}
