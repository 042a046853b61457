//! Every method's facts in one table: what it is ([`Info`], one row each in [`Method::info`]).
//! The pipeline, the memory plan, the projection, admission, the demo and check tables and the
//! eval read a method's facts from its row, never from a list of their own. This module stands
//! below the request and the selection machinery (it imports neither); a method's policy, if it
//! selects, is a [`crate::select::Selector`] in a file of its own under `select/`, built by
//! [`crate::select::selector_for`]. Adding a method touches its policy file, this table (the
//! variant and its row) and the selector's arm.

mod info;

pub use info::{Adapter, Build, Depth, Info, PrefixMode, Probe, Recompute};

use flowprefill_worker::lookahead::LOOKAHEAD_ROWS;
use flowprefill_worker::{Field, InputError};
use std::str::FromStr;

/// How the answer's KV context is built.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum Method {
    /// Single-pass full prefill (the exact baseline).
    Full,
    /// Chunk caches concatenated, nothing recomputed (ratio 0).
    None,
    /// InfoFlow: prompt-to-context attention mass at the scoring layers.
    Infoflow,
    /// ProphetKV: query attention averaged over all layers.
    Prophet,
    /// CacheBlend: value deviation at check layer 1.
    Cacheblend,
    /// EPIC: the first tokens of each chunk.
    Epic,
    /// CacheClip: auxiliary model's last-layer query attention, 8/5 windows, shared prefix.
    Cacheclip,
    /// Uniformly random tokens (seeded).
    Random,
    /// Star Attention: anchor-block prefill, no recomputation.
    Star,
    /// Ring attention: exact full prefill spread over the ranks (zigzag).
    Ring,
    /// KV Packet: every chunk wrapped in trained header/trailer soft rows when its cache is
    /// made, caches concatenated, nothing recomputed (needs an adapter).
    Kvpacket,
    /// LookaheadKV's trained rows, run after the prompt, choose what to recompute by their
    /// attention mass at InfoFlow's scoring layers (needs a lookahead adapter).
    Lookahead,
    /// Per request, the fastest of full, ring, none and InfoFlow (at the ratio or coverage
    /// given) whose expected quality meets the floor ([`crate::auto`]); resolved before the job
    /// runs, never run itself.
    Auto,
}

/// A row of the table with the usual values: chunked, the request's ratio, no prefix, no probe,
/// no adapter, in the demo once.
const fn row(name: &'static str) -> Info {
    Info {
        name,
        build: Build::Chunked,
        recompute: Recompute::Selected,
        prefix: PrefixMode::None,
        probe: Probe::None,
        scores_mass: false,
        reorders: true,
        adapter: None,
        demo: &[false],
        projected: false,
    }
}

/// A row of an exact prefill: everything recomputed, nothing to reorder, projected.
const fn exact(name: &'static str, build: Build) -> Info {
    Info { build, recompute: Recompute::Everything, reorders: false, projected: true, ..row(name) }
}

impl Method {
    /// Every method, in table order.
    pub const ALL: [Method; 12] = [
        Method::Full,
        Method::None,
        Method::Infoflow,
        Method::Prophet,
        Method::Cacheblend,
        Method::Epic,
        Method::Cacheclip,
        Method::Random,
        Method::Star,
        Method::Ring,
        Method::Kvpacket,
        Method::Lookahead,
    ];

    /// The method's facts (the table).
    pub const fn info(self) -> Info {
        match self {
            Method::Full => exact("full", Build::Single),
            Method::None => Info { recompute: Recompute::Nothing, projected: true, ..row("none") },
            Method::Infoflow => Info {
                probe: Probe::Attention { depth: Depth::ScoreLayers, rows_after_prompt: 0 },
                scores_mass: true,
                demo: &[false, true],
                projected: true,
                ..row("infoflow")
            },
            Method::Prophet => Info {
                probe: Probe::Attention { depth: Depth::AllLayers, rows_after_prompt: 0 },
                scores_mass: true,
                ..row("prophet")
            },
            Method::Cacheblend => Info { probe: Probe::Deviation, scores_mass: true, ..row("cacheblend") },
            Method::Epic => row("epic"),
            Method::Cacheclip => Info {
                prefix: PrefixMode::Shared,
                probe: Probe::Attention { depth: Depth::AuxLastLayer, rows_after_prompt: 0 },
                scores_mass: true,
                ..row("cacheclip")
            },
            Method::Random => row("random"),
            Method::Star => {
                Info { recompute: Recompute::Nothing, prefix: PrefixMode::Anchor, reorders: false, ..row("star") }
            }
            Method::Ring => Info { demo: &[], ..exact("ring", Build::Ring) },
            Method::Kvpacket => {
                Info { recompute: Recompute::Nothing, adapter: Some(Adapter::KvPacket), ..row("kvpacket") }
            }
            Method::Lookahead => Info {
                probe: Probe::Attention { depth: Depth::ScoreLayers, rows_after_prompt: LOOKAHEAD_ROWS },
                scores_mass: true,
                adapter: Some(Adapter::Lookahead),
                ..row("lookahead")
            },
            // Its candidates do not reorder: `auto+reorder` is refused, not run without it.
            Method::Auto => Info { build: Build::Chosen, demo: &[], reorders: false, ..row("auto") },
        }
    }

    /// Lower-case name.
    pub const fn name(self) -> &'static str {
        self.info().name
    }

    /// Prefix mode the method is defined with.
    pub fn default_prefix(self) -> PrefixMode {
        self.info().prefix
    }

    /// Whether a recompute ratio applies (selectors); `none`, `star` and `kvpacket` recompute
    /// nothing, `full` and `ring` run no chunking at all, `auto` is resolved to another method.
    pub fn selects(self) -> bool {
        let i = self.info();
        i.recompute == Recompute::Selected && i.build == Build::Chunked
    }

    /// Methods that prefill the whole sequence exactly (no chunk caches).
    pub fn is_exact_prefill(self) -> bool {
        self.info().build.is_exact()
    }

    /// Whether the method's selector scores each token by a mass that adds up (attention mass,
    /// CacheBlend's value deviation), so that a budget by coverage ([`crate::request::Coverage`])
    /// applies. EPIC's and random's scores are orders, not masses.
    pub fn scores_mass(self) -> bool {
        self.info().scores_mass
    }

    /// The methods of the demo and check tables, in table order, each once per reorder setting
    /// its row lists.
    pub fn demo_table() -> Vec<(Method, bool)> {
        Method::ALL.iter().flat_map(|&m| m.info().demo.iter().map(move |&r| (m, r))).collect()
    }
}

impl FromStr for Method {
    type Err = InputError;
    fn from_str(s: &str) -> std::result::Result<Self, InputError> {
        let s = s.trim().to_ascii_lowercase();
        Method::ALL.into_iter().chain([Method::Auto]).find(|m| m.name() == s).ok_or_else(|| {
            InputError::new(
                Field::Method,
                format!(
                    "unknown method `{s}`; choose one of: {}, or auto",
                    Method::ALL.iter().map(|m| m.name()).collect::<Vec<_>>().join(", ")
                ),
            )
        })
    }
}

impl std::fmt::Display for Method {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_row_is_named_after_its_method_and_parses_back() {
        for m in Method::ALL.into_iter().chain([Method::Auto]) {
            assert_eq!(m.name().parse::<Method>().unwrap(), m);
            // A probe or a mass only where a ratio applies.
            let i = m.info();
            assert!(m.selects() || (i.probe == Probe::None && !i.scores_mass), "{m}");
            assert!(!(i.build.is_exact() && i.recompute != Recompute::Everything), "{m}");
        }
    }

    #[test]
    fn the_demo_table_is_every_method_but_ring_with_infoflow_reordered_too() {
        let names: Vec<String> =
            Method::demo_table().iter().map(|&(m, r)| format!("{m}{}", if r { "+reorder" } else { "" })).collect();
        assert_eq!(
            names.join(","),
            "full,none,infoflow,infoflow+reorder,prophet,cacheblend,epic,cacheclip,random,star,kvpacket,lookahead"
        );
    }
}
