//! Next-token choice: greedy by default, temperature and nucleus (top-p) sampling optional.

use crate::error::{Field, InputError, Result};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// How to pick the next token.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct SamplingConfig {
    /// 0 means greedy (argmax); otherwise logits are divided by it.
    pub temperature: f32,
    /// Nucleus mass in (0, 1]; 1 keeps every token.
    pub top_p: f32,
    /// Seed of the sampler's RNG (sampling is reproducible).
    pub seed: u64,
}

impl Default for SamplingConfig {
    fn default() -> Self {
        Self { temperature: 0.0, top_p: 1.0, seed: 0 }
    }
}

/// A stateful sampler.
#[derive(Debug)]
pub struct Sampler {
    cfg: SamplingConfig,
    rng: StdRng,
    /// Where the decoding loop counts the answer's tokens as it takes them ([`Self::count_into`]).
    tally: Option<Arc<AtomicU64>>,
}

/// Index of the largest logit (the first one on ties; NaN never wins).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    let mut best_v = f32::NEG_INFINITY;
    for (i, &v) in logits.iter().enumerate() {
        if v > best_v {
            best_v = v;
            best = i;
        }
    }
    best as u32
}

impl Sampler {
    /// Checks the configuration.
    pub fn new(cfg: SamplingConfig) -> Result<Self> {
        if !(cfg.temperature >= 0.0 && cfg.temperature.is_finite()) {
            return Err(InputError::new(
                Field::Temperature,
                format!("{} must be a finite number >= 0", cfg.temperature),
            )
            .into());
        }
        if !(cfg.top_p > 0.0 && cfg.top_p <= 1.0) {
            return Err(InputError::new(Field::TopP, format!("{} must be in (0, 1]", cfg.top_p)).into());
        }
        let rng = StdRng::seed_from_u64(cfg.seed);
        Ok(Self { cfg, rng, tally: None })
    }

    /// Counts into `tally` every token the decoding loop ([`crate::generate::decode_with`])
    /// takes into the answer (not an end token), as it takes it: what a job that fails later
    /// had produced (and streamed) by then, which its lost result cannot say.
    pub fn count_into(&mut self, tally: Arc<AtomicU64>) {
        self.tally = Some(tally);
    }

    /// One more token of the answer (see [`Self::count_into`]).
    pub(crate) fn took_one(&self) {
        if let Some(t) = &self.tally {
            t.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Picks a token from logits. A NaN logit never wins, as in [`argmax`] (its probability is
    /// 0: it used to sort first, turn every sum into NaN and hand back the least likely token).
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.cfg.temperature == 0.0 || logits.is_empty() {
            return argmax(logits);
        }
        let t = self.cfg.temperature;
        let mx = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        // No finite maximum (a +inf logit, or none above -inf): `l - mx` would be NaN for every
        // token and the least likely one handed back. The greedy choice is the only sensible one.
        if !mx.is_finite() {
            return argmax(logits);
        }
        let mut probs: Vec<(f32, u32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (if l.is_nan() { 0.0 } else { ((l - mx) / t).exp() }, i as u32))
            .collect();
        probs.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        let total: f32 = probs.iter().map(|p| p.0).sum();
        // Keep the smallest prefix whose mass reaches top_p.
        let mut kept = 0usize;
        let mut mass = 0f32;
        for p in &probs {
            kept += 1;
            mass += p.0;
            if mass >= self.cfg.top_p * total {
                break;
            }
        }
        let r = self.rng.random::<f32>() * mass;
        let mut acc = 0f32;
        for p in &probs[..kept] {
            acc += p.0;
            if acc >= r {
                return p.1;
            }
        }
        probs[kept - 1].1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_is_argmax_first_on_ties() {
        let mut s = Sampler::new(SamplingConfig::default()).unwrap();
        assert_eq!(s.sample(&[0.1, 3.0, 3.0, -1.0]), 1);
        assert_eq!(argmax(&[f32::NAN, 1.0]), 1);
    }

    #[test]
    fn an_infinite_logit_is_chosen_and_all_minus_infinity_is_greedy() {
        let mut s = Sampler::new(SamplingConfig { temperature: 1.0, top_p: 0.9, seed: 3 }).unwrap();
        for _ in 0..20 {
            assert_eq!(s.sample(&[0.5, f32::INFINITY, 2.0, -1.0]), 1);
            assert_eq!(s.sample(&[f32::NEG_INFINITY; 4]), 0);
        }
    }

    #[test]
    fn a_nan_logit_is_never_sampled() {
        let mut s = Sampler::new(SamplingConfig { temperature: 1.0, top_p: 1.0, seed: 5 }).unwrap();
        for _ in 0..200 {
            let t = s.sample(&[f32::NAN, 2.0, f32::NAN, 1.0, -50.0]);
            assert!(t == 1 || t == 3 || t == 4, "sampled {t}, a NaN logit");
        }
        let mut s = Sampler::new(SamplingConfig { temperature: 0.7, top_p: 0.01, seed: 5 }).unwrap();
        assert_eq!(s.sample(&[f32::NAN, 2.0, f32::NAN, 1.0, -50.0]), 1, "the best finite logit");
    }

    #[test]
    fn top_p_small_keeps_only_the_best() {
        let mut s = Sampler::new(SamplingConfig { temperature: 1.0, top_p: 0.01, seed: 3 }).unwrap();
        for _ in 0..50 {
            assert_eq!(s.sample(&[0.0, 5.0, 1.0]), 1);
        }
    }

    #[test]
    fn sampling_is_seeded_and_varies() {
        let cfg = SamplingConfig { temperature: 1.0, top_p: 1.0, seed: 9 };
        let logits = [0.0f32; 8];
        let a: Vec<u32> = {
            let mut s = Sampler::new(cfg.clone()).unwrap();
            (0..40).map(|_| s.sample(&logits)).collect()
        };
        let b: Vec<u32> = {
            let mut s = Sampler::new(cfg).unwrap();
            (0..40).map(|_| s.sample(&logits)).collect()
        };
        assert_eq!(a, b);
        assert!(a.iter().any(|&x| x != a[0]));
    }

    #[test]
    fn rejects_bad_config() {
        assert!(Sampler::new(SamplingConfig { temperature: -1.0, ..Default::default() }).is_err());
        assert!(Sampler::new(SamplingConfig { top_p: 0.0, ..Default::default() }).is_err());
        assert!(Sampler::new(SamplingConfig { top_p: 1.5, ..Default::default() }).is_err());
    }
}
