//! The autotuner's memory: which configuration of the tensor-core attention won on which GPU,
//! kept in a small text file in the cache folder (`$FLOWPREFILL_HOME/tune/attention.tsv`) and
//! reused by every later process on that machine. The timing itself needs a GPU
//! (`CudaBackend::tune_attention`); this half is plain data, tested on any machine.
//!
//! A decision is keyed by everything its outcome depends on: the GPU's name, the driver's CUDA
//! version, the kernels' sources and launch shapes ([`super::sources_hash`]), the head
//! dimension and the shape class ([`ShapeClass`]). A key that matches nothing (a new driver,
//! changed kernels, another GPU) finds no decision: the program runs with the default
//! configuration and tunes again, never with stale data. A line this reader cannot read is
//! skipped and counted, never fatal (the file is a cache).

use std::fmt;
use std::path::{Path, PathBuf};

/// The shapes a decision holds for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ShapeClass {
    /// Many query rows (prefill, a chunk, a recomputation): blocks enough to fill the GPU.
    Prefill,
    /// Prefill-like, but too few query rows to give every SM [`DEFAULT_BLOCKS_PER_SM`] blocks of
    /// the default configuration (SmolLM2's 2,048-token chunk on an H100: 144 blocks on 132
    /// SMs), so the keys are split as well: smaller blocks may win here and not at 8K (on the
    /// H200 of 2026-11-28, 2048 tokens at 9/3 heads and d64 ran at 100.8 TFLOP/s with the
    /// Hopper kernel's configuration 3, one consumer warpgroup, against 81.8 with the 8K
    /// decision). A probe's or a final prompt's hundred rows over a long context are narrow
    /// too; the split keeps its default aim (the decision is the configuration only), so that
    /// a decision made on one such call cannot give the others a split tuned for another shape.
    Narrow,
    /// A few query rows over many keys (decode, a probe): the keys are split over blocks, and
    /// the decision includes how many blocks per SM the split aims at.
    Decode,
}

/// Packed query rows (queries x heads of a KV group) below which a call is decode-like.
pub const DECODE_ROWS: u64 = 256;

/// Packed query rows per block of the default configuration, by which the classes count blocks.
fn default_rows(head_dim: u32) -> u32 {
    super::ops::FlashKernel::Fa2(0).rows(head_dim)
}

impl ShapeClass {
    /// The class of an attention call of `dims` on a GPU of `sm_count` SMs: fewer than
    /// [`DECODE_ROWS`] packed rows is decode-like; fewer blocks of the default configuration
    /// than [`DEFAULT_BLOCKS_PER_SM`] per SM is narrow; the rest is prefill.
    pub fn of(dims: super::ops::AttnDims, sm_count: u32) -> Self {
        let packed = dims.m as u64 * dims.group() as u64;
        let rows = default_rows(dims.head_dim) as u64;
        let blocks = packed.div_ceil(rows.max(1)) * dims.n_kv_heads.max(1) as u64;
        if packed < DECODE_ROWS {
            ShapeClass::Decode
        } else if blocks < DEFAULT_BLOCKS_PER_SM as u64 * sm_count.max(1) as u64 {
            ShapeClass::Narrow
        } else {
            ShapeClass::Prefill
        }
    }

    /// The query rows of the narrow prefill `flowprefill tune` times for `n_heads` query heads
    /// over `n_kv_heads` at head dimension `head_dim` on `sm_count` SMs: as many default blocks
    /// as SMs (half the class's bound), at least a narrow call's packed rows, at most `tokens`.
    pub fn narrow_rows(n_heads: u32, n_kv_heads: u32, head_dim: u32, sm_count: u32, tokens: u32) -> u32 {
        let group = n_heads / n_kv_heads.max(1);
        (sm_count.max(1) * default_rows(head_dim) / n_heads.max(1))
            .max((DECODE_ROWS as u32).div_ceil(group.max(1)))
            .min(tokens)
    }

    /// The class whose decision a call of this class runs while it has none of its own and is
    /// too small to make one: a narrow call takes the prefill decision (before this class
    /// existed, it was one), the others the default configuration.
    pub fn fallback(self) -> Option<Self> {
        match self {
            ShapeClass::Narrow => Some(ShapeClass::Prefill),
            ShapeClass::Prefill | ShapeClass::Decode => None,
        }
    }

    /// Whether a decision of this class includes the key split's blocks per SM.
    pub fn tunes_split(self) -> bool {
        matches!(self, ShapeClass::Decode)
    }

    fn name(self) -> &'static str {
        match self {
            ShapeClass::Prefill => "prefill",
            ShapeClass::Narrow => "narrow",
            ShapeClass::Decode => "decode",
        }
    }
}

impl fmt::Display for ShapeClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What a decision depends on.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TuneKey {
    /// The GPU's name (`NVIDIA H100 80GB HBM3`).
    pub gpu: String,
    /// The driver's CUDA version (`cuDriverGetVersion`, e.g. 12080).
    pub driver: i32,
    /// [`super::sources_hash`] of the kernels it was timed with.
    pub sources: u64,
    /// Head dimension.
    pub head_dim: u32,
    /// Shape class.
    pub class: ShapeClass,
}

/// One decision: the winning configuration, the decode split's blocks per SM, and every
/// candidate's median time (microseconds) on the shape it was timed on.
#[derive(Clone, Debug, PartialEq)]
pub struct TuneEntry {
    /// What it holds for.
    pub key: TuneKey,
    /// The winner: an index of [`super::shapes::FA2_CONFIGS`], or [`HOPPER_CONFIG`] plus an
    /// index of [`super::shapes::HOPPER_CONFIGS`].
    pub config: u8,
    /// Blocks per SM the key splits aim at (tuned for the decode class; 2 elsewhere, the
    /// untuned default).
    pub blocks_per_sm: u32,
    /// The shape timed: (query rows, keys).
    pub timed_on: (u32, u32),
    /// Each candidate: (configuration, blocks per SM, median microseconds).
    pub candidates: Vec<(u8, u32, f64)>,
}

/// The configuration number of the Hopper kernel's (`flash_hopper.cu`) default configuration
/// among the candidates: the one after flash2's ([`super::shapes::FA2_CONFIGS`]); its other
/// configurations follow ([`super::shapes::HOPPER_CONFIGS`]). Timed on compute capability 9.0
/// only, each once its self-check passed.
pub const HOPPER_CONFIG: u8 = super::shapes::FA2_CONFIGS.len() as u8;

/// One past the last configuration number.
pub const CONFIGS: u8 = HOPPER_CONFIG + super::shapes::HOPPER_CONFIGS.len() as u8;

/// The kernel a configuration number stands for.
pub fn kernel_of(config: u8) -> super::ops::FlashKernel {
    if config >= HOPPER_CONFIG {
        super::ops::FlashKernel::Hopper(config - HOPPER_CONFIG)
    } else {
        super::ops::FlashKernel::Fa2(config)
    }
}

pub use super::shapes::DEFAULT_BLOCKS_PER_SM;

/// The decisions of one machine.
#[derive(Clone, Debug, Default)]
pub struct TuneTable {
    /// Every decision read or made.
    pub entries: Vec<TuneEntry>,
    /// Lines of the file that could not be read (skipped).
    pub skipped: usize,
}

const HEADER: &str = "# flowprefill attention autotuner: gpu\tdriver\tsources\thead_dim\tclass\tconfig\t\
                      blocks_per_sm\trows\tkeys\tcandidates (config:blocks:micros,...)";

/// Where the decisions live: `$FLOWPREFILL_HOME/tune/attention.tsv` (default home
/// `~/.cache/flowprefill`).
pub fn default_path() -> PathBuf {
    crate::flowprefill_home().join("tune").join("attention.tsv")
}

impl TuneTable {
    /// Reads `path`; a missing file is an empty table.
    pub fn load(path: &Path) -> std::io::Result<Self> {
        match std::fs::read_to_string(path) {
            Ok(text) => Ok(Self::parse(&text)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Self::default()),
            Err(e) => Err(e),
        }
    }

    /// Reads the text of a table.
    pub fn parse(text: &str) -> Self {
        let mut t = Self::default();
        for line in text.lines().filter(|l| !l.trim().is_empty() && !l.starts_with('#')) {
            match parse_line(line) {
                Some(e) => t.put(e),
                None => t.skipped += 1,
            }
        }
        t
    }

    /// The decision for `key`, if one was made with exactly these conditions.
    pub fn get(&self, key: &TuneKey) -> Option<&TuneEntry> {
        self.entries.iter().find(|e| &e.key == key)
    }

    /// Adds `entry`, replacing a decision of the same key.
    pub fn put(&mut self, entry: TuneEntry) {
        self.entries.retain(|e| e.key != entry.key);
        self.entries.push(entry);
    }

    /// The table as text.
    pub fn render(&self) -> String {
        let mut out = String::from(HEADER);
        out.push('\n');
        let mut entries: Vec<&TuneEntry> = self.entries.iter().collect();
        entries.sort_by(|a, b| a.key.cmp(&b.key));
        for e in entries {
            let k = &e.key;
            let cands: Vec<String> = e.candidates.iter().map(|(c, b, us)| format!("{c}:{b}:{us}")).collect();
            out.push_str(&format!(
                "{}\t{}\t{:016x}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\n",
                k.gpu.replace(['\t', '\n'], " "),
                k.driver,
                k.sources,
                k.head_dim,
                k.class,
                e.config,
                e.blocks_per_sm,
                e.timed_on.0,
                e.timed_on.1,
                cands.join(",")
            ));
        }
        out
    }

    /// Writes the table to `path` whole: a temporary file in the same folder, then a rename
    /// (a reader never sees half a table; two processes that tune at once leave one table).
    pub fn save(&self, path: &Path) -> std::io::Result<()> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        // This process's and thread's: thread ranks tune at once in one process.
        let tmp = path.with_extension(format!("tsv.{}", super::temporary_suffix()));
        std::fs::write(&tmp, self.render())?;
        std::fs::rename(&tmp, path)
    }
}

fn parse_line(line: &str) -> Option<TuneEntry> {
    let f: Vec<&str> = line.split('\t').collect();
    let [gpu, driver, sources, head_dim, class, config, blocks, rows, keys, cands] = f.as_slice() else {
        return None;
    };
    let class = match *class {
        "prefill" => ShapeClass::Prefill,
        "narrow" => ShapeClass::Narrow,
        "decode" => ShapeClass::Decode,
        _ => return None,
    };
    let config: u8 = config.parse().ok()?;
    if config >= CONFIGS {
        return None;
    }
    let candidates = cands
        .split(',')
        .filter(|c| !c.is_empty())
        .map(|c| {
            let mut p = c.split(':');
            Some((p.next()?.parse().ok()?, p.next()?.parse().ok()?, p.next()?.parse().ok()?))
        })
        .collect::<Option<Vec<_>>>()?;
    Some(TuneEntry {
        key: TuneKey {
            gpu: gpu.to_string(),
            driver: driver.parse().ok()?,
            sources: u64::from_str_radix(sources, 16).ok()?,
            head_dim: head_dim.parse().ok()?,
            class,
        },
        config,
        blocks_per_sm: blocks.parse().ok().filter(|&b: &u32| (1..=64).contains(&b))?,
        timed_on: (rows.parse().ok()?, keys.parse().ok()?),
        candidates,
    })
}

/// Lines describing the decisions on file for the GPU named `gpu` (what `flowprefill devices`
/// prints): each with its configuration and blocks per SM, and whether it holds now (the
/// driver `driver` and the kernels `sources` it was made with) or is stale (re-tuned on next
/// use).
pub fn describe(table: &TuneTable, gpu: &str, driver: i32, sources: u64) -> Vec<String> {
    let mut out: Vec<String> = table
        .entries
        .iter()
        .filter(|e| e.key.gpu == gpu)
        .map(|e| {
            let k = &e.key;
            let state = if k.driver != driver {
                format!("stale: made with driver API {}", k.driver)
            } else if k.sources != sources {
                "stale: made with other kernels".to_string()
            } else {
                "current".to_string()
            };
            let speed = e
                .candidates
                .iter()
                .find(|c| (c.0, c.1) == (e.config, e.blocks_per_sm))
                .map_or(String::new(), |c| format!(", {:.1} us", c.2));
            format!(
                "attention d{} {}: configuration {} ({}), {} block(s) per SM for key splits; timed on {} x {}{speed} ({state})",
                k.head_dim,
                k.class,
                e.config,
                describe_config(e.config as usize, k.head_dim),
                e.blocks_per_sm,
                e.timed_on.0,
                e.timed_on.1,
            )
        })
        .collect();
    out.sort();
    out
}

/// A configuration's shape at head dimension `d`, in words.
pub fn describe_config(config: usize, d: u32) -> String {
    if let Some(h) = config.checked_sub(HOPPER_CONFIG as usize).and_then(|c| super::shapes::HOPPER_CONFIGS.get(c)) {
        return format!(
            "flash_hopper: {} consumer warpgroup(s) x 64 rows, {} keys a tile, {} stages, ping-pong {}, {}/16 of \
             exp2 by polynomial, {}wgmma + TMA",
            h.consumers_at(d),
            super::shapes::HOPPER_KEYS,
            h.stages,
            if h.pingpong { "on" } else { "off" },
            h.poly,
            if h.persistent { "persistent (a block per SM), " } else { "" }
        );
    }
    let Some(c) = super::shapes::FA2_CONFIGS.get(config) else { return "unknown".into() };
    let s = c.at(d);
    format!(
        "{} warps x {} rows, {} keys a tile, Q {}",
        s.warps,
        16 * s.wm,
        s.keys,
        if s.q_in_regs { "in registers" } else { "from shared memory" }
    )
}

/// The winner of timed candidates `(configuration, blocks per SM, median microseconds)`: the
/// fastest; among candidates within 1% of it, the default configuration (0) and then the
/// default blocks per SM, so that noise never moves the choice off the default.
pub fn winner(candidates: &[(u8, u32, f64)]) -> Option<(u8, u32)> {
    let best = candidates.iter().map(|c| c.2).filter(|t| t.is_finite() && *t > 0.0).fold(f64::INFINITY, f64::min);
    if !best.is_finite() {
        return None;
    }
    candidates
        .iter()
        .filter(|c| c.2.is_finite() && c.2 <= best * 1.01)
        .min_by_key(|c| (c.0 != 0, c.1 != DEFAULT_BLOCKS_PER_SM, (c.2 * 1000.0) as u64))
        .map(|c| (c.0, c.1))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(driver: i32, d: u32, class: ShapeClass) -> TuneKey {
        TuneKey { gpu: "NVIDIA H100 80GB HBM3".into(), driver, sources: 0xabc, head_dim: d, class }
    }

    fn entry(driver: i32, d: u32, class: ShapeClass, config: u8) -> TuneEntry {
        TuneEntry {
            key: key(driver, d, class),
            config,
            blocks_per_sm: 4,
            timed_on: (8192, 8192),
            candidates: vec![(0, 2, 812.5), (config, 4, 700.25)],
        }
    }

    #[test]
    fn a_table_round_trips_and_a_new_driver_finds_nothing() {
        let dir = std::env::temp_dir().join(format!("fp-tune-{}", std::process::id()));
        let path = dir.join("attention.tsv");
        assert!(TuneTable::load(&path).unwrap().entries.is_empty(), "no file: no decisions");
        let mut t = TuneTable::default();
        t.put(entry(12080, 128, ShapeClass::Prefill, 2));
        t.put(entry(12080, 64, ShapeClass::Decode, 1));
        t.put(entry(12080, 128, ShapeClass::Prefill, 3)); // replaces the first
        t.save(&path).unwrap();
        let back = TuneTable::load(&path).unwrap();
        assert_eq!(back.entries.len(), 2);
        assert_eq!(back.skipped, 0);
        assert_eq!(back.get(&key(12080, 128, ShapeClass::Prefill)).map(|e| e.config), Some(3));
        assert_eq!(back.get(&key(12080, 64, ShapeClass::Decode)), Some(&entry(12080, 64, ShapeClass::Decode, 1)));
        // A new driver, other kernels, another dimension or class: stale, not used.
        assert!(back.get(&key(12090, 128, ShapeClass::Prefill)).is_none());
        assert!(back.get(&TuneKey { sources: 0xabd, ..key(12080, 128, ShapeClass::Prefill) }).is_none());
        assert!(back.get(&key(12080, 128, ShapeClass::Decode)).is_none());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn devices_says_which_decisions_hold() {
        let mut t = TuneTable::default();
        t.put(entry(12080, 128, ShapeClass::Prefill, 2));
        t.put(entry(12070, 64, ShapeClass::Decode, 1));
        let lines = describe(&t, "NVIDIA H100 80GB HBM3", 12080, 0xabc);
        assert_eq!(lines.len(), 2, "{lines:?}");
        assert!(lines[1].contains("d64 decode: configuration 1") && lines[1].contains("stale: made with driver"));
        assert!(lines[0].contains("d128 prefill: configuration 2") && lines[0].ends_with("(current)"));
        assert!(
            lines[0].contains("700.2 us") && lines[0].contains("4 warps x 16 rows, 64 keys a tile, Q in registers")
        );
        assert!(describe(&t, "NVIDIA A100", 12080, 0xabc).is_empty());
        assert!(describe(&t, "NVIDIA H100 80GB HBM3", 12080, 0xabd)[0].contains("stale: made with other kernels"));
    }

    #[test]
    fn unreadable_lines_are_skipped_and_counted() {
        let good = TuneTable { entries: vec![entry(12080, 64, ShapeClass::Prefill, 1)], skipped: 0 }.render();
        let text = format!(
            "{good}garbage\nH100\t12080\tabc\t64\tprefill\t99\t2\t1\t1\t0:2:1.0\n\
             H100\t12080\tabc\t64\tsideways\t0\t2\t1\t1\t0:2:1.0\nH100\t12080\tabc\t64\tprefill\t0\t0\t1\t1\t\n"
        );
        let t = TuneTable::parse(&text);
        assert_eq!(t.entries.len(), 1);
        assert_eq!(t.skipped, 4, "garbage, a configuration that does not exist, a bad class, 0 blocks per SM");
    }

    #[test]
    fn the_winner_is_the_fastest_and_noise_keeps_the_default() {
        assert_eq!(winner(&[(0, 2, 100.0), (1, 2, 80.0), (2, 2, 90.0)]), Some((1, 2)));
        assert_eq!(winner(&[(0, 2, 100.0), (1, 2, 99.5)]), Some((0, 2)), "within 1%: the default");
        assert_eq!(winner(&[(0, 1, 99.8), (0, 2, 100.0), (0, 4, 90.0)]), Some((0, 4)));
        assert_eq!(winner(&[(0, 1, 99.8), (0, 2, 100.0)]), Some((0, 2)));
        assert_eq!(winner(&[(0, 2, f64::NAN), (1, 2, f64::INFINITY)]), None, "nothing timed");
        assert_eq!(winner(&[]), None);
    }

    #[test]
    fn a_call_too_small_to_fill_the_gpu_is_narrow() {
        use crate::gpu::ops::AttnDims;
        let d =
            |m: u32, n_heads: u32, n_kv_heads: u32, head_dim: u32| AttnDims { m, n: m, n_heads, n_kv_heads, head_dim };
        let h100 = 132;
        // The fifth run's shapes (docs/gpu.md): 2048 x 9/3 at d64 is 48 x 3 = 144 blocks of 128
        // packed rows, under 2 x 132; the others fill the GPU twice.
        assert_eq!(ShapeClass::of(d(2048, 9, 3, 64), h100), ShapeClass::Narrow);
        assert_eq!(ShapeClass::of(d(4096, 14, 2, 64), h100), ShapeClass::Prefill);
        assert_eq!(ShapeClass::of(d(2048, 32, 8, 128), h100), ShapeClass::Prefill);
        assert_eq!(ShapeClass::of(d(8192, 32, 8, 128), h100), ShapeClass::Prefill);
        // The bound on 132 SMs is 264 blocks: 33 x 8 KV heads is prefill, 32 x 8 narrow.
        assert_eq!(ShapeClass::of(d(33 * 128, 8, 8, 64), h100), ShapeClass::Prefill);
        assert_eq!(ShapeClass::of(d(33 * 128 - 1, 8, 8, 64), h100), ShapeClass::Prefill, "a partial block counts");
        assert_eq!(ShapeClass::of(d(32 * 128, 8, 8, 64), h100), ShapeClass::Narrow);
        // Packed rows (queries x group) under 256: decode-like, whatever the GPU.
        assert_eq!(ShapeClass::of(d(85, 9, 3, 64), h100), ShapeClass::Decode);
        assert_eq!(ShapeClass::of(d(86, 9, 3, 64), h100), ShapeClass::Narrow);
        assert_eq!(ShapeClass::of(d(1, 32, 8, 128), 1), ShapeClass::Decode);
        // A smaller GPU fills sooner.
        assert_eq!(ShapeClass::of(d(2048, 9, 3, 64), 16), ShapeClass::Prefill);
        // What `flowprefill tune` times for the class (docs/gpu.md's figures), and it is narrow.
        assert_eq!(ShapeClass::narrow_rows(9, 3, 64, h100, 8192), 1877);
        assert_eq!(ShapeClass::narrow_rows(32, 8, 128, h100, 8192), 528);
        assert_eq!(ShapeClass::narrow_rows(32, 8, 128, h100, 300), 300, "at most the tokens");
        assert_eq!(ShapeClass::narrow_rows(32, 8, 128, 1, 8192), 64, "at least 256 packed rows");
        for (h, kv, dim) in [(9, 3, 64), (32, 8, 128), (14, 2, 64)] {
            let m = ShapeClass::narrow_rows(h, kv, dim, h100, 8192);
            assert_eq!(ShapeClass::of(d(m, h, kv, dim), h100), ShapeClass::Narrow, "{h}/{kv} d{dim}: {m}");
        }
        assert_eq!(ShapeClass::Narrow.fallback(), Some(ShapeClass::Prefill));
        assert_eq!(ShapeClass::Prefill.fallback(), None);
        assert_eq!(ShapeClass::Decode.fallback(), None);
        assert!(ShapeClass::Decode.tunes_split());
        assert!(!ShapeClass::Prefill.tunes_split() && !ShapeClass::Narrow.tunes_split());
        // The class goes to the file and back.
        let t = TuneTable { entries: vec![entry(12080, 64, ShapeClass::Narrow, 11)], skipped: 0 };
        let back = TuneTable::parse(&t.render());
        assert_eq!(back.entries, t.entries);
        assert!(t.render().contains("\tnarrow\t11\t4\t"), "{}", t.render());
    }

    #[test]
    fn the_hopper_kernel_is_the_configuration_after_flash2s() {
        use crate::gpu::ops::FlashKernel;
        assert_eq!(kernel_of(HOPPER_CONFIG), FlashKernel::Hopper(0));
        assert_eq!(kernel_of(HOPPER_CONFIG + 3), FlashKernel::Hopper(3));
        assert_eq!(kernel_of(1), FlashKernel::Fa2(1));
        // Every candidate number names a distinct kernel, and they are every kernel but the
        // reference.
        let named: Vec<FlashKernel> = (0..CONFIGS).map(kernel_of).collect();
        let want: Vec<FlashKernel> =
            FlashKernel::every().into_iter().filter(|k| *k != FlashKernel::Reference).collect();
        assert_eq!(named, want);
        assert!(describe_config(HOPPER_CONFIG as usize + 3, 128).contains("1 consumer warpgroup(s)"));
        assert!(describe_config(HOPPER_CONFIG as usize, 128).starts_with("flash_hopper"));
        assert!(describe_config(HOPPER_CONFIG as usize + 4, 64).contains("4/16 of exp2 by polynomial"));
        assert!(describe_config(HOPPER_CONFIG as usize + 6, 64).starts_with("flash_hopper: 3 consumer"));
        assert!(describe_config(HOPPER_CONFIG as usize + 6, 128).starts_with("flash_hopper: 2 consumer"));
        let mut t = TuneTable::default();
        t.put(entry(12080, 128, ShapeClass::Prefill, HOPPER_CONFIG));
        let back = TuneTable::parse(&t.render());
        assert_eq!(back.skipped, 0);
        assert_eq!(back.get(&key(12080, 128, ShapeClass::Prefill)).map(|e| e.config), Some(HOPPER_CONFIG));
        // Within 1% of flash2's default, flash2 stays.
        assert_eq!(winner(&[(0, 2, 100.0), (HOPPER_CONFIG, 2, 99.5)]), Some((0, 2)));
        assert_eq!(winner(&[(0, 2, 100.0), (HOPPER_CONFIG, 2, 80.0)]), Some((HOPPER_CONFIG, 2)));
    }
}
