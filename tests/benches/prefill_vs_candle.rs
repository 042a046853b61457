//! Full-prefill throughput of flowprefill next to candle-transformers' `quantized_llama` with
//! f32 weights (`CANDLE_DEQUANTIZE_ALL=1`), same model file, same tokens, same process, on
//! divan (`item/s` counts prompt tokens, so it reads tokens/s).
//!
//! `cargo bench -p flowprefill-tests --bench prefill_vs_candle` (filter: `-- candle`,
//! `-- flowprefill`). candle's quantized_llama refuses prompts beyond its hard-coded
//! MAX_SEQ_LEN (4096), so it runs to 4096 only; flowprefill runs to 8000 as well.

use candle_core::quantized::gguf_file;
use candle_core::{Device, Tensor};
use candle_transformers::models::quantized_llama;
use divan::counter::ItemsCount;
use divan::Bencher;
use flowprefill_kernels::Backend as _;
use flowprefill_lab::corpus;
use flowprefill_tests::default_model_path;
use flowprefill_worker::generate::prefill_into;
use flowprefill_worker::kv::{KeyForm, KvCache};
use flowprefill_worker::{Cpu, LoadedModel};
use std::sync::{Mutex, OnceLock};

fn main() {
    std::env::set_var("CANDLE_DEQUANTIZE_ALL", "1");
    println!("threads {}", flowprefill_kernels::simd::threads());
    divan::main();
}

fn lm() -> &'static LoadedModel<Cpu> {
    static LM: OnceLock<LoadedModel<Cpu>> = OnceLock::new();
    LM.get_or_init(|| LoadedModel::load(&default_model_path(), Cpu).unwrap_or_else(|e| panic!("{e}")))
}

/// The first `n` tokens of generated English prose (the same for both implementations).
fn tokens(n: usize) -> Vec<u32> {
    let ids = lm().tokenizer.encode_text(&corpus::prose(1, n * 6)).unwrap_or_else(|e| panic!("{e}"));
    ids[..n].to_vec()
}

#[divan::bench(args = [512, 2048, 4096, 8000], sample_count = 3, sample_size = 1)]
fn flowprefill(b: Bencher, n: usize) {
    let (model, ids) = (&lm().model, tokens(n));
    let cfg = model.config();
    b.counter(ItemsCount::new(n)).bench_local(|| {
        let mut cache = KvCache::new(model.backend(), cfg.n_layers, cfg.kv_dim(), KeyForm::Rotated)
            .unwrap_or_else(|e| panic!("{e}"));
        prefill_into(model, &mut cache, &ids, 0, model.backend().prefill_rows()).unwrap_or_else(|e| panic!("{e}"))
    });
}

fn candle_model() -> &'static Mutex<quantized_llama::ModelWeights> {
    static M: OnceLock<Mutex<quantized_llama::ModelWeights>> = OnceLock::new();
    M.get_or_init(|| {
        let path = default_model_path();
        let mut file = std::fs::File::open(&path).unwrap_or_else(|e| panic!("{e}"));
        let content = gguf_file::Content::read(&mut file).unwrap_or_else(|e| panic!("{e}"));
        Mutex::new(
            quantized_llama::ModelWeights::from_gguf(content, &mut file, &Device::Cpu)
                .unwrap_or_else(|e| panic!("{e}")),
        )
    })
}

#[divan::bench(args = [512, 2048, 4096], sample_count = 3, sample_size = 1)]
fn candle(b: Bencher, n: usize) {
    let ids = tokens(n);
    let input =
        Tensor::new(ids.as_slice(), &Device::Cpu).and_then(|t| t.unsqueeze(0)).unwrap_or_else(|e| panic!("{e}"));
    let mut model = candle_model().lock().unwrap_or_else(|p| p.into_inner());
    b.counter(ItemsCount::new(n)).bench_local(|| model.forward(&input, 0).unwrap_or_else(|e| panic!("{e}")));
}
