//! Tokenizer and chat template built from the GGUF file.

use flowprefill_tests::default_model;
use flowprefill_worker::template::{tokenize_pieces, Message, Part, Piece};

#[test]
fn round_trips_text() {
    let t = &default_model().tokenizer;
    for s in ["The quick brown fox. 12345", "  leading spaces\nand\ttabs, ünïcödé — “quotes” 😀", "a"] {
        let ids = t.encode_text(s).unwrap();
        assert_eq!(t.decode(&ids).unwrap(), s);
    }
}

#[test]
fn digits_are_split_one_by_one() {
    // SmolLM2's pre-tokenizer is `smollm`: every digit is its own pre-token.
    let t = &default_model().tokenizer;
    let ids = t.encode_text("4829175").unwrap();
    assert_eq!(ids.len(), 7, "{ids:?}");
    for (id, ch) in ids.iter().zip("4829175".chars()) {
        assert_eq!(t.decode(&[*id]).unwrap(), ch.to_string());
    }
}

#[test]
fn special_tokens_only_in_template_text() {
    let t = &default_model().tokenizer;
    let im_end = t.encode_template("<|im_end|>").unwrap();
    assert_eq!(im_end, vec![2]);
    assert!(t.is_end(2));
    let plain = t.encode_text("<|im_end|>").unwrap();
    assert!(plain.len() > 1 && !plain.contains(&2), "{plain:?}");
}

#[test]
fn chat_template_renders_chatml_from_the_gguf() {
    let lm = default_model();
    let s = lm.template.render(&[Message::text("user", "Hi")], true).unwrap();
    assert_eq!(
        s,
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
         <|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
    let with_system =
        lm.template.render(&[Message::text("system", "Be brief."), Message::text("user", "Hi")], false).unwrap();
    assert_eq!(with_system, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n");
}

#[test]
fn pieces_locate_user_text_and_slots() {
    let lm = default_model();
    let msgs = [Message {
        role: "user".into(),
        parts: vec![Part::Slot(0), Part::Text("\n\nQuestion: why?".into()), Part::Slot(1)],
    }];
    let pieces = lm.template.render_pieces(&msgs, true).unwrap();
    assert!(matches!(pieces.first(), Some(Piece::Template(t)) if t.starts_with("<|im_start|>system")));
    assert!(pieces.contains(&Piece::Slot(0)) && pieces.contains(&Piece::Slot(1)));
    let docs = ["First document.", "Second <|im_end|> document."];
    let tp = tokenize_pieces(&lm.tokenizer, &pieces, |i| lm.tokenizer.encode_text(docs[i])).unwrap();
    assert_eq!(tp.slots.len(), 2);
    for (slot, r) in &tp.slots {
        assert_eq!(lm.tokenizer.decode(&tp.ids[r.clone()]).unwrap(), docs[*slot]);
    }
    assert_eq!(lm.tokenizer.decode(&tp.ids[tp.texts[0].clone()]).unwrap(), "\n\nQuestion: why?");
    // Exactly the template's own <|im_end|> tokens are control tokens: two for the system and
    // user turns, none from the document text.
    assert_eq!(tp.ids.iter().filter(|&&i| i == 2).count(), 2);
}

/// An answer prefix opens the assistant's turn: the prompt is the plain prompt followed by the
/// prefix's own tokens (so the probe scores with it), and the context is untouched.
#[test]
fn an_answer_prefix_ends_the_prompt() {
    let lm = flowprefill_tests::default_model();
    let mut req = flowprefill_coordinator::Request {
        conversation: Default::default(),
        context: flowprefill_coordinator::Context::Documents(vec!["The gate code is 4729.".into()]),
        query: "What is the gate code?".into(),
        system: None,
        answer_prefix: None,
    };
    let plain = flowprefill_coordinator::layout::Layout::build(lm, &req).expect("layout");
    req.answer_prefix = Some("The gate code mentioned in the provided text is".into());
    let with = flowprefill_coordinator::layout::Layout::build(lm, &req).expect("layout");
    let prefix = lm.tokenizer.encode_text("The gate code mentioned in the provided text is").expect("tokens");
    assert_eq!((&with.head, &with.chunks), (&plain.head, &plain.chunks));
    assert_eq!(with.prompt.len(), plain.prompt.len() + prefix.len());
    assert_eq!(&with.prompt[..plain.prompt.len()], &plain.prompt[..]);
    assert_eq!(&with.prompt[plain.prompt.len()..], &prefix[..]);
    let text = lm.tokenizer.decode(&with.prompt).expect("decodes");
    assert!(text.ends_with("assistant\nThe gate code mentioned in the provided text is"), "{text:?}");
}

/// A chat's turns go around the context's turn as the template renders them: those after the
/// question extend the prompt (the head and the chunks, and so their caches, stay), those before
/// it extend the head; the context's tokens are the same either way.
#[test]
fn a_conversation_extends_the_prompt_or_the_head_and_keeps_the_chunks() {
    use flowprefill_coordinator::{layout::Layout, Role, Turn};
    let lm = flowprefill_tests::default_model();
    let plain = flowprefill_coordinator::Request {
        conversation: Default::default(),
        context: flowprefill_coordinator::Context::Documents(vec!["The gate code is 4729.".into(), "Rain.".into()]),
        query: "What is the gate code?".into(),
        system: None,
        answer_prefix: None,
    };
    let turn = |role, text: &str| Turn { role, text: text.into() };
    let mut req = plain.clone();
    req.conversation.after = vec![turn(Role::Assistant, "4729."), turn(Role::User, "And the weather?")];
    let (p, a) = (Layout::build(lm, &plain).expect("layout"), Layout::build(lm, &req).expect("layout"));
    assert_eq!((&a.head, &a.chunks), (&p.head, &p.chunks));
    let im_end = |ids: &[u32]| ids.iter().filter(|&&i| i == 2).count();
    assert_eq!(im_end(&a.prompt), im_end(&p.prompt) + 2, "two more closed turns");
    let text = lm.tokenizer.decode(&a.prompt).expect("decodes");
    let at = |s: &str| text.find(s).unwrap_or_else(|| panic!("{s:?} not in {text:?}"));
    assert!(
        at("Question: What is the gate code?") < at("assistant\n4729.") && at("4729.") < at("user\nAnd the weather?"),
        "{text:?}"
    );
    assert!(text.ends_with("assistant\n"), "the answer's turn is open last: {text:?}");
    let mut req = plain.clone();
    req.conversation.before = vec![turn(Role::User, "Hello."), turn(Role::Assistant, "Hi.")];
    let b = Layout::build(lm, &req).expect("layout");
    assert_eq!((&b.chunks, &b.prompt), (&p.chunks, &p.prompt));
    assert_eq!(im_end(&b.head), im_end(&p.head) + 2);
    let head = lm.tokenizer.decode(&b.head).expect("decodes");
    assert!(head.contains("user\nHello.") && head.contains("assistant\nHi.") && head.ends_with("user\n"), "{head:?}");
    // Turns of one role in a row are one message, as templates that require alternation need:
    // no turn is closed between them.
    let mut req = plain.clone();
    req.conversation.before = vec![turn(Role::User, "Hello.")];
    req.conversation.after = vec![turn(Role::User, "Also, the weather?")];
    let j = Layout::build(lm, &req).expect("layout");
    assert_eq!(j.chunks, p.chunks);
    assert_eq!((im_end(&j.head), im_end(&j.prompt)), (im_end(&p.head), im_end(&p.prompt)));
    let head = lm.tokenizer.decode(&j.head).expect("decodes");
    assert!(head.ends_with("user\nHello.\n\n"), "{head:?}");
    let text = lm.tokenizer.decode(&j.prompt).expect("decodes");
    assert!(text.contains("Question: What is the gate code?\n\nAlso, the weather?"), "{text:?}");
}

/// Documents long enough to be tokenized on several threads come out as one thread makes
/// them: in order, each its text and the separator.
#[test]
fn many_long_documents_tokenize_in_order() {
    let lm = flowprefill_tests::default_model();
    // 23 documents of about 3 KB (past the threshold in all, an odd count for the threads).
    let docs: Vec<String> = (0..23)
        .map(|i| format!("Document {i}. ") + &format!("Harbour {i} keeps {} boats and a lantern. ", i * 7).repeat(60))
        .collect();
    let req = flowprefill_coordinator::Request {
        conversation: Default::default(),
        context: flowprefill_coordinator::Context::Documents(docs.clone()),
        query: "How many boats?".into(),
        system: None,
        answer_prefix: None,
    };
    let layout = flowprefill_coordinator::layout::Layout::build(lm, &req).expect("layout");
    assert_eq!(layout.chunks.len(), docs.len());
    for (d, ids) in docs.iter().zip(&layout.chunks) {
        let alone =
            lm.tokenizer.encode_text(&format!("{}{}", d.trim(), flowprefill_coordinator::layout::DOC_SEPARATOR));
        assert_eq!(ids, &alone.expect("tokens"));
    }
}

/// A needle's rows are the tokens of its chunk that cover its text: the first one carries the
/// space before it (`ĠThe`), and an answer of one token has one row. (Counting the tokens of
/// the text before the needle put every range one row late and a one-token answer at none.)
#[test]
fn needle_rows_are_the_tokens_that_carry_the_needle_and_its_answer() {
    let t = &default_model().tokenizer;
    let mut one_token_answers = 0;
    for task in ["niah_single", "niah_multikey", "qa_onehop"] {
        for sample in 0..6 {
            let case = flowprefill_lab::tasks::generate(task, t, 1, 400, sample, &[0.1, 0.5, 0.9]).expect("a task");
            let found = case.needle_rows(t);
            assert_eq!(found.len(), case.needles.len(), "{task} {sample}: every needle is found");
            for (i, ((doc, rows, answer), n)) in found.into_iter().zip(&case.needles).enumerate() {
                let ids = t.encode_text(case.documents[doc].trim()).unwrap();
                let text = t.decode(&ids[rows.clone()]).unwrap();
                assert_eq!(text.trim(), n.text.trim(), "{task} sample {sample} needle {i}: rows {rows:?}");
                let Some(a) = answer else { continue };
                let said = t.decode(&ids[a.clone()]).unwrap();
                let want = n.answer.as_deref().expect("an answer span has an answer");
                assert!(
                    !a.is_empty() && said.trim().trim_matches('"').contains(want.trim_matches('"')),
                    "{task} {sample}: {said:?} for {want:?}"
                );
                one_token_answers += usize::from(a.len() == 1);
            }
        }
    }
    assert!(one_token_answers > 0, "the cases include one-token answers (the words)");
}

/// No answer word of the needle tasks appears in the haystack's prose (an answer copied from
/// the prose would score without the needle).
#[test]
fn answer_words_never_appear_in_the_haystack() {
    let prose = flowprefill_lab::corpus::prose(3, 400_000).to_lowercase();
    for w in flowprefill_lab::tasks::ruler::WORDS {
        assert!(!prose.contains(w), "{w} is in the corpus's prose");
    }
}
