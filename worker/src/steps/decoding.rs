//! Decode steps over a job's segments and replicated tail ([`DecodeSteps`]), recorded once and
//! replayed per token where the backend can ([`Backend::record`]: a CUDA graph).
//!
//! ```text
//!   tail: [prompt rows][rows ahead: zero K/V at the coming positions]   (AHEAD rows at a time)
//!   step: Replicated::at_row writes the token's K/V at its row (put_rows), attends to
//!         every segment and the whole tail (rows ahead are after the query: masked),
//!         logits into one device buffer, read back
//!   first step of a block of rows ahead: op by op (it warms every cache the ops use)
//!   second: recorded (not run), then op by op
//!   third: replayed, then op by op again; the recording is kept only if both agree (a replay
//!          with other values than those recorded: a value baked in would show)
//!   the rest of the block: replayed (token, position and row are all that change)
//! ```
//! Only with one rank (no collective inside a step) and where the caller says one thread drives
//! the device. A recording that cannot be made, or disagrees with the ops, turns recording off
//! for the job with one line on stderr; answers never depend on it.

use super::{LocalSegment, Replicated};
use crate::error::{Result, WorkerError};
use crate::interrupt::Check;
use crate::kv::KvCache;
use crate::model::Model;
use flowprefill_comm::Communicator;
use flowprefill_kernels::backend::{Recorded, StepValues};
use flowprefill_kernels::{Backend, KernelError};
use std::sync::atomic::{AtomicBool, Ordering};

/// Tail rows made ahead at a time: a recording serves this many tokens before the tail's buffers
/// grow and the step is recorded again.
pub const AHEAD: usize = 128;

/// How far a replay's logits may be from the same step's ops, relative to the largest logit (a
/// replay runs the same kernels on the same inputs: equal in practice).
pub const REPLAY_TOLERANCE: f32 = 1e-3;

/// Said once per process: why decode steps run op by op.
static WARNED: AtomicBool = AtomicBool::new(false);

/// Whether decode steps may be recorded at all: not with `FLOWPREFILL_DECODE_GRAPH=off`.
pub fn decode_graphs_allowed() -> bool {
    std::env::var("FLOWPREFILL_DECODE_GRAPH").map_or(true, |v| v != "off")
}

/// The decode steps of one job (see the module docs).
pub struct DecodeSteps<'a, 'c, B: Backend> {
    model: &'a Model<B>,
    segs: Vec<LocalSegment<'a, B>>,
    tail: &'c mut KvCache<B>,
    /// The tail row of the next step.
    row: usize,
    /// The tail row no step reaches (the first plus the most steps the caller runs): rows ahead
    /// stop there, so that a cache reserved for the answer does not grow.
    end: usize,
    /// The last step's logits, on the device.
    logits: B::Buf,
    /// Whether steps may be recorded.
    record: bool,
    recorded: Option<Recorded>,
    /// Whether a replay of `recorded` agreed with the ops.
    verified: bool,
    /// Whether a step ran op by op over the present rows ahead.
    warm: bool,
    /// Steps whose logits came from a replay (`run --json` and `generate --json` report it:
    /// what shows recording in use, not only that it did not fail).
    replayed: usize,
}

impl<'a, 'c, B: Backend> DecodeSteps<'a, 'c, B> {
    /// At most `steps` steps over `segs` and `tail` (rotated, the prompt in it), the first at
    /// the position after the tail's last; `record`: whether steps may be recorded (the caller's
    /// promise that one thread drives the device).
    pub fn new(
        model: &'a Model<B>,
        segs: Vec<LocalSegment<'a, B>>,
        tail: &'c mut KvCache<B>,
        steps: usize,
        record: bool,
    ) -> Result<Self> {
        let row = tail.len();
        let end = row + steps;
        let logits = model.backend().zeros(model.config().vocab_size)?;
        Ok(Self {
            model,
            segs,
            tail,
            row,
            end,
            logits,
            record,
            recorded: None,
            verified: false,
            warm: false,
            replayed: 0,
        })
    }

    /// Steps whose logits came from a replay so far.
    pub fn replayed(&self) -> usize {
        self.replayed
    }

    /// Runs token `tok` at `pos` (the position after the previous step's) and returns its
    /// logits; `check` runs before every layer of a step run op by op, and once before a
    /// replayed one.
    pub fn run(&mut self, comm: &mut dyn Communicator, tok: u32, pos: u32, check: Check<'_>) -> Result<Vec<f32>> {
        if self.row == self.tail.len() {
            // The recording names the tail's buffers, which move now.
            (self.recorded, self.verified, self.warm) = (None, false, false);
            let window = self.model.config().context_length;
            let rows = AHEAD.min(window.saturating_sub(pos as usize)).min(self.end.saturating_sub(self.row)).max(1);
            self.tail.extend_ahead(self.model.backend(), pos, rows)?;
        }
        if self.tail.positions().get(self.row) != Some(&pos) {
            return Err(crate::error::internal(format!(
                "decode step at position {pos}, but tail row {} is at {:?}",
                self.row,
                self.tail.positions().get(self.row)
            )));
        }
        let v = StepValues { token: tok, position: pos, row: self.row as u32 };
        let record = self.record && comm.size() == 1;
        let logits = if self.recorded.is_some() {
            // A replayed step calls no check of its own: the job's cancellation and deadline are
            // seen here, once per token.
            check()?;
            match self.replay(v)? {
                Some(l) if self.verified => {
                    self.replayed += 1;
                    l
                }
                Some(l) => self.verify(comm, v, check, l)?,
                None => self.by_ops(comm, v, check)?,
            }
        } else if record && self.warm {
            self.record_step(comm, v, check);
            self.by_ops(comm, v, check)?
        } else {
            self.by_ops(comm, v, check)?
        };
        self.row += 1;
        Ok(logits)
    }

    /// The step replayed, if a recording holds (`None` when it went stale: dropped, and the next
    /// step records again).
    fn replay(&mut self, v: StepValues) -> Result<Option<Vec<f32>>> {
        let Some(rec) = &self.recorded else { return Ok(None) };
        if let Err(e) = rec.replay(v) {
            tracing::debug!("decode: recording the step again ({e})");
            self.recorded = None;
            return Ok(None);
        }
        Ok(Some(self.model.backend().download(&self.logits)?))
    }

    /// The step op by op.
    fn by_ops(&mut self, comm: &mut dyn Communicator, v: StepValues, check: Check<'_>) -> Result<Vec<f32>> {
        step_ops(self.model, &self.segs, self.tail, &mut self.logits, comm, v, check)?;
        self.warm = true;
        Ok(self.model.backend().download(&self.logits)?)
    }

    /// Records the step (without running it): the recording's first replay, at the next step,
    /// is checked against the ops ([`DecodeSteps::verify`]) with other values than those it was
    /// recorded with, so that a value read from the recording instead of its device word
    /// shows.
    fn record_step(&mut self, comm: &mut dyn Communicator, v: StepValues, check: Check<'_>) {
        let be = self.model.backend();
        let mut failed: Option<String> = None;
        let rec = {
            let (model, segs, tail, logits) = (self.model, &self.segs, &mut *self.tail, &mut self.logits);
            let mut step = || -> flowprefill_kernels::Result<()> {
                step_ops(model, segs, tail, logits, &mut *comm, v, &mut *check).map_err(|e| {
                    failed = Some(e.to_string());
                    KernelError::Backend { backend: "record", detail: e.to_string() }
                })
            };
            crate::model::untimed(|| be.record(v, &mut step))
        };
        match rec {
            Ok(Some(r)) => (self.recorded, self.verified) = (Some(r), false),
            // The backend records nothing (the CPU).
            Ok(None) => self.record = false,
            Err(e) => {
                let why = failed.unwrap_or_else(|| e.to_string());
                self.stop_recording(&format!("the step could not be recorded ({why})"));
            }
        }
    }

    /// The step op by op after its first replay gave `replayed`: the recording serves the
    /// coming steps only if the two agree; the ops' logits either way.
    fn verify(
        &mut self,
        comm: &mut dyn Communicator,
        v: StepValues,
        check: Check<'_>,
        replayed: Vec<f32>,
    ) -> Result<Vec<f32>> {
        let ops = self.by_ops(comm, v, check)?;
        let scale = ops.iter().fold(1.0f32, |m, x| m.max(x.abs()));
        // A NaN on either side is an infinite difference (`f32::max` would drop it): a replay
        // that gives NaN logits is never taken for the ops' step.
        let diff = ops.iter().zip(&replayed).fold(0.0f32, |m, (a, b)| {
            let d = (a - b).abs();
            m.max(if d.is_nan() { f32::INFINITY } else { d })
        });
        if replayed.len() == ops.len() && diff <= REPLAY_TOLERANCE * scale {
            self.verified = true;
        } else {
            self.recorded = None;
            self.stop_recording(&format!("a replayed step's logits differ from its ops' by {diff} (largest {scale})"));
        }
        Ok(ops)
    }

    fn stop_recording(&mut self, why: &str) {
        self.record = false;
        if !WARNED.swap(true, Ordering::Relaxed) {
            // One write, so that under mpirun another process's output cannot split the line.
            let line = format!("flowprefill: decode steps run op by op: {why}\n");
            let _ = std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes());
        }
    }
}

impl<B: Backend> Drop for DecodeSteps<'_, '_, B> {
    /// The tail keeps the rows written; the rows ahead no step reached are dropped.
    fn drop(&mut self) {
        self.recorded = None;
        if let Err(e) = self.tail.truncate(self.model.backend(), self.row) {
            tracing::warn!("decode: the rows ahead stay in the tail ({e})");
        }
    }
}

/// One decode step's ops: the token's K/V into its tail row, attention over the segments and
/// the tail, its logits into `logits` on the device.
fn step_ops<B: Backend>(
    model: &Model<B>,
    segs: &[LocalSegment<'_, B>],
    tail: &mut KvCache<B>,
    logits: &mut B::Buf,
    comm: &mut dyn Communicator,
    v: StepValues,
    check: Check<'_>,
) -> Result<()> {
    let be = model.backend();
    let pos = [v.position];
    let mut rep =
        Replicated::new(be, comm, "decode", segs.to_vec(), tail, &[], vec![])?.at_row(&pos, v.row as usize)?;
    model.forward_to_device(&[v.token], &pos, &mut rep, logits, check)?;
    rep.commit().map(|_| ()).map_err(|e: WorkerError| e)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Arch, ModelConfig};
    use crate::kv::KeyForm;
    use crate::model::Logits;
    use flowprefill_comm::local::LocalComm;
    use flowprefill_kernels::{Cpu, HostBuf};
    use std::sync::atomic::AtomicUsize;
    use std::sync::Arc;

    /// Float rounding of one forward, relative (f32 sums in another order).
    const ROUNDING: f32 = 1e-5;

    fn tiny() -> Model<Cpu> {
        let cfg = ModelConfig {
            arch: Arch::Llama,
            name: "tiny".into(),
            n_layers: 2,
            d_model: 64,
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: 16,
            ffn_dim: 96,
            vocab_size: 200,
            context_length: 512,
            rope_base: 10000.0,
            rope_dim: 16,
            rope_linear_factor: 1.0,
            rms_eps: 1e-5,
            tied_embeddings: true,
        };
        Model::synthetic(cfg, Cpu, 11).expect("a tiny synthetic model")
    }

    /// Rows `0..n` prefilled into a fresh rotated cache (queries over themselves).
    fn prefill(
        m: &Model<Cpu>,
        comm: &mut LocalComm,
        local: Vec<LocalSegment<'_, Cpu>>,
        tokens: &[u32],
        first: u32,
    ) -> KvCache<Cpu> {
        let c = m.config();
        let mut cache = KvCache::new(m.backend(), c.n_layers, c.kv_dim(), KeyForm::Rotated).unwrap();
        let pos: Vec<u32> = (first..first + tokens.len() as u32).collect();
        let mut rep = Replicated::new(m.backend(), comm, "prompt", local, &mut cache, &pos, vec![]).unwrap();
        m.forward(tokens, &pos, &mut rep, Logits::Last).unwrap();
        rep.commit().unwrap();
        cache
    }

    /// Decoding into rows made ahead (written in place, the rows after the query masked by
    /// position) gives the logits of decoding by appending, over a segment and the prompt's
    /// tail, across the end of a block of rows ahead: within [`ROUNDING`] of the largest logit
    /// (the CPU's attention blocks its keys differently when masked rows follow: the same sum
    /// in another order) and the same greedy token at every step.
    #[test]
    fn steps_into_rows_ahead_equal_steps_that_append() {
        let m = tiny();
        let mut comm = LocalComm::group(1).pop().unwrap();
        let doc: Vec<u32> = (0..30).map(|i| (i * 13 % 200) as u32).collect();
        let seg_cache = prefill(&m, &mut comm, vec![], &doc, 0);
        let segs = vec![LocalSegment::placed(0, &seg_cache)];
        let prompt: Vec<u32> = (0..12).map(|i| (i * 29 % 200) as u32).collect();
        let mut tail_a = prefill(&m, &mut comm, segs.clone(), &prompt, 30);
        let mut tail_b = prefill(&m, &mut comm, segs.clone(), &prompt, 30);
        let mut steps = DecodeSteps::new(&m, segs.clone(), &mut tail_b, 1000, true).unwrap();
        let n = AHEAD + 10;
        for t in 0..n {
            let (tok, pos) = ((t * 31 % 200) as u32, 42 + t as u32);
            let mut rep =
                Replicated::new(m.backend(), &mut comm, "d", segs.clone(), &mut tail_a, &[pos], vec![]).unwrap();
            let want = m.forward(&[tok], &[pos], &mut rep, Logits::Last).unwrap().last().to_vec();
            rep.commit().unwrap();
            let got = steps.run(&mut comm, tok, pos, &mut crate::interrupt::never).unwrap();
            let scale = want.iter().fold(1.0f32, |m, x| m.max(x.abs()));
            let diff = flowprefill_kernels::testing::max_abs_diff(&got, &want);
            assert!(diff <= ROUNDING * scale, "step {t} (position {pos}): logits differ by {diff}");
            let best = |l: &[f32]| l.iter().enumerate().fold(0, |b, (i, &x)| if x > l[b] { i } else { b });
            assert_eq!(best(&got), best(&want), "step {t}: the greedy token");
        }
        assert_eq!(steps.replayed(), 0, "the CPU records nothing: every step ran op by op");
        drop(steps);
        assert_eq!(tail_b.positions(), tail_a.positions(), "the rows ahead no step reached are dropped");
        for l in 0..m.config().n_layers {
            let b = m.backend().download(&tail_b.layer(l).k).unwrap();
            let a = m.backend().download(&tail_a.layer(l).k).unwrap();
            assert_eq!(a.len(), b.len());
            let diff = flowprefill_kernels::testing::max_abs_diff(&b, &a);
            assert!(diff <= ROUNDING, "layer {l}: keys differ by {diff}");
        }
    }

    /// The CPU with a recording that replays nothing (a graph whose ops never run) or cannot
    /// be made: how [`DecodeSteps`] treats a recording it cannot trust.
    struct Faulty {
        /// Whether `record` fails (else it returns a recording that does nothing).
        fails: bool,
        records: Arc<AtomicUsize>,
        replays: Arc<AtomicUsize>,
    }

    struct Nothing(Arc<AtomicUsize>);

    impl flowprefill_kernels::backend::Replay for Nothing {
        fn replay(&self, _: StepValues) -> flowprefill_kernels::Result<()> {
            self.0.fetch_add(1, Ordering::SeqCst);
            Ok(())
        }
    }

    impl flowprefill_kernels::Wrapper for Faulty {
        type Inner = Cpu;
        fn inner(&self) -> &Cpu {
            &Cpu
        }
        fn buf(buf: &HostBuf) -> &HostBuf {
            buf
        }
        fn buf_mut(buf: &mut HostBuf) -> &mut HostBuf {
            buf
        }
        fn adopt(&self, buf: HostBuf) -> flowprefill_kernels::Result<HostBuf> {
            Ok(buf)
        }
    }

    flowprefill_kernels::forward_backend! {
        impl Backend for Faulty {
            type Buf = HostBuf;
            fn name(&self) -> &'static str {
                "faulty"
            }
            fn record(
                &self,
                _values: StepValues,
                _step: &mut dyn FnMut() -> flowprefill_kernels::Result<()>,
            ) -> flowprefill_kernels::Result<Option<Recorded>> {
                self.records.fetch_add(1, Ordering::SeqCst);
                if self.fails {
                    return Err(KernelError::Backend { backend: "faulty", detail: "no recording".into() });
                }
                Ok(Some(Recorded::new(Box::new(Nothing(self.replays.clone())))))
            }
        }
    }

    /// A recording whose replay computes nothing is caught by its first replay's check against
    /// the ops (its logits are the previous step's), and one that cannot be made turns recording
    /// off: either way every step's logits are those of steps run op by op, and no replayed
    /// logits are used.
    #[test]
    fn a_recording_that_disagrees_or_fails_is_not_used() {
        for fails in [false, true] {
            let (records, replays) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
            let be = Faulty { fails, records: records.clone(), replays: replays.clone() };
            let m = Model::synthetic(tiny().config().clone(), be, 11).unwrap();
            let cpu = tiny();
            let mut comm = LocalComm::group(1).pop().unwrap();
            let prompt = [3u32, 1, 4, 1, 5];
            let c = m.config();
            let mut tail = KvCache::new(m.backend(), c.n_layers, c.kv_dim(), KeyForm::Rotated).unwrap();
            let mut cpu_tail = prefill(&cpu, &mut comm, vec![], &prompt, 0);
            {
                let pos: Vec<u32> = (0..5).collect();
                let mut rep = Replicated::new(m.backend(), &mut comm, "p", vec![], &mut tail, &pos, vec![]).unwrap();
                m.forward(&prompt, &pos, &mut rep, Logits::Last).unwrap();
                rep.commit().unwrap();
            }
            let mut steps = DecodeSteps::new(&m, vec![], &mut tail, 100, true).unwrap();
            let mut plain = DecodeSteps::new(&cpu, vec![], &mut cpu_tail, 100, false).unwrap();
            for t in 0..8u32 {
                let never = &mut crate::interrupt::never;
                let got = steps.run(&mut comm, 7 + t, 5 + t, never).unwrap();
                let want = plain.run(&mut comm, 7 + t, 5 + t, &mut crate::interrupt::never).unwrap();
                assert_eq!(got, want, "fails {fails}, step {t}: the ops' logits");
            }
            assert_eq!(steps.replayed(), 0, "fails {fails}: no replayed logits used");
            assert_eq!(records.load(Ordering::SeqCst), 1, "fails {fails}: recorded once, then off for the job");
            let checked = if fails { 0 } else { 1 };
            assert_eq!(replays.load(Ordering::SeqCst), checked, "fails {fails}: one replay, checked and refused");
        }
    }

    /// A step out of order (its position not its row's) is an error, not a wrong answer.
    #[test]
    fn a_step_at_the_wrong_position_is_refused() {
        let m = tiny();
        let mut comm = LocalComm::group(1).pop().unwrap();
        let mut tail = prefill(&m, &mut comm, vec![], &[1, 2, 3], 0);
        let mut steps = DecodeSteps::new(&m, vec![], &mut tail, 10, false).unwrap();
        steps.run(&mut comm, 5, 3, &mut crate::interrupt::never).unwrap();
        let e = steps.run(&mut comm, 6, 9, &mut crate::interrupt::never).unwrap_err().to_string();
        assert!(e.contains("position 9"), "{e}");
    }
}
