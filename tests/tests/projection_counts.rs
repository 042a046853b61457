//! The projection's work accounting against the real engine: a backend that counts what the
//! model actually runs (GEMM FLOPs, visible attention pairs, score pairs) per rank thread, and
//! the communicator's own byte counters per collective, must equal what
//! `coordinator::project::plan` derives for the same request. If the pipeline changes (a new
//! forward, another attention pattern, another message), this test fails until the projection
//! follows.

use flowprefill_coordinator::project::{plan, Request, Shape};
use flowprefill_coordinator::{Context, Job, Method, PrefixMode, RunOptions, Scope, ThreadRanks};
use flowprefill_kernels::attention::AttnShape;
use flowprefill_kernels::matmul::Matrix;
use flowprefill_kernels::rope::RopeTable;
use flowprefill_kernels::{Backend, Cpu, Result};
use flowprefill_worker::LoadedModel;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::thread::ThreadId;

/// What one thread ran.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Ran {
    gemm_flops: f64,
    attn_pairs: u64,
    score_pairs: u64,
}

/// The CPU backend, counting per calling thread (each thread rank runs on its own thread).
#[derive(Default)]
struct Counting {
    ran: Mutex<HashMap<ThreadId, Ran>>,
}

impl Counting {
    fn add(&self, f: impl FnOnce(&mut Ran)) {
        let mut m = self.ran.lock().unwrap_or_else(|e| e.into_inner());
        f(m.entry(std::thread::current().id()).or_default());
    }

    fn take(&self) -> Vec<Ran> {
        let mut m = self.ran.lock().unwrap_or_else(|e| e.into_inner());
        m.drain().map(|(_, r)| r).collect()
    }
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
        Cpu.upload(host)
    }
    fn download(&self, buf: &Vec<f32>) -> Result<Vec<f32>> {
        Cpu.download(buf)
    }
    fn download_range(&self, buf: &Vec<f32>, start: usize, len: usize) -> Result<Vec<f32>> {
        Cpu.download_range(buf, start, len)
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

/// The collectives the projection accounts for byte by byte.
const COUNTED_OPS: &[&str] = &[
    "ring.kv",
    "probe.gather",
    "probe.merged",
    "final.gather",
    "final.merged",
    "recompute.q",
    "recompute.partials",
    "recompute.kv",
];

fn key(r: &Ran) -> (u64, u64, u64) {
    (r.gemm_flops as u64, r.attn_pairs, r.score_pairs)
}

#[test]
fn projected_work_equals_what_the_engine_runs() {
    let path = flowprefill_tests::default_model_path();
    let lm = Arc::new(LoadedModel::load(&path, Counting::default()).expect("model loads"));
    let shape = Shape::of_config(lm.model.config());
    let docs = flowprefill_tests::small_docs();
    let request = flowprefill_coordinator::Request {
        context: Context::Documents(docs),
        query: "What is the access code for the north gate?".into(),
        system: None,
    };
    let cases: Vec<(&str, usize, RunOptions)> = vec![
        ("full", 1, RunOptions { method: Method::Full, ..RunOptions::default() }),
        ("ring P=2", 2, RunOptions { method: Method::Ring, ..RunOptions::default() }),
        ("ring P=3", 3, RunOptions { method: Method::Ring, ..RunOptions::default() }),
        ("infoflow P=1", 1, RunOptions::default()),
        ("infoflow exact P=2", 2, RunOptions::default()),
        ("infoflow exact P=3, batches of 7", 3, RunOptions { ratio: 0.2, recompute_batch: 7, ..RunOptions::default() }),
        ("infoflow sparse P=2", 2, RunOptions { scope: Scope::Sparse, recompute_batch: 5, ..RunOptions::default() }),
        (
            "infoflow shared prefix P=2",
            2,
            RunOptions { prefix: Some(PrefixMode::Shared), ratio: 0.3, ..RunOptions::default() },
        ),
        ("none P=2", 2, RunOptions { method: Method::None, ..RunOptions::default() }),
    ];
    for (name, ranks, opts) in cases {
        let opts = RunOptions { max_new_tokens: 1, ..opts };
        let mut world = ThreadRanks::new(lm.clone(), ranks, 1 << 30, std::time::Duration::from_secs(300))
            .expect("thread ranks start");
        lm.model.backend().take();
        let job = Job { request: request.clone(), options: opts.clone() };
        let r = world.run(&job, &mut |_| true).unwrap_or_else(|e| panic!("{name}: {e}"));
        let ran = lm.model.backend().take();
        drop(world);
        let work = plan(&shape, &opts, ranks, &Request::of_run(&r)).unwrap_or_else(|e| panic!("{name}: {e}"));
        let projected: Vec<Ran> = (0..ranks)
            .map(|rank| {
                let c = work.rank_counts(rank, &shape, 4.0, 4.0);
                Ran { gemm_flops: c.gemm_flops, attn_pairs: c.attn_pair_layers, score_pairs: c.score_pair_layers }
            })
            .collect();
        // Ranks with no work at all never call the backend.
        let mut got: Vec<(u64, u64, u64)> = ran.iter().map(key).collect();
        let mut want: Vec<(u64, u64, u64)> = projected.iter().map(key).filter(|k| *k != (0, 0, 0)).collect();
        got.sort_unstable();
        want.sort_unstable();
        assert_eq!(got, want, "{name}: (GEMM FLOPs, attention pairs x layers, score pairs x layers) per rank");
        // Bytes of every accounted collective, per rank.
        for (rank, stats) in r.rank_stats.iter().enumerate() {
            for op in COUNTED_OPS {
                let real = stats.comm.ops.get(*op).map_or((0, 0, 0), |o| (o.calls, o.bytes_sent, o.bytes_received));
                let mut calls = 0u64;
                let (mut sent, mut received) = (0u64, 0u64);
                for m in work.per_rank[rank].iter().flat_map(|p| &p.messages).filter(|m| m.op == *op) {
                    calls += m.calls as u64;
                    sent += m.sent * m.calls as u64;
                    received += m.received * m.calls as u64;
                }
                assert_eq!(real, (calls, sent, received), "{name}: rank {rank} `{op}` (calls, sent, received)");
            }
        }
        eprintln!(
            "{name}: {} ranks agree (GEMM {:.3} GFLOP, {} attention pairs x layers on the busiest rank)",
            ranks,
            projected.iter().map(|p| p.gemm_flops).fold(0.0, f64::max) / 1e9,
            projected.iter().map(|p| p.attn_pairs).max().unwrap_or(0)
        );
    }
}
