//! `flowprefill ingest`: documents prefilled into the chunk store before the questions come, so
//! that a later `run`, `serve` or `bench` process finds their caches on disk (InfoFlow KV's
//! offline precomputation). Each document gets an id (its text's hash, the same everywhere) and
//! its text is kept beside the caches, so that a job can name it by id (`run --doc-id`, the
//! API's `document_ids`). Under `mpirun -np N` each rank takes every N-th document into the one
//! folder; rank 0 prints the whole table.

use crate::Common;
use anyhow::{Context as _, Result};
use flowprefill_coordinator::{Engine, Ingested};
use flowprefill_worker::store::documents::Documents;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

/// Arguments of `ingest`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// A document file (one document each); repeat for several.
    #[arg(long = "doc")]
    pub docs: Vec<PathBuf>,
    /// A folder: every file in it (not its subfolders), one document each, in name order.
    #[arg(long = "dir")]
    pub dirs: Vec<PathBuf>,
    /// A JSON Lines file: one document a line, a JSON string or an object with a `text` field.
    #[arg(long)]
    pub jsonl: Vec<PathBuf>,
    /// The system message the questions will be asked with (default: the template's own): the
    /// head the first document's cache is prefilled behind. Jobs find these caches only with the
    /// same system message (`run --system S`, the API's `system` field).
    #[arg(long)]
    pub system: Option<String>,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Under mpirun: seconds rank 0 waits, once its own documents are done, for the other
    /// ranks' reports (their documents may take longer than its own); a rank silent for longer
    /// is reported lost.
    #[arg(long, default_value_t = 3600.0)]
    pub comm_timeout: f64,
}

/// One document to ingest: where it came from, its text.
struct Source {
    name: String,
    text: String,
}

/// What one document's ingestion gave (crosses ranks as JSON under mpirun).
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
struct Row {
    index: usize,
    id: String,
    source: String,
    tokens: usize,
    prefilled: usize,
    rank: usize,
    seconds: f64,
    /// Whether every cache a job needs of it (the head's too) was on disk at the end.
    #[serde(default = "yes")]
    on_disk: bool,
}

fn yes() -> bool {
    true
}

/// Every document the arguments name, in order: files, folders, JSON Lines.
fn sources(args: &Args) -> Result<Vec<Source>> {
    let mut out = Vec::new();
    for p in &args.docs {
        out.push(Source { name: p.display().to_string(), text: super::read_text("--doc", p)? });
    }
    for d in &args.dirs {
        let mut files: Vec<PathBuf> = std::fs::read_dir(d)
            .map_err(|e| crate::exit::usage(format!("--dir {}: {e}; give a readable folder", d.display())))?
            .flatten()
            .map(|e| e.path())
            // Hidden files (`.gitkeep`, an editor's swap file) are not documents.
            .filter(|p| p.is_file() && !p.file_name().is_some_and(|n| n.to_string_lossy().starts_with('.')))
            .collect();
        files.sort();
        for p in files {
            out.push(Source { name: p.display().to_string(), text: super::read_text("a file of --dir", &p)? });
        }
    }
    for f in &args.jsonl {
        for (i, line) in super::read_text("--jsonl", f)?.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let at = || format!("--jsonl {} line {}", f.display(), i + 1);
            let v: serde_json::Value =
                serde_json::from_str(line).map_err(|e| crate::exit::usage(format!("{}: not JSON ({e})", at())))?;
            let text = match &v {
                serde_json::Value::String(s) => s.clone(),
                serde_json::Value::Object(o) => match o.get("text") {
                    Some(serde_json::Value::String(s)) => s.clone(),
                    _ => return Err(crate::exit::usage(format!("{}: an object needs a string field `text`", at()))),
                },
                _ => return Err(crate::exit::usage(format!("{}: give a JSON string or {{\"text\": ...}}", at()))),
            };
            out.push(Source { name: format!("{}:{}", f.display(), i + 1), text });
        }
    }
    if out.is_empty() {
        return Err(crate::exit::Usage("no documents: give --doc FILE, --dir FOLDER or --jsonl FILE".into()).into());
    }
    if let Some(s) = out.iter().find(|s| s.text.trim().is_empty()) {
        // Named by where it came from (a file of --dir, a line of --jsonl), not as a --doc.
        return Err(crate::exit::usage(format!("{}: the document is empty; remove it or give it some text", s.name)));
    }
    Ok(out)
}

/// This process's rank and the world's size, and the communicator under mpirun.
type Ranks = (usize, usize, Option<Box<dyn flowprefill_comm::Communicator>>);

fn ranks(timeout: std::time::Duration) -> Result<Ranks> {
    // Without MPI every process would ingest every document (and say it ran on one rank).
    super::setup::refuse_mpirun_without_mpi()?;
    #[cfg(feature = "mpi")]
    if flowprefill_comm::mpi::launched_by_mpirun() {
        use flowprefill_comm::Communicator;
        let mut comm = flowprefill_comm::mpi::MpiComm::init()?;
        comm.set_timeout(timeout);
        return Ok((comm.rank(), comm.size(), Some(Box::new(comm))));
    }
    let _ = timeout;
    Ok((0, 1, None))
}

/// What a rank sends rank 0 at the end: its rows and losses, or why it stopped.
type Report = std::result::Result<(Vec<Row>, Lost), String>;

/// Runs the command.
pub fn run(common: &Common, args: Args) -> Result<()> {
    let docs = sources(&args)?;
    let Some(tier) = common.disk_tier()? else {
        return Err(crate::exit::Usage(
            "ingestion keeps the caches in the disk store, and --store is off: give --store FOLDER".into(),
        )
        .into());
    };
    let registry = Documents::open(&tier.dir)
        .with_context(|| format!("--store {}: the documents folder cannot be made", tier.dir.display()))?;
    // Housekeeping: what a killed ingestion left (a folder that cannot be read fails below).
    let _ = registry.remove_dead_writes();
    let timeout = super::comm_timeout(args.comm_timeout)?;
    let (rank, size, mut comm) = ranks(timeout)?;
    let lm = Arc::new(super::load_model(common)?);
    if let Some(c) = comm.as_mut() {
        super::setup::agree(&mut **c, &lm)?;
    }
    let engine = Engine::new(lm, flowprefill_coordinator::DEFAULT_STORE_BYTES).with_disk(Some(&tier));
    let started = Instant::now();
    let before = engine.store().disk_stats().unwrap_or_default();
    let mut rows = Vec::new();
    let mine: Vec<usize> = (0..docs.len()).filter(|i| i % size == rank).collect();
    // A document that fails stops this rank's share; the others still report theirs to rank 0.
    let mut failed: Option<anyhow::Error> = None;
    for (n, &i) in mine.iter().enumerate() {
        let d = &docs[i];
        let t = Instant::now();
        // Kept under its id only once its caches are made: a document that fails (longer than
        // the window) is not left behind as ingested.
        let done = engine
            .ingest(&d.text, args.system.as_deref(), &mut || Ok(()))
            .with_context(|| format!("ingesting {}", d.name))
            .and_then(|got| {
                let (id, _) =
                    registry.put(&d.text).with_context(|| format!("keeping {} in {}", d.name, tier.dir.display()))?;
                Ok((id, got))
            });
        let (id, Ingested { tokens, prefilled }) = match done {
            Ok(x) => x,
            Err(e) => {
                failed = Some(e);
                break;
            }
        };
        let seconds = t.elapsed().as_secs_f64();
        if !args.json {
            let what =
                if prefilled == 0 { "already stored".to_string() } else { format!("prefilled in {seconds:.2} s") };
            let who = if size > 1 { format!("rank {rank} ") } else { String::new() };
            crate::say!("{who}[{}/{}] {id} {}: {tokens} tokens, {what}", n + 1, mine.len(), d.name);
        }
        rows.push(Row { index: i, id, source: d.name.clone(), tokens, prefilled, rank, seconds, on_disk: true });
    }
    // The disk writes are queued on the store's writer: wait for them before reporting, then
    // count what did not reach the disk or did not stay there.
    if let Some(d) = engine.store().disk() {
        d.flush();
    }
    let mut lost = Lost::between(&before, &engine.store().disk_stats().unwrap_or_default());
    // What the counts cannot see: a cache this run found stored (or the head's, which every
    // document shares) deleted since for the budget. Each document's files are looked for.
    for r in &mut rows {
        r.on_disk = engine.on_disk(&docs[r.index].text, args.system.as_deref())?;
    }
    drop(engine);
    let mut errors: Vec<String> = failed.iter().map(|e| format!("rank {rank}: {e:#}")).collect();
    if let Some(c) = comm.as_mut() {
        let op = "ingest.rows";
        if rank != 0 {
            let report: Report = match &failed {
                None => Ok((rows, lost)),
                Some(e) => Err(format!("{e:#}")),
            };
            c.post(op, vec![(0, serde_json::to_vec(&report)?)], vec![])?;
            c.wait()?;
            // Rank 0 reports the failure, with what every rank stored, and exits non-zero: a
            // non-zero exit here would make mpirun abort rank 0 before it says so (a race that
            // CI lost once).
            if let Some(e) = failed {
                crate::say!("rank {rank}: {e:#} (reported to rank 0)");
            }
            return Ok(());
        }
        c.post(op, vec![], (1..size).collect())?;
        for (r, bytes) in (1..size).zip(c.wait()?) {
            match serde_json::from_slice::<Report>(&bytes).context("a rank's ingestion report")? {
                Ok((theirs, their_lost)) => {
                    rows.extend(theirs);
                    lost.unwritten += their_lost.unwritten;
                    lost.deleted += their_lost.deleted;
                }
                Err(e) => errors.push(format!("rank {r}: {e}")),
            }
        }
    }
    // What was stored stays; a failure says which documents are in (and, on one rank, which
    // were not reached).
    let list = |v: Vec<String>| if v.is_empty() { "none".to_string() } else { v.join(", ") };
    let stored = || list(rows.iter().map(|r| format!("{} ({})", r.source, r.id)).collect());
    if let Some(e) = failed.filter(|_| size == 1) {
        // The error's class, and so the exit status, is the failure's.
        let rest = docs.iter().skip(rows.len() + 1).map(|d| d.name.clone()).collect();
        return Err(e.context(format!(
            "ingestion stopped; stored before that: {}; not reached: {}",
            stored(),
            list(rest)
        )));
    }
    if !errors.is_empty() {
        anyhow::bail!(
            "ingestion stopped on {} rank(s): {}; stored before that: {}",
            errors.len(),
            errors.join("; "),
            stored()
        );
    }
    rows.sort_by_key(|r| r.index);
    let seconds = started.elapsed().as_secs_f64();
    let tokens: usize = rows.iter().map(|r| r.tokens).sum();
    let made = rows.iter().filter(|r| r.prefilled > 0).count();
    if args.json {
        let v = serde_json::json!({
            "store": tier.dir,
            "ranks": size,
            "seconds": seconds,
            "unwritten": lost.unwritten,
            "deleted": lost.deleted,
            "documents": rows.iter().map(|r| serde_json::json!({
                "id": r.id, "source": r.source, "tokens": r.tokens,
                "prefilled": r.prefilled, "rank": r.rank, "seconds": r.seconds, "on_disk": r.on_disk,
            })).collect::<Vec<_>>(),
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return kept(&lost, &rows, &tier);
    }
    let mut out = std::io::stdout().lock();
    writeln!(out, "{:<16}  {:>7}  {:<14}  source", "id", "tokens", "")?;
    for r in &rows {
        let state = match (r.on_disk, r.prefilled) {
            (false, _) => "NOT KEPT",
            (true, 0) => "already stored",
            (true, _) => "prefilled",
        };
        writeln!(out, "{:<16}  {:>7}  {:<14}  {}", r.id, r.tokens, state, r.source)?;
    }
    let distinct = rows.iter().map(|r| r.id.as_str()).collect::<std::collections::HashSet<_>>().len();
    let repeated = if distinct < rows.len() { format!(" ({distinct} distinct)") } else { String::new() };
    let system = if args.system.is_some() { " with the same --system" } else { "" };
    writeln!(
        out,
        "{} documents{repeated}, {tokens} tokens, in {} ({made} prefilled, {} already stored) in {seconds:.1} s on \
         {size} rank(s); name them by id: run --doc-id ID{system}, or \"document_ids\" in POST /v1/jobs",
        rows.len(),
        tier.dir.display(),
        rows.len() - made,
    )?;
    drop(out);
    kept(&lost, &rows, &tier)
}

/// `Ok` when every document's caches are on disk; else an error that says what was not kept,
/// which documents lack caches now, and what to change.
fn kept(lost: &Lost, rows: &[Row], tier: &flowprefill_coordinator::DiskTier) -> Result<()> {
    let missing: Vec<String> = rows.iter().filter(|r| !r.on_disk).map(|r| format!("{} ({})", r.source, r.id)).collect();
    match (lost.problem(tier), missing.is_empty()) {
        (None, true) => Ok(()),
        (Some(p), true) => anyhow::bail!("{p}"),
        (p, false) => anyhow::bail!(
            "{}not on disk now, so a job prefills them again: {} (the store deletes its least recently used \
             entries to stay within --store-gib, {:.3} GiB: raise it, then ingest again)",
            p.map_or(String::new(), |p| format!("{p}. ")),
            missing.join(", "),
            tier.bytes as f64 / (1u64 << 30) as f64
        ),
    }
}

/// Chunk caches an ingestion made that are not on disk: writes that failed (a full disk, a
/// folder not writable: the store logs the first and counts the rest), and entries of its own
/// the store deleted at once to stay within `--store-gib` (its least recently used go first,
/// so this ingestion's go only when the budget cannot hold them all).
#[derive(Clone, Copy, Debug, Default, serde::Serialize, serde::Deserialize)]
pub(crate) struct Lost {
    pub(crate) unwritten: u64,
    pub(crate) deleted: u64,
}

impl Lost {
    /// What the disk tier's counters say was lost between `before` and `after`.
    pub(crate) fn between(
        before: &flowprefill_worker::store::disk::DiskStats,
        after: &flowprefill_worker::store::disk::DiskStats,
    ) -> Self {
        let written = after.writes.saturating_sub(before.writes);
        let evicted = after.evictions.saturating_sub(before.evictions);
        // Entries the store knows now, against what this ingestion wrote: fewer, and some of
        // this ingestion's were deleted (at most as many as were evicted).
        let deleted = if evicted > 0 { written.saturating_sub(after.entries as u64).min(evicted) } else { 0 };
        Self { unwritten: after.write_failures.saturating_sub(before.write_failures), deleted }
    }

    /// What was not kept and what to change, if anything was lost.
    pub(crate) fn problem(&self, tier: &flowprefill_coordinator::DiskTier) -> Option<String> {
        let mut why = Vec::new();
        if self.unwritten > 0 {
            why.push(format!(
                "{} chunk caches could not be written to {} (the warning above says why: a full disk, a folder \
                 not writable); free space there or give another --store",
                self.unwritten,
                tier.dir.display()
            ));
        }
        if self.deleted > 0 {
            why.push(format!(
                "{} chunk caches written now were deleted at once: the store's budget (--store-gib, {:.3} GiB) \
                 cannot hold them; raise --store-gib",
                self.deleted,
                tier.bytes as f64 / (1u64 << 30) as f64
            ));
        }
        if why.is_empty() {
            return None;
        }
        Some(format!(
            "ingestion did not keep every document: {}; then ingest again (what is stored is not made twice)",
            why.join("; ")
        ))
    }
}
