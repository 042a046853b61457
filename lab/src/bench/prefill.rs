//! `bench prefill`: full prefill of generated English prose at several lengths: tokens/s,
//! spread, peak RSS, and where the time goes.

use crate::{LabError, Result};
use flowprefill_worker::generate::prefill_into;
use flowprefill_worker::kv::{KeyForm, KvCache};
use flowprefill_worker::model::OpTimes;
use flowprefill_worker::{Backend, LoadedModel};
use std::time::Instant;

/// Seconds of `runs` full prefills of `ids` (after one warm-up) and their mean op profile; fewer
/// runs when `stop` says so before one (none when it does before the first).
pub fn time_prefills<B: Backend>(
    lm: &LoadedModel<B>,
    ids: &[u32],
    runs: usize,
    piece: usize,
    stop: &dyn Fn() -> bool,
) -> Result<(Vec<f64>, OpTimes)> {
    let model = &lm.model;
    let cfg = model.config();
    let mut times = Vec::with_capacity(runs);
    let mut prof = OpTimes::default();
    for run in 0..=runs {
        if stop() {
            break;
        }
        let mut cache = KvCache::new(model.backend(), cfg.n_layers, cfg.kv_dim(), KeyForm::Rotated)?;
        model.profile().reset();
        let t = Instant::now();
        let logits = prefill_into(model, &mut cache, ids, 0, piece)?;
        let dt = t.elapsed().as_secs_f64();
        if !logits.iter().all(|x| x.is_finite()) {
            return Err(LabError::Failed(format!("non-finite logits at {} tokens", ids.len())));
        }
        if run > 0 {
            times.push(dt);
            let p = model.op_times()?;
            prof.matmul_s += p.matmul_s;
            prof.attention_s += p.attention_s;
            prof.norm_rope_s += p.norm_rope_s;
            prof.elementwise_s += p.elementwise_s;
            prof.logits_s += p.logits_s;
        }
    }
    let n = times.len().max(1) as f64;
    for s in
        [&mut prof.matmul_s, &mut prof.attention_s, &mut prof.norm_rope_s, &mut prof.elementwise_s, &mut prof.logits_s]
    {
        *s /= n;
    }
    Ok((times, prof))
}

/// The table's header line.
pub fn header() -> String {
    format!(
        "{:>7} {:>10} {:>10} {:>10} {:>9} {:>9} | {:>7} {:>7} {:>7} {:>7}",
        "tokens", "median s", "min s", "max s", "tok/s", "peak MB", "matmul", "attn", "norm+rope", "other"
    )
}

/// One length's measurement.
pub struct Row {
    /// Prompt tokens.
    pub tokens: usize,
    /// Timed runs.
    pub runs: usize,
    /// Seconds of each timed run.
    pub times: Vec<f64>,
    /// The mean op profile.
    pub prof: OpTimes,
    /// Peak RSS (MB; NaN when unknown).
    pub peak_mb: f64,
    /// Whether the peak counts from the process start (it could not be reset).
    pub peak_since_start: bool,
}

impl Row {
    /// (median, min, max) seconds.
    fn spread(&self) -> (f64, f64, f64) {
        let (min, max) = self.times.iter().fold((f64::MAX, 0f64), |(lo, hi), &t| (lo.min(t), hi.max(t)));
        (crate::median(&mut self.times.clone()), min, max)
    }

    /// The table's line.
    pub fn line(&self) -> String {
        let (med, min, max) = self.spread();
        let prof = &self.prof;
        let total = prof.total_s().max(1e-12);
        let pct = |x: f64| 100.0 * x / total;
        format!(
            "{:>7} {:>10.3} {:>10.3} {:>10.3} {:>9.1} {:>9.0} | {:>6.1}% {:>6.1}% {:>8.1}% {:>6.1}%",
            self.tokens,
            med,
            min,
            max,
            self.tokens as f64 / med,
            self.peak_mb,
            pct(prof.matmul_s),
            pct(prof.attention_s),
            pct(prof.norm_rope_s),
            pct(prof.elementwise_s + prof.logits_s)
        )
    }

    /// The JSON object of the row.
    pub fn json(&self) -> serde_json::Value {
        let (med, min, max) = self.spread();
        serde_json::json!({
            "tokens": self.tokens,
            "runs": self.runs,
            "median_s": med,
            "min_s": min,
            "max_s": max,
            "times_s": self.times,
            "tok_per_s": self.tokens as f64 / med,
            "peak_rss_mb": self.peak_mb,
            "peak_rss_since_start": self.peak_since_start,
            "breakdown_s": self.prof,
        })
    }
}
