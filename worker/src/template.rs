//! The chat template, rendered from the model's own `tokenizer.chat_template` with minijinja.
//!
//! User content is passed as numbered slots: the template is rendered with a sentinel per slot,
//! then the output is cut at the sentinels into template text and slots. Template text is
//! tokenized with special tokens recognised; slot text (documents, questions) with special
//! tokens as plain text, and its position in the token stream is known, which is how template
//! tokens are kept out of the selection candidates.

use crate::error::{Result, WorkerError};
use crate::gguf::GgufFile;
use crate::tokenizer::Tokenizer;
use minijinja::{context, Environment, Error, ErrorKind};
use std::ops::Range;

const SLOT_OPEN: char = '\u{E000}';
const SLOT_CLOSE: char = '\u{E001}';

/// A chat message whose content is a sequence of text parts and slots.
#[derive(Clone, Debug)]
pub struct Message {
    /// `system`, `user` or `assistant`.
    pub role: String,
    /// Content parts, concatenated.
    pub parts: Vec<Part>,
}

/// Part of a message's content.
#[derive(Clone, Debug)]
pub enum Part {
    /// Literal text (treated as user text when tokenized).
    Text(String),
    /// A numbered slot filled by the caller.
    Slot(usize),
}

impl Message {
    /// A message of one text part.
    pub fn text(role: &str, text: &str) -> Self {
        Self { role: role.to_string(), parts: vec![Part::Text(text.to_string())] }
    }
}

/// A rendered piece of the prompt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Piece {
    /// Text produced by the template itself (role headers, separators, special tokens).
    Template(String),
    /// User text of a message part.
    Text(String),
    /// A slot, to be filled by the caller.
    Slot(usize),
}

/// The model's chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos: String,
    eos: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").finish_non_exhaustive()
    }
}

fn raise_exception(msg: String) -> std::result::Result<String, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

impl ChatTemplate {
    /// Reads `tokenizer.chat_template` from the file.
    pub fn from_gguf(f: &GgufFile, tokenizer: &Tokenizer) -> Result<Self> {
        let src = f.get_str("tokenizer.chat_template").map_err(|_| {
            WorkerError::Template(format!(
                "{} has no tokenizer.chat_template; use a chat (instruct) model",
                f.path().display()
            ))
        })?;
        Self::new(src, tokenizer.token_str(tokenizer.bos()), tokenizer.token_str(tokenizer.eos()))
    }

    /// A template from its Jinja source, rendered as Hugging Face's `apply_chat_template` does:
    /// the newline after a block tag dropped (`trim_blocks`), the indentation before one
    /// (`lstrip_blocks`), `{% break %}` and `{% continue %}` known.
    pub fn new(source: &str, bos: String, eos: String) -> Result<Self> {
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| WorkerError::Template(format!("the template syntax: {e}")))?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_template_owned("chat".to_string(), source.to_string())
            .map_err(|e| WorkerError::Template(format!("cannot parse the model's template: {e}")))?;
        Ok(Self { env, bos, eos })
    }

    /// Renders messages to text (slots appear as sentinels).
    fn render_raw(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        let msgs: Vec<_> = messages
            .iter()
            .map(|m| {
                let content: String = m
                    .parts
                    .iter()
                    .map(|p| match p {
                        Part::Text(t) => t.clone(),
                        Part::Slot(i) => format!("{SLOT_OPEN}{i}{SLOT_CLOSE}"),
                    })
                    .collect();
                context! { role => m.role.clone(), content => content }
            })
            .collect();
        let tmpl = self.env.get_template("chat").map_err(|e| WorkerError::Template(e.to_string()))?;
        tmpl.render(context! {
            messages => msgs,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos.clone(),
            eos_token => self.eos.clone(),
        })
        .map_err(|e| WorkerError::Template(format!("rendering failed: {e}")))
    }

    /// Renders the messages to one string (for display; text parts inline).
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        self.render_raw(messages, add_generation_prompt)
    }

    /// Renders into pieces: template text, user text, slots, in order.
    pub fn render_pieces(&self, messages: &[Message], add_generation_prompt: bool) -> Result<Vec<Piece>> {
        // Text parts become slots too, so user text is never confused with template text.
        let mut texts = Vec::new();
        let mut slotted = Vec::with_capacity(messages.len());
        for m in messages {
            let mut parts = Vec::with_capacity(m.parts.len());
            for p in &m.parts {
                match p {
                    Part::Slot(i) => parts.push(Part::Slot(2 * i + 1)),
                    Part::Text(t) => {
                        parts.push(Part::Slot(2 * texts.len()));
                        texts.push(t.clone());
                    }
                }
            }
            slotted.push(Message { role: m.role.clone(), parts });
        }
        let raw = self.render_raw(&slotted, add_generation_prompt)?;
        let mut pieces = Vec::new();
        let mut rest = raw.as_str();
        while let Some(open) = rest.find(SLOT_OPEN) {
            if open > 0 {
                pieces.push(Piece::Template(rest[..open].to_string()));
            }
            let after = &rest[open + SLOT_OPEN.len_utf8()..];
            let close = after
                .find(SLOT_CLOSE)
                .ok_or_else(|| WorkerError::Template("the template altered a content placeholder".into()))?;
            let n: usize = after[..close]
                .parse()
                .map_err(|_| WorkerError::Template("the template altered a content placeholder".into()))?;
            // A placeholder the messages did not hold (a template that writes one of its own)
            // is the template's error, never an index past the texts.
            let held = slotted.iter().flat_map(|m| &m.parts).any(|p| matches!(p, Part::Slot(k) if *k == n));
            let piece = match n {
                _ if !held => None,
                _ if n.is_multiple_of(2) => texts.get(n / 2).cloned().map(Piece::Text),
                _ => Some(Piece::Slot(n / 2)),
            };
            pieces.push(piece.ok_or_else(|| {
                WorkerError::Template(format!("the template wrote a content placeholder ({n}) no message holds"))
            })?);
            rest = &after[close + SLOT_CLOSE.len_utf8()..];
        }
        if !rest.is_empty() {
            pieces.push(Piece::Template(rest.to_string()));
        }
        Ok(pieces)
    }
}

/// A tokenized prompt: ids, and which id ranges came from which slot.
#[derive(Clone, Debug, Default)]
pub struct TokenizedPrompt {
    /// All token ids.
    pub ids: Vec<u32>,
    /// `(slot, range of ids)` in order of appearance.
    pub slots: Vec<(usize, Range<usize>)>,
    /// Id ranges that came from user text parts (not slots, not template).
    pub texts: Vec<Range<usize>>,
}

/// Tokenizes rendered pieces; `fill(slot)` gives the ids of a slot.
pub fn tokenize_pieces(
    tokenizer: &Tokenizer,
    pieces: &[Piece],
    mut fill: impl FnMut(usize) -> Result<Vec<u32>>,
) -> Result<TokenizedPrompt> {
    let mut out = TokenizedPrompt::default();
    for p in pieces {
        let start = out.ids.len();
        match p {
            Piece::Template(t) => out.ids.extend(tokenizer.encode_template(t)?),
            Piece::Text(t) => {
                out.ids.extend(tokenizer.encode_text(t)?);
                out.texts.push(start..out.ids.len());
            }
            Piece::Slot(i) => {
                out.ids.extend(fill(*i)?);
                out.slots.push((*i, start..out.ids.len()));
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn template(source: &str) -> ChatTemplate {
        ChatTemplate::new(source, "<s>".into(), "</s>".into()).expect("a template")
    }

    /// Block tags on lines of their own leave no newline or indentation behind, as in Hugging
    /// Face's renderer (jinja2 with trim_blocks and lstrip_blocks); loop controls parse.
    #[test]
    fn templates_render_as_hugging_face_renders_them() {
        let t = template(
            "{% for m in messages %}\n    {% if m.role == 'skip' %}\n        {% continue %}\n    {% endif %}\n\
             <{{ m.role }}>{{ m.content }}\n    {% if m.content == 'stop' %}\n        {% break %}\n    {% endif %}\n\
             {% endfor %}\n{% if add_generation_prompt %}\n<assistant>\n{% endif %}",
        );
        let msgs = [
            Message::text("system", "be brief"),
            Message::text("skip", "x"),
            Message::text("user", "stop"),
            Message::text("user", "never"),
        ];
        assert_eq!(t.render(&msgs, true).unwrap(), "<system>be brief\n<user>stop\n<assistant>\n");
    }

    /// A placeholder the messages do not hold (a template writing one of its own) is the
    /// template's error: it indexed past the texts (a panic) or was taken as a slot.
    #[test]
    fn a_placeholder_no_message_holds_is_an_error() {
        let msgs = [Message { role: "user".into(), parts: vec![Part::Text("hi".into()), Part::Slot(0)] }];
        let ok = template("{% for m in messages %}[{{ m.content }}]{% endfor %}");
        let pieces = ok.render_pieces(&msgs, false).unwrap();
        assert_eq!(pieces[1..3], [Piece::Text("hi".into()), Piece::Slot(0)]);
        for n in [4, 5, 9] {
            let t = template(&format!(
                "{{% for m in messages %}}[{{{{ m.content }}}}]{SLOT_OPEN}{n}{SLOT_CLOSE}{{% endfor %}}"
            ));
            let e = t.render_pieces(&msgs, false).unwrap_err().to_string();
            assert!(e.contains(&format!("a content placeholder ({n}) no message holds")), "{e}");
        }
    }
}
