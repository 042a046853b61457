//! Moving values between device buffers for [`CudaBackend`]: a buffer's growth (`reserve`,
//! `resize`), appends (all of a buffer or a range of its rows) and row copies (one
//! device-to-device copy for consecutive rows, the index kernel otherwise).

use super::backend::{check_same, CudaBackend};
use super::buffers::want;
use super::buffers::{DevData, DeviceBuf};
use super::err;
use super::graph::Role;
use crate::error::{KernelError, Result};
use crate::gpu::ops;
use crate::gpu::{Elem, Ptr};
use cudarc::driver::DevicePtr;

impl CudaBackend {
    /// [`crate::Backend::reserve`]: a larger allocation holding the first `len` values.
    pub(super) fn reserve_buf(&self, buf: &mut DeviceBuf, capacity: usize) -> Result<()> {
        if capacity <= buf.capacity() {
            return Ok(());
        }
        // Uninitialised past `len`: nothing reads a buffer beyond its length, `resize` zeroes
        // what it exposes, `append` overwrites it.
        let mut grown = DeviceBuf { data: self.alloc_for_overwrite(capacity, buf.dtype())?, len: 0 };
        if buf.len > 0 {
            self.copy_values(buf, 0, &mut grown, 0, buf.len, "reserve")?;
        }
        buf.data = grown.data;
        Ok(())
    }

    /// [`crate::Backend::resize`]: new values are zero.
    pub(super) fn resize_buf(&self, buf: &mut DeviceBuf, len: usize) -> Result<()> {
        if len > buf.capacity() {
            self.reserve_buf(buf, len)?;
        }
        if len > buf.len {
            let r = match &mut buf.data {
                DevData::F32(d) => self.stream.memset_zeros(&mut d.slice_mut(buf.len..len)),
                DevData::Bf16(d) => self.stream.memset_zeros(&mut d.slice_mut(buf.len..len)),
            };
            r.map_err(|e| err("resize", e))?;
        }
        buf.len = len;
        Ok(())
    }

    /// Appends `add` values of `src` from value `start` to the end of `dst` (one copy; the
    /// capacity grows geometrically, so appending token by token copies each value O(1) times).
    pub(super) fn append_range(&self, dst: &mut DeviceBuf, src: &DeviceBuf, start: usize, add: usize) -> Result<()> {
        want("append", "src", src.dtype(), dst.dtype())?;
        let old = dst.len;
        if add == 0 {
            return Ok(());
        }
        if old + add > dst.capacity() {
            self.reserve_buf(dst, (old + add).max(2 * dst.capacity()))?;
        }
        self.copy_values(src, start, dst, old, add, "append")?;
        dst.len = old + add;
        Ok(())
    }

    /// [`crate::Backend::copy_rows`]: consecutive rows to consecutive rows (gathering a chunk's rows,
    /// scattering them back) are one device-to-device copy, with no index upload and no
    /// kernel; any other rows go through the index kernel.
    pub(super) fn copy_rows_on_device(
        &self,
        src: &DeviceBuf,
        src_rows: &[usize],
        dst: &mut DeviceBuf,
        dst_rows: &[usize],
        row_len: usize,
    ) -> Result<()> {
        check_same("copy_rows", "dst_rows", dst_rows.len(), src_rows.len())?;
        want("copy_rows", "dst", dst.dtype(), src.dtype())?;
        for (rows, len) in [(src_rows, src.len), (dst_rows, dst.len)] {
            if let Some(&r) = rows.iter().find(|&&r| (r + 1) * row_len > len) {
                return Err(KernelError::Shape {
                    op: "copy_rows",
                    detail: format!("row {r} of {row_len} values is outside a buffer of {len}"),
                });
            }
        }
        if src_rows.is_empty() || row_len == 0 {
            return Ok(());
        }
        let run = |rows: &[usize]| rows.windows(2).all(|w| w[1] == w[0] + 1);
        if run(src_rows) && run(dst_rows) {
            let n = src_rows.len() * row_len;
            return self.copy_values(src, src_rows[0] * row_len, dst, dst_rows[0] * row_len, n, "copy_rows");
        }
        let s: Vec<u32> = src_rows.iter().map(|&r| r as u32).collect();
        let d: Vec<u32> = dst_rows.iter().map(|&r| r as u32).collect();
        let (sd, dd) = (self.upload_u32(&s)?, self.upload_u32(&d)?);
        let (sr, _a) = sd.device_ptr(&self.stream);
        let (dr, _b) = dd.device_ptr(&self.stream);
        let (sp, _c) = src.ptr(&self.stream);
        let (dp, _d) = dst.ptr_mut(&self.stream);
        let u = |p| Ptr::new(p, Elem::U32);
        self.run_built(ops::copy_rows(sp, u(sr), dp, u(dr), s.len() as u32, row_len as u32))
    }

    /// [`crate::Backend::put_rows`]: one device-to-device copy, or while this thread records a
    /// step, for one row, the index kernel with the destination row read from the step's word
    /// (a replay writes the row it is given).
    pub(super) fn put_rows_on_device(
        &self,
        dst: &mut DeviceBuf,
        src: &DeviceBuf,
        at: usize,
        width: usize,
    ) -> Result<()> {
        want("put_rows", "dst", dst.dtype(), src.dtype())?;
        if width == 0 || src.len == 0 {
            return Ok(());
        }
        let rows = src.len / width;
        if rows * width != src.len || (at + rows) * width > dst.len {
            return Err(KernelError::Shape {
                op: "put_rows",
                detail: format!(
                    "{} values in rows of {width} at row {at} do not fit a buffer of {} values",
                    src.len, dst.len
                ),
            });
        }
        if rows != 1 || !self.recording_here() {
            return self.copy_values(src, 0, dst, at * width, src.len, "put_rows");
        }
        let (sd, dd) = (self.upload_u32(&[0])?, self.upload_as(&[at as u32], Role::Row)?);
        let (sr, _a) = sd.device_ptr(&self.stream);
        let (dr, _b) = dd.device_ptr(&self.stream);
        let (sp, _c) = src.ptr(&self.stream);
        let (dp, _d) = dst.ptr_mut(&self.stream);
        let u = |p| Ptr::new(p, Elem::U32);
        self.run_built(ops::copy_rows(sp, u(sr), dp, u(dr), 1, width as u32))
    }

    /// Copies `n` values of `src` from `from` to `dst` at `to` (one device-to-device copy).
    fn copy_values(
        &self,
        src: &DeviceBuf,
        from: usize,
        dst: &mut DeviceBuf,
        to: usize,
        n: usize,
        op: &str,
    ) -> Result<()> {
        let r = match (&src.data, &mut dst.data) {
            (DevData::F32(s), DevData::F32(d)) => {
                self.stream.memcpy_dtod(&s.slice(from..from + n), &mut d.slice_mut(to..to + n))
            }
            (DevData::Bf16(s), DevData::Bf16(d)) => {
                self.stream.memcpy_dtod(&s.slice(from..from + n), &mut d.slice_mut(to..to + n))
            }
            _ => return Err(err(op, "element types differ")),
        };
        r.map_err(|e| err(op, e))
    }
}
