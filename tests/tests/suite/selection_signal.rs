//! InfoFlow's selection signal end to end: the scores the engine's sharded probe produces
//! (chunk caches prefilled independently, the prompt run over the sharded segments with the
//! partials merged across ranks, each rank scoring its own keys under the merged normaliser)
//! equal a brute-force computation written out here: every cache made by a forward whose
//! attention is an explicit softmax, the chunks' keys rotated to the geometry's positions, the
//! prompt run over the concatenated context with an explicit softmax over every visible key,
//! the probabilities summed over prompt tokens and heads at the scoring layers. For every
//! geometry, on 1 and 3 ranks, with a small random-weight model (the real tokenizer, so the
//! request goes through the engine's own layout).

use flowprefill_coordinator::layout::Layout;
use flowprefill_coordinator::select::default_score_layers;
use flowprefill_coordinator::{Context, Geometry, Job, Method, PrefixMode, Request, RunOptions, ThreadRanks};
use flowprefill_kernels::{Backend, HostBuf};
use flowprefill_tests::{default_model_path, temp_dir, write_tiny_gguf, TinySpec};
use flowprefill_worker::attend::{Attend, LayerInput};
use flowprefill_worker::{Cpu, LoadedModel, Model};
use std::sync::Arc;
use std::time::Duration;

/// Largest difference between engine and brute-force scores, relative to the largest score
/// (f32 sums in another order; the scores of one key add up to at most prompt x heads x layers).
const SCORE_TOL: f32 = 1e-4;

/// Per layer, what a forward recorded: (pre-RoPE keys, values), `[n, kv_dim]` each.
type Recorded = Vec<(Vec<f32>, Vec<f32>)>;

/// Plain causal attention with an explicit softmax over `context` (keys rotated to their
/// positions) and the tokens themselves; records each layer's pre-RoPE keys and values and,
/// at weighted layers, the probability mass every context key receives.
struct Brute {
    /// Per layer: (rotated keys, values) of the context.
    context: Vec<(Vec<f32>, Vec<f32>)>,
    /// Positions of the context keys.
    cpos: Vec<u32>,
    weights: Vec<f32>,
    recorded: Recorded,
    mass: Vec<f32>,
}

impl Attend<Cpu> for Brute {
    fn attend(&mut self, x: &LayerInput<'_, Cpu>, out: &mut HostBuf) -> flowprefill_worker::Result<()> {
        let s = x.shape;
        // The default CPU backend keeps everything in f32.
        let (xq, xk, xv) = (x.q.to_f32(), x.k.to_f32(), x.v.to_f32());
        let (h, hkv, d) = (s.n_heads, s.n_kv_heads, s.head_dim);
        let (qd, kvd, group) = (s.q_dim(), s.kv_dim(), h / hkv);
        let m = x.positions.len();
        self.recorded.push((x.k_pre.to_f32(), xv.clone()));
        let empty = (vec![], vec![]);
        let (ck, cv) = self.context.get(x.layer).unwrap_or(&empty);
        let cpos = &self.cpos;
        let nc = cpos.len();
        // Keys: context first, then the tokens themselves.
        let key = |j: usize| -> (&[f32], &[f32], u32) {
            if j < nc {
                (&ck[j * kvd..(j + 1) * kvd], &cv[j * kvd..(j + 1) * kvd], cpos[j])
            } else {
                let t = j - nc;
                (&xk[t * kvd..(t + 1) * kvd], &xv[t * kvd..(t + 1) * kvd], x.positions[t])
            }
        };
        let w = self.weights.get(x.layer).copied().unwrap_or(0.0);
        let mut o = vec![0.0f32; m * qd];
        for i in 0..m {
            for head in 0..h {
                let kvh = head / group;
                let q = &xq[i * qd + head * d..i * qd + (head + 1) * d];
                let logits: Vec<Option<f64>> = (0..nc + m)
                    .map(|j| {
                        let (k, _, p) = key(j);
                        (p <= x.positions[i]).then(|| {
                            let k = &k[kvh * d..(kvh + 1) * d];
                            q.iter().zip(k).map(|(a, b)| f64::from(*a) * f64::from(*b)).sum::<f64>()
                                * f64::from(s.scale)
                        })
                    })
                    .collect();
                let max = logits.iter().flatten().fold(f64::NEG_INFINITY, |a, &b| a.max(b));
                let z: f64 = logits.iter().flatten().map(|l| (l - max).exp()).sum();
                for (j, l) in logits.iter().enumerate() {
                    let Some(l) = l else { continue };
                    let p = (l - max).exp() / z;
                    let (_, v, _) = key(j);
                    for (o, vv) in o[i * qd + head * d..i * qd + (head + 1) * d].iter_mut().zip(&v[kvh * d..]) {
                        *o += (p * f64::from(*vv)) as f32;
                    }
                    if j < nc && w > 0.0 {
                        self.mass[j] += w * p as f32;
                    }
                }
            }
        }
        *out = HostBuf::F32(o);
        Ok(())
    }
}

/// A forward of `tokens` at `positions` over `context` (per layer: pre-RoPE keys, values and
/// the positions to rotate them to): what it recorded and the weighted mass per context key.
fn brute_forward(
    model: &Model<Cpu>,
    tokens: &[u32],
    positions: &[u32],
    context: &[(Recorded, Vec<u32>)],
    weights: &[f32],
) -> (Recorded, Vec<f32>) {
    let c = model.config();
    let kvd = c.kv_dim();
    let mut layers = Vec::with_capacity(c.n_layers);
    let mut all_pos: Vec<u32> = Vec::new();
    for (_, pos) in context {
        all_pos.extend(pos);
    }
    for l in 0..c.n_layers {
        let (mut k, mut v) = (Vec::new(), Vec::new());
        for (rec, pos) in context {
            let mut kl = HostBuf::F32(rec[l].0.clone());
            model.backend().rope(&mut kl, c.n_kv_heads, pos, model.rope()).expect("rope");
            assert_eq!(kl.len(), pos.len() * kvd);
            k.extend(kl.to_f32());
            v.extend(&rec[l].1);
        }
        layers.push((k, v));
    }
    let n = all_pos.len();
    let mut b =
        Brute { context: layers, cpos: all_pos, weights: weights.to_vec(), recorded: Vec::new(), mass: vec![0.0; n] };
    model
        .forward_layers(tokens, positions, &mut b, c.n_layers, &mut flowprefill_worker::interrupt::never)
        .expect("forward");
    (b.recorded, b.mass)
}

/// The tiny model with the default model's tokenizer and chat template.
fn tiny_lm() -> Arc<LoadedModel<Cpu>> {
    let real = LoadedModel::load(&default_model_path(), Cpu).expect("default model");
    let dir = temp_dir("selection-signal");
    let path = dir.join("tiny.gguf");
    let spec = TinySpec { layers: 4, vocab: real.model.config().vocab_size, seed: 7, ..TinySpec::new("llama") };
    write_tiny_gguf(&path, &spec);
    let model = Model::load(&path, Cpu).expect("tiny model");
    let _ = std::fs::remove_dir_all(dir);
    Arc::new(LoadedModel {
        model,
        tokenizer: real.tokenizer,
        template: real.template,
        synthetic: None,
        fingerprint: real.fingerprint,
        adapter: None,
        cache_identity: "tiny-llama-7".into(),
    })
}

fn request() -> Request {
    let docs = [
        "The lighthouse keeper logs every ship that passes the northern cape.",
        "A short note.",
        "The access code for the north gate is 4729, and it changes every spring.",
        "Rivers in the valley flood after the snow melts in the high mountains each year.",
        "Bread is baked at dawn.",
    ];
    Request {
        conversation: Default::default(),
        context: Context::Documents(docs.iter().map(|s| s.to_string()).collect()),
        query: "What is the access code for the north gate?".into(),
        system: None,
        answer_prefix: None,
    }
}

#[test]
fn infoflow_scores_from_the_sharded_probe_equal_brute_force_in_every_geometry() {
    let lm = tiny_lm();
    let model = &lm.model;
    let req = request();
    let layout = Layout::build(&lm, &req).expect("layout");
    let n_layers = model.config().n_layers;
    let (a, b) = default_score_layers(n_layers);
    let weights: Vec<f32> = (0..n_layers).map(|l| if (a..=b).contains(&l) { 1.0 } else { 0.0 }).collect();
    // Shared prefix: every chunk prefilled behind the head, at P.. (its local positions).
    let p = layout.head.len() as u32;
    let head_pos: Vec<u32> = (0..p).collect();
    let (head, _) = brute_forward(model, &layout.head, &head_pos, &[], &[]);
    let local: Vec<Vec<u32>> = layout.chunks.iter().map(|c| (p..p + c.len() as u32).collect()).collect();
    let chunks: Vec<Recorded> = layout
        .chunks
        .iter()
        .zip(&local)
        .map(|(toks, pos)| brute_forward(model, toks, pos, &[(head.clone(), head_pos.clone())], &[]).0)
        .collect();
    let order: Vec<usize> = (0..layout.chunks.len()).collect();
    let by_id: Vec<&[u32]> = local.iter().map(Vec::as_slice).collect();
    for geometry in Geometry::ALL {
        let (chunk_pos, prompt_pos) = layout.positions(geometry, &order, &by_id);
        let mut context = vec![(head.clone(), head_pos.clone())];
        for (i, &c) in order.iter().enumerate() {
            context.push((chunks[c].clone(), chunk_pos[i].clone()));
        }
        let (_, mass) = brute_forward(model, &layout.prompt, &prompt_pos, &context, &weights);
        let brute: Vec<&[f32]> = {
            let mut at = p as usize;
            order
                .iter()
                .map(|&c| {
                    let s = &mass[at..at + layout.chunks[c].len()];
                    at += s.len();
                    s
                })
                .collect()
        };
        let top = mass[p as usize..].iter().fold(0f32, |a, &b| a.max(b));
        assert!(top > 0.0, "{}: the prompt attends to the context", geometry.name());
        for ranks in [1, 3] {
            let opts = RunOptions {
                method: Method::Infoflow,
                ratio: 0.3,
                geometry,
                prefix: Some(PrefixMode::Shared),
                max_new_tokens: 1,
                keep_scores: true,
                ..RunOptions::default()
            };
            let mut world = ThreadRanks::new(lm.clone(), ranks, 1 << 30, Duration::from_secs(60)).expect("ranks");
            let r = world.run(&Job { request: req.clone(), options: opts }, &mut |_| true).expect("run");
            let scores = r.scores.expect("scores were kept");
            let mut worst = 0f32;
            for c in 0..layout.chunks.len() {
                assert_eq!(scores[c].len(), brute[c].len(), "chunk {c}: one score per token");
                worst = worst.max(flowprefill_kernels::testing::max_abs_diff(&scores[c], brute[c]) / top);
            }
            eprintln!(
                "{} on {ranks} ranks: largest score difference {worst:.2e} of the top score {top:.3}",
                geometry.name()
            );
            assert!(worst <= SCORE_TOL, "{} on {ranks} ranks: relative score difference {worst}", geometry.name());
            if ranks == 3 {
                assert!(r.owners.iter().any(|&o| o != 0), "the chunks are spread over the ranks");
            }
        }
        // --score-pool: the engine's scores are the brute-force ones averaged over a centred
        // window within each chunk (3 ranks: every rank pools its own chunks).
        let opts = RunOptions {
            method: Method::Infoflow,
            ratio: 0.3,
            geometry,
            score_pool: Some(5),
            prefix: Some(PrefixMode::Shared),
            max_new_tokens: 1,
            keep_scores: true,
            ..RunOptions::default()
        };
        let mut world = ThreadRanks::new(lm.clone(), 3, 1 << 30, Duration::from_secs(60)).expect("ranks");
        let r = world.run(&Job { request: req.clone(), options: opts }, &mut |_| true).expect("run");
        let scores = r.scores.expect("scores were kept");
        let mut worst = 0f32;
        for c in 0..layout.chunks.len() {
            let pooled: Vec<f32> = (0..brute[c].len())
                .map(|i| {
                    let w = &brute[c][i.saturating_sub(2)..(i + 3).min(brute[c].len())];
                    w.iter().sum::<f32>() / w.len() as f32
                })
                .collect();
            assert_eq!(scores[c].len(), pooled.len(), "chunk {c}: a score per token");
            worst = worst.max(flowprefill_kernels::testing::max_abs_diff(&scores[c], &pooled) / top);
        }
        assert!(worst <= SCORE_TOL, "{} pooled over 5: relative score difference {worst}", geometry.name());
    }
}
