//! `flowprefill store stats | ls | verify | gc | clear`: the chunk store's disk tier for the operator.
//! Works on the folder alone (no model is loaded): entries of every model, device kind and KV
//! type that share it, told apart by their headers.

use anyhow::Result;
use flowprefill_worker::store::disk;
use std::path::PathBuf;
use std::time::SystemTime;

/// `flowprefill store ...`.
#[derive(clap::Subcommand, Debug)]
pub enum Store {
    /// Entries and bytes per model / device / KV type, the oldest and newest use.
    Stats,
    /// Every entry, newest first: size, tokens, last use, who made it.
    Ls {
        /// At most this many lines.
        #[arg(long, default_value_t = 50)]
        limit: usize,
    },
    /// Reads every entry whole and checks its checksum; deletes the damaged ones.
    Verify,
    /// Deletes the least recently used entries until at most `--max-gib` remain (the ingested
    /// documents' texts, `documents/`, are kept and not counted).
    Gc {
        /// GiB to keep.
        #[arg(long)]
        max_gib: f64,
    },
    /// Deletes every entry (and writers' temporary files); the ingested documents' texts
    /// (`documents/`) are kept: a job naming one by id prefills it again.
    Clear,
}

/// The store's folder as `--store` names it (`$FLOWPREFILL_HOME/store` when not given); `--store
/// off` is an error.
pub(crate) fn folder(common: &crate::Common) -> Result<PathBuf> {
    match common.store_flag()? {
        crate::StoreFlag::Off => {
            Err(crate::exit::usage("--store off: there is no disk tier to look at; give a folder"))
        }
        crate::StoreFlag::Dir(d) => Ok(d),
        crate::StoreFlag::Unset => Ok(flowprefill_worker::fetch::home()?.join("store")),
    }
}

fn ago(t: SystemTime) -> String {
    let s = SystemTime::now().duration_since(t).map_or(0, |d| d.as_secs());
    match s {
        0..=119 => format!("{s} s ago"),
        120..=7199 => format!("{} min ago", s / 60),
        7200..=172_799 => format!("{} h ago", s / 3600),
        _ => format!("{} days ago", s / 86_400),
    }
}

fn gib(b: u64) -> String {
    format!("{:.3} GiB", b as f64 / (1u64 << 30) as f64)
}

fn who(l: &disk::Listed) -> String {
    match &l.made_by {
        Some((_, _, _, version)) if *version != disk::FORMAT_VERSION => {
            format!("format v{version} (another build of flowprefill: never served by this one)")
        }
        Some((model, device, dtype, version)) => {
            let short: String = model.chars().take(12).collect();
            format!("model {short} {device} {dtype} v{version}")
        }
        None => "unreadable header".into(),
    }
}

/// Runs `flowprefill store ...`.
/// Says that the ingested documents' texts stay (and how to forget them), if there are any.
fn say_documents_kept(dir: &std::path::Path) -> Result<()> {
    if dir.join("documents").is_dir() {
        let docs = flowprefill_worker::store::documents::Documents::open(dir)?;
        println!(
            "  kept: {} ingested documents' texts in {} (a job naming one by id prefills it again; delete that \
             folder to forget them)",
            docs.ids()?.len(),
            docs.dir().display()
        );
    }
    Ok(())
}

pub fn run(common: &crate::Common, cmd: Store) -> Result<()> {
    let dir = folder(common)?;
    crate::ensure_usage!(
        !dir.exists() || dir.is_dir(),
        "--store {}: a file, not a folder; give the chunk store's folder",
        dir.display()
    );
    if !dir.is_dir() {
        println!("{}: no chunk store there yet (run or serve makes it)", dir.display());
        return Ok(());
    }
    match cmd {
        Store::Stats => {
            let all = disk::list(&dir, None)?;
            let total: u64 = all.iter().map(|l| l.bytes).sum();
            println!("{}: {} entries, {}", dir.display(), all.len(), gib(total));
            let mut groups: std::collections::BTreeMap<String, (usize, u64)> = Default::default();
            for l in &all {
                let g = groups.entry(who(l)).or_default();
                g.0 += 1;
                g.1 += l.bytes;
            }
            for (w, (n, b)) in groups {
                println!("  {w}: {n} entries, {}", gib(b));
            }
            if let (Some(newest), Some(oldest)) = (all.first(), all.last()) {
                println!("  last used: newest {}, oldest {}", ago(newest.used), ago(oldest.used));
            }
            if dir.join("documents").is_dir() {
                let docs = flowprefill_worker::store::documents::Documents::open(&dir)?;
                // Their caches may have gone (store clear, gc, the budget); with no entry at all
                // none is left, and a job naming one by id prefills it from its text.
                let caches = if all.is_empty() {
                    "; no cache of theirs is on disk: a job naming one prefills it again, `ingest` stores them again"
                } else {
                    ""
                };
                println!(
                    "  ingested documents: {} (texts by id in {}; name them with run --doc-id ID{caches})",
                    docs.ids()?.len(),
                    docs.dir().display()
                );
            }
        }
        Store::Ls { limit } => {
            let all = disk::list(&dir, None)?;
            for l in all.iter().take(limit) {
                let name = l.path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
                println!("{name}  {:>10} B  {:>6} tokens  {:>14}  {}", l.bytes, l.rows, ago(l.used), who(l));
            }
            if all.len() > limit {
                println!("({} older entries not shown; --limit {} lists every one)", all.len() - limit, all.len());
            }
        }
        Store::Verify => {
            let v = disk::verify(&dir)?;
            for b in &v.damaged {
                let _ = std::fs::remove_file(b);
                println!("damaged, deleted: {}", b.display());
            }
            let other = match v.other_versions.len() {
                0 => String::new(),
                n => format!(
                    ", {n} of another format version left alone (another build of flowprefill; never served here; \
                     `store gc` or `store clear` removes them)"
                ),
            };
            for u in &v.unreadable {
                println!("unreadable, left alone: {}", u.display());
            }
            let unreadable = match v.unreadable.len() {
                0 => String::new(),
                n => format!(", {n} unreadable here (permissions or an I/O error; not checked, not deleted)"),
            };
            println!("{}: {} intact, {} damaged{other}{unreadable}", dir.display(), v.ok, v.damaged.len());
        }
        Store::Gc { max_gib } => {
            crate::ensure_usage!(
                max_gib >= 0.0 && max_gib.is_finite(),
                "--max-gib {max_gib}: give a size of at least 0"
            );
            let (files, bytes) = disk::gc(&dir, (max_gib * (1u64 << 30) as f64) as u64)?;
            println!("{}: deleted {files} least recently used entries, {}", dir.display(), gib(bytes));
            say_documents_kept(&dir)?;
        }
        Store::Clear => {
            let (files, bytes) = disk::clear(&dir)?;
            println!("{}: deleted {files} files, {}", dir.display(), gib(bytes));
            say_documents_kept(&dir)?;
        }
    }
    Ok(())
}
