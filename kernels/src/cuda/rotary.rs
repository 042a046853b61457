//! RoPE on the device for [`CudaBackend`]: rotation in place, the rotated copy that places a
//! pre-RoPE cache, and the QKV split with its rotations in one launch; the device side of the
//! tables (uploaded once per table) and of the positions (through the control-data cache).

use super::backend::{check_same, CudaBackend};
use super::buffers::{DeviceBuf, DeviceRope};
use super::graph::Role;
use crate::backend::Backend;
use crate::error::Result;
use crate::gpu::ops::{self, RopeArgs};
use crate::gpu::{Elem, Ptr};
use crate::rope::{RopeStyle, RopeTable};
use cudarc::driver::{CudaSlice, DevicePtr};
use std::sync::Arc;

impl CudaBackend {
    /// Runs `f` with the device side of `table` and the device copy of `positions` (their
    /// stream-order guards held until `f` returns).
    fn with_rope<R>(
        &self,
        table: &RopeTable,
        positions: &[u32],
        f: impl FnOnce(&RopeArgs, Ptr) -> Result<R>,
    ) -> Result<R> {
        let t = self.rope_table(table, table.rows_for(positions))?;
        let pos = self.upload_as(positions, Role::Position)?;
        let s = &self.stream;
        let (pp, _p) = pos.device_ptr(s);
        let (cos, _c) = t.cos.device_ptr(s);
        let (sin, _s) = t.sin.device_ptr(s);
        let args = RopeArgs {
            cos: Ptr::new(cos, Elem::F32),
            sin: Ptr::new(sin, Elem::F32),
            table_len: t.rows as u32,
            head_dim: table.head_dim() as u32,
            rot_dim: table.rot_dim() as u32,
            interleaved: table.style() == RopeStyle::Interleaved,
        };
        f(&args, Ptr::new(pp, Elem::U32))
    }

    /// The device copy of `table` with at least `rows` rows, uploaded once per distinct table
    /// (and again, longer, when a call's positions pass the rows uploaded: the kernels read
    /// every angle from the table).
    fn rope_table(&self, table: &RopeTable, rows: usize) -> Result<Arc<DeviceRope>> {
        let mut key = 0xcbf2_9ce4_8422_2325u64;
        let parts = [table.head_dim() as u64, table.rot_dim() as u64, table.table_len() as u64, table.style() as u64];
        for b in parts.into_iter().chain(table.inv_freq().iter().map(|f| f.to_bits())) {
            key = (key ^ b).wrapping_mul(0x0100_0000_01b3);
        }
        let mut ropes = self.ropes.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(r) = ropes.get(&key).filter(|r| r.rows >= rows) {
            self.recorder.keep_rope(r);
            return Ok(r.clone());
        }
        if self.recording_here() {
            return Err(super::err("record", format!("the RoPE table for {rows} positions is not on the device yet")));
        }
        let (cos, sin) = table.tables_to(rows);
        let up = |v: &[f32]| -> Result<CudaSlice<f32>> {
            if v.is_empty() {
                self.stream.alloc_zeros::<f32>(1).map_err(|e| self.oom("rope table", 1, 4, e))
            } else {
                self.stream.clone_htod(v).map_err(|e| self.oom("rope table", v.len(), 4, e))
            }
        };
        let r = Arc::new(DeviceRope { cos: up(&cos)?, sin: up(&sin)?, rows });
        ropes.insert(key, r.clone());
        Ok(r)
    }

    /// [`Backend::rope`] in place.
    pub(super) fn rope_on_device(
        &self,
        x: &mut DeviceBuf,
        n_heads: usize,
        positions: &[u32],
        table: &RopeTable,
    ) -> Result<()> {
        let d = table.head_dim();
        check_same("rope", "x", x.len, positions.len() * n_heads * d)?;
        if positions.is_empty() || table.rot_dim() == 0 {
            return Ok(());
        }
        self.with_rope(table, positions, |args, pos| {
            let (xp, _x) = x.ptr_mut(&self.stream);
            self.run_built(ops::rope(xp, positions.len() as u32, n_heads as u32, pos, args))
        })
    }

    /// [`Backend::rope_copy`] in one pass (`fp_rope_copy`), into memory it overwrites whole.
    pub(super) fn rope_copy_on_device(
        &self,
        src: &DeviceBuf,
        n_heads: usize,
        positions: &[u32],
        table: &RopeTable,
    ) -> Result<DeviceBuf> {
        let d = table.head_dim();
        check_same("rope_copy", "src", src.len, positions.len() * n_heads * d)?;
        if positions.is_empty() || table.rot_dim() == 0 {
            return self.duplicate(src);
        }
        let mut dst = DeviceBuf { data: self.alloc_for_overwrite(src.len, src.dtype())?, len: src.len };
        self.with_rope(table, positions, |args, pos| {
            let (sp, _a) = src.ptr(&self.stream);
            let (dp, _b) = dst.ptr_mut(&self.stream);
            self.run_built(ops::rope_copy(sp, dp, positions.len() as u32, n_heads as u32, pos, args))
        })?;
        Ok(dst)
    }

    /// [`Backend::split_qkv_rope`] in one launch (`fp_split_qkv_rope`).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn split_qkv_rope_on_device(
        &self,
        qkv: &DeviceBuf,
        heads: (usize, usize),
        positions: &[u32],
        table: &RopeTable,
        q: &mut DeviceBuf,
        k_pre: &mut DeviceBuf,
        k: &mut DeviceBuf,
        v: &mut DeviceBuf,
    ) -> Result<()> {
        let op = "split_qkv_rope";
        let (d, rows) = (table.head_dim(), positions.len());
        let (qd, kvd) = (heads.0 * d, heads.1 * d);
        check_same(op, "qkv", qkv.len, rows * (qd + 2 * kvd))?;
        check_same(op, "q", q.len, rows * qd)?;
        for (what, b) in [("k_pre", &*k_pre), ("k", &*k), ("v", &*v)] {
            check_same(op, what, b.len, rows * kvd)?;
        }
        if rows == 0 {
            return Ok(());
        }
        self.with_rope(table, positions, |args, pos| {
            let s = &self.stream;
            let (qkvp, _a) = qkv.ptr(s);
            let (qp, _b) = q.ptr_mut(s);
            let (kpp, _d) = k_pre.ptr_mut(s);
            let (kp, _e) = k.ptr_mut(s);
            let (vp, _f) = v.ptr_mut(s);
            let parts = ops::QkvParts { qkv: qkvp, q: qp, k_pre: kpp, k: kp, v: vp };
            self.run_built(ops::split_qkv_rope(parts, rows as u32, heads.0 as u32, heads.1 as u32, pos, args))
        })
    }
}
