//! Device memory of the CUDA backend: typed buffers with a capacity, weight matrices, the
//! scratch buffers reused across calls, the cache of uploaded control data, and the marks
//! (timing events) of [`super::CudaBackend`].
//!
//! Allocations come from the device's stream-ordered pool (`cuMemAllocAsync`), which the
//! backend tells to keep what it frees ([`keep_freed_memory`]): a buffer dropped at the end
//! of a layer and allocated again at the next is a pool hit, not a call into the OS, and no
//! allocation or free waits for the stream.

use super::err;
use crate::backend::DType;
use crate::error::Result;
use crate::gpu::{Elem, Ptr};
use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, SyncOnDrop};
use std::sync::{Arc, Mutex};

/// The allocation of a device buffer, by element type.
pub(crate) enum DevData {
    F32(CudaSlice<f32>),
    Bf16(CudaSlice<u16>),
}

/// A device buffer: `len` elements of one [`DType`] in use, out of the allocation's capacity.
pub struct DeviceBuf {
    pub(crate) data: DevData,
    pub(crate) len: usize,
}

impl DeviceBuf {
    /// Elements in use.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no element is in use.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Elements the allocation holds.
    pub fn capacity(&self) -> usize {
        match &self.data {
            DevData::F32(d) => d.len(),
            DevData::Bf16(d) => d.len(),
        }
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        match &self.data {
            DevData::F32(_) => DType::F32,
            DevData::Bf16(_) => DType::Bf16,
        }
    }

    /// The device address for reading, and the guard that orders other streams after the read.
    pub(crate) fn ptr<'a>(&'a self, stream: &'a CudaStream) -> (Ptr, SyncOnDrop<'a>) {
        match &self.data {
            DevData::F32(d) => {
                let (p, g) = d.device_ptr(stream);
                (Ptr::new(p, Elem::F32), g)
            }
            DevData::Bf16(d) => {
                let (p, g) = d.device_ptr(stream);
                (Ptr::new(p, Elem::Bf16), g)
            }
        }
    }

    /// The device address for writing, and its guard.
    pub(crate) fn ptr_mut<'a>(&'a mut self, stream: &'a CudaStream) -> (Ptr, SyncOnDrop<'a>) {
        match &mut self.data {
            DevData::F32(d) => {
                let (p, g) = d.device_ptr_mut(stream);
                (Ptr::new(p, Elem::F32), g)
            }
            DevData::Bf16(d) => {
                let (p, g) = d.device_ptr_mut(stream);
                (Ptr::new(p, Elem::Bf16), g)
            }
        }
    }
}

pub(crate) enum MatData {
    F32(CudaSlice<f32>),
    Bf16(CudaSlice<u16>),
}

/// A weight matrix `[rows, cols]` on the device.
pub struct DeviceMat {
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    pub(crate) data: MatData,
}

impl DeviceMat {
    /// `(rows, cols)`.
    pub fn shape(&self) -> (usize, usize) {
        (self.rows, self.cols)
    }
}

pub(crate) struct DeviceRope {
    pub(crate) cos: CudaSlice<f32>,
    pub(crate) sin: CudaSlice<f32>,
    /// Positions it covers.
    pub(crate) rows: usize,
}

/// A device allocation reused across calls, grown (never shrunk) to the largest request.
pub(crate) struct Scratch<T> {
    buf: Mutex<Option<CudaSlice<T>>>,
    /// Counts reallocations (shared by the backend's scratch buffers): a recorded step that
    /// names the allocation is stale once this moves.
    grown: Arc<std::sync::atomic::AtomicU64>,
}

impl<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits> Scratch<T> {
    pub(crate) fn new(grown: Arc<std::sync::atomic::AtomicU64>) -> Self {
        Self { buf: Mutex::new(None), grown }
    }

    /// The allocation, at least `len` long, locked for the caller. `recording`: a step is being
    /// recorded on this thread, which must not reallocate (the recording would name memory it
    /// allocated itself): an error then, and the step runs as usual.
    pub(crate) fn get(
        &self,
        stream: &Arc<CudaStream>,
        len: usize,
        recording: bool,
    ) -> Result<std::sync::MutexGuard<'_, Option<CudaSlice<T>>>> {
        let mut g = self.buf.lock().unwrap_or_else(|p| p.into_inner());
        if g.as_ref().is_none_or(|s| s.len() < len) {
            if recording {
                return Err(err("record", format!("a scratch buffer of {len} values would be reallocated")));
            }
            self.grown.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
            *g = None; // free the smaller one first
            let bytes = len.max(1) * std::mem::size_of::<T>();
            *g = Some(stream.alloc_zeros::<T>(len.max(1)).map_err(|e| alloc_err(stream, "scratch alloc", bytes, e))?);
        }
        Ok(g)
    }
}

/// Why a buffer of the wrong element type was refused.
pub(super) fn want(op: &'static str, what: &str, got: DType, want: DType) -> Result<()> {
    if got == want {
        Ok(())
    } else {
        Err(crate::KernelError::Dtype { op, detail: format!("{what} holds {got} values; this operation takes {want}") })
    }
}

/// The error of a failed allocation of `bytes` on `stream`'s device (or of an upload that
/// allocates): [`crate::KernelError::OutOfMemory`] with the device's free memory when the
/// driver is out of memory, else a backend error naming `op`.
pub(crate) fn alloc_err(
    stream: &CudaStream,
    op: &str,
    bytes: usize,
    e: cudarc::driver::DriverError,
) -> crate::KernelError {
    if e.0 == cudarc::driver::sys::cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY {
        let ctx = stream.context();
        return crate::KernelError::OutOfMemory {
            device: format!("cuda:{}", ctx.ordinal()),
            requested: bytes,
            free: ctx.mem_get_info().ok().map(|(free, _)| free),
            advice: crate::OomAdvice::default(),
        };
    }
    err(op, e)
}

/// Control data (positions, key metadata, row indices) uploaded once per distinct content:
/// every layer of a forward passes the same positions, so a forward uploads them once, not
/// once per op and layer. The most recently used entries are kept, up to [`Self::ENTRIES`]
/// and [`Self::BYTES`]; an evicted entry is freed in stream order (later work that still
/// reads it was queued before the free).
pub(crate) struct ControlCache {
    entries: Mutex<Vec<ControlEntry>>,
    /// Where a miss is copied from (`None`: `FLOWPREFILL_PINNED_CONTROL=0`, from pageable
    /// memory as before 2026-11-28; made on first use).
    ring: Option<Mutex<Option<ControlRing>>>,
}

/// Words of the page-locked ring control data is copied from (4 MiB).
const RING_WORDS: usize = 1 << 20;

/// Page-locked memory that control data is copied to the device from. A copy from pageable
/// memory (`clone_htod`) waits until every op queued before it has run (the driver stages the
/// bytes after a stream synchronisation); the Hopper kernel's tensor maps name the K/V
/// addresses, so nearly every attention call missed the cache and drained the queue: 65-75 us
/// of host time per attention call, the device idle in between (H100, 2026-11-28; the reading
/// of a review, to be measured). Two halves: a half is written again only once the event
/// recorded when the writer left it has completed (long before, in practice).
struct ControlRing {
    ptr: *mut u32,
    stream: Arc<CudaStream>,
    /// Next free word.
    at: usize,
    /// The half `at` is in.
    half: usize,
    /// Per half: the event recorded when the writer last left it.
    left: [Option<CudaEvent>; 2],
}

// SAFETY: the allocation is owned by this value alone and written only under the cache's
// lock; the device reads it through copies that are waited for before it is written again.
unsafe impl Send for ControlRing {}

impl Drop for ControlRing {
    fn drop(&mut self) {
        // No copy may still read the ring when it is freed.
        let _ = self.stream.synchronize();
        // SAFETY: allocated by `malloc_host`, freed once, no copy in flight.
        let _ = unsafe { cudarc::driver::result::free_host(self.ptr.cast()) };
    }
}

impl ControlRing {
    fn new(stream: &Arc<CudaStream>) -> Result<Self> {
        stream.context().bind_to_thread().map_err(|e| err("control ring", e))?;
        // SAFETY: a plain page-locked allocation of RING_WORDS u32 values.
        let ptr = unsafe { cudarc::driver::result::malloc_host(RING_WORDS * 4, 0) }
            .map_err(|e| err("control ring: page-locked memory", e))?;
        Ok(Self { ptr: ptr.cast(), stream: stream.clone(), at: 0, half: 0, left: [None, None] })
    }

    /// A new device allocation holding `v` (at most half the ring), its copy queued from the
    /// ring without waiting for the stream.
    fn upload(&mut self, v: &[u32]) -> Result<CudaSlice<u32>> {
        let half = RING_WORDS / 2;
        // 64-word (256-byte) places.
        let len = v.len().div_ceil(64) * 64;
        if len > half {
            return Err(err("control ring", format!("{} words do not fit half the ring", v.len())));
        }
        if self.at + len > (self.half + 1) * half {
            let ev = self.stream.context().new_event(None).map_err(|e| err("control ring", e))?;
            ev.record(&self.stream).map_err(|e| err("control ring", e))?;
            self.left[self.half] = Some(ev);
            self.half ^= 1;
            self.at = self.half * half;
            if let Some(ev) = self.left[self.half].take() {
                ev.synchronize().map_err(|e| err("control ring", e))?;
            }
        }
        // SAFETY: `at + v.len()` is within the ring (checked above), no other slice over it is
        // alive, and the copies that read these words before were waited for (the half's event).
        let src = unsafe { std::slice::from_raw_parts_mut(self.ptr.add(self.at), v.len()) };
        src.copy_from_slice(v);
        // SAFETY: every element is written by the copy queued next, before any reader.
        let mut dev = unsafe { self.stream.alloc::<u32>(v.len()) }
            .map_err(|e| alloc_err(&self.stream, "upload", 4 * v.len(), e))?;
        {
            let (dst, _g) = dev.device_ptr_mut(&self.stream);
            // SAFETY: `v.len()` u32 values into an allocation of as many, from page-locked
            // memory that stays untouched until the copy has run (see above).
            unsafe { cudarc::driver::result::memcpy_htod_async(dst, &*src, self.stream.cu_stream()) }
                .map_err(|e| err("upload", e))?;
        }
        self.at += len;
        Ok(dev)
    }
}

/// A cheap first test of equal contents: the length and eight values spread over them.
fn signature(v: &[u32]) -> u64 {
    let n = v.len();
    let mut h = n as u64;
    if n > 0 {
        for i in 0..8 {
            h = (h.rotate_left(7) ^ v[i * (n - 1) / 7] as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }
    h
}

/// Host contents (with their signature) and their device copy.
type ControlEntry = (u64, Vec<u32>, Arc<CudaSlice<u32>>);

impl ControlCache {
    /// Entries kept: enough for every position list a layer of a chunked layout uses (one per
    /// segment and its metadata, the queries' own), which every layer uses again; with 16 the
    /// final prompt over 16 chunks missed on every call, as it cycled through more lists than
    /// the cache held (H200, 2026-11-26).
    pub(crate) const ENTRIES: usize = 256;
    /// Bytes kept (an entry larger than this is uploaded and not kept).
    pub(crate) const BYTES: usize = 16 << 20;

    /// `pinned`: misses are copied through the page-locked ring.
    pub(crate) fn new(pinned: bool) -> Self {
        Self { entries: Mutex::new(Vec::new()), ring: pinned.then(|| Mutex::new(None)) }
    }

    /// `v` on the device, copied through the ring where there is one and it fits.
    fn upload(&self, stream: &Arc<CudaStream>, v: &[u32]) -> Result<CudaSlice<u32>> {
        if let Some(ring) = self.ring.as_ref().filter(|_| v.len() <= RING_WORDS / 2) {
            let mut g = ring.lock().unwrap_or_else(|p| p.into_inner());
            if g.is_none() {
                *g = Some(ControlRing::new(stream)?);
            }
            if let Some(r) = g.as_mut() {
                return r.upload(v);
            }
        }
        stream.clone_htod(v).map_err(|e| alloc_err(stream, "upload", 4 * v.len(), e))
    }

    /// The device copy of `v` (at least one element: an empty allocation is not allowed).
    pub(crate) fn get(&self, stream: &Arc<CudaStream>, v: &[u32]) -> Result<Arc<CudaSlice<u32>>> {
        let sig = signature(v);
        let mut entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(i) = entries.iter().rposition(|(s, host, _)| *s == sig && host.as_slice() == v) {
            let e = entries.remove(i);
            let dev = e.2.clone();
            entries.push(e);
            return Ok(dev);
        }
        let dev = Arc::new(if v.is_empty() {
            stream.alloc_zeros::<u32>(1).map_err(|e| alloc_err(stream, "upload", 4, e))?
        } else {
            self.upload(stream, v)?
        });
        if 4 * v.len() <= Self::BYTES {
            entries.push((sig, v.to_vec(), dev.clone()));
            let mut bytes: usize = entries.iter().map(|(_, h, _)| 4 * h.len()).sum();
            while entries.len() > Self::ENTRIES || bytes > Self::BYTES {
                bytes -= 4 * entries.remove(0).1.len();
            }
        }
        Ok(dev)
    }

    /// The device copy of `v` if it is held, without uploading or evicting anything.
    pub(crate) fn find(&self, v: &[u32]) -> Option<Arc<CudaSlice<u32>>> {
        let sig = signature(v);
        let entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        entries.iter().rev().find(|(s, host, _)| *s == sig && host.as_slice() == v).map(|e| e.2.clone())
    }

    /// Entries held (for tests and statistics).
    #[allow(dead_code)]
    pub(crate) fn len(&self) -> usize {
        self.entries.lock().unwrap_or_else(|p| p.into_inner()).len()
    }
}

/// A [`crate::Backend::mark`] of the CUDA backend: an event with timing, recorded on the
/// backend's stream.
#[derive(Clone)]
pub struct Mark(pub(crate) Arc<CudaEvent>);

/// A timing event recorded on `stream` now.
pub(crate) fn mark(ctx: &Arc<CudaContext>, stream: &CudaStream) -> Result<Mark> {
    let ev = ctx.new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT)).map_err(|e| err("mark", e))?;
    ev.record(stream).map_err(|e| err("mark", e))?;
    Ok(Mark(Arc::new(ev)))
}

/// Tells the device's default memory pool (the one `cuMemAllocAsync` draws from) to keep
/// freed memory for reuse instead of returning it to the driver at every synchronisation.
pub(crate) fn keep_freed_memory(ctx: &Arc<CudaContext>) -> Result<()> {
    set_pool_attribute(ctx, cudarc::driver::sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, u64::MAX)
}

/// The device's default memory pool (the stream-ordered allocator every buffer comes from),
/// with the context current on this thread.
fn default_pool(ctx: &Arc<CudaContext>) -> Result<cudarc::driver::sys::CUmemoryPool> {
    use cudarc::driver::sys;
    ctx.bind_to_thread().map_err(|e| err("memory pool", e))?;
    let mut pool = std::mem::MaybeUninit::<sys::CUmemoryPool>::uninit();
    // SAFETY: the context is current on this thread; `pool` receives the device's default
    // pool handle, valid for the context's lifetime.
    unsafe {
        sys::cuDeviceGetDefaultMemPool(pool.as_mut_ptr(), ctx.cu_device())
            .result()
            .map_err(|e| err("memory pool", e))?;
        Ok(pool.assume_init())
    }
}

/// A u64 attribute of `pool`.
fn pool_attribute(
    pool: cudarc::driver::sys::CUmemoryPool,
    attr: cudarc::driver::sys::CUmemPool_attribute,
) -> Result<u64> {
    let mut v = 0u64;
    // SAFETY: `pool` is a valid pool handle; every attribute read here is a u64.
    unsafe {
        cudarc::driver::result::mem_pool::get_attribute(pool, attr, &mut v as *mut u64 as *mut std::ffi::c_void)
            .map_err(|e| err("memory pool", e))?;
    }
    Ok(v)
}

/// Bytes a job can allocate on the device of `ctx` now: free in the driver, plus what the
/// default pool keeps reserved but unused (kept by [`keep_freed_memory`]; the driver counts it
/// as taken, yet the next allocation of this process reuses it).
pub(crate) fn device_free(ctx: &Arc<CudaContext>) -> Result<usize> {
    use cudarc::driver::sys::CUmemPool_attribute as A;
    let (free, _total) = ctx.mem_get_info().map_err(|e| err("memory info", e))?;
    if !ctx.has_async_alloc() {
        return Ok(free);
    }
    let pool = default_pool(ctx)?;
    let reserved = pool_attribute(pool, A::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)?;
    let used = pool_attribute(pool, A::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)?;
    Ok(free.saturating_add(reserved.saturating_sub(used) as usize))
}

/// Bytes of the default pool in use now, and the most in use since [`reset_pool_peak`].
pub(crate) fn pool_use(ctx: &Arc<CudaContext>) -> Result<(usize, usize)> {
    use cudarc::driver::sys::CUmemPool_attribute as A;
    if !ctx.has_async_alloc() {
        return Err(err("memory pool", "this device has no stream-ordered allocator"));
    }
    let pool = default_pool(ctx)?;
    let now = pool_attribute(pool, A::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)? as usize;
    let peak = pool_attribute(pool, A::CU_MEMPOOL_ATTR_USED_MEM_HIGH)? as usize;
    Ok((now, peak.max(now)))
}

/// Restarts the pool's high-water mark of used memory (the driver takes 0 as "from the
/// current use").
pub(crate) fn reset_pool_peak(ctx: &Arc<CudaContext>) -> Result<()> {
    set_pool_attribute(ctx, cudarc::driver::sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH, 0)
}

/// Sets a u64 attribute of the device's default pool (nothing on a device without one).
/// Returns the default pool's memory that no allocation holds to the driver (the pool keeps
/// freed memory for reuse, [`keep_freed_memory`]: after one long job, its peak stayed reserved
/// while the process sat idle, taken for every other process on the GPU and for allocations
/// outside the pool, NCCL's and cuBLAS's).
pub(crate) fn trim_pool(ctx: &Arc<CudaContext>) -> Result<()> {
    if !ctx.has_async_alloc() {
        return Ok(());
    }
    let pool = default_pool(ctx)?;
    // SAFETY: `pool` is a valid pool handle (the context is current); trimming releases only
    // memory that backs no outstanding allocation.
    unsafe { cudarc::driver::result::mem_pool::trim_to(pool, 0).map_err(|e| err("memory pool", e)) }
}

fn set_pool_attribute(
    ctx: &Arc<CudaContext>,
    attr: cudarc::driver::sys::CUmemPool_attribute,
    value: u64,
) -> Result<()> {
    if !ctx.has_async_alloc() {
        return Ok(());
    }
    let pool = default_pool(ctx)?;
    let mut v = value;
    // SAFETY: `pool` is a valid pool handle; the attributes set here (release threshold,
    // used-memory high-water mark) take a u64.
    unsafe {
        cudarc::driver::result::mem_pool::set_attribute(pool, attr, &mut v as *mut u64 as *mut std::ffi::c_void)
            .map_err(|e| err("memory pool", e))
    }
}
