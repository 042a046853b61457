//! A CPU backend that counts what runs on it, per calling thread (each thread rank runs on its
//! own thread) and per engine phase (`coordinator::timings::current_phase`): GEMM FLOPs,
//! visible attention and score pairs, and copies between host and device, with the copies a
//! transport stages (`Backend::stage_out` / `stage_in`) apart from the ones the steps make.

use flowprefill_kernels::attention::AttnShape;
use flowprefill_kernels::matmul::Matrix;
use flowprefill_kernels::rope::RopeTable;
use flowprefill_kernels::{Backend, Cpu, Result};
use std::collections::HashMap;
use std::sync::Mutex;
use std::thread::ThreadId;

/// What ran on one thread in one phase.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Ran {
    /// GEMM FLOPs (2 per multiply-add).
    pub gemm_flops: f64,
    /// Visible (query, key) pairs of attention calls (per head).
    pub attn_pairs: u64,
    /// Visible pairs of score passes.
    pub score_pairs: u64,
    /// Downloads made by the steps (not a transport's staging).
    pub downloads: u64,
    /// Floats they moved.
    pub download_floats: u64,
    /// Uploads made by the steps.
    pub uploads: u64,
    /// Floats they moved.
    pub upload_floats: u64,
    /// Buffers a transport staged out or in.
    pub staged: u64,
    /// Floats staged.
    pub staged_floats: u64,
}

impl std::ops::AddAssign for Ran {
    fn add_assign(&mut self, o: Ran) {
        self.gemm_flops += o.gemm_flops;
        self.attn_pairs += o.attn_pairs;
        self.score_pairs += o.score_pairs;
        self.downloads += o.downloads;
        self.download_floats += o.download_floats;
        self.uploads += o.uploads;
        self.upload_floats += o.upload_floats;
        self.staged += o.staged;
        self.staged_floats += o.staged_floats;
    }
}

/// The counting CPU backend.
#[derive(Default)]
pub struct Counting {
    ran: Mutex<HashMap<(ThreadId, &'static str), Ran>>,
}

impl Counting {
    fn add(&self, f: impl FnOnce(&mut Ran)) {
        let phase = flowprefill_coordinator::timings::current_phase().unwrap_or("(outside phases)");
        let mut m = self.ran.lock().unwrap_or_else(|e| e.into_inner());
        f(m.entry((std::thread::current().id(), phase)).or_default());
    }

    /// Everything counted since the last call, by (thread, phase); the counters restart.
    pub fn take(&self) -> Vec<(ThreadId, &'static str, Ran)> {
        let mut m = self.ran.lock().unwrap_or_else(|e| e.into_inner());
        m.drain().map(|((t, p), r)| (t, p, r)).collect()
    }
}

/// What ran, summed per thread (one entry per rank thread that ran anything).
pub fn per_thread(ran: &[(ThreadId, &'static str, Ran)]) -> Vec<Ran> {
    let mut by: HashMap<ThreadId, Ran> = HashMap::new();
    for (t, _, r) in ran {
        *by.entry(*t).or_default() += *r;
    }
    by.into_values().collect()
}

/// Visible (query, key) pairs: keys at or before the query's position.
fn visible(qpos: &[u32], kpos: &[u32]) -> u64 {
    qpos.iter().map(|&q| kpos.iter().filter(|&&k| k <= q).count() as u64).sum()
}

impl Backend for Counting {
    type Buf = Vec<f32>;
    type Mat = Matrix;
    fn name(&self) -> &'static str {
        "counting-cpu"
    }
    fn upload(&self, host: &[f32]) -> Result<Vec<f32>> {
        self.add(|r| {
            r.uploads += 1;
            r.upload_floats += host.len() as u64;
        });
        Cpu.upload(host)
    }
    fn download(&self, buf: &Vec<f32>) -> Result<Vec<f32>> {
        self.add(|r| {
            r.downloads += 1;
            r.download_floats += buf.len() as u64;
        });
        Cpu.download(buf)
    }
    fn download_range(&self, buf: &Vec<f32>, start: usize, len: usize) -> Result<Vec<f32>> {
        self.add(|r| {
            r.downloads += 1;
            r.download_floats += len as u64;
        });
        Cpu.download_range(buf, start, len)
    }
    fn stage_out(&self, buf: &Vec<f32>) -> Result<Vec<f32>> {
        self.add(|r| {
            r.staged += 1;
            r.staged_floats += buf.len() as u64;
        });
        Cpu.download(buf)
    }
    fn stage_in(&self, host: &[f32]) -> Result<Vec<f32>> {
        self.add(|r| {
            r.staged += 1;
            r.staged_floats += host.len() as u64;
        });
        Cpu.upload(host)
    }
    fn zeros(&self, len: usize) -> Result<Vec<f32>> {
        Cpu.zeros(len)
    }
    fn len(&self, buf: &Vec<f32>) -> usize {
        buf.len()
    }
    fn resize(&self, buf: &mut Vec<f32>, len: usize) -> Result<()> {
        Cpu.resize(buf, len)
    }
    fn reserve(&self, buf: &mut Vec<f32>, capacity: usize) -> Result<()> {
        Cpu.reserve(buf, capacity)
    }
    fn matrix(&self, m: Matrix) -> Result<Matrix> {
        Cpu.matrix(m)
    }
    fn mat_shape(&self, m: &Matrix) -> (usize, usize) {
        Cpu.mat_shape(m)
    }
    fn embedding(&self, table: &Matrix, ids: &[u32], out: &mut Vec<f32>) -> Result<()> {
        Cpu.embedding(table, ids, out)
    }
    fn matmul_t(&self, x: &Vec<f32>, rows: usize, w: &Matrix, out: &mut Vec<f32>) -> Result<()> {
        let (n, k) = (w.rows(), w.cols());
        self.add(|r| r.gemm_flops += 2.0 * (rows * n * k) as f64);
        Cpu.matmul_t(x, rows, w, out)
    }
    fn add_bias(&self, x: &mut Vec<f32>, bias: &Vec<f32>) -> Result<()> {
        Cpu.add_bias(x, bias)
    }
    fn rms_norm(&self, x: &Vec<f32>, w: &Vec<f32>, eps: f32, out: &mut Vec<f32>) -> Result<()> {
        Cpu.rms_norm(x, w, eps, out)
    }
    fn rope(&self, x: &mut Vec<f32>, n_heads: usize, positions: &[u32], table: &RopeTable) -> Result<()> {
        Cpu.rope(x, n_heads, positions, table)
    }
    fn attention(
        &self,
        shape: &AttnShape,
        q: &Vec<f32>,
        qpos: &[u32],
        k: &Vec<f32>,
        v: &Vec<f32>,
        kpos: &[u32],
        out: &mut Vec<f32>,
        lse: &mut Vec<f32>,
    ) -> Result<()> {
        self.add(|r| r.attn_pairs += visible(qpos, kpos));
        Cpu.attention(shape, q, qpos, k, v, kpos, out, lse)
    }
    fn attention_scores(
        &self,
        shape: &AttnShape,
        q: &Vec<f32>,
        qpos: &[u32],
        k: &Vec<f32>,
        kpos: &[u32],
        lse: &Vec<f32>,
        scores: &mut Vec<f32>,
    ) -> Result<()> {
        self.add(|r| r.score_pairs += visible(qpos, kpos));
        Cpu.attention_scores(shape, q, qpos, k, kpos, lse, scores)
    }
    fn merge_partial(
        &self,
        out: &mut Vec<f32>,
        lse: &mut Vec<f32>,
        block_out: &Vec<f32>,
        block_lse: &Vec<f32>,
        head_dim: usize,
    ) -> Result<()> {
        Cpu.merge_partial(out, lse, block_out, block_lse, head_dim)
    }
    fn silu_mul(&self, gate_up: &Vec<f32>, ffn: usize, out: &mut Vec<f32>) -> Result<()> {
        Cpu.silu_mul(gate_up, ffn, out)
    }
    fn add_assign(&self, x: &mut Vec<f32>, y: &Vec<f32>) -> Result<()> {
        Cpu.add_assign(x, y)
    }
    fn copy_columns(
        &self,
        src: &Vec<f32>,
        src_cols: usize,
        col: usize,
        width: usize,
        dst: &mut Vec<f32>,
    ) -> Result<()> {
        Cpu.copy_columns(src, src_cols, col, width, dst)
    }
    fn copy_rows(
        &self,
        src: &Vec<f32>,
        src_rows: &[usize],
        dst: &mut Vec<f32>,
        dst_rows: &[usize],
        row_len: usize,
    ) -> Result<()> {
        Cpu.copy_rows(src, src_rows, dst, dst_rows, row_len)
    }
    fn append(&self, dst: &mut Vec<f32>, src: &Vec<f32>) -> Result<()> {
        Cpu.append(dst, src)
    }
}

/// The three small documents and the north-gate question.
pub fn needle_request() -> flowprefill_coordinator::Request {
    flowprefill_coordinator::Request {
        context: flowprefill_coordinator::Context::Documents(crate::small_docs()),
        query: "What is the access code for the north gate?".into(),
        system: None,
        answer_prefix: None,
    }
}

/// Runs `opts` (one answer token) on `ranks` fresh thread ranks over `lm`; returns the result
/// and what ran, by (thread, phase). `name` labels a failure.
pub fn run_counted(
    lm: &std::sync::Arc<flowprefill_worker::LoadedModel<Counting>>,
    name: &str,
    ranks: usize,
    request: &flowprefill_coordinator::Request,
    opts: &flowprefill_coordinator::RunOptions,
) -> (flowprefill_coordinator::RunResult, Vec<(ThreadId, &'static str, Ran)>) {
    run_counted_on(lm, name, ranks, false, request, opts)
}

/// [`run_counted`], with a device plane between the ranks when `plane` ([`crate::thread_planes`]:
/// buffers move between ranks as device buffers, nothing is staged).
pub fn run_counted_on(
    lm: &std::sync::Arc<flowprefill_worker::LoadedModel<Counting>>,
    name: &str,
    ranks: usize,
    plane: bool,
    request: &flowprefill_coordinator::Request,
    opts: &flowprefill_coordinator::RunOptions,
) -> (flowprefill_coordinator::RunResult, Vec<(ThreadId, &'static str, Ran)>) {
    let options = flowprefill_coordinator::RunOptions { max_new_tokens: 1, ..opts.clone() };
    let mut world =
        flowprefill_coordinator::ThreadRanks::new(lm.clone(), ranks, 1 << 30, std::time::Duration::from_secs(300))
            .unwrap_or_else(|e| panic!("{name}: thread ranks: {e}"));
    if plane {
        world =
            world.with_plane(crate::thread_planes::<Counting>(ranks)).unwrap_or_else(|e| panic!("{name}: planes: {e}"));
    }
    lm.model.backend().take();
    let job = flowprefill_coordinator::Job { request: request.clone(), options };
    let r = world.run(&job, &mut |_| true).unwrap_or_else(|e| panic!("{name}: {e}"));
    let ran = lm.model.backend().take();
    (r, ran)
}
