//! Tests of the request types and their checks (`super`).

use super::*;

#[test]
fn splits_documents_on_separator_lines() {
    let (d, q) = split_documents("first doc\nline two\n---\nsecond\n  ---  \nWhat is it?");
    assert_eq!(d, vec!["first doc\nline two".to_string(), "second".to_string()]);
    assert_eq!(q, "What is it?");
    let (d, q) = split_documents("just a question");
    assert!(d.is_empty());
    assert_eq!(q, "just a question");
    // An empty document between two separators is refused (dropped, it would renumber the
    // documents after it), naming which.
    let chat = |content: &str| {
        let body = serde_json::json!({ "messages": [{ "role": "user", "content": content }] }).to_string();
        parse::<ChatRequest>(body.as_bytes()).unwrap().into_job().map(|j| j.0)
    };
    assert!(chat("a\n---\nb\n---\nq?").is_ok());
    let e = chat("a\n---\n  \n---\nb\n---\nq?").unwrap_err();
    assert!(e.message.contains("messages[0].content`: document 2 ") && e.message.contains("empty"), "{}", e.message);
}

#[test]
fn a_coverage_budget_comes_with_its_bounds_and_never_beside_a_ratio() {
    let job = |body: &str| parse::<JobRequest>(body.as_bytes()).unwrap().into_job().map(|j| j.0);
    let o = job(r#"{"documents": ["a"], "query": "q", "coverage": 0.9, "max_ratio": 0.4}"#).unwrap().options;
    assert_eq!(o.coverage, Some(Coverage { share: 0.9, min_ratio: 0.0, max_ratio: 0.4 }));
    let o = job(r#"{"documents": ["a"], "query": "q", "method": "prophet~0.8"}"#).unwrap().options;
    assert_eq!(o.coverage, Some(Coverage::new(0.8)));
    let o = job(r#"{"documents": ["a"], "query": "q", "method": "prophet~0.8", "min_ratio": 0.1}"#).unwrap().options;
    assert_eq!(o.coverage, Some(Coverage { min_ratio: 0.1, ..Coverage::new(0.8) }));
    let o = job(r#"{"documents": ["a"], "query": "q", "method": "auto", "quality_floor": 0.05}"#).unwrap().options;
    assert!(o.method == flowprefill_coordinator::Method::Auto && o.quality_floor == Some(0.05));
    for (body, says) in [
        (r#"{"documents": ["a"], "query": "q", "min_ratio": 0.1}"#, "field `min_ratio`"),
        (r#"{"documents": ["a"], "query": "q", "coverage": 0.9, "ratio": 0.2}"#, "field `coverage`"),
        (r#"{"documents": ["a"], "query": "q", "coverage": 1.5}"#, "field `coverage`"),
        (
            r#"{"documents": ["a"], "query": "q", "coverage": 0.9, "min_ratio": 0.5, "max_ratio": 0.2}"#,
            "field `min_ratio`",
        ),
        (r#"{"documents": ["a"], "query": "q", "coverage": 0.9, "max_ratio": 2}"#, "field `max_ratio`"),
    ] {
        let e = job(body).unwrap_err();
        assert!(e.message.contains(says), "{body}: {}", e.message);
    }
}

#[test]
fn the_method_field_takes_the_command_line_spec() {
    let job = |body: &str| parse::<JobRequest>(body.as_bytes()).unwrap().into_job().map(|j| j.0);
    let o = job(r#"{"documents": ["a"], "query": "q", "method": "epic+reorder@0.3"}"#).unwrap().options;
    assert!(o.method == flowprefill_coordinator::Method::Epic && o.reorder && o.ratio == 0.3);
    let o =
        job(r#"{"documents": ["a"], "query": "q", "method": "epic", "ratio": 0.2, "reorder": true}"#).unwrap().options;
    assert!(o.method == flowprefill_coordinator::Method::Epic && o.reorder && o.ratio == 0.2);
    let e = job(r#"{"documents": ["a"], "query": "q", "method": "epic@0.3", "ratio": 0.2}"#).unwrap_err();
    assert!(e.message.contains("give the ratio once"), "{}", e.message);
    let e = job(r#"{"documents": ["a"], "query": "q", "method": "epic+reorder", "reorder": false}"#).unwrap_err();
    assert!(e.message.contains("field `reorder`"), "{}", e.message);
    let e = parse::<JobRequest>(br#"{"documents": ["a"], "query": "q", "method": "epic@2"}"#).unwrap_err();
    assert!(e.message.contains("field `method`") && e.message.contains("outside [0, 1]"), "{}", e.message);
    let o = job(r#"{"documents": ["a"], "query": "q", "evict": "snapkv", "kv_budget": 128}"#).unwrap().options;
    let snapkv = flowprefill_coordinator::EvictPolicy::Snapkv;
    assert_eq!(o.evict, Some(flowprefill_coordinator::Evict { policy: snapkv, budget: 128 }));
    let e = job(r#"{"documents": ["a"], "query": "q", "evict": "snapkv"}"#).unwrap_err();
    assert!(e.message.contains("field `kv_budget`: missing"), "{}", e.message);
    let e = job(r#"{"documents": ["a"], "query": "q", "kv_budget": 128}"#).unwrap_err();
    assert!(e.message.contains("field `evict`: missing"), "{}", e.message);
    let e = job(r#"{"documents": ["a"], "query": "q", "evict": "snapkv", "kv_budget": 0}"#).unwrap_err();
    assert!(e.message.contains("field `kv_budget`: 0 keeps nothing"), "{}", e.message);
}

#[test]
fn errors_name_the_field() {
    let e = parse::<JobRequest>(br#"{"documents": ["a"], "query": "q", "ratio": "high"}"#).unwrap_err();
    assert!(e.message.contains("field `ratio`"), "{}", e.message);
    let e = parse::<JobRequest>(br#"{"documents": ["a"], "query": "q", "ratoi": 0.1}"#).unwrap_err();
    assert!(e.message.contains("ratoi"), "{}", e.message);
    let e = parse::<JobRequest>(br#"{"documents": ["a"]}"#).unwrap_err();
    assert!(e.message.contains("query"), "{}", e.message);
    let e = parse::<JobRequest>(b"{not json").unwrap_err();
    assert!(e.message.contains("malformed JSON"), "{}", e.message);
    let r: JobRequest = parse(br#"{"documents": ["a"], "query": "q", "ratio": 1.5}"#).unwrap();
    assert!(r.into_job().unwrap_err().message.contains("field `ratio`"));
    let e = parse::<JobRequest>(br#"{"documents": ["a"], "query": "q", "method": "magic"}"#).unwrap_err();
    assert!(e.message.contains("field `method`") && e.message.contains("unknown method `magic`"), "{}", e.message);
    assert!(!e.message.contains("--"), "API errors name fields, not flags: {}", e.message);
    let e = parse::<JobRequest>(br#"{"documents": ["a"], "query": "q", "geometry": "hl_hp"}"#).unwrap_err();
    assert!(e.message.contains("field `geometry`") && e.message.contains("hl-hp"), "{}", e.message);
    let r: JobRequest = parse(br#"{"documents": ["a", " "], "query": "q"}"#).unwrap();
    let e = r.into_job().unwrap_err().message;
    assert!(e.contains("field `documents[1]`") && !e.contains("--"), "API errors name fields, not flags: {e}");
}

#[test]
fn only_json_objects_are_bodies() {
    // A JSON array would fill the struct's fields by position.
    let e = parse::<JobRequest>(br#"[["a"], null, null, "q"]"#).unwrap_err();
    assert!(e.message.contains("must be a JSON object"), "{}", e.message);
    assert!(parse::<JobRequest>(b"  ").unwrap_err().message.contains("empty"));
}

#[test]
fn chat_refuses_what_it_would_ignore() {
    let base = r#""messages": [{"role": "user", "content": "doc\n---\nq?"}]"#;
    let chat =
        |extra: &str| parse::<ChatRequest>(format!("{{{base}{extra}}}").as_bytes()).and_then(ChatRequest::into_job);
    assert!(chat("").is_ok());
    assert!(chat(r#", "n": 1, "stop": null, "logprobs": false, "user": "u1", "presence_penalty": 0"#).is_ok());
    for (extra, field) in [
        (r#", "n": 2"#, "field `n`"),
        (r#", "stop": ["\n"]"#, "field `stop`"),
        (r#", "tools": [{"type": "function"}]"#, "field `tools`"),
        (r#", "logprobs": true"#, "field `logprobs`"),
        (r#", "frequency_penalty": 0.5"#, "field `frequency_penalty`"),
        (r#", "temprature": 0.5"#, "temprature"),
    ] {
        let e = chat(extra).unwrap_err();
        assert_eq!(e.status, 400);
        assert!(e.message.contains(field), "{extra}: {}", e.message);
    }
}

#[test]
fn chat_takes_a_whole_conversation_and_refuses_parts_it_cannot_read() {
    let chat = |messages: &str| {
        parse::<ChatRequest>(format!(r#"{{"messages": {messages}}}"#).as_bytes()).and_then(ChatRequest::into_job)
    };
    // Earlier turns with the fields OpenAI clients send: the last user message with documents
    // holds the context, the tool exchange is left out.
    let history = r#"[{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "doc\n---\nfirst?", "name": "ann"},
        {"role": "assistant", "content": null, "refusal": null,
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
        {"role": "user", "content": [{"type": "text", "text": "doc two\n---\n"}, {"text": "second?"}]}]"#;
    let (job, _, _) = chat(history).expect("a conversation with tool turns");
    assert_eq!(job.request.query, "second?");
    assert_eq!(job.request.system.as_deref(), Some("Be brief."));
    // The last user message with documents holds the context; the turns before it are kept in
    // order (the tool call and the tool's answer left out: this server takes no tools).
    let user = |t: &str| Turn { role: Role::User, text: t.into() };
    let assistant = |t: &str| Turn { role: Role::Assistant, text: t.into() };
    assert_eq!(job.request.conversation.before, [user("doc\n---\nfirst?")]);
    assert!(job.request.conversation.after.is_empty());
    // A follow-up asks about the documents of an earlier turn without repeating them.
    let follow = r#"[{"role": "user", "content": "hello"}, {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "doc one\n---\ndoc two\n---\nfirst?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Yes."}]},
        {"role": "user", "content": "And the second?"}]"#;
    let (job, _, _) = chat(follow).expect("a follow-up");
    assert_eq!(job.request.query, "first?");
    assert!(matches!(&job.request.context, Context::Documents(d) if d == &["doc one", "doc two"]));
    assert_eq!(job.request.conversation.before, [user("hello"), assistant("Hi.")]);
    assert_eq!(job.request.conversation.after, [assistant("Yes."), user("And the second?")]);
    // No user message holds documents: the error says where they go; an empty follow-up is
    // refused by its index.
    let e = chat(r#"[{"role": "user", "content": "hello"}, {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "why?"}]"#)
        .unwrap_err();
    assert!(
        e.message.contains("field `messages[2].content`: put the documents") && e.message.contains("follow-up"),
        "{}",
        e.message
    );
    let e = chat(r#"[{"role": "user", "content": "d\n---\nq?"}, {"role": "assistant", "content": "a"}, {"role": "user", "content": " "}]"#)
        .unwrap_err();
    assert!(e.message.contains("field `messages[2].content`: a follow-up question is empty"), "{}", e.message);
    // `/v1/jobs` takes the same turns as `conversation`, and refuses a role it does not know.
    let body = r#"{"documents": ["d"], "query": "q?", "conversation": {"after": [{"role": "assistant", "text": "a"}, {"role": "user", "text": "and?"}]}}"#;
    let (job, _, _) = parse::<JobRequest>(body.as_bytes()).and_then(JobRequest::into_job).expect("a job with turns");
    assert_eq!(job.request.conversation.after, [assistant("a"), user("and?")]);
    let body = r#"{"documents": ["d"], "query": "q?", "conversation": {"after": [{"role": "tool", "text": "a"}]}}"#;
    assert!(parse::<JobRequest>(body.as_bytes()).unwrap_err().message.contains("tool"));
    let body = r#"{"documents": ["d"], "query": "q?", "conversation": {"after": [{"role": "assistant", "text": "a"}, {"role": "user", "text": " "}]}}"#;
    let e = parse::<JobRequest>(body.as_bytes()).and_then(JobRequest::into_job).unwrap_err();
    assert!(
        e.message.contains("conversation.after[1]") && e.message.contains("follow-up question is empty"),
        "{}",
        e.message
    );
    // Every system and developer message is kept, in order (the last alone was).
    let two = r#"[{"role": "system", "content": "You are a lawyer."}, {"role": "developer", "content": "Answer in French."},
        {"role": "user", "content": "doc\n---\nq?"}]"#;
    let (job, _, _) = chat(two).expect("two system messages");
    assert_eq!(job.request.system.as_deref(), Some("You are a lawyer.\n\nAnswer in French."));
    // A blank one is none (the template's default system prompt stays), beside others or alone.
    let blank = r#"[{"role": "system", "content": " "}, {"role": "developer", "content": "Answer in French."},
        {"role": "user", "content": "doc\n---\nq?"}]"#;
    assert_eq!(chat(blank).expect("a blank system message").0.request.system.as_deref(), Some("Answer in French."));
    let alone = r#"[{"role": "system", "content": ""}, {"role": "user", "content": "doc\n---\nq?"}]"#;
    assert_eq!(chat(alone).expect("an empty system message").0.request.system, None);
    // Sampling without a seed draws one per request; a seed repeats it.
    let sampled = |extra: &str| {
        let body =
            format!(r#"{{"messages": [{{"role": "user", "content": "doc\n---\nq?"}}], "temperature": 0.8{extra}}}"#);
        parse::<ChatRequest>(body.as_bytes()).and_then(ChatRequest::into_job).expect("a job").0.options.sampling.seed
    };
    assert_ne!(sampled(""), sampled(""), "no seed: a fresh draw each time");
    assert_eq!((sampled(r#", "seed": 7"#), sampled(r#", "seed": 7"#)), (7, 7));
    // stream_options.include_usage is read, not ignored.
    let usage = |o: &str| {
        parse::<ChatRequest>(format!(r#"{{"messages": [], "stream_options": {o}}}"#).as_bytes())
            .expect("parses")
            .include_usage()
    };
    assert!(usage(r#"{"include_usage": true}"#).expect("true") && !usage("{}").expect("absent"));
    assert!(usage(r#"{"include_usage": "yes"}"#).unwrap_err().message.contains("not true or false"));
    for (content, says) in [
        (
            r#"[{"type": "text", "text": "doc\n---\nq?"}, {"type": "image_url", "image_url": {"url": "x"}}]"#,
            "type `image_url`",
        ),
        (r#"[{"type": "text"}]"#, "without a `text` string"),
    ] {
        let e = chat(&format!(r#"[{{"role": "user", "content": {content}}}]"#)).unwrap_err();
        assert_eq!(e.status, 400);
        assert!(e.message.contains("field `messages[0].content[") && e.message.contains(says), "{}", e.message);
    }
}

#[test]
fn constant_time_compare() {
    assert!(token_matches("secret", "secret"));
    assert!(!token_matches("secreT", "secret"));
    assert!(!token_matches("secret-longer", "secret"));
    assert!(!token_matches("", "secret"));
}
