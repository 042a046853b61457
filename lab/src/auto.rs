//! The projection's answer to `--method auto` (issue 53, item 4): for each candidate (full
//! prefill, ring attention on several ranks, `none`, InfoFlow at the request's ratio or
//! coverage) a predicted TTFT from the projection's work accounting on a device profile
//! (`cpu-local` as `bench calibrate` measures it, or a GPU's), with the chunks the store holds
//! costing no prefill, and an expected quality: the mean KL of the method's verified answers on
//! this model when there are [`HISTORY_MIN`] of them, else a stated prior ([`prior_kl`]). The
//! fastest candidate whose expected KL is within the floor wins; a context of one chunk is
//! answered by full prefill (chunking it changes nothing but adds the probe).
//!
//! The history is a JSON-lines file of verified answers (`$FLOWPREFILL_HOME/quality/history.jsonl`
//! for `run` and `serve`), appended by every verified job of a process that has a chooser.

use crate::project::{self, Profiles};
use flowprefill_coordinator::auto::{label, Candidate, Choice, Chooser, Situation, DEFAULT_AUTO_FLOOR};
use flowprefill_coordinator::request::{Method, RunOptions};
use std::io::Write;
use std::path::PathBuf;
use std::sync::Mutex;

/// Verified answers of a method on a model needed before their mean replaces the prior. The
/// first token's KL is heavy-tailed: on Qwen2.5-Coder-0.5B at 8K the first three verified
/// answers of `none` averaged 0.028 and the first six 0.251 (docs/quality.md, "With a quality
/// history"); the verified sets there hold 24-32 answers over 4-6 tasks.
pub const HISTORY_MIN: usize = 20;

/// The prior's KL for recomputing nothing: the mean first-token KL of `none` against full
/// prefill measured on SmolLM2-135M at 2,048 tokens (docs/quality.md: 0.21 over 32 cases).
pub const PRIOR_KL_NONE: f64 = 0.2;

/// The built-in device profile and link `auto` predicts a GPU named `name` with (the driver's
/// name, `NVIDIA H200`, `NVIDIA A100-SXM4-80GB`, ...): an H200 as `h200`, an A100 as `a100-sxm`
/// (NVLink 3), an H100 as `h100-sxm` (NVLink 4); the PCIe cards' links as PCIe. Any other GPU,
/// or none known, is predicted as an H100 (the choice's `why` names the profile).
pub fn gpu_profile(name: Option<&str>) -> (&'static str, &'static str) {
    let n = name.unwrap_or("").to_ascii_uppercase();
    let pcie = n.contains("PCIE");
    if n.contains("H200") {
        ("h200", "nvlink4")
    } else if n.contains("H100") {
        ("h100-sxm", if pcie { "pcie5" } else { "nvlink4" })
    } else if n.contains("A100") {
        ("a100-sxm", if pcie { "pcie4" } else { "nvlink3" })
    } else {
        ("h100-sxm", "nvlink4")
    }
}

/// The InfoFlow share of the context a coverage budget is predicted to recompute before any
/// run of it is in the history.
pub const PRIOR_COVERAGE_RATIO: f64 = 0.15;

/// Expected first-token KL of a method recomputing `recomputed` of its context, before any
/// verified answer: 0 for the exact methods, `PRIOR_KL_NONE * (1 - recomputed)^3` for the
/// chunked ones (nothing recomputed: `none`'s measured mean; everything: exact). A stated
/// guess that the history replaces.
pub fn prior_kl(method: Method, recomputed: f64) -> f64 {
    if method.is_exact_prefill() {
        0.0
    } else {
        PRIOR_KL_NONE * (1.0 - recomputed.clamp(0.0, 1.0)).powi(3)
    }
}

/// One verified answer, as the history keeps it.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
struct Verified {
    /// The model's fingerprint.
    model: String,
    /// The method with its budget (`infoflow@0.15`).
    label: String,
    /// First-token KL against the exact answer, nats.
    kl: f64,
    /// Share of the context recomputed.
    recomputed: f64,
}

/// The chooser `run` and `serve` attach: projection and history.
pub struct ProjectedChooser {
    profiles: Profiles,
    device: String,
    link: String,
    history: Option<PathBuf>,
    seen: Mutex<Vec<Verified>>,
    /// Whether the ranks share one device's compute (CPU ranks on one machine's cores).
    shared: bool,
}

impl ProjectedChooser {
    /// Predicts on profile `device` (ranks joined by `link`) from `profiles`, learning from and
    /// appending to `history` (`None`: in memory only). Unreadable history lines are skipped
    /// with one warning.
    pub fn new(profiles: Profiles, device: &str, link: &str, history: Option<PathBuf>) -> crate::Result<Self> {
        profiles.device(device)?;
        profiles.link(link)?;
        let mut seen = Vec::new();
        if let Some(text) = history.as_ref().and_then(|p| std::fs::read_to_string(p).ok()) {
            let mut bad = 0;
            for line in text.lines().filter(|l| !l.trim().is_empty()) {
                match serde_json::from_str::<Verified>(line) {
                    Ok(v) => seen.push(v),
                    Err(_) => bad += 1,
                }
            }
            if bad > 0 {
                tracing::warn!("auto: {bad} unreadable lines of the quality history skipped");
            }
        }
        Ok(Self { profiles, device: device.into(), link: link.into(), history, seen: Mutex::new(seen), shared: false })
    }

    /// Ranks that share one device's compute (CPU ranks on the cores `device` was calibrated
    /// on): each of P ranks computing at once gets a P-th of it. Without this, P ranks are
    /// predicted P times the device (measured 2026-11-26: every 2-rank candidate came out about
    /// half its measured TTFT on 2 cores, docs/quality.md).
    pub fn sharing_the_device(mut self, shared: bool) -> Self {
        self.shared = shared;
        self
    }

    /// The verified answers of `label` on `model` so far: (count, mean KL, mean recomputed).
    fn history_of(&self, model: &str, label: &str) -> (usize, f64, f64) {
        let seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        let mine: Vec<&Verified> = seen.iter().filter(|v| v.model == model && v.label == label).collect();
        let n = mine.len();
        let mean = |f: &dyn Fn(&Verified) -> f64| mine.iter().map(|v| f(v)).sum::<f64>() / n.max(1) as f64;
        (n, mean(&|v| v.kl), mean(&|v| v.recomputed))
    }

    /// The share of the context `opts` recomputes: its ratio, or a coverage budget's mean in
    /// the history (else [`PRIOR_COVERAGE_RATIO`] within its bounds).
    fn recomputed(&self, model: &str, opts: &RunOptions) -> f64 {
        if !opts.method.selects() {
            return if opts.method.is_exact_prefill() { 1.0 } else { 0.0 };
        }
        match opts.coverage {
            None => opts.ratio,
            Some(c) => match self.history_of(model, &label(opts)) {
                (n, _, r) if n >= HISTORY_MIN => r,
                _ => PRIOR_COVERAGE_RATIO.clamp(c.min_ratio, c.max_ratio),
            },
        }
    }

    /// Predicted TTFT of `opts` in milliseconds.
    fn predict(&self, s: &Situation<'_>, opts: &RunOptions, recomputed: f64) -> Result<f64, String> {
        let shape = s.config.clone();
        let dev = self.profiles.device(&self.device).map_err(|e| e.to_string())?;
        let link = self.profiles.link(&self.link).map_err(|e| e.to_string())?;
        let ranks = if opts.method == Method::Full { 1 } else { s.ranks };
        let req = project::Request {
            head: s.head,
            chunks: s.chunks.clone(),
            prompt: s.prompt,
            selected: None,
            cached: if opts.method.is_exact_prefill() { Vec::new() } else { s.cached.clone() },
        };
        // The projection counts a budget by its ratio: a coverage is predicted at its share.
        let counted = RunOptions { ratio: recomputed, coverage: None, reorder: false, ..opts.clone() };
        let work = project::plan(&shape, &counted, ranks, &req, s.kv_bytes).map_err(|e| e.to_string())?;
        let share = if self.shared && ranks > 1 { 1.0 / ranks as f64 } else { 1.0 };
        Ok(project::project(&work, &shape, dev, link, share).ttft_s * 1e3)
    }
}

impl Chooser for ProjectedChooser {
    fn choose(&self, s: &Situation<'_>) -> Result<(Choice, RunOptions), String> {
        let floor = s.opts.quality_floor.unwrap_or(DEFAULT_AUTO_FLOOR);
        let with = |method: Method| RunOptions { method, reorder: false, ..s.opts.clone() };
        let mut options = vec![with(Method::Full)];
        if s.ranks > 1 {
            options.push(with(Method::Ring));
        }
        options.extend([with(Method::None), with(Method::Infoflow)]);
        let mut candidates = Vec::with_capacity(options.len());
        for o in &options {
            let l = label(o);
            let recomputed = self.recomputed(s.model, o);
            let (n, kl, _) = self.history_of(s.model, &l);
            let (expected_kl, quality_from) = if o.method.is_exact_prefill() {
                (0.0, "exact".to_string())
            } else if n >= HISTORY_MIN {
                (kl, format!("history ({n} verified)"))
            } else {
                (prior_kl(o.method, recomputed), "prior".to_string())
            };
            candidates.push(Candidate {
                label: l,
                ttft_ms: self.predict(s, o, recomputed)?,
                expected_kl,
                quality_from,
                meets: expected_kl <= floor,
            });
        }
        let fastest_meeting = candidates
            .iter()
            .enumerate()
            .filter(|(_, c)| c.meets)
            .min_by(|a, b| a.1.ttft_ms.total_cmp(&b.1.ttft_ms))
            .map(|(i, _)| i);
        let (winner, why) = if s.chunks.len() <= 1 {
            (0, "the context is one chunk: chunking it changes nothing but adds the probe, so full prefill".to_string())
        } else {
            // The exact methods always meet the floor: there is always a winner.
            let w = fastest_meeting.unwrap_or(0);
            let c = &candidates[w];
            let held = s.cached.iter().filter(|&&h| h).count();
            (
                w,
                format!(
                    "{}: predicted TTFT {:.1} ms, the fastest whose expected KL ({:.3}, {}) is within the floor {floor} \
                     ({held} of {} chunks in the store)",
                    c.label,
                    c.ttft_ms,
                    c.expected_kl,
                    c.quality_from,
                    s.chunks.len()
                ),
            )
        };
        // The profile the predictions came from (a calibration file's, or the built-in one of
        // the machine named).
        let why = format!("{why}; predicted on the `{}` profile, ranks over `{}`", self.device, self.link);
        let chosen = options.swap_remove(winner);
        Ok((Choice { floor, candidates, winner, why }, chosen))
    }

    fn learn(&self, model: &str, label: &str, kl: f64, recomputed: f64) {
        let v = Verified { model: model.into(), label: label.into(), kl, recomputed };
        if let Some(path) = &self.history {
            let line = serde_json::to_string(&v).unwrap_or_default();
            let appended = path
                .parent()
                .map_or(Ok(()), std::fs::create_dir_all)
                .and_then(|()| std::fs::OpenOptions::new().create(true).append(true).open(path))
                .and_then(|mut f| writeln!(f, "{line}"));
            if let Err(e) = appended {
                tracing::warn!("auto: the quality history {} was not appended ({e})", path.display());
            }
        }
        self.seen.lock().unwrap_or_else(|p| p.into_inner()).push(v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gpu_is_predicted_on_its_own_profile_where_there_is_one() {
        assert_eq!(gpu_profile(Some("NVIDIA H200")), ("h200", "nvlink4"));
        assert_eq!(gpu_profile(Some("NVIDIA H100 80GB HBM3")), ("h100-sxm", "nvlink4"));
        assert_eq!(gpu_profile(Some("NVIDIA H100 PCIe")), ("h100-sxm", "pcie5"));
        assert_eq!(gpu_profile(Some("NVIDIA A100-SXM4-80GB")), ("a100-sxm", "nvlink3"));
        assert_eq!(gpu_profile(Some("NVIDIA A100-PCIE-40GB")), ("a100-sxm", "pcie4"));
        assert_eq!(gpu_profile(Some("NVIDIA L40S")), ("h100-sxm", "nvlink4"));
        assert_eq!(gpu_profile(None), ("h100-sxm", "nvlink4"));
        // Every profile named is a built-in one.
        let p = crate::project::Profiles::builtin().expect("built-in profiles");
        for name in ["NVIDIA H200", "NVIDIA H100 PCIe", "NVIDIA A100-PCIE-40GB", "NVIDIA A100-SXM4-80GB"] {
            let (d, l) = gpu_profile(Some(name));
            assert!(p.device(d).is_ok() && p.link(l).is_ok(), "{name}: {d} over {l}");
        }
    }

    #[test]
    fn the_prior_falls_with_what_is_recomputed_and_is_zero_when_exact() {
        assert_eq!(prior_kl(Method::Full, 0.0), 0.0);
        assert_eq!(prior_kl(Method::None, 0.0), PRIOR_KL_NONE);
        assert!(prior_kl(Method::Infoflow, 0.15) < PRIOR_KL_NONE);
        assert!(prior_kl(Method::Infoflow, 0.3) < prior_kl(Method::Infoflow, 0.15));
        assert_eq!(prior_kl(Method::Infoflow, 1.0), 0.0);
    }

    #[test]
    fn ranks_sharing_the_device_are_predicted_slower_and_full_is_not() {
        let config = crate::project::shape::builtin("smollm2-135m").expect("built in");
        let opts = RunOptions { method: Method::Auto, ..RunOptions::default() };
        let s = Situation {
            opts: &opts,
            ranks: 2,
            head: 20,
            chunks: vec![512; 8],
            prompt: 24,
            cached: vec![false; 8],
            config: &config,
            model: "m",
            kv_bytes: 4,
        };
        let predicted = |shared: bool| -> Vec<(String, f64)> {
            let c = ProjectedChooser::new(Profiles::builtin().unwrap(), "cpu-local", "cpu-threads", None)
                .unwrap()
                .sharing_the_device(shared);
            c.choose(&s).unwrap().0.candidates.into_iter().map(|k| (k.label, k.ttft_ms)).collect()
        };
        let (own, shared) = (predicted(false), predicted(true));
        for ((label, a), (_, b)) in own.iter().zip(&shared) {
            if label == "full" {
                assert_eq!(a, b, "full runs on one rank: nothing is shared");
            } else {
                assert!(*b > 1.5 * a && *b <= 2.0 * a + 1e-9, "{label}: own device {a} ms, sharing {b} ms");
            }
        }
    }

    #[test]
    fn the_history_is_per_model_and_method_and_survives_a_restart() {
        let dir = std::env::temp_dir().join(format!("fp-auto-history-{}", std::process::id()));
        let path = dir.join("history.jsonl");
        let _ = std::fs::remove_dir_all(&dir);
        let make =
            || ProjectedChooser::new(Profiles::builtin().unwrap(), "cpu-local", "cpu-threads", Some(path.clone()));
        let c = make().unwrap();
        for kl in [0.01, 0.02, 0.03] {
            c.learn("m1", "none", kl, 0.0);
        }
        c.learn("m2", "none", 0.9, 0.0);
        let again = make().unwrap();
        let (n, kl, _) = again.history_of("m1", "none");
        assert!(n == 3 && (kl - 0.02).abs() < 1e-12, "{n} {kl}");
        assert_eq!(again.history_of("m1", "infoflow@0.15").0, 0);
        std::fs::write(&path, "not json\n").unwrap();
        assert_eq!(make().unwrap().history_of("m1", "none").0, 0, "a broken line is skipped");
        assert!(ProjectedChooser::new(Profiles::builtin().unwrap(), "no-such-device", "cpu-threads", None).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
