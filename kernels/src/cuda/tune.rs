//! The attention autotuner on the device: the first large enough attention of a (head
//! dimension, shape class) on a GPU without a decision times every configuration of
//! `flash2.cu` and, on Hopper, `flash_hopper.cu` (and, for decode-like calls, the key split's
//! blocks per SM) on that very call's
//! inputs, with CUDA events, and keeps the fastest: in this process, and in the decisions file
//! (`gpu::tune`) for every later process on the machine. `flowprefill tune` does the same on
//! synthetic inputs ahead of time.
//!
//! Modes: `FLOWPREFILL_FLASH_KERNEL` names a kernel (no tuning, no decision read);
//! `FLOWPREFILL_TUNE=off` uses decisions on file but never times; by default (`auto`) a missing
//! decision is made on the first call large enough to time ([`TUNE_MIN_WORK`] query-key pairs
//! for prefill calls, [`TUNE_MIN_NARROW_WORK`] for narrow ones, [`TUNE_MIN_KEYS`] keys for
//! decode-like ones; smaller calls run the default configuration, a narrow one the prefill
//! decision if there is one, and leave the decision to a larger one). A tuning that
//! fails (a candidate that does not compile, a launch error) says so once and runs the default:
//! tuning never fails a job.

use super::backend::CudaBackend;
use super::err;
use super::hopper::FlashIo;
use super::tuning::Mode;
use crate::error::{KernelError, Result};
use crate::gpu::ops::{self, AttnDims, FlashKernel};
use crate::gpu::tune::{self, ShapeClass, TuneEntry, TuneKey, TuneTable, DEFAULT_BLOCKS_PER_SM};
use crate::gpu::{self, shapes, Elem, Ptr};
use cudarc::driver::{DevicePtr, DevicePtrMut};

/// Query-key pairs (times the query heads of a KV group) a call needs to be timed for a
/// decision: smaller calls are dominated by launch overhead and would decide on noise.
pub const TUNE_MIN_WORK: u64 = 1 << 24;

/// Query-key pairs (times the query heads of a KV group) a narrow call
/// ([`ShapeClass::Narrow`]) needs to be timed: narrow calls are small by definition (SmolLM2's
/// 2,048-token causal chunk is 2^23.6), and a 10 us kernel still times well with events.
pub const TUNE_MIN_NARROW_WORK: u64 = 1 << 22;

/// Keys a decode-like call needs to be timed for a decision.
pub const TUNE_MIN_KEYS: u32 = 4096;

/// Timed runs per candidate (after one warm-up run); the median is kept.
const RUNS: usize = 5;

/// Blocks per SM the key splits of decode-like calls may aim at.
const DECODE_BLOCKS: [u32; 4] = [1, 2, 4, 8];

/// The device inputs of one attention call, for timing candidates on them: bf16 queries,
/// query positions, bf16 keys and values, the key metadata (all device addresses).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Inputs {
    pub q: Ptr,
    pub qpos: Ptr,
    pub k: Ptr,
    pub v: Ptr,
    pub meta: Ptr,
    pub scale: f32,
}

impl Inputs {
    /// The call's buffers with `out` and `lse` as its outputs.
    pub(super) fn io(&self, out: Ptr, lse: Ptr) -> FlashIo {
        FlashIo { q: self.q, qpos: self.qpos, k: self.k, v: self.v, meta: self.meta, out, lse }
    }
}

impl CudaBackend {
    /// Runs attention with `kernel` from now on (as `FLOWPREFILL_FLASH_KERNEL` does): no
    /// decision read or made. Loads the configuration now (an error if it does not compile);
    /// the Hopper kernel must pass its self-check (an error, and nothing changed, if not).
    pub fn fix_attention(&mut self, kernel: FlashKernel) -> Result<()> {
        self.ready(kernel)?;
        self.tuning.mode = Mode::Fixed(kernel);
        self.tuning.forget_choices();
        Ok(())
    }

    /// At start, the kernel `FLOWPREFILL_FLASH_KERNEL` fixed: a flash2 configuration other
    /// than 0 (not among the kernels loaded with the backend) loads now, or the start fails
    /// naming the variable (every attention call failed "not loaded" before); the Hopper kernel
    /// runs only after its self-check on this GPU, else flash2 (and its autotuner, unless
    /// `tune_off`) with one line saying why.
    pub(super) fn settle_fixed(&mut self, fixed: Option<FlashKernel>, tune_off: bool) -> Result<()> {
        let ordinal = self.ordinal();
        match fixed {
            Some(k @ FlashKernel::Fa2(_)) => self.ready(k).map_err(|e| {
                err(
                    "FLOWPREFILL_FLASH_KERNEL",
                    format!(
                        "{} did not load on cuda:{ordinal} ({e}); give another configuration, or unset it",
                        k.name()
                    ),
                )
            }),
            Some(FlashKernel::Hopper(c)) => {
                if let Err(e) = self.hopper_verified(c) {
                    if matches!(e, KernelError::DeviceLost { .. }) {
                        return Err(e);
                    }
                    eprintln!(
                        "flowprefill: cuda:{ordinal}: the Hopper attention is not used: {e}; flash2 (fa2) runs instead"
                    );
                    // The mode the backend would have without the variable; the failed verdict
                    // is kept (the autotuner does not retry it).
                    self.tuning.mode = super::tuning::Tuning::new(None, tune_off).mode;
                }
                Ok(())
            }
            _ => Ok(()),
        }
    }

    /// Makes `kernel` ready to launch: a flash2 configuration loaded (compiled on first use),
    /// the Hopper kernel verified on this GPU (compute capability 9.0, its self-check passed).
    pub(super) fn ready(&self, kernel: FlashKernel) -> Result<()> {
        match kernel {
            FlashKernel::Fa2(c) => self.load_config("flash2.cu", c as usize),
            FlashKernel::Hopper(c) => self.hopper_verified(c),
            FlashKernel::Reference => Ok(()),
        }
    }

    /// The kernel attention is fixed to (`FLOWPREFILL_FLASH_KERNEL`, [`Self::fix_attention`]),
    /// `None` when the autotuner chooses.
    pub fn fixed_attention(&self) -> Option<FlashKernel> {
        match self.tuning.mode {
            Mode::Fixed(k) => Some(k),
            _ => None,
        }
    }

    /// Back to the autotuner's choices (decisions on file, or made on the first large call).
    pub fn auto_attention(&mut self) {
        self.tuning.mode = Mode::Auto;
        self.tuning.forget_choices();
    }

    fn tune_key(&self, head_dim: u32, class: ShapeClass) -> TuneKey {
        TuneKey { gpu: self.gpu_name.clone(), driver: self.driver, sources: gpu::sources_hash(), head_dim, class }
    }

    fn with_table<R>(&self, f: impl FnOnce(&mut TuneTable) -> R) -> R {
        let mut t = self.tuning.table.lock().unwrap_or_else(|p| p.into_inner());
        let table = t.get_or_insert_with(|| match TuneTable::load(&tune::default_path()) {
            Ok(table) => {
                if table.skipped > 0 {
                    eprintln!("flowprefill: the autotuner's file had {} unreadable line(s), skipped", table.skipped);
                }
                table
            }
            Err(e) => {
                eprintln!("flowprefill: the autotuner's file could not be read ({e}): tuning again");
                TuneTable::default()
            }
        });
        f(table)
    }

    fn warn_once(&self, what: String) {
        let mut w = self.tuning.warned.lock().unwrap_or_else(|p| p.into_inner());
        if !*w {
            *w = true;
            eprintln!("flowprefill: cuda:{}: {what}; the default attention configuration runs", self.ordinal());
        }
    }

    /// The attention kernel and the key split's blocks per SM for a call of `dims`: the fixed
    /// kernel, this process's choice, the decision on file, a decision made now by timing the
    /// candidates on `inputs` (auto mode, large call), the decision of the class it falls back
    /// to (a narrow call too small to decide on), or the default; these last two are kept as
    /// the class's interim choice until a call large enough decides.
    pub(super) fn flash_choice(&self, dims: AttnDims, inputs: &Inputs) -> (FlashKernel, u32) {
        let mode = self.tuning.mode;
        if let Mode::Fixed(k) = mode {
            return (k, DEFAULT_BLOCKS_PER_SM);
        }
        let default = (FlashKernel::Fa2(0), DEFAULT_BLOCKS_PER_SM);
        let class = ShapeClass::of(dims, self.sm_count);
        if let Some((c, b)) = self.settled(dims.head_dim, class) {
            return (tune::kernel_of(c), b);
        }
        let slot = (dims.head_dim, class);
        let interim = self.tuning.interim.lock().unwrap_or_else(|p| p.into_inner()).get(&slot).copied();
        if let Some((c, b)) = interim.filter(|_| mode != Mode::Auto || !representative(dims, class)) {
            return (tune::kernel_of(c), b);
        }
        // Inside a decode step being recorded as a CUDA graph nothing may wait on the device (the
        // tuner's timing, a self-check's download, a module load): that invalidated the capture
        // (graphs off for the process) and pinned configuration 0. This call takes the default,
        // not kept: the next call outside a recording settles the choice.
        if self.recording_here() {
            return default;
        }
        let key = self.tune_key(dims.head_dim, class);
        let decided = match self.on_file(&key) {
            Some(d) => Some(d),
            None if mode == Mode::Auto && representative(dims, class) => match self.tune_attention(dims, inputs, key) {
                Ok(e) => Some((e.config, e.blocks_per_sm)),
                Err(e) => {
                    self.warn_once(format!("the attention autotuner failed ({e})"));
                    Some((0, DEFAULT_BLOCKS_PER_SM))
                }
            },
            None => None,
        };
        match decided {
            Some(d) => {
                let (c, b) = self.settle(dims.head_dim, class, d);
                (tune::kernel_of(c), b)
            }
            // Not settled for this class: its first call large enough decides.
            None => {
                let (c, b) = match class.fallback().and_then(|f| self.decision(dims.head_dim, f)) {
                    Some((c, _)) => (c, DEFAULT_BLOCKS_PER_SM),
                    None => (0, DEFAULT_BLOCKS_PER_SM),
                };
                self.tuning.interim.lock().unwrap_or_else(|p| p.into_inner()).insert(slot, (c, b));
                (tune::kernel_of(c), b)
            }
        }
    }

    /// What this process settled for (head dimension, class).
    fn settled(&self, head_dim: u32, class: ShapeClass) -> Option<(u8, u32)> {
        self.tuning.chosen.lock().unwrap_or_else(|p| p.into_inner()).get(&(head_dim, class)).copied()
    }

    /// The decision on file for `key`: (configuration, blocks per SM).
    fn on_file(&self, key: &TuneKey) -> Option<(u8, u32)> {
        self.with_table(|t| t.get(key).map(|e| (e.config, e.blocks_per_sm)))
    }

    /// The decision settled or on file for (head dimension, class), settled if it was on file.
    fn decision(&self, head_dim: u32, class: ShapeClass) -> Option<(u8, u32)> {
        self.settled(head_dim, class)
            .or_else(|| self.on_file(&self.tune_key(head_dim, class)).map(|d| self.settle(head_dim, class, d)))
    }

    /// Keeps `(config, blocks)` as this process's choice for (head dimension, class), once
    /// its kernel is ready (loaded, or the Hopper kernel verified); the default if it is not.
    fn settle(&self, head_dim: u32, class: ShapeClass, (c, b): (u8, u32)) -> (u8, u32) {
        let (c, b) = match self.ready(tune::kernel_of(c)) {
            Ok(()) => (c, b),
            Err(e) => {
                self.warn_once(format!("configuration {c} of the attention did not load ({e})"));
                (0, DEFAULT_BLOCKS_PER_SM)
            }
        };
        self.tuning.chosen.lock().unwrap_or_else(|p| p.into_inner()).insert((head_dim, class), (c, b));
        // A class that ran another's decision meanwhile looks again.
        self.tuning.interim.lock().unwrap_or_else(|p| p.into_inner()).clear();
        (c, b)
    }

    /// Times every candidate on `inputs` (the call's own), records the winner under `key` in
    /// the decisions file, and returns the decision.
    pub(super) fn tune_attention(&self, dims: AttnDims, inputs: &Inputs, key: TuneKey) -> Result<TuneEntry> {
        let blocks: &[u32] = if key.class.tunes_split() { &DECODE_BLOCKS } else { &[DEFAULT_BLOCKS_PER_SM] };
        let s = &self.stream;
        let out_len = dims.m as usize * dims.n_heads as usize * dims.head_dim as usize;
        let lse_len = dims.m as usize * dims.n_heads as usize;
        let mut out = s.alloc_zeros::<f32>(out_len.max(1)).map_err(|e| self.oom("tune", out_len, 4, e))?;
        let mut lse = s.alloc_zeros::<f32>(lse_len.max(1)).map_err(|e| self.oom("tune", lse_len, 4, e))?;
        let mut candidates = Vec::new();
        // flash2's configurations and, on compute capability 9.0, the Hopper kernel's, each once
        // it passed its self-check.
        let hopper = if self.has_hopper() { tune::HOPPER_CONFIG..tune::CONFIGS } else { 0..0 };
        let configs = (0..shapes::FA2_CONFIGS.len() as u8).chain(hopper);
        for c in configs {
            let kernel = tune::kernel_of(c);
            if let Err(e) = self.ready(kernel) {
                if matches!(e, KernelError::DeviceLost { .. }) {
                    return Err(e);
                }
                eprintln!("flowprefill: autotuner: configuration {c} ({}) skipped ({e})", kernel.name());
                continue;
            }
            for &b in blocks {
                let plan = ops::flash_plan_aiming(dims, kernel, self.sm_count, b, None);
                let (op, _c) = out.device_ptr_mut(s);
                let (lp, _d) = lse.device_ptr_mut(s);
                let io = inputs.io(Ptr::new(op, Elem::F32), Ptr::new(lp, Elem::F32));
                let median = self.with_partials(dims, &plan, |partial| {
                    self.time_with(|| self.run_flash(dims, &plan, io, partial, inputs.scale))
                })?;
                candidates.push((c, b, median));
            }
        }
        let (config, blocks_per_sm) =
            tune::winner(&candidates).ok_or_else(|| err("tune", "no candidate could be timed"))?;
        let entry = TuneEntry { key, config, blocks_per_sm, timed_on: (dims.m, dims.n), candidates };
        // Into this process's table, and into the file as it is now (another process on the
        // machine may have added decisions since it was read).
        self.with_table(|t| t.put(entry.clone()));
        let p = tune::default_path();
        let mut on_disk = TuneTable::load(&p).unwrap_or_default();
        on_disk.put(entry.clone());
        match on_disk.save(&p) {
            Ok(()) => eprintln!(
                "flowprefill: cuda:{}: attention tuned for head_dim {} ({}): configuration {config}, {blocks_per_sm} \
                 block(s) per SM for key splits; kept in {}",
                self.ordinal(),
                dims.head_dim,
                entry.key.class,
                p.display()
            ),
            Err(e) => eprintln!("flowprefill: the autotuner's decision was not saved ({e}); kept for this process"),
        }
        Ok(entry)
    }

    /// Median microseconds of what `launch` queues over [`RUNS`] runs after a warm-up, from
    /// CUDA events on the stream.
    fn time_with(&self, launch: impl Fn() -> Result<()>) -> Result<f64> {
        let s = &self.stream;
        launch()?;
        let mut times = Vec::with_capacity(RUNS);
        for _ in 0..RUNS {
            let start = super::buffers::mark(s.context(), s)?;
            launch()?;
            let end = super::buffers::mark(s.context(), s)?;
            // Bounded: a configuration's first run on a call of this size.
            self.finish_within("the autotuner's timing")?;
            let ms = start.0.elapsed_ms(&end.0).map_err(|e| err("tune", e))?;
            times.push(f64::from(ms) * 1e3);
        }
        times.sort_by(f64::total_cmp);
        Ok(times[RUNS / 2])
    }

    /// `flowprefill tune`: makes the decisions for head dimension `head_dim` (64 or 128) with
    /// `heads` query heads over `kv_heads` KV heads on synthetic inputs: a causal prefill of
    /// `tokens` tokens, a narrow one ([`ShapeClass::Narrow`]: as many blocks as SMs), and one
    /// decode step over `tokens`. Replaces decisions on file.
    pub fn tune_synthetic(&self, head_dim: u32, heads: u32, kv_heads: u32, tokens: u32) -> Result<Vec<TuneEntry>> {
        if !ops::flash_supported(head_dim as usize) {
            return Err(err("tune", format!("head_dim {head_dim}: the tensor-core attention takes 64 or 128")));
        }
        let s = &self.stream;
        let (kvd, qd) = (kv_heads as usize * head_dim as usize, heads as usize * head_dim as usize);
        let n = tokens as usize;
        // Values in [-1, 1) as bf16 bits: a fixed pattern, no host randomness needed.
        let pattern = |len: usize, seed: u32| -> Vec<u16> {
            (0..len as u32)
                .map(|i| {
                    crate::backend::to_bf16(
                        ((i.wrapping_mul(2654435761).wrapping_add(seed) >> 8) as f32 / (1u32 << 24) as f32) * 2.0 - 1.0,
                    )
                })
                .collect()
        };
        let up = |v: Vec<u16>| s.clone_htod(&v).map_err(|e| self.oom("tune", v.len(), 2, e));
        let (q, k, v) = (up(pattern(n * qd, 1))?, up(pattern(n * kvd, 2))?, up(pattern(n * kvd, 3))?);
        let pos: Vec<u32> = (0..tokens).collect();
        let qpos = self.upload_u32(&pos)?;
        let meta = self.upload_u32(&ops::key_meta(&pos))?;
        let last = self.upload_u32(&pos[n.saturating_sub(1)..])?;
        // The narrow class's causal prefill: as many blocks of the default configuration as the
        // GPU has SMs (half the class's bound), over its own keys (the first rows of q, k, v).
        let narrow = ShapeClass::narrow_rows(heads, kv_heads, head_dim, self.sm_count, tokens);
        let narrow_meta = self.upload_u32(&ops::key_meta(&pos[..narrow as usize]))?;
        let (qp, _a) = q.device_ptr(s);
        let (kp, _b) = k.device_ptr(s);
        let (vp, _c) = v.device_ptr(s);
        let (pp, _d) = qpos.device_ptr(s);
        let (mp, _e) = meta.device_ptr(s);
        let (lp, _f) = last.device_ptr(s);
        let (np, _g) = narrow_meta.device_ptr(s);
        let b = |p| Ptr::new(p, Elem::Bf16);
        let u = |p| Ptr::new(p, Elem::U32);
        let scale = 1.0 / (head_dim as f32).sqrt();
        let mut out = Vec::new();
        // (query rows, keys, query positions, key metadata): the prefill, the narrow prefill, one
        // decode step over every token.
        for (m, keys, qpos, meta) in [(tokens, tokens, pp, mp), (narrow, narrow, pp, np), (1, tokens, lp, mp)] {
            let dims = AttnDims { m, n: keys, n_heads: heads, n_kv_heads: kv_heads, head_dim };
            let class = ShapeClass::of(dims, self.sm_count);
            if out.iter().any(|e: &TuneEntry| e.key.class == class) {
                continue; // `tokens` this small is narrow itself
            }
            let inputs = Inputs { q: b(qp), qpos: u(qpos), k: b(kp), v: b(vp), meta: u(meta), scale };
            let e = self.tune_attention(dims, &inputs, self.tune_key(head_dim, class))?;
            self.settle(head_dim, class, (e.config, e.blocks_per_sm));
            out.push(e);
        }
        Ok(out)
    }
}

/// Whether a call is large enough to decide on: prefill calls of at least [`TUNE_MIN_WORK`]
/// query-key pairs (times the query heads of a KV group), narrow ones of at least
/// [`TUNE_MIN_NARROW_WORK`], decode-like calls over at least [`TUNE_MIN_KEYS`] keys.
fn representative(d: AttnDims, class: ShapeClass) -> bool {
    let work = d.m as u64 * d.n as u64 * d.group() as u64;
    match class {
        ShapeClass::Prefill => work >= TUNE_MIN_WORK,
        ShapeClass::Narrow => work >= TUNE_MIN_NARROW_WORK,
        ShapeClass::Decode => d.n >= TUNE_MIN_KEYS,
    }
}
