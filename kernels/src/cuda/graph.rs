//! Recorded steps on the device: [`crate::Backend::record`] as a CUDA graph (issue 51, item 5).
//!
//! ```text
//!   record(values, step)   begin capture on the backend's stream
//!                          3 copies: page-locked [token, position, row] -> 3 device words
//!                          step(): every op queued is captured, not run; a list equal to the
//!                            step's token / position / row is served from its word, any other
//!                            control list from the control cache (kept alive by the graph) or,
//!                            first seen now, copied from page-locked memory the graph keeps
//!                            (made before the capture: allocating host memory may synchronise,
//!                            which a capture does not allow)
//!                          end capture, instantiate (memory the step allocates is the graph's)
//!   replay(values)         wait until the previous replay read the words, write them, launch
//! ```
//!
//! What makes a recording stale: a scratch buffer it names reallocated (a replay then refuses
//! and the caller records again) or a buffer of the caller's moved (the caller's to avoid: it
//! drops the recording before it grows a cache). Work another thread queues on the stream while
//! a step is being recorded would land in the recording: kernel launches from another thread
//! are refused then ([`CudaBackend::run`]), and the engine records only where one thread
//! drives the device.

use super::backend::CudaBackend;
use super::buffers::DeviceRope;
use super::err;
use crate::backend::{Recorded, Replay, StepValues};
use crate::error::Result;
use cudarc::driver::{result, sys, CudaEvent, CudaGraph, CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::ThreadId;

/// What a control list is to a step: which of [`StepValues`] a one-element list may stand for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Role {
    /// Token ids (an embedding).
    Token,
    /// Query positions (rotations, the attention's queries).
    Position,
    /// The destination row of [`crate::Backend::put_rows`].
    Row,
    /// Anything else (key positions and metadata, row indices, tensor maps): fixed in a
    /// recording.
    Other,
}

/// Page-locked host memory of u32 values: the source of the copies a recording replays (a copy
/// from pageable memory cannot be captured, and its source must outlive the graph).
struct Pinned {
    ptr: *mut u32,
    len: usize,
}

// SAFETY: the allocation is owned by this value alone and read by the device only through
// copies the owner queued.
unsafe impl Send for Pinned {}

impl Pinned {
    /// A page-locked copy of `values` (one zero when empty). The context must be current.
    fn new(values: &[u32]) -> Result<Self> {
        let len = values.len().max(1);
        // SAFETY: a plain page-locked allocation of `len` u32 values, all written below.
        let raw = unsafe { result::malloc_host(4 * len, 0) }.map_err(|e| err("record: page-locked memory", e))?;
        let mut p = Self { ptr: raw.cast(), len };
        p.write(values);
        Ok(p)
    }

    fn write(&mut self, values: &[u32]) {
        // SAFETY: `ptr` holds `len` u32 values owned by `self`, borrowed mutably here.
        let s = unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) };
        s.fill(0);
        let n = values.len().min(self.len);
        s[..n].copy_from_slice(&values[..n]);
    }

    fn slice(&self) -> &[u32] {
        // SAFETY: as in `write`, shared.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // SAFETY: allocated by `malloc_host`, freed once; its owners wait for the copies that
        // read it before dropping it.
        let _ = unsafe { result::free_host(self.ptr.cast()) };
    }
}

/// The device words a replay's values are read from, and the page-locked words copied into
/// them at the start of every replay.
struct Slots {
    token: Arc<CudaSlice<u32>>,
    position: Arc<CudaSlice<u32>>,
    row: Arc<CudaSlice<u32>>,
    host: Mutex<Pinned>,
    /// Recorded after the last replay: the host words are rewritten only once it has run.
    done: Mutex<Option<CudaEvent>>,
}

impl Slots {
    /// Queues the copies host -> device words (captured: every replay runs them first).
    fn copy_in(&self, stream: &CudaStream) -> Result<()> {
        let host = lock(&self.host);
        let src = host.slice();
        for (i, word) in [&self.token, &self.position, &self.row].into_iter().enumerate() {
            let (dst, _g) = word.device_ptr(stream);
            // SAFETY: one u32 into a one-element device allocation; the source is page-locked
            // and lives as long as these slots (every recording holds them).
            unsafe { result::memcpy_htod_async(dst, &src[i..i + 1], stream.cu_stream()) }
                .map_err(|e| err("record: step values", e))?;
        }
        Ok(())
    }

    /// Writes `v` into the host words, once the previous replay has copied them.
    fn set(&self, v: StepValues) -> Result<()> {
        if let Some(ev) = lock(&self.done).as_ref() {
            ev.synchronize().map_err(|e| err("replay", e))?;
        }
        lock(&self.host).write(&[v.token, v.position, v.row]);
        Ok(())
    }

    /// Marks the end of the replay just launched on `stream`.
    fn launched(&self, stream: &Arc<CudaStream>) -> Result<()> {
        let mut done = lock(&self.done);
        if done.is_none() {
            *done = Some(stream.context().new_event(None).map_err(|e| err("replay", e))?);
        }
        if let Some(ev) = done.as_ref() {
            ev.record(stream).map_err(|e| err("replay", e))?;
        }
        Ok(())
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// One recording under way.
struct Active {
    values: StepValues,
    thread: ThreadId,
    slots: Arc<Slots>,
    /// Control lists the recording reads from the control cache (held so that an eviction
    /// does not free them under the graph).
    kept: Vec<Arc<CudaSlice<u32>>>,
    /// RoPE tables it reads.
    ropes: Vec<Arc<DeviceRope>>,
    /// Sources of the lists first seen while recording, from the front (page-locked memory
    /// cannot be allocated while a capture is under way: it is made before).
    staged: Pinned,
    staged_used: usize,
}

/// u32 values a recording can copy from page-locked memory (lists first seen while recording:
/// a few row indices and tensor maps).
const STAGED_WORDS: usize = 16 << 10;

/// The recording state of a [`CudaBackend`].
pub(crate) struct Recorder {
    on: AtomicBool,
    active: Mutex<Option<Active>>,
    slots: Mutex<Option<Arc<Slots>>>,
    /// Reallocations of the backend's scratch buffers (shared with them).
    pub(super) scratch_epoch: Arc<AtomicU64>,
}

impl Recorder {
    pub(crate) fn new(scratch_epoch: Arc<AtomicU64>) -> Self {
        Self { on: AtomicBool::new(false), active: Mutex::new(None), slots: Mutex::new(None), scratch_epoch }
    }

    /// Runs `f` on the recording of this thread, if there is one.
    fn with_mine<R>(&self, f: impl FnOnce(&mut Active) -> R) -> Option<R> {
        if !self.on.load(Ordering::Acquire) {
            return None;
        }
        let me = std::thread::current().id();
        lock(&self.active).as_mut().filter(|a| a.thread == me).map(f)
    }

    /// Keeps `r` alive with the recording of this thread (if any).
    pub(super) fn keep_rope(&self, r: &Arc<DeviceRope>) {
        self.with_mine(|a| a.ropes.push(r.clone()));
    }
}

/// A recorded step (see the module docs).
struct CudaStep {
    graph: Option<CudaGraph>,
    stream: Arc<CudaStream>,
    slots: Arc<Slots>,
    epoch: Arc<AtomicU64>,
    recorded_at: u64,
    _kept: Vec<Arc<CudaSlice<u32>>>,
    _ropes: Vec<Arc<DeviceRope>>,
    staged: Option<Pinned>,
}

impl Replay for CudaStep {
    fn replay(&self, values: StepValues) -> Result<()> {
        let now = self.epoch.load(Ordering::Acquire);
        if now != self.recorded_at {
            return Err(err("replay", "stale: a scratch buffer the step reads was reallocated since it was recorded"));
        }
        let graph = self.graph.as_ref().ok_or_else(|| err("replay", "no graph"))?;
        self.slots.set(values)?;
        graph.launch().map_err(|e| err("replay", e))?;
        self.slots.launched(&self.stream)
    }
}

impl Drop for CudaStep {
    fn drop(&mut self) {
        // The page-locked sources are freed only after the last replay read them.
        let _ = self.stream.context().bind_to_thread();
        let _ = self.stream.synchronize();
        self.graph = None;
        self.staged = None;
    }
}

impl CudaBackend {
    /// Whether this thread is recording a step now.
    pub(super) fn recording_here(&self) -> bool {
        self.recorder.with_mine(|_| ()).is_some()
    }

    /// An error when another thread is recording a step: work queued now would land in its
    /// recording.
    pub(super) fn refuse_while_recorded_elsewhere(&self, op: &str) -> Result<()> {
        if !self.recorder.on.load(Ordering::Acquire) || self.recording_here() {
            return Ok(());
        }
        Err(err(op, "another thread is recording a decode step on this GPU; run the work when it is done"))
    }

    /// The device copy of control data `v` (cached by content, see
    /// [`super::buffers::ControlCache`]).
    pub(super) fn upload_u32(&self, v: &[u32]) -> Result<Arc<CudaSlice<u32>>> {
        self.upload_as(v, Role::Other)
    }

    /// The device copy of control list `v` in `role`: the control cache's, or while this thread
    /// records a step, the step's word for a one-element list equal to its token, position or
    /// row (by `role`), else the cache's copy kept with the recording, else a copy made inside
    /// the recording.
    pub(super) fn upload_as(&self, v: &[u32], role: Role) -> Result<Arc<CudaSlice<u32>>> {
        if !self.recorder.on.load(Ordering::Acquire) {
            return self.control.get(&self.stream, v);
        }
        let me = std::thread::current().id();
        let mut g = lock(&self.recorder.active);
        let Some(a) = g.as_mut().filter(|a| a.thread == me) else {
            drop(g);
            return self.control.get(&self.stream, v);
        };
        let word = match role {
            Role::Token if v == [a.values.token] => Some(&a.slots.token),
            Role::Position if v == [a.values.position] => Some(&a.slots.position),
            Role::Row if v == [a.values.row] => Some(&a.slots.row),
            _ => None,
        };
        if let Some(w) = word {
            return Ok(w.clone());
        }
        if let Some(hit) = self.control.find(v) {
            a.kept.push(hit.clone());
            return Ok(hit);
        }
        // First seen while recording: a copy the graph makes from page-locked memory it keeps,
        // into memory it allocates (and frees when the caller drops this, inside the recording).
        let (from, len) = (a.staged_used, v.len().max(1));
        if from + len > a.staged.len {
            return Err(err("record", format!("more than {STAGED_WORDS} values of control data first seen")));
        }
        // SAFETY: `staged` holds `staged.len` u32 values owned by the recording; this range is
        // written once, here, before the copy that reads it is queued.
        let src = unsafe { std::slice::from_raw_parts_mut(a.staged.ptr.add(from), len) };
        src.fill(0);
        src[..v.len()].copy_from_slice(v);
        a.staged_used += len;
        // SAFETY: every element is written by the copy queued next, before any reader.
        let mut dev = unsafe { self.stream.alloc::<u32>(len) }.map_err(|e| self.oom("record", len, 4, e))?;
        {
            let (dst, _g) = dev.device_ptr_mut(&self.stream);
            // SAFETY: `len` u32 values into an allocation of as many; the source is page-locked
            // and kept with the recording.
            unsafe { result::memcpy_htod_async(dst, src, self.stream.cu_stream()) }
                .map_err(|e| err("record: upload", e))?;
        }
        Ok(Arc::new(dev))
    }

    /// The device words of the step values, made once.
    fn slots(&self) -> Result<Arc<Slots>> {
        let mut g = lock(&self.recorder.slots);
        if let Some(s) = g.as_ref() {
            return Ok(s.clone());
        }
        let word = || -> Result<Arc<CudaSlice<u32>>> {
            Ok(Arc::new(self.stream.alloc_zeros::<u32>(1).map_err(|e| self.oom("record", 1, 4, e))?))
        };
        let s = Arc::new(Slots {
            token: word()?,
            position: word()?,
            row: word()?,
            host: Mutex::new(Pinned::new(&[0, 0, 0])?),
            done: Mutex::new(None),
        });
        *g = Some(s.clone());
        Ok(s)
    }

    /// [`crate::Backend::record`]: `step`'s ops captured into a CUDA graph on the backend's
    /// stream.
    pub(super) fn record_step(
        &self,
        values: StepValues,
        step: &mut dyn FnMut() -> Result<()>,
    ) -> Result<Option<Recorded>> {
        self.stream.context().bind_to_thread().map_err(|e| err("record", e))?;
        let slots = self.slots()?;
        {
            let mut g = lock(&self.recorder.active);
            if g.is_some() {
                return Err(err("record", "another step is being recorded on this GPU"));
            }
            let thread = std::thread::current().id();
            let staged = Pinned::new(&vec![0; STAGED_WORDS])?;
            let slots = slots.clone();
            *g = Some(Active { values, thread, slots, kept: vec![], ropes: vec![], staged, staged_used: 0 });
        }
        let recorded_at = self.recorder.scratch_epoch.load(Ordering::Acquire);
        let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
        if let Err(e) = self.stream.begin_capture(mode) {
            lock(&self.recorder.active).take();
            return Err(err("record: begin capture", e));
        }
        self.recorder.on.store(true, Ordering::Release);
        let ran = slots.copy_in(&self.stream).and_then(|()| step());
        self.recorder.on.store(false, Ordering::Release);
        // Memory the step allocated and did not free is the graph's, freed at its next launch.
        let flags = sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH;
        let ended = self.stream.end_capture(flags);
        let active = lock(&self.recorder.active).take();
        if ran.is_err() || ended.is_err() {
            // A free the driver refused inside the failed capture is reported by the next call
            // on the context (cudarc defers it): it belongs to the recording, not to that call.
            let _ = self.stream.context().check_err();
        }
        ran?;
        let graph =
            ended.map_err(|e| err("record: end capture", e))?.ok_or_else(|| err("record", "nothing recorded"))?;
        let a = active.ok_or_else(|| err("record", "the recording's state is gone"))?;
        Ok(Some(Recorded::new(Box::new(CudaStep {
            graph: Some(graph),
            stream: self.stream.clone(),
            slots,
            epoch: self.recorder.scratch_epoch.clone(),
            recorded_at,
            _kept: a.kept,
            _ropes: a.ropes,
            staged: Some(a.staged),
        }))))
    }
}
