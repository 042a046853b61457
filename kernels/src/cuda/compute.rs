//! The compute-heavy ops of [`CudaBackend`]: cuBLAS GEMMs and the attention kernels (their
//! scratch buffers and launch plans). Buffer growth and copies are in `copies.rs`, the rest of
//! the op set in `backend.rs`.

use super::backend::{check_same, CudaBackend};
use super::buffers::want;
use super::buffers::{DeviceBuf, DeviceMat, MatData};
use super::err;
use super::graph::Role;
use crate::attention::AttnShape;
use crate::backend::DType;
use crate::error::{KernelError, Result};
use crate::gpu::ops::{self, AttnDims};
use crate::gpu::{self, Elem, Ptr};
use cudarc::cublas::{result as cublas, sys as cublas_sys};
use cudarc::driver::{DevicePtr, DevicePtrMut};

impl CudaBackend {
    /// [`Backend::matmul_t`] and [`Backend::matmul_t_acc`] (lengths checked here):
    /// out[rows, n] = x[rows, k] · Wᵀ (W `[n, k]` row-major), or `+=` when `accumulate` (the
    /// residual add in the epilogue: beta 1, the sum in f32, rounded once into `out`'s type):
    /// cuBLAS column-major with C (n x rows) = op(A) B + beta C, A = W viewed as k x n
    /// (transposed), B = x viewed as k x rows. f32 weights multiply f32 activations in FP32;
    /// bf16 weights multiply bf16 activations (an f32 input is rounded into a scratch first)
    /// with f32 accumulation, into an f32 or bf16 output.
    pub(super) fn gemm(
        &self,
        x: &DeviceBuf,
        rows: usize,
        w: &DeviceMat,
        out: &mut DeviceBuf,
        accumulate: bool,
    ) -> Result<()> {
        let op = if accumulate { "matmul_t_acc" } else { "matmul_t" };
        check_same(op, "x", x.len, rows * w.cols)?;
        check_same(op, "out", out.len, rows * w.rows)?;
        if rows == 0 || w.rows == 0 {
            return Ok(());
        }
        let k = w.cols;
        let out_type = out.dtype();
        let (c, _c) = out.ptr_mut(&self.stream);
        let call =
            GemmTn { handle: *self.blas.handle(), m: w.rows, n: rows, k, accumulate, c: c.addr, c_type: out_type };
        let run = |a: u64, b: u64, t: DType, what: &str| call.run(a, b, t, what).map_err(|e| self.or_lost(e));
        let (xp, _x) = x.ptr(&self.stream);
        match (&w.data, x.dtype()) {
            (MatData::F32(wd), DType::F32) => {
                want("matmul_t", "out", out_type, DType::F32)?;
                let (a, _a) = wd.device_ptr(&self.stream);
                run(a, xp.addr, DType::F32, "gemm (f32)")
            }
            (MatData::F32(_), DType::Bf16) => Err(KernelError::Dtype {
                op: "matmul_t",
                detail: "bf16 activations with f32 weights: load the model with --weights bf16".into(),
            }),
            (MatData::Bf16(wd), DType::Bf16) => {
                let (a, _a) = wd.device_ptr(&self.stream);
                run(a, xp.addr, DType::Bf16, "gemm (bf16)")
            }
            (MatData::Bf16(wd), DType::F32) => {
                // f32 activations (an attention output) go to bf16 in a scratch reused across
                // calls.
                let need = rows * k;
                let mut scratch = self.gemm_x.get(&self.stream, need, self.recording_here())?;
                let xb = scratch.as_mut().ok_or_else(|| err("gemm", "no scratch"))?;
                let (xbp, _xb) = xb.device_ptr_mut(&self.stream);
                self.run_built(ops::convert(xp, Ptr::new(xbp, Elem::Bf16), need as u64))?;
                let (a, _a) = wd.device_ptr(&self.stream);
                run(a, xbp, DType::Bf16, "gemm (bf16)")
            }
        }
    }

    /// The queries `q` as bf16 for the tensor-core kernels: their own address when they are
    /// bf16 already (the bf16 forward), else a rounded copy in the attention scratch; runs `f`
    /// with it.
    pub(super) fn with_bf16_queries<R>(&self, q: &DeviceBuf, f: impl FnOnce(Ptr) -> Result<R>) -> Result<R> {
        let (qp, _q) = q.ptr(&self.stream);
        if q.dtype() == DType::Bf16 {
            return f(qp);
        }
        let mut scratch = self.attn_q.get(&self.stream, q.len, self.recording_here())?;
        let qb = scratch.as_mut().ok_or_else(|| err("attention", "no scratch"))?;
        let (qbp, _g) = qb.device_ptr_mut(&self.stream);
        let qb = Ptr::new(qbp, Elem::Bf16);
        self.run_built(ops::convert(qp, qb, q.len as u64))?;
        f(qb)
    }

    /// f32 queries for the FP32 kernels: `None` when `q` is f32, else a widened copy (exact).
    fn f32_queries(&self, q: &DeviceBuf) -> Result<Option<DeviceBuf>> {
        if q.dtype() == DType::F32 {
            return Ok(None);
        }
        let mut wide = crate::Backend::zeros_as(self, q.len, DType::F32)?;
        crate::Backend::copy_columns(self, q, q.len, 0, q.len, &mut wide)?;
        Ok(Some(wide))
    }

    /// Runs `f` with the partial output and log-sum-exp buffers of `plan`'s key splits (`None`
    /// without splits), from the backend's scratch.
    pub(super) fn with_partials<R>(
        &self,
        dims: AttnDims,
        plan: &ops::FlashPlan,
        f: impl FnOnce(Option<(Ptr, Ptr)>) -> Result<R>,
    ) -> Result<R> {
        let s = &self.stream;
        let (po, pl) = ops::flash_partial_lens(dims, plan);
        let mut part_o = self.part_out.get(s, po, self.recording_here())?;
        let mut part_l = self.part_lse.get(s, pl, self.recording_here())?;
        let (o_slice, l_slice) = part_o.as_mut().zip(part_l.as_mut()).ok_or_else(|| err("attention", "no scratch"))?;
        let (pop, _e) = o_slice.device_ptr_mut(s);
        let (plp, _f) = l_slice.device_ptr_mut(s);
        f((plan.splits > 1).then_some((Ptr::new(pop, Elem::F32), Ptr::new(plp, Elem::F32))))
    }

    /// [`Backend::attention`] on the device: tensor cores for bf16 K/V of head_dim 64 /
    /// 128 (key splits when few blocks would fill the GPU), the FP32 kernel otherwise; either
    /// writes an f32 or a bf16 `out` (rounded once, in its epilogue or the splits' combine).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attention_on_device(
        &self,
        shape: &AttnShape,
        q: &DeviceBuf,
        qpos: &[u32],
        k: &DeviceBuf,
        v: &DeviceBuf,
        kpos: &[u32],
        out: &mut DeviceBuf,
        lse: &mut DeviceBuf,
    ) -> Result<()> {
        let op = "attention";
        if shape.head_dim > gpu::ATTENTION_MAX_DIM {
            return Err(KernelError::Shape {
                op,
                detail: format!("head_dim {} is above the CUDA kernel's {}", shape.head_dim, gpu::ATTENTION_MAX_DIM),
            });
        }
        check_same(op, "q", q.len, qpos.len() * shape.q_dim())?;
        check_same(op, "k", k.len, kpos.len() * shape.kv_dim())?;
        check_same(op, "v", v.len, kpos.len() * shape.kv_dim())?;
        check_same(op, "out", out.len, q.len)?;
        check_same(op, "lse", lse.len, qpos.len() * shape.n_heads)?;
        want(op, "v", v.dtype(), k.dtype())?;
        want(op, "lse", lse.dtype(), DType::F32)?;
        if qpos.is_empty() {
            return Ok(());
        }
        if k.dtype() == DType::Bf16 && ops::flash_supported(shape.head_dim) {
            return self.flash_at(shape, (q, 0, qpos), (k, v, 0, kpos), out, lse);
        }
        let dims = AttnDims::of(shape, qpos.len(), kpos.len());
        let s = &self.stream;
        let wide = self.f32_queries(q)?;
        let q = wide.as_ref().unwrap_or(q);
        let (qp, kp2) = (self.upload_as(qpos, Role::Position)?, self.upload_u32(kpos)?);
        let (qpp, _a) = qp.device_ptr(s);
        let (kpp, _b) = kp2.device_ptr(s);
        let (qd, _c) = q.ptr(s);
        let (kd, _d) = k.ptr(s);
        let (vd, _e) = v.ptr(s);
        let (od, _f) = out.ptr_mut(s);
        let (ld, _g) = lse.ptr_mut(s);
        let u = |p| Ptr::new(p, Elem::U32);
        self.run_built(ops::attention(dims, qd, u(qpp), kd, vd, u(kpp), od, ld, shape.scale))
    }

    /// [`Backend::attention_rows`] on the device: the tensor-core kernel reads the rows in place
    /// (offset pointers) when K/V and the queries are bf16 and the head size is one it has;
    /// otherwise the rows are gathered ([`crate::backend::attention_rows_by_gathering`]).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attention_rows_on_device(
        &self,
        shape: &AttnShape,
        q: &DeviceBuf,
        q_first: usize,
        qpos: &[u32],
        k: &DeviceBuf,
        v: &DeviceBuf,
        k_first: usize,
        kpos: &[u32],
        out: &mut DeviceBuf,
        lse: &mut DeviceBuf,
    ) -> Result<()> {
        let op = "attention_rows";
        let (m, n) = (qpos.len(), kpos.len());
        for (what, have, first, rows, width) in [
            ("q", q.len, q_first, m, shape.q_dim()),
            ("k", k.len, k_first, n, shape.kv_dim()),
            ("v", v.len, k_first, n, shape.kv_dim()),
            ("out", out.len, q_first, m, shape.q_dim()),
            ("lse", lse.len, q_first, m, shape.n_heads),
        ] {
            crate::backend::check_rows(op, what, have, first, rows, width)?;
        }
        want(op, "v", v.dtype(), k.dtype())?;
        if m == 0 {
            return Ok(());
        }
        let in_place = k.dtype() == DType::Bf16
            && q.dtype() == DType::Bf16
            && lse.dtype() == DType::F32
            && shape.head_dim <= gpu::ATTENTION_MAX_DIM
            && ops::flash_supported(shape.head_dim);
        if in_place {
            return self.flash_at(shape, (q, q_first, qpos), (k, v, k_first, kpos), out, lse);
        }
        crate::backend::attention_rows_by_gathering(self, shape, q, q_first, qpos, k, v, k_first, kpos, out, lse)
    }

    /// The tensor-core attention of the query rows from `q_first` (`(q, q_first, qpos)`) over
    /// the key rows from `k_first` (`(k, v, k_first, kpos)`, bf16), into the same rows of `out`
    /// and `lse` (the query rows); lengths checked by the caller.
    fn flash_at(
        &self,
        shape: &AttnShape,
        (q, q_first, qpos): (&DeviceBuf, usize, &[u32]),
        (k, v, k_first, kpos): (&DeviceBuf, &DeviceBuf, usize, &[u32]),
        out: &mut DeviceBuf,
        lse: &mut DeviceBuf,
    ) -> Result<()> {
        let dims = AttnDims::of(shape, qpos.len(), kpos.len());
        let s = &self.stream;
        let (qd, kvd) = (shape.q_dim(), shape.kv_dim());
        let (qp, meta) = (self.upload_as(qpos, Role::Position)?, self.upload_u32(&ops::key_meta(kpos))?);
        let (qpp, _a) = qp.device_ptr(s);
        let (mp, _b) = meta.device_ptr(s);
        let (kp, _c) = k.ptr(s);
        let (vp, _d) = v.ptr(s);
        let (outp, _g) = out.ptr_mut(s);
        let (lsep, _h) = lse.ptr_mut(s);
        let (kp, vp) = (kp.at(k_first * kvd), vp.at(k_first * kvd));
        let (outp, lsep) = (outp.at(q_first * qd), lsep.at(q_first * shape.n_heads));
        let u = |p| Ptr::new(p, Elem::U32);
        self.with_bf16_queries(q, |qb| {
            let qb = qb.at(q_first * qd);
            // The configuration the autotuner chose for this GPU and shape class (it may time
            // the candidates on these very inputs, once per machine).
            let inputs = super::tune::Inputs { q: qb, qpos: u(qpp), k: kp, v: vp, meta: u(mp), scale: shape.scale };
            let (kernel, blocks_per_sm) = self.flash_choice(dims, &inputs);
            let plan = ops::flash_plan_aiming(dims, kernel, self.sm_count, blocks_per_sm, None);
            self.with_partials(dims, &plan, |partial| {
                self.run_flash(dims, &plan, inputs.io(outp, lsep), partial, shape.scale)
            })
        })
    }

    /// [`Backend::attention_scores`] on the device.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attention_scores_on_device(
        &self,
        shape: &AttnShape,
        q: &DeviceBuf,
        qpos: &[u32],
        k: &DeviceBuf,
        kpos: &[u32],
        lse: &DeviceBuf,
        scores: &mut DeviceBuf,
    ) -> Result<()> {
        let op = "attention_scores";
        check_same(op, "q", q.len, qpos.len() * shape.q_dim())?;
        check_same(op, "k", k.len, kpos.len() * shape.kv_dim())?;
        check_same(op, "lse", lse.len, qpos.len() * shape.n_heads)?;
        check_same(op, "scores", scores.len, kpos.len())?;
        want(op, "scores", scores.dtype(), DType::F32)?;
        if qpos.is_empty() || kpos.is_empty() {
            return Ok(());
        }
        let dims = AttnDims::of(shape, qpos.len(), kpos.len());
        let s = &self.stream;
        let (qp, kp) = (self.upload_as(qpos, Role::Position)?, self.upload_u32(kpos)?);
        let (qpp, _a) = qp.device_ptr(s);
        let (kpp, _b) = kp.device_ptr(s);
        let u = |p| Ptr::new(p, Elem::U32);
        let (kd, _c) = k.ptr(s);
        let (ld, _d) = lse.ptr(s);
        let (sd, _e) = scores.ptr_mut(s);
        if k.dtype() == DType::Bf16 && ops::flash_supported(shape.head_dim) {
            return self.with_bf16_queries(q, |qb| {
                self.run_built(ops::flash_scores(dims, qb, u(qpp), kd, u(kpp), ld, sd, shape.scale))
            });
        }
        let wide = self.f32_queries(q)?;
        let (qd, _f) = wide.as_ref().unwrap_or(q).ptr(s);
        self.run_built(ops::attention_scores(dims, qd, u(qpp), kd, u(kpp), ld, sd, shape.scale))
    }
}

/// One cuBLAS GEMM `C (m x n) = op(A) B + beta C` in column-major terms, A (`k x m`, a
/// row-major `[m, k]` weight) transposed, B `k x n`, f32 accumulation; beta 1 when
/// `accumulate`. `c` is the output's device address, of type `c_type`.
struct GemmTn {
    handle: cublas_sys::cublasHandle_t,
    m: usize,
    n: usize,
    k: usize,
    accumulate: bool,
    c: u64,
    c_type: DType,
}

fn cuda_type(d: DType) -> cublas_sys::cudaDataType_t {
    match d {
        DType::F32 => cublas_sys::cudaDataType_t::CUDA_R_32F,
        DType::Bf16 => cublas_sys::cudaDataType_t::CUDA_R_16BF,
    }
}

impl GemmTn {
    /// Runs it with A at `a` and B at `b`, both of type `t`.
    fn run(&self, a: u64, b: u64, t: DType, what: &str) -> Result<()> {
        let (m, n, k) = (self.m as i32, self.n as i32, self.k as i32);
        let (alpha, beta) = (1.0f32, if self.accumulate { 1.0f32 } else { 0.0 });
        let t = cuda_type(t);
        // SAFETY: `a`, `b` and `c` are live device allocations of at least m*k, n*k and m*n
        // elements of their types (the caller checked the lengths; a bf16 scratch holds n*k);
        // alpha and beta outlive the call; the caller holds the allocations' stream-order
        // guards until this returns.
        unsafe {
            cublas::gemm_ex(
                self.handle,
                cublas_sys::cublasOperation_t::CUBLAS_OP_T,
                cublas_sys::cublasOperation_t::CUBLAS_OP_N,
                m,
                n,
                k,
                &alpha as *const f32 as *const _,
                a as *const _,
                t,
                k,
                b as *const _,
                t,
                k,
                &beta as *const f32 as *const _,
                self.c as *mut _,
                cuda_type(self.c_type),
                m,
                cublas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| err(what, e))
    }
}
