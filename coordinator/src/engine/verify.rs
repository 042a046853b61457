//! Verification against the exact answer, and the quality gate on it (`--verify`,
//! `--quality-floor`, `--on-breach`).
//!
//! A verified job runs twice through the world: as asked, then exactly (full prefill on one
//! rank, ring on several; a job of its own, so every rank follows it as any job), with the same
//! request, answer length and sampling. The answer then carries how far it was from the exact
//! one ([`Quality`]): the KL divergence of the first answer token's distribution, whether both
//! put the same token first, and how many leading answer tokens agree. The exact answer is
//! decoded freely: its leading tokens equal the approximate answer's exactly as far as the
//! exact model, fed the approximate answer, would have picked the same tokens (teacher
//! forcing), and it is the answer a breached job falls back to.
//!
//! The exact answer depends only on the twin (request, answer length, sampling, seed) and the
//! world's size, so the last one computed is kept ([`ExactMemo`]): jobs that ask the same
//! request in turn (an eval's methods over one case, a client retrying with another method)
//! pay for it once, and their `quality` says it was reused.

use super::RunResult;
use crate::request::{Job, Method, OnBreach, RunOptions};
use flowprefill_worker::sampling::argmax;
use std::sync::Mutex;

/// How a verified answer compares with the exact one.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Quality {
    /// KL(exact || answered) of the first answer token's distribution, in nats (0: the same).
    pub kl: f64,
    /// Whether both put the same token first.
    pub top1: bool,
    /// Leading answer tokens on which both agree.
    pub agree_tokens: usize,
    /// Tokens of the answer as computed (before any fallback).
    pub answer_tokens: usize,
    /// How the exact answer was computed (full on one rank, ring on several).
    pub exact_method: Method,
    /// The exact computation's time to first token, in milliseconds (when reused, the time it
    /// took when it was computed).
    pub exact_ttft_ms: f64,
    /// Whether the exact answer was the one computed for an earlier job with the same request
    /// (nothing was computed for this job's verification).
    #[serde(default)]
    pub exact_reused: bool,
    /// The exact answer's text.
    pub exact_answer: String,
    /// The KL bound the answer was held to (`--quality-floor`), if any.
    pub floor: Option<f64>,
    /// Whether the KL was above the floor.
    pub breached: bool,
    /// Whether the answer returned is the exact one (a breach under `--on-breach fallback`).
    pub fell_back: bool,
}

/// The exact twin of `job` in a world of `ranks`: the same request, answer length and
/// sampling, full prefill (one rank) or ring attention (several), nothing approximate and no
/// verification of its own.
pub fn exact_job(job: &Job, ranks: usize) -> Job {
    let o = &job.options;
    let method = if ranks > 1 { Method::Ring } else { Method::Full };
    let options = RunOptions {
        method,
        ratio: 1.0,
        max_new_tokens: o.max_new_tokens,
        sampling: o.sampling.clone(),
        seed: o.seed,
        cache_slack: o.cache_slack,
        ..RunOptions::default()
    };
    Job { request: job.request.clone(), options }
}

/// The last exact answer computed for verification, under its twin's key (the twin as JSON
/// and the world's size). One entry: the jobs that share an exact answer come in turn.
#[derive(Default)]
pub(super) struct ExactMemo(Mutex<Option<(String, RunResult)>>);

impl ExactMemo {
    /// The key of `exact` in a world of `ranks` (None: the job does not serialize, never reused).
    pub(super) fn key(exact: &Job, ranks: usize) -> Option<String> {
        serde_json::to_string(exact).ok().map(|j| format!("{ranks} {j}"))
    }

    /// The exact answer kept under `key`, if it is the last one computed.
    pub(super) fn get(&self, key: &str) -> Option<RunResult> {
        let kept = self.0.lock().unwrap_or_else(|p| p.into_inner());
        kept.as_ref().filter(|(k, _)| k == key).map(|(_, r)| r.clone())
    }

    /// Keeps `exact` under `key` in place of the last one.
    pub(super) fn put(&self, key: String, exact: &RunResult) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = Some((key, exact.clone()));
    }
}

/// KL(p || q) of the distributions of two logit vectors, in nats (f64 throughout). Logits
/// that are no distribution (a NaN or +inf on either side: a broken computation) are as far as
/// can be: infinite, never a pass (a NaN sum read as 0 through `max` passed every floor).
fn kl_of_logits(p: &[f32], q: &[f32]) -> f64 {
    if p.len() != q.len() || p.is_empty() || broken(p) || broken(q) {
        return f64::INFINITY;
    }
    let log_softmax = |x: &[f32]| -> Vec<f64> {
        let mx = x.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(v as f64));
        let z = x.iter().map(|&v| (v as f64 - mx).exp()).sum::<f64>().ln() + mx;
        x.iter().map(|&v| v as f64 - z).collect()
    };
    let (lp, lq) = (log_softmax(p), log_softmax(q));
    let kl: f64 = lp.iter().zip(&lq).map(|(a, b)| if a.is_finite() { a.exp() * (a - b) } else { 0.0 }).sum();
    if kl.is_nan() {
        return f64::INFINITY;
    }
    kl.max(0.0)
}

/// Logits that are no distribution: a NaN or +inf (a broken computation).
fn broken(x: &[f32]) -> bool {
    x.iter().any(|v| v.is_nan() || *v == f32::INFINITY)
}

/// The quality of `answered` against `exact`, and the gate's verdict under `opts`; under
/// `fallback` a breached answer becomes the exact one; `reused`: the exact answer was kept
/// from an earlier job.
pub(super) fn judge(answered: &mut RunResult, exact: RunResult, reused: bool, opts: &RunOptions) {
    // The reference itself broken: nothing to judge by, and nothing to fall back to (nor to
    // learn from: the caller learns from a quality only).
    if broken(&exact.first_logits) {
        answered.verify_error =
            Some("the exact computation's first-token logits hold a NaN or +inf: the answer is not verified".into());
        return;
    }
    let kl = kl_of_logits(&exact.first_logits, &answered.first_logits);
    let agree_tokens = answered.tokens.iter().zip(&exact.tokens).take_while(|(a, b)| a == b).count();
    let breached = opts.quality_floor.is_some_and(|f| kl > f);
    let fell_back = breached && opts.on_breach == OnBreach::Fallback;
    let quality = Quality {
        kl,
        top1: argmax(&exact.first_logits) == argmax(&answered.first_logits),
        agree_tokens,
        answer_tokens: answered.tokens.len(),
        exact_method: exact.method,
        exact_ttft_ms: exact.ttft.as_secs_f64() * 1e3,
        exact_reused: reused,
        exact_answer: exact.answer.clone(),
        floor: opts.quality_floor,
        breached,
        fell_back,
    };
    if fell_back {
        answered.answer = exact.answer;
        answered.tokens = exact.tokens;
        answered.stop = exact.stop;
    }
    answered.quality = Some(quality);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kl_is_zero_for_the_same_logits_and_grows_with_the_difference() {
        let p = [1.0f32, 2.0, 3.0, -1.0];
        assert_eq!(kl_of_logits(&p, &p), 0.0);
        let shifted: Vec<f32> = p.iter().map(|v| v + 5.0).collect();
        assert!(kl_of_logits(&p, &shifted) < 1e-12, "a shift of every logit is the same distribution");
        let near = [1.0f32, 2.0, 2.9, -1.0];
        let far = [3.0f32, 2.0, 1.0, -1.0];
        let (a, b) = (kl_of_logits(&p, &near), kl_of_logits(&p, &far));
        assert!(a > 0.0 && a < b, "{a} {b}");
        // By hand: p = softmax([0, ln 3]) = (1/4, 3/4), q = (3/4, 1/4):
        // KL = 1/4 ln(1/3) + 3/4 ln 3 = ln 3 / 2.
        let three = 3f32.ln();
        let kl = kl_of_logits(&[0.0, three], &[three, 0.0]);
        assert!((kl - 3f64.ln() / 2.0).abs() < 1e-6, "{kl}");
        assert!(kl_of_logits(&[1.0], &[1.0, 2.0]).is_infinite(), "different vocabularies never pass");
        // A NaN or +inf anywhere is a broken computation: never a pass (a NaN was 0 before).
        for bad in [f32::NAN, f32::INFINITY] {
            let mut broken = p;
            broken[2] = bad;
            assert_eq!(kl_of_logits(&p, &broken), f64::INFINITY, "{bad} answered");
            assert_eq!(kl_of_logits(&broken, &p), f64::INFINITY, "{bad} exact");
        }
        // A token the answer gives no chance (-inf) where the exact one gives some: infinite;
        // one neither gives any: nothing.
        let mut none = p;
        none[3] = f32::NEG_INFINITY;
        assert_eq!(kl_of_logits(&p, &none), f64::INFINITY);
        assert_eq!(kl_of_logits(&none, &none), 0.0);
    }

    #[test]
    fn the_exact_twin_keeps_the_request_and_drops_the_approximation() {
        let job = Job {
            request: crate::request::Request {
                conversation: Default::default(),
                context: crate::request::Context::Documents(vec!["a".into()]),
                query: "q?".into(),
                system: None,
                answer_prefix: None,
            },
            options: RunOptions {
                method: Method::Infoflow,
                ratio: 0.2,
                verify: true,
                quality_floor: Some(0.1),
                max_new_tokens: 7,
                ..RunOptions::default()
            },
        };
        let one = exact_job(&job, 1);
        assert_eq!(one.options.method, Method::Full);
        assert_eq!(exact_job(&job, 3).options.method, Method::Ring);
        assert!(!one.options.verify && one.options.quality_floor.is_none(), "no verification of its own");
        assert_eq!(one.options.max_new_tokens, 7);
        assert_eq!(one.request.query, job.request.query);
    }
}
