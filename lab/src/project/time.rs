//! Device and link profiles, and the time model that turns counted work into TTFT.
//!
//! Per op, a roofline: `max(FLOPs / (peak x efficiency(size) x scale), bytes / bandwidth)`.
//! GEMM efficiency is a curve over the GEMM's rows (small row counts fill few tiles),
//! attention efficiency a curve over query rows; the non-GEMM ops move their rows through
//! memory; every block of a forward pays a fixed overhead (kernel launches). A message costs
//! `latency + max(sent, received) / bandwidth`; where the sender does not wait for its sends
//! (the sparse scope's K/V all-gather: it goes on to its own attention and MLP while they
//! travel), they cost the receivers only, so a rank that recomputes most of the rows hides
//! its sends behind that work, and the others wait for them. The ring's transfer of step `s`
//! overlaps its attention of step `s`: the step lasts as long as the longer of the two, and
//! the ring's attention section is divided by the device's ring efficiency (how close an
//! implementation gets to that ideal). A phase lasts as long as its slowest rank; TTFT is the
//! sum of phases.
//! `scale` is one global factor on compute efficiency (GEMM and attention alike), for a
//! calibration on one published cell; it is 1 unless the caller sets it.

use super::work::{Attn, Forward, Message, PhaseWork, Work};
use super::{Cost, ProjectError, Shape};
use std::collections::BTreeMap;

/// A constant and where it comes from.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct Const {
    /// The value (SI units: FLOP/s, bytes/s, seconds, bytes).
    pub value: f64,
    /// Where it comes from.
    pub source: String,
}

/// An efficiency curve over a size (rows), interpolated linearly in log(size).
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct Curve {
    /// (size, efficiency in (0, 1]) points, sizes increasing.
    pub points: Vec<(f64, f64)>,
    /// Where it comes from.
    pub source: String,
}

impl Curve {
    /// Efficiency at `size` (clamped to the curve's ends).
    pub fn at(&self, size: f64) -> f64 {
        let pts = &self.points;
        let Some(first) = pts.first() else { return 1.0 };
        let size = size.max(1.0);
        if size <= first.0 {
            return first.1;
        }
        for w in pts.windows(2) {
            let ((x0, y0), (x1, y1)) = (w[0], w[1]);
            if size <= x1 {
                let t = (size.ln() - x0.ln()) / (x1.ln() - x0.ln()).max(1e-12);
                return y0 + t * (y1 - y0);
            }
        }
        pts.last().map_or(1.0, |p| p.1)
    }
}

/// One accelerator (or one CPU core set).
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct Device {
    /// What it is.
    pub description: String,
    /// Peak dense FLOP/s at the data type of `weight_bytes`.
    pub peak_flops: Const,
    /// Memory bandwidth, bytes/s.
    pub mem_bytes_per_s: Const,
    /// GEMM efficiency (of peak) by GEMM rows.
    pub gemm_efficiency: Curve,
    /// Attention efficiency (of peak) by query rows.
    pub attention_efficiency: Curve,
    /// Fraction of the memory bandwidth the non-GEMM ops reach.
    pub other_efficiency: Const,
    /// Fixed time per block of a forward (kernel launches, synchronisation).
    pub layer_overhead_s: Const,
    /// Bytes per weight.
    pub weight_bytes: Const,
    /// Bytes per K/V and activation element.
    pub kv_bytes: Const,
    /// Fraction of the ideal overlapped ring a ring implementation reaches on this device.
    pub ring_efficiency: Const,
}

/// One interconnect between ranks.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct Link {
    /// What it is.
    pub description: String,
    /// Bandwidth per rank and direction while a rank sends and receives at once (what an
    /// all-gather measures), bytes/s.
    pub bytes_per_s: Const,
    /// Bandwidth of the bytes that go one way only (a gather: the sender's, and the bytes one
    /// side of an exchange sends beyond what the other sends back), where it differs from
    /// `bytes_per_s`: on a shaped link a protocol's replies wait behind the other direction's
    /// full queue, so traffic both ways moves slower than traffic one way. Default:
    /// `bytes_per_s`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub one_way_bytes_per_s: Option<Const>,
    /// Latency of one message (collective call), seconds.
    pub latency_s: Const,
}

/// Devices and links by name.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct Profiles {
    /// Devices.
    pub devices: BTreeMap<String, Device>,
    /// Links.
    pub links: BTreeMap<String, Link>,
}

/// The profiles shipped with flowprefill (`lab/profiles.json`).
pub const BUILTIN_PROFILES: &str = include_str!("../../profiles.json");

impl Profiles {
    /// The built-in profiles.
    pub fn builtin() -> Result<Self, ProjectError> {
        Self::parse("built-in profiles.json", BUILTIN_PROFILES)
    }

    /// Profiles from JSON text (`what` names it in errors).
    pub fn parse(what: &str, text: &str) -> Result<Self, ProjectError> {
        let p: Profiles = serde_json::from_str(text)
            .map_err(|e| ProjectError::Profiles { path: what.to_string(), detail: e.to_string() })?;
        p.check(what)?;
        Ok(p)
    }

    /// Adds (or replaces) the devices and links of `other`.
    pub fn merge(&mut self, other: Profiles) {
        self.devices.extend(other.devices);
        self.links.extend(other.links);
    }

    fn check(&self, what: &str) -> Result<(), ProjectError> {
        let bad = |detail: String| Err(ProjectError::Profiles { path: what.to_string(), detail });
        for (name, d) in &self.devices {
            for (field, c) in [
                ("peak_flops", &d.peak_flops),
                ("mem_bytes_per_s", &d.mem_bytes_per_s),
                ("weight_bytes", &d.weight_bytes),
                ("kv_bytes", &d.kv_bytes),
            ] {
                if !(c.value.is_finite() && c.value > 0.0) {
                    return bad(format!("device {name}: {field} must be a positive number"));
                }
            }
            for (field, c) in [("other_efficiency", &d.other_efficiency), ("ring_efficiency", &d.ring_efficiency)] {
                if !(c.value > 0.0 && c.value <= 1.0) {
                    return bad(format!("device {name}: {field} must be in (0, 1]"));
                }
            }
            for (field, c) in
                [("gemm_efficiency", &d.gemm_efficiency), ("attention_efficiency", &d.attention_efficiency)]
            {
                if c.points.is_empty()
                    || c.points.iter().any(|p| !(p.0 >= 1.0 && p.1 > 0.0 && p.1 <= 1.0))
                    || c.points.windows(2).any(|w| w[1].0 <= w[0].0)
                {
                    return bad(format!(
                        "device {name}: {field} needs points [size >= 1, efficiency in (0, 1]] with sizes increasing"
                    ));
                }
            }
            if d.layer_overhead_s.value < 0.0 {
                return bad(format!("device {name}: layer_overhead_s must not be negative"));
            }
        }
        for (name, l) in &self.links {
            if !(l.bytes_per_s.value > 0.0 && l.latency_s.value >= 0.0) {
                return bad(format!("link {name}: bytes_per_s must be positive and latency_s not negative"));
            }
            if l.one_way_bytes_per_s.as_ref().is_some_and(|c| c.value.is_nan() || c.value <= 0.0) {
                return bad(format!("link {name}: one_way_bytes_per_s must be positive"));
            }
        }
        Ok(())
    }

    /// A device by name.
    pub fn device(&self, name: &str) -> Result<&Device, ProjectError> {
        self.devices.get(name).ok_or_else(|| ProjectError::UnknownProfile {
            kind: "device",
            name: name.to_string(),
            known: self.devices.keys().cloned().collect::<Vec<_>>().join(", "),
        })
    }

    /// A link by name.
    pub fn link(&self, name: &str) -> Result<&Link, ProjectError> {
        self.links.get(name).ok_or_else(|| ProjectError::UnknownProfile {
            kind: "link",
            name: name.to_string(),
            known: self.links.keys().cloned().collect::<Vec<_>>().join(", "),
        })
    }
}

/// Time of one phase (its slowest rank).
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct PhaseTime {
    /// Phase name.
    pub phase: &'static str,
    /// Wall time of the phase, seconds.
    pub total_s: f64,
    /// Compute on the slowest rank (GEMM, attention, other ops), seconds.
    pub compute_s: f64,
    /// Of which GEMMs.
    pub gemm_s: f64,
    /// Of which attention and scores.
    pub attention_s: f64,
    /// Communication on the slowest rank, overlapped or not, seconds.
    pub comm_s: f64,
    /// Communication not hidden behind compute, seconds.
    pub exposed_comm_s: f64,
}

/// Projected TTFT of one request.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Projection {
    /// Time to first token, seconds.
    pub ttft_s: f64,
    /// Per phase.
    pub phases: Vec<PhaseTime>,
}

impl Projection {
    /// Sum of a field over phases.
    pub fn sum(&self, f: impl Fn(&PhaseTime) -> f64) -> f64 {
        self.phases.iter().map(f).sum()
    }
}

struct Model<'a> {
    shape: &'a Shape,
    dev: &'a Device,
    link: &'a Link,
    scale: f64,
}

impl Model<'_> {
    fn gemm(&self, f: &Forward) -> f64 {
        let (s, d) = (self.shape, self.dev);
        let (peak, bw, wb) = (d.peak_flops.value * self.scale, d.mem_bytes_per_s.value, d.weight_bytes.value);
        let mut t = 0.0;
        if f.rows > 0 {
            let flops = (f.rows * f.layers) as f64 * s.gemm_flops_per_row_layer();
            let bytes = f.layers as f64 * s.layer_params() * wb;
            t += (flops / (peak * d.gemm_efficiency.at(f.rows as f64))).max(bytes / bw);
        }
        if f.logit_rows > 0 {
            let flops = f.logit_rows as f64 * s.logits_flops_per_row();
            let bytes = (s.d_model * s.vocab_size) as f64 * wb;
            t += (flops / (peak * d.gemm_efficiency.at(f.logit_rows as f64))).max(bytes / bw);
        }
        t
    }

    fn other(&self, f: &Forward) -> f64 {
        let d = self.dev;
        let bytes = (f.rows * f.layers) as f64 * self.shape.other_elems_per_row_layer() * d.kv_bytes.value;
        bytes / (d.mem_bytes_per_s.value * d.other_efficiency.value) + f.layers as f64 * d.layer_overhead_s.value
    }

    fn attention(&self, a: &Attn, flops_per_pair: f64, kv_reads: f64) -> f64 {
        let (s, d) = (self.shape, self.dev);
        let flops = flops_per_pair * (a.pairs * a.layers as u64) as f64 * (s.n_heads * s.head_dim) as f64;
        let bytes = (a.keys * a.layers) as f64 * kv_reads * s.kv_dim() as f64 * d.kv_bytes.value;
        let peak = d.peak_flops.value * self.scale;
        (flops / (peak * d.attention_efficiency.at(a.queries as f64))).max(bytes / d.mem_bytes_per_s.value)
    }

    /// `m` as this rank sees it; `upload`: for a message sent behind the senders' work, the
    /// most bytes one other rank sends per call (they leave through that rank's one link, and
    /// a receiver waits for the longest of them).
    fn message(&self, m: &Message, upload: u64) -> f64 {
        if m.sent == 0 && m.received == 0 {
            return 0.0;
        }
        // Sends that travel behind the sender's own work cost it nothing beyond what it
        // receives; what it receives arrives no sooner than the longest upload.
        let (sent, received) =
            if m.behind { (m.sent.min(m.received), m.received.max(upload)) } else { (m.sent, m.received) };
        // The bytes both directions carry at once move at the two-way rate, the rest one way.
        let (both, one) = (sent.min(received) as f64, sent.abs_diff(received) as f64);
        let one_way = self.link.one_way_bytes_per_s.as_ref().map_or(self.link.bytes_per_s.value, |c| c.value);
        m.calls as f64 * (self.link.latency_s.value + both / self.link.bytes_per_s.value + one / one_way)
    }

    /// One rank's phase: (total, compute, gemm, attention, comm, exposed comm); `uploads`: per
    /// message sent behind the senders' work, in order, the most bytes one other rank sends.
    fn phase(&self, w: &PhaseWork, uploads: &[u64]) -> [f64; 6] {
        let gemm: f64 = w.forwards.iter().map(|f| self.gemm(f)).sum();
        let other: f64 = w.forwards.iter().map(|f| self.other(f)).sum();
        let serial_attn: f64 =
            w.attn.iter().filter(|a| a.step.is_none()).map(|a| self.attention(a, 4.0, 2.0)).sum::<f64>()
                + w.scores.iter().map(|a| self.attention(a, 2.0, 1.0)).sum::<f64>();
        let mut uploads = uploads.iter();
        let serial_comm: f64 = w
            .messages
            .iter()
            .filter(|m| m.step.is_none())
            .map(|m| self.message(m, if m.behind { uploads.next().copied().unwrap_or(0) } else { 0 }))
            .sum();
        // Ring steps: the transfer of a step overlaps the attention of the same step.
        let steps = w.attn.iter().filter_map(|a| a.step).chain(w.messages.iter().filter_map(|m| m.step)).max();
        let (mut ring, mut ring_attn, mut ring_comm, mut ring_exposed) = (0.0, 0.0, 0.0, 0.0);
        if let Some(last) = steps {
            for s in 0..=last {
                let a: f64 = w.attn.iter().filter(|x| x.step == Some(s)).map(|x| self.attention(x, 4.0, 2.0)).sum();
                let c: f64 = w.messages.iter().filter(|x| x.step == Some(s)).map(|x| self.message(x, 0)).sum();
                ring += a.max(c);
                ring_attn += a;
                ring_comm += c;
                ring_exposed += (c - a).max(0.0);
            }
            let eff = self.dev.ring_efficiency.value;
            ring /= eff;
            ring_attn /= eff;
        }
        let compute = gemm + other + serial_attn + ring_attn;
        let total = gemm + other + serial_attn + serial_comm + ring;
        [total, compute, gemm, serial_attn + ring_attn, serial_comm + ring_comm, serial_comm + ring_exposed]
    }
}

/// Projects `work` for `shape` on `dev` ranks joined by `link`; `scale` multiplies every
/// compute efficiency (1: the profile's own).
pub fn project(work: &Work, shape: &Shape, dev: &Device, link: &Link, scale: f64) -> Projection {
    let model = Model { shape, dev, link, scale };
    let n_phases = work.per_rank.iter().map(Vec::len).max().unwrap_or(0);
    let mut out = Projection::default();
    for i in 0..n_phases {
        // What each rank sends per call in each message of the phase sent behind its work.
        let behind: Vec<Vec<u64>> = (work.per_rank.iter())
            .map(|rank| {
                rank.get(i).map_or_else(Vec::new, |w| w.messages.iter().filter(|m| m.behind).map(|m| m.sent).collect())
            })
            .collect();
        let mut slowest: Option<(&'static str, [f64; 6])> = None;
        for (r, rank) in work.per_rank.iter().enumerate() {
            let Some(w) = rank.get(i) else { continue };
            let uploads: Vec<u64> = (0..behind[r].len())
                .map(|j| {
                    behind
                        .iter()
                        .enumerate()
                        .filter(|&(o, _)| o != r)
                        .filter_map(|(_, b)| b.get(j))
                        .copied()
                        .max()
                        .unwrap_or(0)
                })
                .collect();
            let t = model.phase(w, &uploads);
            if slowest.is_none_or(|s| t[0] > s.1[0]) {
                slowest = Some((w.phase, t));
            }
        }
        if let Some((phase, t)) = slowest {
            out.phases.push(PhaseTime {
                phase,
                total_s: t[0],
                compute_s: t[1],
                gemm_s: t[2],
                attention_s: t[3],
                comm_s: t[4],
                exposed_comm_s: t[5],
            });
        }
    }
    out.ttft_s = out.sum(|p| p.total_s);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtin_profiles_parse_and_every_constant_has_a_source() {
        let p = Profiles::builtin().expect("profiles.json parses");
        assert!(p.devices.contains_key("h100-sxm") && p.links.contains_key("nvlink4"));
        for (name, d) in &p.devices {
            for c in [
                &d.peak_flops,
                &d.mem_bytes_per_s,
                &d.other_efficiency,
                &d.layer_overhead_s,
                &d.weight_bytes,
                &d.kv_bytes,
                &d.ring_efficiency,
            ] {
                assert!(c.source.len() > 8, "device {name}: a constant without a source");
            }
            assert!(d.gemm_efficiency.source.len() > 8 && d.attention_efficiency.source.len() > 8, "{name}");
        }
        for (name, l) in &p.links {
            assert!(l.bytes_per_s.source.len() > 8 && l.latency_s.source.len() > 8, "link {name}");
        }
    }

    fn flat_device(ring_efficiency: f64) -> Device {
        let k = |v: f64| Const { value: v, source: "test".into() };
        let flat = Curve { points: vec![(1.0, 1.0)], source: "test".into() };
        Device {
            description: "test".into(),
            peak_flops: k(1e12),
            mem_bytes_per_s: k(1e15),
            gemm_efficiency: flat.clone(),
            attention_efficiency: flat,
            other_efficiency: k(1.0),
            layer_overhead_s: k(0.0),
            weight_bytes: k(2.0),
            kv_bytes: k(2.0),
            ring_efficiency: k(ring_efficiency),
        }
    }

    #[test]
    fn ring_steps_overlap_transfers_and_phases_wait_for_the_slowest_rank() {
        use crate::project::work::{Attn, Message, PhaseWork, Work};
        let shape = crate::project::shape::builtin("smollm2-135m").expect("built in");
        let link = Link {
            description: "test".into(),
            bytes_per_s: Const { value: 1e9, source: "test".into() },
            one_way_bytes_per_s: None,
            latency_s: Const { value: 0.0, source: "test".into() },
        };
        // Attention of 1e6 pairs x 1 layer = 4e6 x 576 FLOPs = 2.304 ms at 1 TFLOP/s.
        let attn = |step| Attn { queries: 10, keys: 10, pairs: 1_000_000, layers: 1, step };
        let msg = |bytes, step| Message { op: "x".into(), calls: 1, sent: bytes, received: bytes, step, behind: false };
        let ring = PhaseWork {
            phase: "prefill",
            attn: vec![attn(Some(0)), attn(Some(1))],
            // Step 0: 1 ms of transfer (hidden); step 1: 5 ms (2.696 ms exposed).
            messages: vec![msg(1_000_000, Some(0)), msg(5_000_000, Some(1))],
            ..Default::default()
        };
        let idle = PhaseWork { phase: "prefill", ..Default::default() };
        let work =
            Work { method: flowprefill_coordinator::Method::Ring, ranks: 2, per_rank: vec![vec![idle], vec![ring]] };
        let p = project(&work, &shape, &flat_device(1.0), &link, 1.0);
        let a = 2.304e-3;
        assert!((p.ttft_s - (a + 5e-3)).abs() < 1e-9, "{}", p.ttft_s);
        assert!((p.phases[0].exposed_comm_s - (5e-3 - a)).abs() < 1e-9);
        assert!((p.phases[0].comm_s - 6e-3).abs() < 1e-9);
        // A ring implementation at half the ideal doubles the overlapped section.
        let half = project(&work, &shape, &flat_device(0.5), &link, 1.0);
        assert!((half.ttft_s - 2.0 * (a + 5e-3)).abs() < 1e-9);
        // A global efficiency of 0.5 doubles the compute, not the transfers.
        let slow = project(&work, &shape, &flat_device(1.0), &link, 0.5);
        assert!((slow.ttft_s - (2.0 * a + 5e-3)).abs() < 1e-9, "{}", slow.ttft_s);
    }

    #[test]
    fn bytes_both_ways_move_at_the_two_way_rate_and_the_rest_at_the_one_way_rate() {
        let shape = crate::project::shape::builtin("smollm2-135m").expect("built in");
        let k = |v: f64| Const { value: v, source: "test".into() };
        let mut link =
            Link { description: "test".into(), bytes_per_s: k(1e6), one_way_bytes_per_s: None, latency_s: k(0.0) };
        let dev = flat_device(1.0);
        let m = Model { shape: &shape, dev: &dev, link: &link, scale: 1.0 };
        let msg = |sent, received| crate::project::work::Message {
            op: "x".into(),
            calls: 1,
            sent,
            received,
            step: None,
            behind: false,
        };
        // Without a one-way rate: the larger direction at the one rate, as before.
        assert!((m.message(&msg(3_000_000, 1_000_000), 0) - 3.0).abs() < 1e-12);
        link.one_way_bytes_per_s = Some(k(2e6));
        let m = Model { shape: &shape, dev: &dev, link: &link, scale: 1.0 };
        // 1 MB both ways at 1 MB/s, the other 2 MB one way at 2 MB/s.
        assert!((m.message(&msg(3_000_000, 1_000_000), 0) - 2.0).abs() < 1e-12);
        assert!((m.message(&msg(0, 4_000_000), 0) - 2.0).abs() < 1e-12, "a gather's receiver");
        assert!((m.message(&msg(2_000_000, 2_000_000), 0) - 2.0).abs() < 1e-12, "an all-gather");
        // Sends that travel behind the sender's work: the sender pays for what it receives
        // (1 MB, both ways at once); the receiver of the 3 MB pays for all of them.
        let behind = |sent, received| crate::project::work::Message { behind: true, ..msg(sent, received) };
        assert!((m.message(&behind(3_000_000, 1_000_000), 0) - 1.0).abs() < 1e-12);
        assert!((m.message(&behind(1_000_000, 3_000_000), 0) - 2.0).abs() < 1e-12);
        assert!((m.message(&behind(2_000_000, 2_000_000), 0) - 2.0).abs() < 1e-12, "even: as any all-gather");
        // A receiver waits for the longest upload: 0.1 MB both ways, 2.9 MB more one way.
        assert!((m.message(&behind(100_000, 1_000_000), 3_000_000) - 1.55).abs() < 1e-12);
        // In a phase: rank 0 sends 2 MB to each of two peers, behind its work; each peer
        // receives its 2 MB only when rank 0's 4 MB have left (one way, 2 s); rank 0 waits for
        // nothing.
        let send = |sent, received| PhaseWork {
            phase: "recompute",
            messages: vec![behind(sent, received)],
            ..Default::default()
        };
        let per_rank = vec![vec![send(4_000_000, 0)], vec![send(0, 2_000_000)], vec![send(0, 2_000_000)]];
        let work = Work { method: flowprefill_coordinator::Method::Infoflow, ranks: 3, per_rank };
        let p = project(&work, &shape, &dev, &link, 1.0);
        assert!((p.ttft_s - 2.0).abs() < 1e-12, "{}", p.ttft_s);
        link.one_way_bytes_per_s = Some(k(0.0));
        let text =
            serde_json::to_string(&Profiles { devices: BTreeMap::new(), links: [("l".to_string(), link)].into() })
                .expect("serialises");
        let e = Profiles::parse("z.json", &text).expect_err("refused").to_string();
        assert!(e.contains("one_way_bytes_per_s"), "{e}");
    }

    #[test]
    fn curves_interpolate_in_log_size_and_clamp() {
        let c = Curve { points: vec![(1.0, 0.1), (100.0, 0.5)], source: String::new() };
        assert_eq!(c.at(0.5), 0.1);
        assert!((c.at(10.0) - 0.3).abs() < 1e-12);
        assert_eq!(c.at(1e6), 0.5);
    }

    #[test]
    fn bad_profiles_are_refused_with_the_field() {
        let mut p = Profiles::builtin().expect("parses");
        let Some(d) = p.devices.get_mut("h100-sxm") else { panic!("h100-sxm missing") };
        d.ring_efficiency.value = 1.5;
        let text = serde_json::to_string(&p).expect("serialises");
        let e = Profiles::parse("x.json", &text).expect_err("refused").to_string();
        assert!(e.contains("ring_efficiency") && e.contains("x.json"), "{e}");
        let e = Profiles::parse("y.json", "{").expect_err("refused").to_string();
        assert!(e.contains("y.json"), "{e}");
    }
}
