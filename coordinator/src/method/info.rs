//! The facts a method's row in the table gives ([`Info`]) and their types.

use flowprefill_kernels::Backend;
use flowprefill_worker::{Field, InputError, LoadedModel};
use std::str::FromStr;

/// What the rest of the system needs to know about a method.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Info {
    /// Lower-case name (the CLI's and the API's).
    pub name: &'static str,
    /// How the answer's context is built.
    pub build: Build,
    /// How much of the context is recomputed.
    pub recompute: Recompute,
    /// What each chunk is prefilled behind (unless the request says otherwise).
    pub prefix: PrefixMode,
    /// What scoring runs before the selection (and how deep; the memory plan's probe terms).
    pub probe: Probe,
    /// Whether the scores are masses that add up, so that a budget by coverage applies.
    pub scores_mass: bool,
    /// Whether its chunks may be reordered by importance (`+reorder`): not for the exact
    /// prefills, nor behind Star's anchor block.
    pub reorders: bool,
    /// The trained adapter the method cannot run without.
    pub adapter: Option<Adapter>,
    /// Its rows in the demo and check tables: one per reorder setting listed (none: not shown).
    pub demo: &'static [bool],
    /// Whether `bench project` models its work.
    pub projected: bool,
}

/// How a method builds the answer's context.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Build {
    /// One exact prefill of the whole sequence on one rank (`full`).
    Single,
    /// One exact prefill spread over the ranks (`ring`).
    Ring,
    /// Chunk caches, placed and partly recomputed.
    Chunked,
    /// Another method's, chosen per request before the job runs (`auto`).
    Chosen,
}

impl Build {
    /// Whether the whole sequence is prefilled exactly (no chunk caches).
    pub const fn is_exact(self) -> bool {
        matches!(self, Build::Single | Build::Ring)
    }
}

/// How much of the context a method recomputes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Recompute {
    /// Nothing: the chunk caches as they are (ratio 0).
    Nothing,
    /// Everything (exact prefill, ratio 1).
    Everything,
    /// The share the request's ratio or coverage asks for.
    Selected,
}

/// What a method's scoring runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Probe {
    /// No forward: the scores come from positions or a seeded draw (EPIC, random), or there is
    /// nothing to score.
    None,
    /// A forward of the prompt over the placed chunks measuring its attention mass on every
    /// context token, through `depth`; `rows_after_prompt` more query rows follow the prompt
    /// (LookaheadKV's).
    Attention {
        /// The layers whose attention is weighted.
        depth: Depth,
        /// Query rows run after the prompt's, whose mass is the score.
        rows_after_prompt: usize,
    },
    /// Every context token recomputed through the first layers, the value deviation measured
    /// (CacheBlend).
    Deviation,
}

/// Which layers an attention probe weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Depth {
    /// InfoFlow's scoring layers (`--score-layers`).
    ScoreLayers,
    /// Every layer (ProphetKV).
    AllLayers,
    /// The auxiliary model's last layer (CacheClip).
    AuxLastLayer,
}

/// A trained adapter a method needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Adapter {
    /// KV Packet's header and trailer rows around every chunk (`--adapter`).
    KvPacket,
    /// LookaheadKV's rows and their LoRA (`--lookahead-adapter`).
    Lookahead,
}

impl Adapter {
    /// The adapter's name in messages.
    pub const fn label(self) -> &'static str {
        match self {
            Adapter::KvPacket => "KV Packet",
            Adapter::Lookahead => "LookaheadKV",
        }
    }

    /// The flag that gives it.
    pub const fn flag(self) -> &'static str {
        match self {
            Adapter::KvPacket => "--adapter",
            Adapter::Lookahead => "--lookahead-adapter",
        }
    }

    /// The `flowprefill train` subcommand that makes it.
    pub const fn trainer(self) -> &'static str {
        match self {
            Adapter::KvPacket => "kvpacket",
            Adapter::Lookahead => "lookahead",
        }
    }

    /// Whether its rows wrap every chunk (so that chunk caches are made with it).
    pub const fn wraps_chunks(self) -> bool {
        matches!(self, Adapter::KvPacket)
    }

    /// Whether `lm` has it.
    pub fn loaded<B: Backend>(self, lm: &LoadedModel<B>) -> bool {
        match self {
            Adapter::KvPacket => lm.adapter.is_some(),
            Adapter::Lookahead => lm.model.lookahead_rows() > 0,
        }
    }

    /// The hash of the one `lm` has (runs made with another adapter are another method's).
    pub fn hash<B: Backend>(self, lm: &LoadedModel<B>) -> Option<String> {
        match self {
            Adapter::KvPacket => lm.adapter.as_ref().map(|a| a.hash.clone()),
            Adapter::Lookahead => lm.model.lookahead_hash().map(str::to_string),
        }
    }

    /// The error for `method` run on `lm` without it, saying how to get one.
    pub fn missing<B: Backend>(self, method: &str, lm: &LoadedModel<B>) -> InputError {
        InputError::new(
            Field::Method,
            format!(
                "{method} needs a {} adapter for {}: start flowprefill with {} PATH (made by `flowprefill train {}`), \
                 or choose another method (infoflow needs none)",
                self.label(),
                lm.model.config().name,
                self.flag(),
                self.trainer()
            ),
        )
    }
}

/// What a chunk is prefilled behind (methods.md section 1).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum PrefixMode {
    /// Each chunk alone from position 0 (the first chunk follows the template's head, as it does
    /// in the real sequence).
    None,
    /// Every chunk behind the template head (system prompt); one copy of it kept (CacheClip).
    Shared,
    /// Every chunk after the first behind the anchor block (template head + first chunk),
    /// dropped after prefill (Star Attention).
    Anchor,
}

impl FromStr for PrefixMode {
    type Err = InputError;
    fn from_str(s: &str) -> std::result::Result<Self, InputError> {
        match s.trim().to_ascii_lowercase().as_str() {
            "none" => Ok(Self::None),
            "shared" => Ok(Self::Shared),
            "anchor" => Ok(Self::Anchor),
            other => Err(InputError::new(
                Field::Prefix,
                format!("unknown prefix mode `{other}`; choose none, shared or anchor"),
            )),
        }
    }
}

impl PrefixMode {
    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Shared => "shared",
            Self::Anchor => "anchor",
        }
    }
}
