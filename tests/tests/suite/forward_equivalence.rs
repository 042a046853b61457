//! The position-explicit forward is one function: prefill of [A;B] equals prefilling A and
//! then running B at positions |A|.. over A's cache; micro-batched prefill equals one pass.

use flowprefill_tests::{default_model, max_abs_diff, TEXT};
use flowprefill_worker::generate::prefill_into;
use flowprefill_worker::kv::{KeyForm, KvCache};
use flowprefill_worker::{Cpu, Model};

/// Max |difference| of last logits, relative to their range, between equivalent paths.
const PATH_LOGIT_TOL: f32 = 1e-4;
/// Max |difference| of cached K/V values between equivalent paths, relative to max |value|.
const PATH_KV_TOL: f32 = 1e-4;

fn tokens(n: usize) -> Vec<u32> {
    let lm = default_model();
    let mut ids = Vec::new();
    while ids.len() < n {
        ids.extend(lm.tokenizer.encode_text(TEXT).expect("tokenize"));
        ids.extend(lm.tokenizer.encode_text("\n\n").expect("tokenize"));
    }
    ids.truncate(n);
    ids
}

fn empty_cache(model: &Model<Cpu>) -> KvCache<Cpu> {
    let c = model.config();
    KvCache::new(model.backend(), c.n_layers, c.kv_dim(), KeyForm::Rotated).expect("cache")
}

fn assert_rows_close(tag: &str, a: &KvCache<Cpu>, a_from: usize, b: &KvCache<Cpu>, b_from: usize, rows: usize) {
    let kvd = a.kv_dim();
    for l in 0..a.n_layers() {
        for (name, x, y) in [("k", &a.layer(l).k, &b.layer(l).k), ("v", &a.layer(l).v, &b.layer(l).v)] {
            let (x, y) = (x.to_f32(), y.to_f32());
            let xa = &x[a_from * kvd..(a_from + rows) * kvd];
            let yb = &y[b_from * kvd..(b_from + rows) * kvd];
            let scale = yb.iter().fold(0f32, |m, v| m.max(v.abs())).max(1.0);
            let err = max_abs_diff(xa, yb) / scale;
            assert!(err <= PATH_KV_TOL, "{tag}: layer {l} {name}: relative error {err}");
        }
    }
}

#[test]
fn prefill_of_ab_equals_a_then_b_over_a_cache() {
    let model = &default_model().model;
    let ids = tokens(260);
    let (a, b) = ids.split_at(170);

    let mut full = empty_cache(model);
    let full_logits = prefill_into(model, &mut full, &ids, 0, 4096).expect("full");

    let mut split = empty_cache(model);
    prefill_into(model, &mut split, a, 0, 4096).expect("A");
    let b_logits = prefill_into(model, &mut split, b, a.len() as u32, 4096).expect("B over A");

    assert_eq!(full.len(), ids.len());
    assert_eq!(split.len(), ids.len());
    assert_eq!(full.positions(), split.positions());
    let rel = max_abs_diff(&full_logits, &b_logits) / flowprefill_tests::range(&full_logits);
    assert!(rel <= PATH_LOGIT_TOL, "last logits differ: {rel}");
    assert_rows_close("B rows", &split, a.len(), &full, a.len(), b.len());
    assert_rows_close("A rows", &split, 0, &full, 0, a.len());
}

#[test]
fn micro_batched_prefill_equals_one_pass() {
    let model = &default_model().model;
    let ids = tokens(300);
    let mut one = empty_cache(model);
    let l1 = prefill_into(model, &mut one, &ids, 0, 4096).expect("one pass");
    let mut many = empty_cache(model);
    let l2 = prefill_into(model, &mut many, &ids, 0, 37).expect("batches of 37");
    let rel = max_abs_diff(&l1, &l2) / flowprefill_tests::range(&l1);
    assert!(rel <= PATH_LOGIT_TOL, "last logits differ: {rel}");
    assert_rows_close("all rows", &many, 0, &one, 0, ids.len());
}
