//! A CPU backend with a memory ledger that can be told to refuse allocations: past a byte
//! limit, or every allocation inside one engine phase (`coordinator::timings::current_phase`).
//! A refusal is the backend's out-of-memory error ([`KernelError::OutOfMemory`]), as a GPU's
//! allocator gives it. Buffers give their bytes back when dropped, so a test can check that a
//! failed job released everything it held.

use flowprefill_kernels::attention::AttnShape;
use flowprefill_kernels::matmul::Matrix;
use flowprefill_kernels::{Cpu, DType, HostBuf, KernelError, Memory, MemoryUse, Result, Wrapper};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// Bytes in use and the refusal policy.
#[derive(Debug)]
pub struct Ledger {
    in_use: AtomicUsize,
    peak: AtomicUsize,
    limit: AtomicUsize,
    fail_in: Mutex<Option<&'static str>>,
    refused: AtomicUsize,
    /// The most bytes in use during each engine phase since the last reset (`-`: outside one).
    phase_peaks: Mutex<Vec<(&'static str, usize)>>,
    /// Another tenant: takes its bytes at the first allocation of its phase, holds them until
    /// [`Ledger::tenant_leaves`].
    tenant: Mutex<Tenant>,
    /// Tokens per full-prefill forward the backend asks for (`Backend::prefill_rows`).
    prefill_rows: AtomicUsize,
    /// Keys gathered for one attention call over many sources (`Backend::gathered_keys`).
    gathered_keys: AtomicUsize,
    /// Attention calls so far.
    attention_calls: AtomicUsize,
}

#[derive(Debug, Default)]
struct Tenant {
    phase: Option<&'static str>,
    bytes: usize,
    holds: usize,
}

impl Ledger {
    /// Bytes held by live buffers and weight matrices.
    pub fn in_use(&self) -> usize {
        self.in_use.load(Ordering::SeqCst)
    }

    /// The most bytes in use at once since the last [`Ledger::reset_peak`].
    pub fn peak(&self) -> usize {
        self.peak.load(Ordering::SeqCst)
    }

    /// Restarts [`Ledger::peak`] from the bytes in use now.
    pub fn reset_peak(&self) {
        self.peak.store(self.in_use(), Ordering::SeqCst);
        self.phase_peaks.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }

    /// The most bytes in use during each engine phase (in the order the phases first
    /// allocated) since the last [`Ledger::reset_peak`].
    pub fn phase_peaks(&self) -> Vec<(&'static str, usize)> {
        self.phase_peaks.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Allocations refused so far.
    pub fn refused(&self) -> usize {
        self.refused.load(Ordering::SeqCst)
    }

    /// Refuses an allocation that would take the bytes in use past `limit` (`usize::MAX`: no
    /// limit).
    pub fn set_limit(&self, limit: usize) {
        self.limit.store(limit, Ordering::SeqCst);
    }

    /// Makes the backend ask for full-prefill forwards of `rows` tokens (a GPU's 8192, the
    /// CPU's 2048 by default).
    pub fn set_prefill_rows(&self, rows: usize) {
        self.prefill_rows.store(rows, Ordering::SeqCst);
    }

    /// Makes attention over many sources gather up to `keys` keys into one call, as a GPU does
    /// (0, the CPU's default: one call per source).
    pub fn set_gathered_keys(&self, keys: usize) {
        self.gathered_keys.store(keys, Ordering::SeqCst);
    }

    /// Attention calls so far (`Backend::attention`, every thread).
    pub fn attention_calls(&self) -> usize {
        self.attention_calls.load(Ordering::SeqCst)
    }

    /// Refuses every allocation made inside engine phase `phase` (`None`: none).
    pub fn fail_in(&self, phase: Option<&'static str>) {
        *self.fail_in.lock().unwrap_or_else(|e| e.into_inner()) = phase;
    }

    /// Another tenant of the device takes `bytes` at the first allocation of engine phase
    /// `phase` (memory taken from under a running job).
    pub fn tenant_in(&self, phase: &'static str, bytes: usize) {
        let mut t = self.tenant.lock().unwrap_or_else(|e| e.into_inner());
        (t.phase, t.bytes) = (Some(phase), bytes);
    }

    /// The tenant gives its bytes back (and comes no more).
    pub fn tenant_leaves(&self) {
        let mut t = self.tenant.lock().unwrap_or_else(|e| e.into_inner());
        self.in_use.fetch_sub(t.holds, Ordering::SeqCst);
        *t = Tenant::default();
    }

    fn charge(&self, bytes: usize) -> Result<()> {
        let phase = flowprefill_coordinator::timings::current_phase();
        {
            let mut t = self.tenant.lock().unwrap_or_else(|e| e.into_inner());
            if t.phase.is_some() && t.phase == phase && t.holds == 0 {
                t.holds = t.bytes;
                self.in_use.fetch_add(t.bytes, Ordering::SeqCst);
            }
        }
        let armed = *self.fail_in.lock().unwrap_or_else(|e| e.into_inner());
        let limit = self.limit.load(Ordering::SeqCst);
        let used = self.in_use.load(Ordering::SeqCst);
        if (armed.is_some() && armed == phase) || used.saturating_add(bytes) > limit {
            self.refused.fetch_add(1, Ordering::SeqCst);
            return Err(KernelError::OutOfMemory {
                device: "limited".into(),
                requested: bytes,
                free: Some(limit.saturating_sub(used)),
                advice: flowprefill_kernels::OomAdvice::default(),
            });
        }
        let now = self.in_use.fetch_add(bytes, Ordering::SeqCst) + bytes;
        self.peak.fetch_max(now, Ordering::SeqCst);
        let mut peaks = self.phase_peaks.lock().unwrap_or_else(|e| e.into_inner());
        let name = phase.unwrap_or("-");
        match peaks.iter_mut().find(|(p, _)| *p == name) {
            Some((_, b)) => *b = (*b).max(now),
            None => peaks.push((name, now)),
        }
        Ok(())
    }

    fn release(&self, bytes: usize) {
        self.in_use.fetch_sub(bytes, Ordering::SeqCst);
    }
}

/// A buffer of [`Limited`]: the CPU buffer and the bytes it is charged for.
pub struct Tracked {
    buf: HostBuf,
    charged: usize,
    ledger: Arc<Ledger>,
}

impl Drop for Tracked {
    fn drop(&mut self) {
        self.ledger.release(self.charged);
    }
}

/// The CPU backend behind a [`Ledger`].
pub struct Limited {
    cpu: Cpu,
    ledger: Arc<Ledger>,
}

impl Default for Limited {
    fn default() -> Self {
        let ledger = Ledger {
            in_use: AtomicUsize::new(0),
            peak: AtomicUsize::new(0),
            limit: AtomicUsize::new(usize::MAX),
            fail_in: Mutex::new(None),
            refused: AtomicUsize::new(0),
            phase_peaks: Mutex::new(Vec::new()),
            tenant: Mutex::new(Tenant::default()),
            prefill_rows: AtomicUsize::new(flowprefill_kernels::PREFILL_ROWS),
            gathered_keys: AtomicUsize::new(0),
            attention_calls: AtomicUsize::new(0),
        };
        Self { cpu: Cpu, ledger: Arc::new(ledger) }
    }
}

impl Limited {
    /// The ledger (shared with every buffer).
    pub fn ledger(&self) -> &Arc<Ledger> {
        &self.ledger
    }

    /// A charged buffer of `buf`, or the refusal.
    fn track(&self, buf: HostBuf) -> Result<Tracked> {
        let bytes = buf.len() * buf.dtype().size();
        self.ledger.charge(bytes)?;
        Ok(Tracked { buf, charged: bytes, ledger: self.ledger.clone() })
    }

    /// Charges `t` for `elems` elements if it is charged for fewer.
    fn grow(&self, t: &mut Tracked, elems: usize) -> Result<()> {
        let need = elems * t.buf.dtype().size();
        if need > t.charged {
            self.ledger.charge(need - t.charged)?;
            t.charged = need;
        }
        Ok(())
    }
}

impl Wrapper for Limited {
    type Inner = Cpu;
    fn inner(&self) -> &Cpu {
        &self.cpu
    }
    fn buf(buf: &Tracked) -> &HostBuf {
        &buf.buf
    }
    fn buf_mut(buf: &mut Tracked) -> &mut HostBuf {
        &mut buf.buf
    }
    fn adopt(&self, buf: HostBuf) -> Result<Tracked> {
        self.track(buf)
    }
}

// The ops not written here run on the CPU, a buffer they make charged when it is adopted;
// `matmul_t_acc` adds in the epilogue, as the real backends do: no temporary to count.
flowprefill_kernels::forward_backend! {
    impl Backend for Limited {
        type Buf = Tracked;
        // The trait's defaults, not the CPU's: they allocate through `zeros_as`, `matrix` and
        // `append` here, so their buffers, temporaries and weights are charged (before they are
        // made).
        defaults(zeros, duplicate, rope_copy, matrix_typed, attention_rows, append_rows, download_many, upload_many);

        fn name(&self) -> &'static str {
            "limited-cpu"
        }
        fn zeros_as(&self, len: usize, dtype: DType) -> Result<Tracked> {
            self.ledger.charge(len * dtype.size())?;
            let buf = self.cpu.zeros_as(len, dtype);
            let buf = buf.inspect_err(|_| self.ledger.release(len * dtype.size()))?;
            Ok(Tracked { buf, charged: len * dtype.size(), ledger: self.ledger.clone() })
        }
        fn resize(&self, buf: &mut Tracked, len: usize) -> Result<()> {
            self.grow(buf, len)?;
            self.cpu.resize(&mut buf.buf, len)
        }
        fn reserve(&self, buf: &mut Tracked, capacity: usize) -> Result<()> {
            self.grow(buf, capacity)?;
            self.cpu.reserve(&mut buf.buf, capacity)
        }
        fn matrix(&self, m: Matrix) -> Result<Matrix> {
            // Weights are charged for the model's lifetime (never given back).
            self.ledger.charge(m.rows() * m.cols() * 4)?;
            Ok(m)
        }
        fn append(&self, dst: &mut Tracked, src: &Tracked) -> Result<()> {
            self.grow(dst, dst.buf.len() + src.buf.len())?;
            self.cpu.append(&mut dst.buf, &src.buf)
        }
        fn memory_use(&self) -> Option<MemoryUse> {
            Some(MemoryUse { now: self.ledger.in_use(), peak: self.ledger.peak() })
        }
        fn reset_memory_peak(&self) {
            self.ledger.reset_peak();
        }
        fn prefill_rows(&self) -> usize {
            self.ledger.prefill_rows.load(Ordering::SeqCst)
        }
        fn gathered_keys(&self) -> usize {
            self.ledger.gathered_keys.load(Ordering::SeqCst)
        }
        #[allow(clippy::too_many_arguments)]
        fn attention(
            &self,
            shape: &AttnShape,
            q: &Tracked,
            qpos: &[u32],
            k: &Tracked,
            v: &Tracked,
            kpos: &[u32],
            out: &mut Tracked,
            lse: &mut Tracked,
        ) -> Result<()> {
            self.ledger.attention_calls.fetch_add(1, Ordering::SeqCst);
            self.cpu.attention(shape, &q.buf, qpos, &k.buf, &v.buf, kpos, &mut out.buf, &mut lse.buf)
        }
        fn memory(&self) -> Option<Memory> {
            // Free memory is what the limit leaves; without one it is unknown.
            let limit = self.ledger.limit.load(Ordering::SeqCst);
            (limit != usize::MAX)
                .then(|| Memory { device: "limited".into(), free: limit.saturating_sub(self.ledger.in_use()) })
        }
    }
}
