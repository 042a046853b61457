//! Whole buffers between the device and the host for [`CudaBackend`]: one buffer at a time
//! (`download_typed`, `upload_typed`: a copy through pageable memory, which waits), or many in
//! one batch through a page-locked staging area that the backend keeps (`download_many`,
//! `upload_many`): every copy queued asynchronously, one wait for all of them. The chunk
//! store's disk tier moves a chunk cache's every layer (K and V: 60 buffers for SmolLM2) this
//! way; one at a time, 17 chunks of 512 tokens cost about 1,000 waits and 100-165 ms per request
//! on an H200 (2026-11-27, docs/gpu.md).

use super::backend::CudaBackend;
use super::buffers::{DevData, DeviceBuf};
use super::err;
use crate::error::Result;
use crate::{DType, HostBuf};
use cudarc::driver::{result, DevicePtr};
use std::sync::{Mutex, MutexGuard};

/// The largest staging area kept (bytes); a larger batch goes one buffer at a time.
const MAX_STAGING: usize = 1 << 30;
/// Alignment of each buffer's place in the area.
const ALIGN: usize = 256;

/// Page-locked host memory owned by the backend.
struct Area {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the allocation is owned by this value alone; the device reads or writes it only
// through copies queued while the owner's lock is held, and waited for before it is released.
unsafe impl Send for Area {}

impl Drop for Area {
    fn drop(&mut self) {
        // SAFETY: allocated by `malloc_host`, freed once; no copy is in flight (see `Send`).
        let _ = unsafe { result::free_host(self.ptr.cast()) };
    }
}

/// The backend's staging area, made on first use and grown to the largest batch (up to
/// [`MAX_STAGING`]).
#[derive(Default)]
pub(crate) struct Staging {
    area: Mutex<Option<Area>>,
}

impl Staging {
    fn lock(&self) -> MutexGuard<'_, Option<Area>> {
        self.area.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Each buffer's offset in a staging area (aligned) and the bytes of the whole batch.
fn places(bytes: impl Iterator<Item = usize>) -> (Vec<usize>, usize) {
    let mut at = 0;
    let offsets = bytes
        .map(|b| {
            let o = at;
            at += b.div_ceil(ALIGN) * ALIGN;
            o
        })
        .collect();
    (offsets, at)
}

/// The area of `g`, at least `bytes` long. The backend's context must be current.
fn area(g: &mut Option<Area>, bytes: usize) -> Result<&mut Area> {
    if g.as_ref().is_none_or(|a| a.len < bytes) {
        *g = None;
        let len = bytes.next_power_of_two().min(MAX_STAGING).max(bytes);
        // SAFETY: a plain page-locked allocation (not write-combined: the host reads it back).
        let ptr = unsafe { result::malloc_host(len, 0) }.map_err(|e| err("staging: page-locked memory", e))?;
        *g = Some(Area { ptr: ptr.cast(), len });
    }
    g.as_mut().ok_or_else(|| err("staging", "no area"))
}

/// `len` values of `T` at byte `offset` of `a`.
///
/// # Safety
/// `offset + len * size_of::<T>()` within the area, `offset` aligned for `T`, and no other
/// live slice over the same bytes.
unsafe fn values<T>(a: &mut Area, offset: usize, len: usize) -> &mut [T] {
    std::slice::from_raw_parts_mut(a.ptr.add(offset).cast::<T>(), len)
}

impl CudaBackend {
    /// [`crate::Backend::download_typed`].
    pub(super) fn download_one(&self, buf: &DeviceBuf) -> Result<HostBuf> {
        if buf.len == 0 {
            return Ok(HostBuf::zeros(0, buf.dtype()));
        }
        Ok(match &buf.data {
            DevData::F32(d) => {
                HostBuf::F32(self.stream.clone_dtoh(&d.slice(0..buf.len)).map_err(|e| err("download", e))?)
            }
            DevData::Bf16(d) => {
                HostBuf::Bf16(self.stream.clone_dtoh(&d.slice(0..buf.len)).map_err(|e| err("download", e))?)
            }
        })
    }

    /// [`crate::Backend::upload_typed`].
    pub(super) fn upload_one(&self, host: &HostBuf) -> Result<DeviceBuf> {
        if host.is_empty() {
            return <Self as crate::Backend>::zeros_as(self, 0, host.dtype());
        }
        let data = match host {
            HostBuf::F32(v) => DevData::F32(self.stream.clone_htod(v).map_err(|e| self.oom("upload", v.len(), 4, e))?),
            HostBuf::Bf16(v) => {
                DevData::Bf16(self.stream.clone_htod(v).map_err(|e| self.oom("upload", v.len(), 2, e))?)
            }
        };
        Ok(DeviceBuf { data, len: host.len() })
    }

    /// [`crate::Backend::download_many`]: every copy into the staging area, one wait.
    pub(super) fn download_batch(&self, bufs: &[&DeviceBuf]) -> Result<Vec<HostBuf>> {
        let (offsets, total) = places(bufs.iter().map(|b| b.len * b.dtype().size()));
        self.refuse_while_recorded_elsewhere("download_many")?;
        if bufs.len() < 2 || total > MAX_STAGING || self.recording_here() {
            return bufs.iter().map(|b| self.download_one(b)).collect();
        }
        let mut g = self.staging.lock();
        self.stream.context().bind_to_thread().map_err(|e| err("staging", e))?;
        let a = area(&mut g, total)?;
        let cu = self.stream.cu_stream();
        let queued = bufs.iter().zip(&offsets).try_for_each(|(b, &at)| {
            if b.len == 0 {
                return Ok(());
            }
            // SAFETY: each buffer has its own aligned range of the area, `total` long in all;
            // the copies are waited for below, before the area is read or its lock released.
            let r = match &b.data {
                DevData::F32(d) => {
                    let (src, _g) = d.device_ptr(&self.stream);
                    unsafe { result::memcpy_dtoh_async(values::<f32>(a, at, b.len), src, cu) }
                }
                DevData::Bf16(d) => {
                    let (src, _g) = d.device_ptr(&self.stream);
                    unsafe { result::memcpy_dtoh_async(values::<u16>(a, at, b.len), src, cu) }
                }
            };
            r.map_err(|e| err("download_many", e))
        });
        // Waited for even after a failed copy: none may be in flight once the lock is released.
        let waited = self.stream.synchronize().map_err(|e| err("download_many", e));
        queued.and(waited)?;
        Ok(bufs
            .iter()
            .zip(&offsets)
            .map(|(b, &at)| match b.dtype() {
                // SAFETY: written by the copies above, which are complete.
                DType::F32 => HostBuf::F32(unsafe { values::<f32>(a, at, b.len) }.to_vec()),
                DType::Bf16 => HostBuf::Bf16(unsafe { values::<u16>(a, at, b.len) }.to_vec()),
            })
            .collect())
    }

    /// [`crate::Backend::upload_many`]: every buffer into the staging area, every copy from
    /// there queued, one wait (before the area can take the next batch). (Its opening lines are
    /// `download_batch`'s, kept apart as verified on an H200 on 2026-11-27.)
    pub(super) fn upload_batch(&self, hosts: &[&HostBuf]) -> Result<Vec<DeviceBuf>> {
        let (offsets, total) = places(hosts.iter().map(|h| h.len() * h.dtype().size()));
        self.refuse_while_recorded_elsewhere("upload_many")?;
        if hosts.len() < 2 || total > MAX_STAGING || self.recording_here() {
            return hosts.iter().map(|h| self.upload_one(h)).collect();
        }
        let mut g = self.staging.lock();
        self.stream.context().bind_to_thread().map_err(|e| err("staging", e))?;
        let a = area(&mut g, total)?;
        let cu = self.stream.cu_stream();
        let mut out = Vec::with_capacity(hosts.len());
        let queued = hosts.iter().zip(&offsets).try_for_each(|(h, &at)| {
            let data = self.alloc_for_overwrite(h.len(), h.dtype())?;
            // SAFETY: as in `download_batch`; every element of the new buffer is written by
            // its copy before any op can read it (the ops follow on the same stream).
            let r = match (h, &data) {
                (_, _) if h.is_empty() => Ok(()),
                (HostBuf::F32(v), DevData::F32(d)) => {
                    let dst = unsafe { values::<f32>(a, at, v.len()) };
                    dst.copy_from_slice(v);
                    let (p, _g) = d.device_ptr(&self.stream);
                    unsafe { result::memcpy_htod_async(p, &*dst, cu) }
                }
                (HostBuf::Bf16(v), DevData::Bf16(d)) => {
                    let dst = unsafe { values::<u16>(a, at, v.len()) };
                    dst.copy_from_slice(v);
                    let (p, _g) = d.device_ptr(&self.stream);
                    unsafe { result::memcpy_htod_async(p, &*dst, cu) }
                }
                _ => return Err(err("upload_many", "a buffer of another element type than its values")),
            };
            r.map_err(|e| err("upload_many", e))?;
            out.push(DeviceBuf { data, len: h.len() });
            Ok(())
        });
        let waited = self.stream.synchronize().map_err(|e| err("upload_many", e));
        queued.and(waited)?;
        Ok(out)
    }
}
