//! AdamW (decoupled weight decay) whose moments can be saved and restored, so that a training
//! run stopped at any step continues exactly (candle-nn's `AdamW` keeps its moments private; the
//! update is the same, and a test holds the two to each other).

use super::Result;
use candle_core::{Tensor, Var};

/// AdamW's settings.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct AdamWConfig {
    /// Learning rate (scaled by the schedule before each step).
    pub lr: f64,
    /// First-moment decay.
    pub beta1: f64,
    /// Second-moment decay.
    pub beta2: f64,
    /// Denominator guard.
    pub eps: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
}

impl AdamWConfig {
    /// The usual settings (those of candle-nn's and PyTorch's AdamW), usable in constants.
    pub const DEFAULT: Self = Self { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 };
}

impl Default for AdamWConfig {
    fn default() -> Self {
        Self::DEFAULT
    }
}

/// One variable's optimiser: its moments and the step count.
pub struct AdamW {
    /// Settings.
    pub config: AdamWConfig,
    /// First moment.
    pub m: Tensor,
    /// Second moment.
    pub v: Tensor,
    /// Steps taken.
    pub step: u64,
}

impl AdamW {
    /// A fresh optimiser for `var`.
    pub fn new(var: &Var, config: AdamWConfig) -> Result<Self> {
        Ok(Self { config, m: var.zeros_like()?, v: var.zeros_like()?, step: 0 })
    }

    /// One update of `var` by `grad` at learning rate `lr`.
    pub fn step(&mut self, var: &Var, grad: &Tensor, lr: f64) -> Result<()> {
        let c = self.config;
        self.step += 1;
        let t = self.step as i32;
        self.m = ((&self.m * c.beta1)? + (grad * (1.0 - c.beta1))?)?;
        self.v = ((&self.v * c.beta2)? + (grad.sqr()? * (1.0 - c.beta2))?)?;
        let m_hat = (&self.m / (1.0 - c.beta1.powi(t)))?;
        let v_hat = (&self.v / (1.0 - c.beta2.powi(t)))?;
        let decayed = (var.as_tensor() * (1.0 - lr * c.weight_decay))?;
        let update = ((m_hat / (v_hat.sqrt()? + c.eps)?)? * lr)?;
        var.set(&(decayed - update)?)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;
    use candle_nn::Optimizer;

    /// The same updates as candle-nn's AdamW over several steps of a quadratic.
    #[test]
    fn matches_candle_nn_adamw() {
        let start: Vec<f32> = (0..12).map(|i| (i as f32 * 0.37).sin()).collect();
        let target = Tensor::from_vec((0..12).map(|i| i as f32 * 0.1).collect::<Vec<f32>>(), 12, &Device::Cpu).unwrap();
        let cfg = AdamWConfig { lr: 0.05, weight_decay: 0.1, ..AdamWConfig::default() };
        let ours = Var::from_vec(start.clone(), 12, &Device::Cpu).unwrap();
        let theirs = Var::from_vec(start, 12, &Device::Cpu).unwrap();
        let mut opt = AdamW::new(&ours, cfg).unwrap();
        let params = candle_nn::ParamsAdamW {
            lr: cfg.lr,
            beta1: cfg.beta1,
            beta2: cfg.beta2,
            eps: cfg.eps,
            weight_decay: cfg.weight_decay,
        };
        let mut reference = candle_nn::AdamW::new(vec![theirs.clone()], params).unwrap();
        let loss = |v: &Var| (v.as_tensor() - &target).unwrap().sqr().unwrap().sum_all().unwrap();
        for _ in 0..25 {
            let g = loss(&ours).backward().unwrap();
            opt.step(&ours, g.get(ours.as_tensor()).unwrap(), cfg.lr).unwrap();
            reference.backward_step(&loss(&theirs)).unwrap();
        }
        let a: Vec<f32> = ours.as_tensor().to_vec1().unwrap();
        let b: Vec<f32> = theirs.as_tensor().to_vec1().unwrap();
        // The same update in f32, ours and candle's: 25 steps of values near 1 keep a few ulps.
        const CANDLE_TOL: f32 = 1e-5;
        for (x, y) in a.iter().zip(&b) {
            assert!((x - y).abs() < CANDLE_TOL, "{a:?} vs {b:?}");
        }
        assert_eq!(opt.step, 25);
    }
}
