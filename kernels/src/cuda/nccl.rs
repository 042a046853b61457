//! NCCL, loaded at run time like the rest of the CUDA stack: its version, a unique id (made on
//! rank 0 and handed to the other ranks over MPI or to thread ranks), and a communicator per
//! rank. Without the library, or without a GPU, every call is an error that says which, never
//! a panic (cudarc's loader panics when the library is missing, so presence is checked first).
//!
//! The PyPI wheel `nvidia-nccl-cu12` ships `libnccl.so.2`; cudarc looks for `libnccl.so`, so
//! `scripts/cuda-wheels.sh --nccl` links that name to it, and the program does as much for any
//! `libnccl.so.2` it finds ([`super::libs`]).

use super::{fail, CudaBackend, DeviceBuf};
use crate::backend::DType;
use crate::error::Result;
use cudarc::driver::{CudaContext, CudaEvent, CudaStream};
use cudarc::nccl::sys;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Bytes of an NCCL unique id (`NCCL_UNIQUE_ID_BYTES`).
pub const ID_BYTES: usize = 128;

/// Why a device exchange on an [`NcclPlane`] failed. The worker's device plane turns these into
/// its communicator's errors (the messages are the communicator's, so a user reads the same
/// text whichever plane failed).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PlaneError {
    /// Used out of order: an exchange issued while another is pending, after an abort (the
    /// worker's plane refuses that one first, see [`NcclPlane::down`]), or a `complete`
    /// without an `issue`.
    #[error("communicator misuse: {0}")]
    Misuse(String),
    /// A peer rank outside the communicator's world.
    #[error("rank {rank} does not exist in a world of {size}")]
    BadRank {
        /// The rank.
        rank: usize,
        /// World size.
        size: usize,
    },
    /// NCCL or CUDA failed during the exchange; the communicator is aborted.
    #[error("rank {rank} was lost during `{op}` ({detail}); the job cannot continue without it")]
    Lost {
        /// The first peer of the exchange.
        rank: usize,
        /// The exchange.
        op: String,
        /// What failed.
        detail: String,
    },
    /// This rank's own GPU failed during the exchange (its context answers with an error CUDA
    /// keeps): not a peer's fault; the communicator is aborted and the process cannot use the
    /// GPU again.
    #[error(
        "rank {rank}'s GPU failed during `{op}` ({detail}); its context is lost (every later call on it in this \
         process fails): restart the process"
    )]
    DeviceLost {
        /// This rank.
        rank: usize,
        /// The exchange.
        op: String,
        /// What failed, and the context's answer.
        detail: String,
    },
    /// The exchange did not finish before the deadline; the communicator is aborted.
    #[error(
        "rank {rank} did not answer within {secs:.0} s during `{op}` (lost or stuck); raise --comm-timeout \
         if ranks legitimately compute longer between collectives"
    )]
    Timeout {
        /// The first peer of the exchange.
        rank: usize,
        /// The exchange.
        op: String,
        /// The deadline.
        secs: f64,
    },
}

type PlaneResult<T> = std::result::Result<T, PlaneError>;

/// An exchange of rank `me` with `peer` first that failed with `detail`: this GPU's failure when its
/// context answered with an error CUDA keeps (`sticky`), else the peer's loss.
fn plane_error(
    me: usize,
    peer: usize,
    op: &str,
    detail: String,
    sticky: Option<cudarc::driver::sys::CUresult>,
) -> PlaneError {
    match sticky {
        Some(r) => PlaneError::DeviceLost {
            rank: me,
            op: op.to_string(),
            detail: format!("{detail}; the context then answered {r:?}"),
        },
        None => PlaneError::Lost { rank: peer, op: op.to_string(), detail },
    }
}

/// True when the NCCL library can be loaded.
pub fn present() -> bool {
    // SAFETY: only attempts to dlopen the library by its usual names; no symbol is called.
    unsafe { cudarc::nccl::sys::is_culib_present() }
}

fn require() -> Result<()> {
    if present() {
        Ok(())
    } else {
        Err(fail(format!("{}; or use the MPI communicator", super::libs::missing_named("NCCL"))))
    }
}

/// NCCL's version as (major, minor, patch).
pub fn version() -> Result<(i32, i32, i32)> {
    require()?;
    let code = cudarc::nccl::result::get_nccl_version().map_err(|e| fail(format!("ncclGetVersion: {e:?}")))?;
    // Since NCCL 2.9 the code is major * 10000 + minor * 100 + patch.
    Ok((code / 10000, (code % 10000) / 100, code % 100))
}

/// A fresh unique id for a new communicator (rank 0 makes it; every rank needs the same one).
/// Needs the library, not a GPU.
pub fn unique_id() -> Result<[u8; ID_BYTES]> {
    require()?;
    let id = cudarc::nccl::safe::Id::new().map_err(|e| fail(format!("ncclGetUniqueId: {e:?}")))?;
    let mut out = [0u8; ID_BYTES];
    for (o, &c) in out.iter_mut().zip(id.internal().iter()) {
        *o = c as u8;
    }
    Ok(out)
}

/// An NCCL communicator this process owns: destroyed when dropped, or aborted
/// (`ncclCommAbort`) once something went wrong, never left behind.
pub struct NcclComm {
    raw: sys::ncclComm_t,
    ctx: Arc<CudaContext>,
    ordinal: usize,
    rank: usize,
    world: usize,
    aborted: bool,
}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "NcclComm(rank {} of {} on cuda:{}{})",
            self.rank,
            self.world,
            self.ordinal,
            if self.aborted { ", aborted" } else { "" }
        )
    }
}

// SAFETY: an NCCL communicator may be used from any thread as long as one thread uses it at a
// time; `NcclComm` is only used through `&mut self` or dropped.
unsafe impl Send for NcclComm {}

impl NcclComm {
    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.world
    }

    /// Device ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// `ncclCommAbort`: operations in flight are abandoned; the communicator is gone.
    pub fn abort(&mut self) {
        if !self.aborted {
            self.aborted = true;
            let _ = self.ctx.bind_to_thread();
            // SAFETY: `raw` came from a successful ncclCommInitRank and is aborted once.
            let _ = unsafe { cudarc::nccl::result::comm_abort(self.raw) };
        }
    }

    /// The asynchronous error NCCL recorded for this communicator, if any.
    fn async_error(&self) -> Option<String> {
        if self.aborted {
            return Some("the communicator was aborted".into());
        }
        let mut st = sys::ncclResult_t::ncclSuccess;
        // SAFETY: `raw` is a live communicator; `st` is a valid out pointer.
        let r = unsafe { sys::ncclCommGetAsyncError(self.raw, &mut st) };
        match (r, st) {
            (sys::ncclResult_t::ncclSuccess, sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress) => {
                None
            }
            (sys::ncclResult_t::ncclSuccess, st) => Some(format!("NCCL reported {st:?}")),
            (r, _) => Some(format!("ncclCommGetAsyncError failed: {r:?}")),
        }
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        if !self.aborted {
            let _ = self.ctx.bind_to_thread();
            // SAFETY: `raw` is live and destroyed once; nothing is pending (the plane completes or
            // aborts its exchanges first).
            let _ = unsafe { cudarc::nccl::result::comm_destroy(self.raw) };
        }
    }
}

/// A raw communicator handle that may cross to the thread that waits for its creation.
struct RawComm(sys::ncclComm_t);
// SAFETY: handed from the creating thread to the caller once, never shared.
unsafe impl Send for RawComm {}

/// The NCCL communicator of `rank` in a world of `world`, on GPU `ordinal`, from the unique id
/// rank 0 made. Every rank must call it (NCCL's rule); a rank that has not joined within
/// `timeout` makes it an error instead of a hang (the waiting thread is left behind).
pub fn communicator(
    ordinal: usize,
    rank: usize,
    world: usize,
    id: &[u8; ID_BYTES],
    timeout: Duration,
) -> Result<NcclComm> {
    require()?;
    if rank >= world {
        return Err(fail(format!("NCCL rank {rank} outside a world of {world}")));
    }
    if !super::driver_present() {
        return Err(fail(format!(
            "an NCCL communicator needs a GPU: the CUDA driver (libcuda) was not found (rank {rank} of {world}, cuda:{ordinal})"
        )));
    }
    let ctx = CudaContext::new(ordinal).map_err(|e| fail(format!("cuda:{ordinal} for NCCL rank {rank}: {e:?}")))?;
    let mut internal = [0 as std::ffi::c_char; ID_BYTES];
    for (i, &b) in internal.iter_mut().zip(id.iter()) {
        *i = b as std::ffi::c_char;
    }
    let (tx, rx) = std::sync::mpsc::channel();
    let thread_ctx = ctx.clone();
    let (n, r) = (world as std::ffi::c_int, rank as std::ffi::c_int);
    std::thread::Builder::new()
        .name(format!("nccl-init-{rank}"))
        .spawn(move || {
            let made = thread_ctx.bind_to_thread().map_err(|e| format!("{e:?}")).and_then(|()| {
                let mut raw = std::mem::MaybeUninit::uninit();
                // SAFETY: `raw` is a valid out pointer; the id is the one rank 0 made.
                unsafe { cudarc::nccl::result::comm_init_rank(raw.as_mut_ptr(), n, sys::ncclUniqueId { internal }, r) }
                    .map(|_| RawComm(unsafe { raw.assume_init() }))
                    .map_err(|e| format!("{e:?}"))
            });
            let _ = tx.send(made);
        })
        .map_err(|e| fail(format!("cannot start NCCL initialization: {e}")))?;
    match rx.recv_timeout(timeout) {
        Ok(Ok(RawComm(raw))) => Ok(NcclComm { raw, ctx, ordinal, rank, world, aborted: false }),
        Ok(Err(e)) => Err(fail(format!("ncclCommInitRank (rank {rank} of {world}, cuda:{ordinal}): {e}"))),
        Err(_) => Err(fail(format!(
            "ncclCommInitRank (rank {rank} of {world}, cuda:{ordinal}): not every rank joined within {:.0} s",
            timeout.as_secs_f64()
        ))),
    }
}

/// One exchange in flight on the communication stream.
struct Pending {
    op: String,
    receives: Vec<DeviceBuf>,
    peers: Vec<usize>,
    done: CudaEvent,
    /// Bytes sent and received.
    bytes: u64,
}

/// The device plane of one GPU rank (the worker puts it behind its communicator): grouped `ncclSend` /
/// `ncclRecv` on a communication stream of its own, ordered against the backend's compute
/// stream by events, so a ring step's transfer runs while the compute stream works:
///
/// ```text
///   compute:  ... K/V of block s ready ──record──┐        attention(block s) ... wait(done) ── attention(s+1)
///   comm:                                       wait ── send s / recv s+1 ── record(done) ──┘
/// ```
/// `complete` polls the event and `ncclCommGetAsyncError` until the deadline; a timeout or an
/// NCCL error aborts the communicator (`ncclCommAbort`) and names the peer and the operation.
pub struct NcclPlane {
    comm: NcclComm,
    compute: Arc<CudaStream>,
    stream: Arc<CudaStream>,
    pending: Option<Pending>,
    timeout: Duration,
    broken: Option<String>,
}

impl NcclPlane {
    /// The plane of `backend`'s GPU over `comm` (made on the same GPU); an exchange not
    /// complete within `timeout` fails (see [`NcclPlane::set_timeout`]).
    pub fn new(comm: NcclComm, backend: &CudaBackend, timeout: Duration) -> Result<Self> {
        if comm.ordinal != backend.ordinal() {
            return Err(fail(format!(
                "the NCCL communicator is on cuda:{} but the backend on cuda:{}",
                comm.ordinal,
                backend.ordinal()
            )));
        }
        let compute = backend.compute_stream().clone();
        // SAFETY: the backend made its buffers without cudarc's events (one stream); with a
        // second stream they order each buffer's uses across the two again, for every buffer
        // made from now on (a job's, its caches'). Those made before (the weights) are never
        // sent, received or freed during an exchange.
        unsafe { compute.context().enable_event_tracking() };
        let stream = compute.context().new_stream().map_err(|e| fail(format!("NCCL stream: {e:?}")))?;
        Ok(Self { comm, compute, stream, pending: None, timeout, broken: None })
    }

    /// The error of an exchange that failed with `detail`: this GPU's when its context is lost
    /// (asked now: [`super::sticky_error`]), else the exchange's first peer's (`peer`).
    fn lost(&self, peer: usize, op: &str, detail: String) -> PlaneError {
        let sticky = self.compute.context().bind_to_thread().ok().and_then(|()| super::sticky_error());
        plane_error(self.comm.rank, peer, op, detail, sticky)
    }

    fn fail(&mut self, e: PlaneError) -> PlaneError {
        self.pending = None;
        self.comm.abort();
        self.broken.get_or_insert_with(|| e.to_string());
        e
    }

    fn issue_on_stream(
        &mut self,
        sends: &[(usize, &DeviceBuf)],
        receives: &mut [(usize, DeviceBuf)],
    ) -> std::result::Result<(), String> {
        let ctx = self.compute.context().clone();
        ctx.bind_to_thread().map_err(|e| format!("{e:?}"))?;
        // The sends read what the compute stream wrote: the communication stream waits for it.
        let ready = self.compute.record_event(None).map_err(|e| format!("record: {e:?}"))?;
        self.stream.wait(&ready).map_err(|e| format!("wait: {e:?}"))?;
        // Each buffer moves in its own element type (f32, or bf16: half the bytes).
        let nccl_type = |d: DType| match d {
            DType::F32 => sys::ncclDataType_t::ncclFloat32,
            DType::Bf16 => sys::ncclDataType_t::ncclBfloat16,
        };
        let cu = self.stream.cu_stream() as sys::cudaStream_t;
        let mut guards = Vec::with_capacity(sends.len() + receives.len());
        cudarc::nccl::result::group_start().map_err(|e| format!("ncclGroupStart: {e:?}"))?;
        let mut issued: std::result::Result<(), String> = Ok(());
        for (peer, b) in sends {
            // The first `b.len()` elements of the allocation.
            let (ptr, g) = b.ptr(&self.stream);
            guards.push(g);
            let t = nccl_type(b.dtype());
            // SAFETY: `ptr` addresses `b.len()` elements kept alive until the exchange completes
            // (the caller holds the buffer until `complete`); stream and communicator are live.
            let r = unsafe {
                cudarc::nccl::result::send(ptr.addr as _, b.len(), t, *peer as std::ffi::c_int, self.comm.raw, cu)
            };
            if let Err(e) = r {
                issued = Err(format!("ncclSend to rank {peer}: {e:?}"));
                break;
            }
        }
        if issued.is_ok() {
            for (peer, b) in receives.iter_mut() {
                let (len, t) = (b.len(), nccl_type(b.dtype()));
                let (ptr, g) = b.ptr_mut(&self.stream);
                guards.push(g);
                // SAFETY: `ptr` addresses at least `len` elements owned by the pending exchange.
                let r = unsafe {
                    cudarc::nccl::result::recv(ptr.addr as _, len, t, *peer as std::ffi::c_int, self.comm.raw, cu)
                };
                if let Err(e) = r {
                    issued = Err(format!("ncclRecv from rank {peer}: {e:?}"));
                    break;
                }
            }
        }
        let ended = cudarc::nccl::result::group_end().map_err(|e| format!("ncclGroupEnd: {e:?}"));
        drop(guards);
        issued.and(ended.map(|_| ()))
    }
}

impl NcclPlane {
    /// Starts the transfers of one exchange: `sends` (to, buffer) and `receives` (from, the
    /// buffer to receive into), grouped, on the communication stream; returns at once. Fails
    /// if an exchange is pending or the communicator was aborted.
    pub fn issue(
        &mut self,
        op: &str,
        sends: &[(usize, &DeviceBuf)],
        receives: Vec<(usize, DeviceBuf)>,
    ) -> PlaneResult<()> {
        if let Some(why) = &self.broken {
            return Err(PlaneError::Misuse(format!("`{op}`: the NCCL communicator was aborted earlier: {why}")));
        }
        if self.pending.is_some() {
            return Err(PlaneError::Misuse(format!("`{op}` issued while another device exchange is pending")));
        }
        let size = self.comm.world;
        if let Some(rank) = sends.iter().map(|s| s.0).chain(receives.iter().map(|r| r.0)).find(|&r| r >= size) {
            return Err(PlaneError::BadRank { rank, size });
        }
        let mut bufs = receives;
        let first_peer = bufs.first().map(|r| r.0).or(sends.first().map(|s| s.0)).unwrap_or(0);
        if let Err(detail) = self.issue_on_stream(sends, &mut bufs) {
            let e = self.lost(first_peer, op, detail);
            return Err(self.fail(e));
        }
        let done = match self.stream.record_event(None) {
            Ok(ev) => ev,
            Err(e) => {
                let e = self.lost(first_peer, op, format!("record: {e:?}"));
                return Err(self.fail(e));
            }
        };
        let peers = bufs.iter().map(|b| b.0).chain(sends.iter().map(|s| s.0)).collect();
        let bytes = bufs
            .iter()
            .map(|b| &b.1)
            .chain(sends.iter().map(|s| s.1))
            .map(|b| b.len() * b.dtype().size())
            .sum::<usize>();
        let receives = bufs.into_iter().map(|b| b.1).collect();
        self.pending = Some(Pending { op: op.to_string(), receives, peers, done, bytes: bytes as u64 });
        Ok(())
    }

    /// Waits for the pending exchange (polling the event and NCCL's asynchronous error until
    /// the deadline): the received buffers in the order of `receives`.
    pub fn complete(&mut self) -> PlaneResult<Vec<DeviceBuf>> {
        self.complete_until(&mut || None)
    }

    /// [`NcclPlane::complete`] that also asks `give_up` while the transfers run (the worker
    /// looks at its control channel for a peer's abort there): `Some(why)` aborts the
    /// communicator, whose unmatched transfers would otherwise stay queued, and fails the
    /// exchange as [`PlaneError::Lost`] with `why`.
    pub fn complete_until(&mut self, give_up: &mut dyn FnMut() -> Option<String>) -> PlaneResult<Vec<DeviceBuf>> {
        let p = self.pending.take().ok_or_else(|| PlaneError::Misuse("device complete without issue".into()))?;
        let peer = p.peers.first().copied().unwrap_or(0);
        // No deadline where `now + timeout` is past what an Instant holds (a huge --comm-timeout).
        let deadline = Instant::now().checked_add(self.timeout);
        let mut nap = Duration::from_micros(10);
        loop {
            match p.done.try_is_complete() {
                Ok(true) => break,
                Ok(false) => {}
                Err(e) => {
                    let e = self.lost(peer, &p.op, format!("CUDA error: {e:?}"));
                    return Err(self.fail(e));
                }
            }
            if let Some(detail) = self.comm.async_error() {
                let e = self.lost(peer, &p.op, detail);
                return Err(self.fail(e));
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                let e = PlaneError::Timeout { rank: peer, op: p.op.clone(), secs: self.timeout.as_secs_f64() };
                return Err(self.fail(e));
            }
            if let Some(why) = give_up() {
                return Err(self.fail(PlaneError::Lost { rank: peer, op: p.op.clone(), detail: why }));
            }
            std::thread::sleep(nap);
            nap = (nap * 2).min(Duration::from_millis(1));
        }
        // Later kernels on the compute stream read the received buffers.
        if let Err(e) = self.compute.wait(&p.done) {
            let e = self.lost(peer, &p.op, format!("wait: {e:?}"));
            return Err(self.fail(e));
        }
        Ok(p.receives)
    }

    /// Tears the plane down (`ncclCommAbort`): every later call fails with `reason`.
    pub fn abort(&mut self, reason: &str) {
        self.pending = None;
        self.comm.abort();
        self.broken.get_or_insert_with(|| reason.to_string());
    }

    /// Changes the deadline of [`NcclPlane::complete`].
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    /// The deadline of [`NcclPlane::complete`].
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Bytes the pending exchange sends and receives (0 without one).
    pub fn pending_bytes(&self) -> u64 {
        self.pending.as_ref().map_or(0, |p| p.bytes)
    }

    /// The job ended: a pending exchange is finished within `limit` and dropped, or, where a
    /// peer gave the job up before its side of it, the communicator is aborted (unmatched
    /// transfers would stay queued in front of the next job's) and every later exchange
    /// fails with that.
    /// `unfinished(op, limit)` is the reason kept when the drain gives up.
    pub fn end_job_within(&mut self, limit: Duration, unfinished: &dyn Fn(&str, Duration) -> String) {
        let Some(op) = self.pending.as_ref().map(|p| p.op.clone()) else { return };
        let until = Instant::now().checked_add(limit);
        let mut gave_up = false;
        let drained = self.complete_until(&mut || {
            gave_up = until.is_some_and(|u| Instant::now() >= u);
            gave_up.then(|| unfinished(&op, limit))
        });
        if drained.is_err() && gave_up {
            // Not "rank N was lost": the peer is alive; it never issued its side.
            self.broken = Some(unfinished(&op, limit));
        }
    }

    /// Why the communicator was aborted, once it was.
    pub fn down(&self) -> Option<String> {
        self.broken.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cudarc::driver::sys::CUresult as R;

    /// A failed exchange blames its peer only while this GPU's context still answers: with an
    /// error CUDA keeps there (a kernel fault of this rank's), the failure is this GPU's.
    #[test]
    fn an_exchange_on_a_lost_context_is_this_gpus_failure_not_the_peers() {
        let e = plane_error(0, 1, "ring.kv", "ncclGroupEnd: ncclUnhandledCudaError".into(), None);
        assert_eq!(
            e,
            PlaneError::Lost { rank: 1, op: "ring.kv".into(), detail: "ncclGroupEnd: ncclUnhandledCudaError".into() }
        );
        let e = plane_error(
            0,
            1,
            "ring.kv",
            "ncclGroupEnd: ncclUnhandledCudaError".into(),
            Some(R::CUDA_ERROR_ILLEGAL_ADDRESS),
        );
        assert_eq!(
            e.to_string(),
            "rank 0's GPU failed during `ring.kv` (ncclGroupEnd: ncclUnhandledCudaError; the context then answered \
             CUDA_ERROR_ILLEGAL_ADDRESS); its context is lost (every later call on it in this process fails): restart \
             the process"
        );
    }
}
