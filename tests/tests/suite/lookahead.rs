//! LookaheadKV: the inference forward of the lookahead rows (LoRA fused on the device) against
//! the training forward, the loss's gradients against finite differences, a short training
//! run that must lower the held-out loss, and `--evict lookahead` in the engine (exactly N per
//! head, the rows leave nothing behind, refused without an adapter).

use candle_core::{Device, Tensor, Var};
use flowprefill_comm::local::LocalComm;
use flowprefill_coordinator::select::pool_mean;
use flowprefill_coordinator::{Evict, EvictPolicy, Job, Method, RunOptions, RunResult, ThreadRanks};
use flowprefill_lab::train::lookahead::fit::{self, LookaheadKv, Params, Sample, Settings};
use flowprefill_lab::train::lookahead::{case_importance, HeadImportance};
use flowprefill_lab::train::model::{Extras, Placed, TrainModel};
use flowprefill_lab::train::run;
use flowprefill_tests::{default_model_path, gate_request};
use flowprefill_worker::evict::SNAPKV_POOL;
use flowprefill_worker::generate::prefill_into;
use flowprefill_worker::kv::{KeyForm, KvCache};
use flowprefill_worker::lookahead::{tensor_specs, LookaheadAdapter, LookaheadMeta};
use flowprefill_worker::steps::{LocalSegment, Replicated};
use flowprefill_worker::{Cpu, LoadedModel, Model};
use std::sync::Arc;
use std::time::Duration;

/// Per-head importance of the inference path against the training path, absolute on values
/// that sum to 1 per head (f32 sums in different orders; the LoRA fused block-diagonally).
const IMPORTANCE_TOL: f32 = 2e-4;
/// A gradient entry against its central difference.
const FD_REL_TOL: f32 = 0.05;
const FD_STEP: f32 = 1e-2;
/// A KL of f32 scores normalised in f32 against the same normalised in f64, relative.
const KL_TOL: f64 = 1e-5;
/// The loss (an f32 graph) against the same KL in f64, relative.
const LOSS_TOL: f64 = 1e-3;

fn tiny(arch: &'static str, vocab: usize) -> (Model<Cpu>, TrainModel, flowprefill_tests::TempDir) {
    flowprefill_tests::tiny_pair("lookahead", arch, vocab, 13)
}

/// An adapter of seeded values: rows of the embedding's scale, LoRA large enough to matter.
fn random_adapter(cfg: &flowprefill_worker::config::ModelConfig, rows: usize, fingerprint: &str) -> LookaheadAdapter {
    let meta = LookaheadMeta {
        model: fingerprint.into(),
        model_name: cfg.name.clone(),
        rows,
        rank: 2,
        alpha: 4.0,
        weights: None,
        training: Default::default(),
    };
    let tensors = tensor_specs(cfg, rows, 2)
        .iter()
        .enumerate()
        .map(|(i, (_, [r, c]))| flowprefill_worker::synthetic::random_values(r * c, 100 + i as u64, 0.3))
        .collect();
    LookaheadAdapter::new(meta, cfg, tensors).expect("adapter")
}

/// The lookahead rows' normalised importance per (layer, KV head) as the engine computes it:
/// the prefix in a cache, the rows after it over that cache (head scores of every row).
fn inference_importance(m: &Model<Cpu>, prefix: &[u32], rows: usize) -> Vec<Vec<Vec<f32>>> {
    let cfg = m.config();
    let mut cache = KvCache::new(&Cpu, cfg.n_layers, cfg.kv_dim(), KeyForm::Rotated).unwrap();
    prefill_into(m, &mut cache, prefix, 0, 64).unwrap();
    let mut tail = KvCache::new(&Cpu, cfg.n_layers, cfg.kv_dim(), KeyForm::Rotated).unwrap();
    let mut comm = LocalComm::group(1).pop().unwrap();
    let n = prefix.len() as u32;
    let pos: Vec<u32> = (n..n + rows as u32).collect();
    let segs = vec![LocalSegment::placed(0, &cache)];
    let mut rep =
        Replicated::new(&Cpu, &mut comm, "lookahead", segs, &mut tail, &pos, vec![]).unwrap().with_head_scores(rows);
    m.forward_lookahead(&pos, &mut rep, cfg.n_layers, &mut flowprefill_worker::interrupt::never).unwrap();
    let mut heads = rep.discard_with_heads().unwrap();
    assert_eq!(tail.len(), 0, "the lookahead rows leave nothing in the tail");
    let mut per_layer = heads.pop().unwrap();
    for h in per_layer.iter_mut().flatten() {
        let s: f32 = h.iter().sum();
        h.iter_mut().for_each(|x| *x /= s);
    }
    per_layer
}

/// The training forward's importance of the same rows over the same prefix.
fn training_importance(tm: &TrainModel, a: &LookaheadAdapter, prefix: &[u32]) -> Vec<Vec<Vec<f32>>> {
    let n = prefix.len() as u32;
    let pos: Vec<u32> = (0..n).collect();
    let (_, kv) = tm.forward(&tm.embed_tokens(prefix).unwrap(), &pos, &[]).unwrap();
    let flat: Vec<f32> = a.tensors.iter().flatten().copied().collect();
    let s = LookaheadKv { rows: a.meta.rows, rank: a.meta.rank, alpha: a.meta.alpha, ..LookaheadKv::default() };
    let t = Tensor::from_vec(flat.clone(), flat.len(), &Device::Cpu).unwrap();
    let p = fit::params(&t, tm, &s).unwrap();
    let la_pos: Vec<u32> = (n..n + a.meta.rows as u32).collect();
    let ctx = [Placed { kv: &kv, positions: pos }];
    let (_, _, imps) =
        tm.forward_ext(&p.rows, &la_pos, &ctx, Extras { lora: Some(&p.lora), capture: prefix.len() }).unwrap();
    imps.iter()
        .map(|t| {
            let t = t.broadcast_div(&t.sum_keepdim(1).unwrap()).unwrap();
            t.to_vec2::<f32>().unwrap()
        })
        .collect()
}

/// The engine's lookahead rows (LoRA fused and block-diagonal on the backend) attend as the
/// training forward's (LoRA per projection, candle) on tiny models of every architecture.
#[test]
fn the_inference_rows_attend_as_the_training_rows() {
    for arch in ["llama", "qwen2", "qwen3"] {
        let (mut m, tm, dir) = tiny(arch, 300);
        let a = random_adapter(m.config(), 5, "tiny");
        m.set_lookahead(Some(&a)).unwrap();
        assert_eq!(m.lookahead_rows(), 5);
        let prefix: Vec<u32> = (0..40).map(|i| (i * 7 + 3) % 300).collect();
        let inf = inference_importance(&m, &prefix, 5);
        let tr = training_importance(&tm, &a, &prefix);
        let mut worst = 0f32;
        assert!(
            !inf.is_empty() && inf.len() == tr.len(),
            "{arch}: importance of {} and {} layers",
            inf.len(),
            tr.len()
        );
        for (li, ti) in inf.iter().zip(&tr) {
            assert_eq!(li.len(), ti.len(), "{arch}: heads per layer");
            for (hi, ht) in li.iter().zip(ti) {
                worst = worst.max(flowprefill_kernels::testing::max_abs_diff(hi, ht));
            }
        }
        assert!(worst <= IMPORTANCE_TOL, "{arch}: importance differs by {worst}");
        // Without the LoRA the rows attend otherwise: the LoRA is applied.
        let mut plain = a.clone();
        for (i, (name, _)) in tensor_specs(m.config(), 5, 2).iter().enumerate() {
            if name.ends_with("lora_b") {
                plain.tensors[i].iter_mut().for_each(|x| *x = 0.0);
            }
        }
        m.set_lookahead(Some(&plain)).unwrap();
        let without = inference_importance(&m, &prefix, 5);
        let moved = inf.iter().flatten().flatten().zip(without.iter().flatten().flatten()).map(|(x, y)| (x - y).abs());
        assert!(moved.fold(0f32, f32::max) > 1e-3, "{arch}: the LoRA changes the rows' attention");
        std::fs::remove_dir_all(dir).ok();
    }
}

fn tiny_settings() -> Settings {
    Settings {
        method: LookaheadKv { rows: 4, rank: 2, alpha: 8.0, max_answer: 4 },
        tasks: vec!["niah_single".into(), "qa_twohop".into()],
        length: 200,
        samples: 4,
        val_samples: 2,
        epochs: 3,
        batch: 2,
        lr: 0.02,
        ..Settings::default()
    }
}

/// The loss's gradient (eq. 5 through the frozen model to the rows and the LoRA) against
/// central differences of the loss, on a few parameters of each kind.
#[test]
fn loss_gradients_match_finite_differences() {
    let (lm, tm, dir) = flowprefill_tests::tiny_lm("lookahead", 13);
    let s = tiny_settings();
    let case = flowprefill_lab::tasks::generate("niah_single", &lm.tokenizer, 5, 200, 0, &[0.5]).expect("a case");
    let sample: Sample = fit::sample(&lm, &case, s.prompts, 4).unwrap().expect("an answer");
    let specs = tensor_specs(tm.config(), s.method.rows, s.method.rank);
    let n: usize = specs.iter().map(|(_, [r, c])| r * c).sum();
    let init = flowprefill_worker::synthetic::random_values(n, 9, 0.2);
    let var = Var::from_vec(init.clone(), n, &Device::Cpu).unwrap();
    let loss_at = |v: &Tensor| -> f32 {
        let p: Params = fit::params(v, &tm, &s.method).unwrap();
        fit::loss(&tm, &p, &sample).unwrap().to_scalar::<f32>().unwrap()
    };
    let p = fit::params(var.as_tensor(), &tm, &s.method).unwrap();
    let g: Vec<f32> =
        fit::loss(&tm, &p, &sample).unwrap().backward().unwrap().remove(var.as_tensor()).unwrap().to_vec1().unwrap();
    // In the rows and in A and B of the first layer's query and down projections, the entry
    // with the largest gradient (a small one is below what f32 differences of the loss resolve).
    let mut offsets = Vec::new();
    let mut off = 0;
    for (name, [r, c]) in &specs {
        if name == "lookahead" || name.starts_with("blk.0.q.") || name.starts_with("blk.0.down.") {
            let best = (off..off + r * c).max_by(|&a, &b| g[a].abs().total_cmp(&g[b].abs())).unwrap();
            offsets.push(best);
        }
        off += r * c;
    }
    for &i in &offsets {
        let mut plus = init.clone();
        plus[i] += FD_STEP;
        let mut minus = init.clone();
        minus[i] -= FD_STEP;
        let t = |v: Vec<f32>| Tensor::from_vec(v, n, &Device::Cpu).unwrap();
        let fd = (loss_at(&t(plus)) - loss_at(&t(minus))) / (2.0 * FD_STEP);
        let scale = fd.abs().max(g[i].abs()).max(1e-3);
        assert!((fd - g[i]).abs() / scale <= FD_REL_TOL, "parameter {i}: gradient {} vs difference {fd}", g[i]);
    }
    std::fs::remove_dir_all(dir).ok();
}

/// A few steps on a tiny random model lower the held-out KL; the adapter file records the
/// run and loads back for the model; resuming a finished run takes no step.
#[test]
fn a_short_training_run_lowers_the_loss_and_resumes() {
    let (lm, tm, dir) = flowprefill_tests::tiny_lm("lookahead", 13);
    let settings = tiny_settings();
    let out = run::Outputs { dir: dir.join("run"), adapter: dir.join("tiny.lookahead.safetensors") };
    let mut steps = 0;
    let (adapter, history) = run::train(&lm, &tm, &settings, &out, &mut |e| {
        if let run::Event::Step { .. } = e {
            steps += 1
        }
    })
    .expect("training");
    assert_eq!((steps, history.train.len()), (6, 6));
    let last = history.validation.last().expect("validation").1;
    assert!(last < history.initial_val, "held-out KL {} -> {last}", history.initial_val);
    assert!(history.none_val > 0.0, "SnapKV's held-out KL is measured: {}", history.none_val);
    // Both also with the scores pooled as eviction pools them, before training and every epoch.
    let pooled = history.pooled.as_ref().expect("LookaheadKV reports the pooled KLs");
    assert!(pooled.reference > 0.0 && pooled.initial > 0.0, "{pooled:?}");
    assert_eq!(pooled.validation.iter().map(|v| v.0).collect::<Vec<_>>(), [1, 2, 3]);
    let loaded = LookaheadAdapter::load(&out.adapter, tm.config()).expect("adapter file");
    assert_eq!(loaded.tensors, adapter.tensors);
    assert_eq!(loaded.meta.training["steps"], 6);
    assert_eq!(loaded.meta.training["pooled"]["snapkv_val_loss"], pooled.reference);
    assert_eq!(loaded.meta.training["pooled"]["val_loss"], pooled.validation[2].1);
    assert_eq!(loaded.meta.weights.as_deref(), Some(lm.cache_identity.as_str()), "records the weights");
    loaded.check_model("tiny", &lm.cache_identity, tm.config()).expect("made for this model");
    let e = loaded.check_model("tiny", "tiny-other", tm.config()).expect_err("a fine-tune").to_string();
    assert!(e.contains("other weights"), "{e}");
    let (again, _) = run::train(&lm, &tm, &settings, &out, &mut |e| {
        assert!(!matches!(e, run::Event::Step { .. }), "a finished run takes no step");
    })
    .expect("resume");
    assert_eq!(again.tensors, adapter.tensors);
    std::fs::remove_dir_all(dir).ok();
}

/// A run stopped after step 3 of 6 (mid-epoch, past the warm-up) and resumed ends bit for bit
/// where the uninterrupted run ends (AdamW's moments and step, the clipped gradients' values,
/// the schedule's step, the history from the one checkpoint file).
#[test]
fn a_run_stopped_mid_way_resumes_exactly() {
    let (lm, tm, dir) = flowprefill_tests::tiny_lm("lookahead-resume", 13);
    let settings = Settings { val_samples: 1, ..tiny_settings() };
    let outputs = |name: &str| run::Outputs { dir: dir.join(name), adapter: dir.join(name).join("a.safetensors") };
    let (whole, whole_history) = run::train(&lm, &tm, &settings, &outputs("whole"), &mut |_| ()).expect("training");
    let out = outputs("stopped");
    let stopped = run::train_until(&lm, &tm, &settings, &out, 3, &mut |_| ()).expect("three steps");
    assert_eq!(stopped.train.len(), 3);
    let mut rest = 0;
    let (resumed, history) = run::train(&lm, &tm, &settings, &out, &mut |e| {
        rest += usize::from(matches!(e, run::Event::Step { .. }));
    })
    .expect("resume");
    assert_eq!(rest, 3, "the resumed run takes the other three steps");
    assert_eq!(resumed.tensors, whole.tensors, "bit for bit");
    assert_eq!(history.train, whole_history.train);
    assert_eq!(history.validation, whole_history.validation);
    assert_eq!(history.pooled, whole_history.pooled);
    std::fs::remove_dir_all(dir).ok();
}

/// KL(truth || prediction) per (layer, KV head), mean over them; the prediction pooled over
/// `pool` rows first (1: as it is), both normalised to sum 1.
fn mean_kl(truth: &HeadImportance, pred: &HeadImportance, pool: usize) -> f64 {
    let norm = |v: &[f32]| {
        let s: f64 = v.iter().map(|&x| f64::from(x.max(0.0))).sum();
        v.iter().map(|&x| f64::from(x.max(0.0)) / s).collect::<Vec<f64>>()
    };
    let (mut sum, mut pairs) = (0.0, 0);
    for (t, q) in truth.pairs().zip(pred.pairs()) {
        let (t, q) = (norm(t), norm(&pool_mean(q, pool)));
        sum += t.iter().zip(&q).filter(|(a, _)| **a > 0.0).map(|(a, b)| a * (a.ln() - b.max(1e-12).ln())).sum::<f64>();
        pairs += 1;
    }
    sum / pairs as f64
}

/// SnapKV's reference KL is on the loss's transform (its window's scores as they are, as the
/// loss takes the rows'), and its pooled KL on eviction's (pooled over SNAPKV_POOL rows): the
/// reference was SnapKV pooled against rows unpooled, two transforms.
#[test]
fn snapkv_reference_is_on_the_loss_transform_and_pooled_apart() {
    let (lm, tm, dir) = flowprefill_tests::tiny_lm("lookahead-kl", 13);
    let s = tiny_settings();
    let case = flowprefill_lab::tasks::generate("niah_single", &lm.tokenizer, 5, 200, 0, &[0.5]).expect("a case");
    let ci = case_importance(&lm, &case.request(s.prompts), 4).unwrap().expect("an answer");
    let sample: Sample = fit::sample(&lm, &case, s.prompts, 4).unwrap().expect("an answer");
    let unpooled = mean_kl(&ci.truth, &ci.snapkv_window, 1);
    let pooled = mean_kl(&ci.truth, &ci.snapkv_window, SNAPKV_POOL);
    // The sample normalises in f32, this in f64.
    assert!((sample.snapkv_kl - unpooled).abs() < KL_TOL * unpooled, "{} vs {unpooled}", sample.snapkv_kl);
    assert!((sample.snapkv_pooled_kl - pooled).abs() < KL_TOL * pooled, "{} vs {pooled}", sample.snapkv_pooled_kl);
    assert!((unpooled - pooled).abs() > 1e-3, "the transforms differ here: {unpooled} vs {pooled}");
    // The rows' pooled KL is their importance pooled the same way.
    let n: usize = tensor_specs(tm.config(), s.method.rows, s.method.rank).iter().map(|(_, [r, c])| r * c).sum();
    let values = Tensor::from_vec(flowprefill_worker::synthetic::random_values(n, 3, 0.2), n, &Device::Cpu).unwrap();
    let p = fit::params(&values, &tm, &s.method).unwrap();
    let rows = HeadImportance {
        values: fit::lookahead_importance(&tm, &p, &sample)
            .unwrap()
            .iter()
            .map(|t| t.to_vec2::<f32>().unwrap())
            .collect(),
    };
    let got = fit::pooled_kl(&tm, &p, &sample).unwrap();
    let want = mean_kl(&ci.truth, &rows, SNAPKV_POOL);
    assert!((got - want).abs() < KL_TOL * want, "{got} vs {want}");
    let loss = f64::from(fit::loss(&tm, &p, &sample).unwrap().to_scalar::<f32>().unwrap());
    let unpooled_rows = mean_kl(&ci.truth, &rows, 1);
    assert!((loss - unpooled_rows).abs() < LOSS_TOL * unpooled_rows, "the loss is the unpooled KL: {loss}");
    std::fs::remove_dir_all(dir).ok();
}

fn real_with_lookahead() -> Arc<LoadedModel<Cpu>> {
    let mut lm = LoadedModel::load(&default_model_path(), Cpu).expect("default model");
    let a = random_adapter(lm.model.config(), 32, &lm.fingerprint.clone());
    lm.use_lookahead(&a).expect("an adapter made for the model");
    Arc::new(lm)
}

fn run(lm: &Arc<LoadedModel<Cpu>>, ranks: usize, opts: RunOptions) -> Result<RunResult, String> {
    let mut world = ThreadRanks::new(lm.clone(), ranks, 1 << 30, Duration::from_secs(60)).expect("ranks");
    let job = Job { request: gate_request(), options: RunOptions { max_new_tokens: 12, ..opts } };
    world.run(&job, &mut |_| true).map_err(|e| e.to_string())
}

/// `--evict lookahead` on the real model (an adapter of seeded values: the mechanics, not the
/// quality): exactly N entries per (layer, KV head) over 1 and 2 ranks; a budget above the
/// context answers exactly as no eviction (the lookahead rows leave no K/V behind and decoding
/// starts where it would); without an adapter the job is refused, naming the flag.
#[test]
fn lookahead_eviction_keeps_the_budget_and_leaves_nothing_behind() {
    let lm = real_with_lookahead();
    let ev = |budget| Some(Evict { policy: EvictPolicy::Lookahead, budget });
    for (method, ranks) in [(Method::Infoflow, 1), (Method::Infoflow, 2), (Method::Full, 1)] {
        let tag = format!("{method} on {ranks} ranks");
        let opts = RunOptions { method, ratio: 0.15, ..RunOptions::default() };
        let r = run(&lm, ranks, RunOptions { evict: ev(48), ..opts.clone() }).unwrap();
        let e = r.eviction.as_ref().expect("eviction reported");
        assert_eq!((e.kept(), e.window, e.policy), (48, 32, EvictPolicy::Lookahead), "{tag}: {e:?}");
        let plain = run(&lm, ranks, opts.clone()).unwrap();
        let all = run(&lm, ranks, RunOptions { evict: ev(100_000), ..opts }).unwrap();
        assert_eq!(all.tokens, plain.tokens, "{tag}: {:?} vs {:?}", all.answer, plain.answer);
    }
    let bare = Arc::new(LoadedModel::load(&default_model_path(), Cpu).expect("default model"));
    let e = run(&bare, 1, RunOptions { evict: ev(48), ..RunOptions::default() }).unwrap_err();
    assert!(e.contains("--lookahead-adapter") && e.contains("--evict"), "{e}");
}

/// The first logits of a recomputing method at ratio 1.0 against full prefill (relative; the
/// same tolerance as the other selectors' test in engine_invariants.rs).
const ENGINE_LOGIT_TOL: f32 = 2e-4;
/// The selection's scores against the reference, relative to the largest score.
const SCORE_REL_TOL: f32 = 1e-4;

/// `--method lookahead`'s scores: the rows run after the prompt, whose K/V the probe keeps in
/// its tail, equal the rows over ONE cache of context + prompt prefilled as a sequence (the
/// context's part of the mass, at the weighted layers only), on tiny models of every
/// architecture; and they are not the prompt's own scores (InfoFlow's).
#[test]
fn lookahead_selection_scores_are_the_rows_mass_after_the_prompt() {
    use flowprefill_coordinator::select::{probe_local, probe_with, Queries};
    for arch in ["llama", "qwen2", "qwen3"] {
        let (mut m, _tm, _dir) = tiny(arch, 300);
        let a = random_adapter(m.config(), 5, "tiny");
        m.set_lookahead(Some(&a)).unwrap();
        let cfg = m.config().clone();
        let context: Vec<u32> = (0..40).map(|i| (i * 11 + 5) % 300).collect();
        let prompt: Vec<u32> = (0..7).map(|i| (i * 13 + 2) % 300).collect();
        let weights: Vec<f32> = (0..cfg.n_layers).map(|l| if l == 0 || l == 1 { 1.0 } else { 0.0 }).collect();
        let (nc, np) = (context.len() as u32, prompt.len() as u32);
        let mut comm = LocalComm::group(1).pop().unwrap();
        let mut ctx = KvCache::new(&Cpu, cfg.n_layers, cfg.kv_dim(), KeyForm::Rotated).unwrap();
        prefill_into(&m, &mut ctx, &context, 0, 64).unwrap();
        let prompt_pos: Vec<u32> = (nc..nc + np).collect();
        let never = &mut flowprefill_worker::interrupt::never;
        let segs = vec![LocalSegment::placed(1, &ctx)];
        let got =
            probe_with(Queries::Lookahead, &m, &mut comm, "la", segs.clone(), &prompt, &prompt_pos, &weights, never)
                .unwrap();
        let own = probe_local(&m, &mut comm, "probe", segs, &prompt, &prompt_pos, &weights, never).unwrap();

        let mut whole = KvCache::new(&Cpu, cfg.n_layers, cfg.kv_dim(), KeyForm::Rotated).unwrap();
        prefill_into(&m, &mut whole, &[context.clone(), prompt.clone()].concat(), 0, 64).unwrap();
        let mut tail = KvCache::new(&Cpu, cfg.n_layers, cfg.kv_dim(), KeyForm::Rotated).unwrap();
        let pos: Vec<u32> = (nc + np..nc + np + 5).collect();
        let segs = vec![LocalSegment::placed(1, &whole)];
        let mut rep = Replicated::new(&Cpu, &mut comm, "ref", segs, &mut tail, &pos, weights.clone()).unwrap();
        m.forward_lookahead(&pos, &mut rep, 2, never).unwrap();
        let want = rep.commit().unwrap().remove(0);

        assert_eq!((got.len(), got[0].len()), (1, context.len()), "{arch}");
        let top = want.iter().fold(0f32, |a, &b| a.max(b));
        assert!(top > 0.0, "{arch}: the rows pay the context no attention");
        // The reference scores every key of its one cache (context, then prompt): the
        // context's part is what the selection scores.
        assert_eq!(want.len(), context.len() + prompt.len(), "{arch}");
        let worst = flowprefill_kernels::testing::max_abs_diff(&got[0], &want[..context.len()]);
        assert!(worst <= SCORE_REL_TOL * top, "{arch}: {worst} against the largest score {top}");
        let apart = flowprefill_kernels::testing::max_abs_diff(&got[0], &own[0]);
        assert!(apart > 1e-3 * top, "{arch}: the rows' scores are the prompt's ({apart})");
    }
}

/// `--method lookahead` on the real model: at ratio 1.0 every context token is recomputed and
/// the job is full prefill (first logits within ENGINE_LOGIT_TOL, the same answer) on 1 and 2
/// ranks; at 0.15 it recomputes the same number of tokens as InfoFlow, chosen otherwise;
/// without an adapter the job is refused, naming the method and the flag.
#[test]
fn lookahead_selection_is_full_prefill_at_ratio_one_and_needs_an_adapter() {
    let lm = real_with_lookahead();
    let full = run(&lm, 1, RunOptions { method: Method::Full, ..RunOptions::default() }).unwrap();
    for ranks in [1, 2] {
        let r = run(&lm, ranks, RunOptions { method: Method::Lookahead, ratio: 1.0, ..RunOptions::default() }).unwrap();
        assert_eq!(r.n_selected(), r.n_context_tokens, "{ranks} ranks: everything is recomputed");
        let d = flowprefill_tests::rel_diff(&r.first_logits, &full.first_logits);
        assert!(d <= ENGINE_LOGIT_TOL, "{ranks} ranks: relative logit difference {d}");
        assert_eq!(r.answer, full.answer, "{ranks} ranks");
    }
    let at = |method| RunOptions { method, ratio: 0.15, ..RunOptions::default() };
    let la = run(&lm, 1, at(Method::Lookahead)).unwrap();
    let inf = run(&lm, 1, at(Method::Infoflow)).unwrap();
    assert_eq!(la.n_selected(), inf.n_selected());
    assert_ne!(la.selected_rows, inf.selected_rows, "the rows choose as the prompt does");
    let bare = Arc::new(LoadedModel::load(&default_model_path(), Cpu).expect("default model"));
    let e = run(&bare, 1, at(Method::Lookahead)).unwrap_err();
    assert!(e.contains("--lookahead-adapter") && e.contains("method"), "{e}");
}

/// The adapters in `adapters/` are found by their models' fingerprints (so `--evict lookahead`
/// and `--method lookahead` need no `--lookahead-adapter` there), have the paper's shape, and
/// fit; a model without one gets none (Qwen2.5-Coder-0.5B is fetched when not in the cache).
#[test]
fn the_fetched_models_have_their_shipped_lookahead_adapters() {
    use flowprefill_worker::lookahead::{shipped, LOOKAHEAD_ROWS, LORA_RANK};
    let mut lm = LoadedModel::load(&default_model_path(), Cpu).expect("default model");
    let smol = shipped(&lm.fingerprint, &lm.cache_identity, lm.model.config())
        .expect("shipped adapters parse")
        .expect("one for SmolLM2");
    // A fine-tune sharing the embedding (the same fingerprint, other weights) gets none.
    assert!(shipped(&lm.fingerprint, "other-weights", lm.model.config()).unwrap().is_none());
    assert_eq!((smol.meta.rows, smol.meta.rank), (LOOKAHEAD_ROWS, LORA_RANK));
    lm.use_lookahead(&smol).expect("its own adapter fits");
    assert_eq!(lm.model.lookahead_rows(), LOOKAHEAD_ROWS);
    assert!(shipped("no such model", "no such weights", lm.model.config()).unwrap().is_none());
    let path = flowprefill_tests::qwen_model_path();
    let mut qwen = LoadedModel::load(&path, Cpu).expect("Qwen loads");
    let a = shipped(&qwen.fingerprint, &qwen.cache_identity, qwen.model.config())
        .expect("parse")
        .expect("one for Qwen2.5-Coder-0.5B");
    assert_ne!(a.hash, smol.hash);
    qwen.use_lookahead(&a).expect("its own adapter fits");
}
