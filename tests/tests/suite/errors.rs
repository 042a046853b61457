//! Bad model files and bad inputs get errors that name the problem.

use flowprefill_tests::{default_model, default_model_path, temp_dir, write_tiny_gguf, TinySpec};
use flowprefill_worker::generate::{generate, prefill_into, GenerateConfig};
use flowprefill_worker::kv::{KeyForm, KvCache};
use flowprefill_worker::{Cpu, LoadedModel, Model, WorkerError};
use std::io::{Read, Write};

fn load_err(path: &std::path::Path) -> String {
    match Model::load(path, Cpu) {
        Ok(_) => panic!("{} loaded but should not", path.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn missing_and_garbage_files() {
    let dir = temp_dir("errors");
    let e = load_err(&dir.join("nope.gguf"));
    assert!(e.contains("cannot open") && e.contains("--model"), "{e}");
    let junk = dir.join("junk.gguf");
    std::fs::write(&junk, b"this is not a gguf file at all").unwrap();
    let e = load_err(&junk);
    assert!(e.contains("not a readable GGUF"), "{e}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn truncated_model_names_the_tensor() {
    let dir = temp_dir("trunc");
    let cut = dir.join("cut.gguf");
    let mut src = std::fs::File::open(default_model_path()).unwrap();
    let mut head = vec![0u8; 20 << 20];
    src.read_exact(&mut head).unwrap();
    std::fs::File::create(&cut).unwrap().write_all(&head).unwrap();
    let e = load_err(&cut);
    assert!(e.contains("tensor `") && e.contains("truncated or corrupt"), "{e}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn unsupported_architecture_and_tensor_are_named() {
    let dir = temp_dir("arch");
    let p = dir.join("mamba.gguf");
    write_tiny_gguf(&p, &TinySpec::new("mamba"));
    let e = load_err(&p);
    assert!(e.contains("architecture `mamba` is not supported"), "{e}");
    let p = dir.join("moe.gguf");
    write_tiny_gguf(
        &p,
        &TinySpec { extra: vec![("blk.0.ffn_gate_exps.weight".into(), vec![4, 96, 64])], ..TinySpec::new("llama") },
    );
    let e = load_err(&p);
    assert!(e.contains("blk.0.ffn_gate_exps.weight") && e.contains("MoE"), "{e}");
    // A tiny model has no tokenizer: loading it as a chat model says so.
    let p = dir.join("tiny.gguf");
    write_tiny_gguf(&p, &TinySpec::new("llama"));
    let e = LoadedModel::load(&p, Cpu).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("tokenizer.ggml.model") && e.contains("missing"), "{e}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn empty_prompt_and_too_long_context() {
    let lm = default_model();
    let c = lm.model.config();
    let mut cache = KvCache::new(lm.model.backend(), c.n_layers, c.kv_dim(), KeyForm::Rotated).unwrap();
    let e = prefill_into(&lm.model, &mut cache, &[], 0, 16).unwrap_err();
    assert!(e.to_string().contains("--prompt: is empty"), "{e}");
    assert_eq!(e.class(), flowprefill_worker::ErrorClass::Caller);
    let long = vec![42u32; c.context_length + 10];
    let e = generate(&lm.model, &lm.tokenizer, &long, &GenerateConfig::default(), &mut |_| true).unwrap_err();
    assert!(matches!(e, WorkerError::ContextTooLong { window: 8192, .. }), "{e}");
    assert!(e.to_string().contains("context window is 8192"), "{e}");
}

#[test]
fn text_far_beyond_the_window_is_refused_before_it_is_tokenized() {
    use flowprefill_coordinator::{admit, Context, ErrorClass, Job, Limits, Request, RunOptions};
    let lm = default_model();
    let tok = &lm.tokenizer;
    // The bound is a lower bound: ordinary text, a run of spaces, and the vocabulary's longest
    // token repeated (the text that packs the most bytes into a token) encode to no fewer.
    let longest = (0..tok.vocab_size() as u32)
        .filter(|&id| !tok.is_special(id))
        .max_by_key(|&id| tok.token(id).map_or(0, |t| t.chars().count()))
        .expect("a vocabulary");
    let longest = tok.decode(&[longest]).expect("decode");
    for text in ["The harbour of Redwater keeps its boats. ".repeat(300), " ".repeat(5000), longest.repeat(300)] {
        let ids = tok.encode_text(&text).expect("encode");
        assert!(
            tok.min_tokens(text.len()) <= ids.len(),
            "{} bytes: bound {} above {} tokens",
            text.len(),
            tok.min_tokens(text.len()),
            ids.len()
        );
    }
    // 8 MB of text: refused by the bound (`TextTooLong`), not after tokenizing
    // (`ContextTooLong`), by admission (the CLI, the service, every rank) and the chat prompt.
    let big = "lorem ipsum dolor sit amet ".repeat(300_000);
    let job = Job {
        request: Request {
            conversation: Default::default(),
            context: Context::Documents(vec![big.clone()]),
            query: "What?".into(),
            system: None,
            answer_prefix: None,
        },
        options: RunOptions::default(),
    };
    let e = admit(lm, &job, &Limits::NONE).expect_err("refused");
    assert_eq!(e.class(), ErrorClass::Caller, "{e}");
    let (msg, api) = (e.to_string(), e.api_message());
    assert!(msg.contains("at least") && msg.contains("context window is 8192 tokens"), "{msg}");
    assert!(api.contains("shorten the documents or the query"), "{api}");
    let e = lm.chat_prompt(None, &big).expect_err("refused");
    assert!(matches!(e, WorkerError::TextTooLong { window: 8192, .. }), "{e}");
    // 100 kB, inside the bound: the exact check on the tokens refuses it.
    let cut = &big[..100_000];
    let job = Job { request: Request { context: Context::Documents(vec![cut.to_string()]), ..job.request }, ..job };
    let e = admit(lm, &job, &Limits::NONE).expect_err("refused");
    assert!(e.to_string().contains("needs") && e.to_string().contains("token positions"), "{e}");
}

#[test]
fn admission_checks_the_cost_bounds_and_the_model() {
    use flowprefill_coordinator::{admit, Context, ErrorClass, Job, Limits, Request, RunOptions};
    let lm = default_model();
    let doc = "The harbour of Redwater keeps its boats in the north basin. ".repeat(4);
    let job = |docs: usize, opts: RunOptions| Job {
        request: Request {
            conversation: Default::default(),
            context: Context::Documents(vec![doc.clone(); docs]),
            query: "Which basin?".into(),
            system: None,
            answer_prefix: None,
        },
        options: opts,
    };
    let limits = Limits { max_documents: 3, max_chunks: 3, max_context_tokens: 120 };
    let ok = admit(lm, &job(1, RunOptions::default()), &limits).expect("a small job passes");
    assert_eq!(ok.chunks(), 1);
    assert!(ok.context_tokens() > 20 && ok.context_tokens() <= 120);
    let refused = |j: Job| {
        let e = admit(lm, &j, &limits).expect_err("refused");
        assert_eq!(e.class(), ErrorClass::Caller, "{e}");
        e.api_message()
    };
    assert!(refused(job(4, RunOptions::default())).contains("field `documents`: 4 documents"));
    assert!(refused(job(3, RunOptions::default())).contains("this server takes at most 120"));
    // Documents pasted into a chat turn before the context count as context: they are prefilled
    // in front of every chunk.
    let mut pasted = job(1, RunOptions::default());
    let turn = flowprefill_coordinator::Turn { role: flowprefill_coordinator::Role::User, text: doc.repeat(2) };
    pasted.request.conversation.before = vec![turn];
    assert!(refused(pasted.clone()).contains("and the system prompt and turns before it"));
    // So does a system prompt; the template's own tokens do not.
    let mut system = job(1, RunOptions::default());
    system.request.system = Some(doc.repeat(2));
    assert!(refused(system).contains("and the system prompt and turns before it"));
    let count = |j: &Job| flowprefill_coordinator::layout::Layout::build(lm, &j.request).expect("layout").head_text;
    let short = Job {
        request: Request { system: Some("Be brief.".into()), ..pasted.request.clone() },
        ..job(1, RunOptions::default())
    };
    let plain = job(1, RunOptions::default());
    assert_eq!(count(&plain), 0, "a head of template tokens only");
    let turn_tokens = lm.tokenizer.encode_text(&doc.repeat(2)).expect("tokens").len();
    assert!(count(&short) >= turn_tokens + 3 && count(&short) <= turn_tokens + 8, "{}", count(&short));
    let text = Job {
        request: Request {
            conversation: Default::default(),
            context: Context::Text { text: doc.clone(), chunk_tokens: 2 },
            query: "q?".into(),
            system: None,
            answer_prefix: None,
        },
        options: RunOptions::default(),
    };
    assert!(refused(text).contains("field `chunk_tokens`"));
    let layers = RunOptions { score_layers: Some((10, 40)), ..RunOptions::default() };
    assert!(refused(job(1, layers)).contains("field `score_layers`: 10-40: the model has layers 0-29"));
    for w in [4, 65] {
        let pool = RunOptions { score_pool: Some(w), ..RunOptions::default() };
        assert!(refused(job(1, pool)).contains(&format!("field `score_pool`: {w}: the window must be odd")));
    }
    // A scoring knob the method does not read is refused, not dropped without a word.
    use flowprefill_coordinator::{Geometry, Method};
    let knob = |method, o: RunOptions| refused(job(1, RunOptions { method, ..o }));
    let pool = RunOptions { score_pool: Some(3), ..RunOptions::default() };
    assert!(knob(Method::Epic, pool.clone()).contains("field `score_pool`: does not apply to method epic"));
    let layers = RunOptions { score_layers: Some((3, 4)), ..RunOptions::default() };
    assert!(knob(Method::Prophet, layers.clone()).contains("field `score_layers`: does not apply to method prophet"));
    let tl_tp = RunOptions { geometry: Geometry::TlTp, ..RunOptions::default() };
    assert!(knob(Method::Cacheblend, tl_tp.clone()).contains("field `geometry`: does not apply to method cacheblend"));
    // ... and accepted where it is read.
    let lm_ok = |method, o: RunOptions| admit(lm, &job(1, RunOptions { method, ..o }), &limits).is_ok();
    assert!(lm_ok(Method::Infoflow, pool) && lm_ok(Method::Prophet, tl_tp));
    assert!(lm_ok(Method::Prophet, RunOptions { reorder: true, ..layers }), "the reorder reads the scoring layers");
    // `auto` does not reorder its candidates: `auto+reorder` is refused.
    let auto_reorder = RunOptions { method: Method::Auto, reorder: true, ..RunOptions::default() };
    assert!(refused(job(1, auto_reorder)).contains("does not apply to method auto"));
    let evict =
        Some(flowprefill_coordinator::Evict { policy: flowprefill_coordinator::EvictPolicy::Snapkv, budget: 0 });
    let none_kept = RunOptions { evict, ..RunOptions::default() };
    assert!(refused(job(1, none_kept)).contains("field `kv_budget`: 0 keeps nothing of the context"));
    // Without limits only the model bounds a job.
    assert!(admit(lm, &job(4, RunOptions::default()), &Limits::NONE).is_ok());
}
