//! A CPU backend that counts what runs on it, per calling thread (each thread rank runs on its
//! own thread) and per engine phase (`coordinator::timings::current_phase`): GEMM FLOPs,
//! visible attention and score pairs, and copies between host and device, with the copies a
//! transport stages (`Backend::stage_out` / `stage_in`) apart from the ones the steps make.

use flowprefill_kernels::attention::AttnShape;
use flowprefill_kernels::matmul::Matrix;
use flowprefill_kernels::{Cpu, DType, HostBuf, Result, Wrapper};
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
    /// Elements they moved.
    pub download_floats: u64,
    /// Uploads made by the steps.
    pub uploads: u64,
    /// Elements they moved.
    pub upload_floats: u64,
    /// Buffers a transport staged out or in.
    pub staged: u64,
    /// Elements staged.
    pub staged_floats: u64,
    /// Bytes staged (a bf16 buffer stages 2 bytes per element).
    pub staged_bytes: u64,
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
        self.staged_bytes += o.staged_bytes;
    }
}

/// The counting CPU backend (f32 KV caches by default).
#[derive(Default)]
pub struct Counting {
    cpu: Cpu,
    ran: Mutex<HashMap<(ThreadId, &'static str), Ran>>,
    released: std::sync::atomic::AtomicU64,
}

impl Counting {
    /// A counting backend whose KV caches hold `kv` elements.
    pub fn with_kv_dtype(kv: DType) -> Self {
        Self { cpu: Cpu::with_kv_dtype(kv), ran: Mutex::default(), released: Default::default() }
    }

    /// How many times [`flowprefill_kernels::Backend::release_unused`] was called.
    pub fn released(&self) -> u64 {
        self.released.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn add(&self, f: impl FnOnce(&mut Ran)) {
        let phase = flowprefill_coordinator::timings::current_phase().unwrap_or("(outside phases)");
        let mut m = self.ran.lock().unwrap_or_else(|e| e.into_inner());
        f(m.entry((std::thread::current().id(), phase)).or_default());
    }

    /// Counts an upload by the steps of `n` elements.
    fn uploaded(&self, n: usize) {
        self.add(|r| {
            r.uploads += 1;
            r.upload_floats += n as u64;
        });
    }

    /// Counts a download by the steps of `n` elements.
    fn downloaded(&self, n: usize) {
        self.add(|r| {
            r.downloads += 1;
            r.download_floats += n as u64;
        });
    }

    /// Counts a transport's staging of `buf`.
    fn staged(&self, buf: &HostBuf) {
        self.add(|r| {
            r.staged += 1;
            r.staged_floats += buf.len() as u64;
            r.staged_bytes += (buf.len() * buf.dtype().size()) as u64;
        });
    }

    /// Counts the FLOPs of `rows` rows times the weight matrix `w`.
    fn gemm(&self, rows: usize, w: &Matrix) {
        let (n, k) = (w.rows(), w.cols());
        self.add(|r| r.gemm_flops += 2.0 * (rows * n * k) as f64);
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

impl Wrapper for Counting {
    type Inner = Cpu;
    fn inner(&self) -> &Cpu {
        &self.cpu
    }
    fn buf(buf: &HostBuf) -> &HostBuf {
        buf
    }
    fn buf_mut(buf: &mut HostBuf) -> &mut HostBuf {
        buf
    }
    fn adopt(&self, buf: HostBuf) -> Result<HostBuf> {
        Ok(buf)
    }
}

// The ops not written here run on the CPU uncounted.
flowprefill_kernels::forward_backend! {
    impl Backend for Counting {
        type Buf = HostBuf;
        // The trait's defaults, not the CPU's: `attention_rows` gathers its rows and calls
        // `attention` here (counted); `memory` is unknown, so that admission refuses nothing;
        // batched copies go through `download_typed` and `upload_typed` one by one (counted).
        defaults(attention_rows, memory, download_many, upload_many);

        fn name(&self) -> &'static str {
            "counting-cpu"
        }
        fn release_unused(&self) {
            self.released.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        fn upload(&self, host: &[f32]) -> Result<HostBuf> {
            self.uploaded(host.len());
            self.cpu.upload(host)
        }
        fn download(&self, buf: &HostBuf) -> Result<Vec<f32>> {
            self.downloaded(buf.len());
            self.cpu.download(buf)
        }
        fn download_range(&self, buf: &HostBuf, start: usize, len: usize) -> Result<Vec<f32>> {
            self.downloaded(len);
            self.cpu.download_range(buf, start, len)
        }
        fn stage_out(&self, buf: &HostBuf) -> Result<HostBuf> {
            self.staged(buf);
            self.cpu.download_typed(buf)
        }
        fn stage_in(&self, host: &HostBuf) -> Result<HostBuf> {
            self.staged(host);
            self.cpu.upload_typed(host)
        }
        fn download_typed(&self, buf: &HostBuf) -> Result<HostBuf> {
            self.downloaded(buf.len());
            self.cpu.download_typed(buf)
        }
        fn upload_typed(&self, host: &HostBuf) -> Result<HostBuf> {
            self.uploaded(host.len());
            self.cpu.upload_typed(host)
        }
        fn matmul_t(&self, x: &HostBuf, rows: usize, w: &Matrix, out: &mut HostBuf) -> Result<()> {
            self.gemm(rows, w);
            self.cpu.matmul_t(x, rows, w, out)
        }
        fn matmul_t_acc(&self, x: &HostBuf, rows: usize, w: &Matrix, out: &mut HostBuf) -> Result<()> {
            self.gemm(rows, w);
            self.cpu.matmul_t_acc(x, rows, w, out)
        }
        fn attention(
            &self,
            shape: &AttnShape,
            q: &HostBuf,
            qpos: &[u32],
            k: &HostBuf,
            v: &HostBuf,
            kpos: &[u32],
            out: &mut HostBuf,
            lse: &mut HostBuf,
        ) -> Result<()> {
            self.add(|r| r.attn_pairs += visible(qpos, kpos));
            self.cpu.attention(shape, q, qpos, k, v, kpos, out, lse)
        }
        fn attention_scores(
            &self,
            shape: &AttnShape,
            q: &HostBuf,
            qpos: &[u32],
            k: &HostBuf,
            kpos: &[u32],
            lse: &HostBuf,
            scores: &mut HostBuf,
        ) -> Result<()> {
            self.add(|r| r.score_pairs += visible(qpos, kpos));
            self.cpu.attention_scores(shape, q, qpos, k, kpos, lse, scores)
        }
    }
}

/// The three small documents and the north-gate question.
pub fn needle_request() -> flowprefill_coordinator::Request {
    flowprefill_coordinator::Request {
        conversation: Default::default(),
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
