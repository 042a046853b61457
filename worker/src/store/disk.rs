//! The chunk store's disk tier: chunk caches in a folder, one file per entry, that outlive the
//! process and are shared by every process on the machine (MPI ranks, a `serve` and a `run`).
//!
//! **What an entry depends on.** A file's name is a hash of the chunk's key ([`ChunkKey`]: the
//! head it was prefilled behind, its start position, its tokens, the adapter) and of the
//! [`Scope`]: the model's fingerprint, the KV element type and the device kind (a GPU's cache
//! and the CPU's differ in their last bits). The same fields are in the file's header and are
//! checked on every read, with the format version: a file of another model, type or version is
//! never served.
//!
//! **Crash safety.** A write goes to a temporary file of its own name (process id and a
//! counter), is flushed and fsynced, renamed over the entry's name (atomic), and the folder is
//! fsynced. A reader therefore sees a whole file or none. Every file ends with a CRC-32 of its
//! header and payload, checked before an entry is served: a truncated or damaged file is
//! deleted and counted (logged once), never served. Temporary files left by a killed writer
//! are removed at the next open once they are older than a minute (a younger one may be a live
//! writer's).
//!
//! **Several processes, no lock.** Files are immutable once renamed and every writer renames
//! its own temporary file, so the folder needs no lock and has no index to lose: the listing
//! is the index. Two writers of one entry write the same bytes (the same chunk on the same
//! kind of device); the last rename wins. A reader whose file is evicted under it keeps reading
//! its open file (POSIX unlink semantics). Each process bounds the bytes it knows of (its
//! listing at open, every entry of its scope counted, plus what it wrote or read since) to its
//! budget by deleting the least recently used (file modification time, refreshed on each
//! read): a folder that earlier runs filled is trimmed at the next open. The stores of one
//! folder and scope within a process (thread ranks, a service's ingester) share one listing and
//! one budget; temporary names carry a counter of the whole process.
//!
//! **A full disk** (or any write error) is a warning and a skipped write, never a failed job.

mod format;

use super::ChunkKey;
use crate::kv::KeyForm;
use flowprefill_kernels::{DType, HostBuf};
pub use format::FORMAT_VERSION;
use format::{check_whole, dtype_code, dtype_name, encode_header, le_bytes, read_header};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::fs::{self, File};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime};

/// Entry files end in this.
pub const EXT: &str = "fpkv";
/// Temporary files of writers end in this.
const TMP: &str = "fpkv-tmp";
/// Whether `name` is an entry file's: 40 lowercase hex digits and `.fpkv` (what
/// [`DiskStore`] names them). A file that only ends in the same letters (`notes-fpkv`,
/// `backup.fpkv`) is someone else's: never listed, judged or deleted.
pub fn is_entry_name(name: &str) -> bool {
    name.strip_suffix(EXT)
        .and_then(|s| s.strip_suffix('.'))
        .is_some_and(|stem| stem.len() == 40 && stem.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')))
}

/// Whether `name` is a writer's temporary file: `.ENTRY.PID.N.fpkv-tmp`.
fn is_tmp_name(name: &str) -> bool {
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    let Some(inner) = name.strip_prefix('.').and_then(|s| s.strip_suffix(TMP)).and_then(|s| s.strip_suffix('.')) else {
        return false;
    };
    let mut parts = inner.rsplitn(3, '.');
    match (parts.next(), parts.next(), parts.next()) {
        (Some(n), Some(pid), Some(entry)) => digits(n) && digits(pid) && is_entry_name(entry),
        _ => false,
    }
}

/// A temporary file older than this is a dead writer's.
const STALE_TMP: Duration = Duration::from_secs(60);
/// How often a use served from memory refreshes an entry's last use ([`DiskStore::touch`]).
pub const TOUCH_EVERY: Duration = Duration::from_secs(60);

/// What an entry's bytes depend on besides its chunk key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Scope {
    /// The model's fingerprint (`LoadedModel::fingerprint`).
    pub model: String,
    /// The KV element type.
    pub dtype: DType,
    /// The kind of device that computed it (`cpu`, `cuda`).
    pub device: String,
}

/// One entry's content: a chunk cache on the host.
#[derive(Clone, Debug, PartialEq)]
pub struct Record {
    /// Pre-RoPE or rotated keys.
    pub form: KeyForm,
    /// Width of one row of K (and of V).
    pub kv_dim: usize,
    /// The positions its rows were computed at.
    pub positions: Vec<u32>,
    /// Per layer: keys, values (`rows x kv_dim` of the scope's element type).
    pub layers: Vec<(HostBuf, HostBuf)>,
}

impl Record {
    /// Bytes of K and V.
    pub fn kv_bytes(&self) -> usize {
        self.layers.iter().map(|(k, v)| (k.len() + v.len()) * k.dtype().size()).sum()
    }
}

/// Counters of the disk tier (this process's view).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct DiskStats {
    /// Entries of this scope known to this process.
    pub entries: usize,
    /// Their bytes on disk.
    pub bytes: u64,
    /// Reads that served an entry.
    pub hits: u64,
    /// Reads that found none.
    pub misses: u64,
    /// Entries written.
    pub writes: u64,
    /// Writes skipped after an error (a full disk): the job went on.
    pub write_failures: u64,
    /// Files dropped as damaged: truncated, a wrong checksum, an unreadable header.
    pub corrupt: u64,
    /// Files of another model, element type, device kind or format version (left alone).
    pub foreign: u64,
    /// Entries deleted for the budget.
    pub evictions: u64,
    /// Temporary files of dead writers removed.
    pub stale_tmp: u64,
}

/// One entry in a listing.
#[derive(Clone, Debug, PartialEq)]
pub struct Listed {
    /// The file.
    pub path: PathBuf,
    /// Its size.
    pub bytes: u64,
    /// Last written or read.
    pub used: SystemTime,
    /// Rows (tokens) of the chunk.
    pub rows: u32,
    /// Whether it belongs to this store's scope (else another model, type, device or version).
    pub ours: bool,
    /// Its header's model fingerprint, device kind, element type and format version (`None`:
    /// no readable header).
    pub made_by: Option<(String, String, &'static str, u32)>,
}

struct State {
    /// Our entries: file name -> (bytes, last use).
    index: HashMap<String, (u64, SystemTime)>,
    stats: DiskStats,
    warned_write: bool,
    warned_corrupt: bool,
    /// Damaged files and failed writes already handed out by [`DiskStore::faults_since_report`].
    reported: (u64, u64),
}

/// The disk tier of one process: reads on the caller's thread, writes on a writer thread of
/// its own (a bounded queue: a job never waits for an fsync unless the queue is full); the
/// queue is drained when the store is dropped, so a process that ends normally leaves every
/// entry it made.
pub struct DiskStore {
    core: Arc<Core>,
    queue: Mutex<Option<SyncSender<Msg>>>,
    writer: Mutex<Option<JoinHandle<()>>>,
}

enum Msg {
    Put(ChunkKey, Record),
    Flush(SyncSender<()>),
}

/// Entries a writer thread may have queued (each a chunk cache held in host memory).
const QUEUE: usize = 4;

struct Core {
    dir: PathBuf,
    scope: Scope,
    budget: u64,
    state: Mutex<State>,
}

/// Numbers the temporary files of every store of this process: thread ranks open a store each
/// over one folder and write the same entries (the shared head first), so a counter per store
/// gave them one temporary name, and one rank's file was truncated under another's.
static TMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// The stores open in this process, by folder and scope: a second open of the same (thread
/// ranks, a service's ingester) shares the first's listing, byte count and budget, so the
/// process keeps its budget once, not once per rank.
static OPEN: Mutex<Vec<(PathBuf, Scope, std::sync::Weak<Core>)>> = Mutex::new(Vec::new());

/// The core of the store of `dir` and `scope` in this process, opened now if none is.
fn shared_core(dir: &Path, scope: Scope, budget: u64) -> io::Result<Arc<Core>> {
    fs::create_dir_all(dir)?;
    let at = fs::canonicalize(dir)?;
    let mut open = OPEN.lock().unwrap_or_else(|p| p.into_inner());
    open.retain(|(_, _, w)| w.strong_count() > 0);
    if let Some(core) = open.iter().find(|(d, s, _)| *d == at && *s == scope).and_then(|(_, _, w)| w.upgrade()) {
        return Ok(core);
    }
    let core = Arc::new(Core::open(dir, scope.clone(), budget)?);
    open.push((at, scope, Arc::downgrade(&core)));
    Ok(core)
}

impl std::fmt::Debug for DiskStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DiskStore").field("dir", &self.core.dir).field("budget", &self.core.budget).finish()
    }
}

impl DiskStore {
    /// Opens (creating) the folder `dir` for entries of `scope`, keeping at most `budget`
    /// bytes of them: lists what is there (headers and sizes: a truncated file is dropped),
    /// removes dead writers' temporary files, trims to the budget, and starts the writer.
    /// Within one process, the stores of one folder and scope share one listing and budget
    /// (the first open's); each has its own writer.
    pub fn open(dir: &Path, scope: Scope, budget: u64) -> io::Result<Self> {
        let core = shared_core(dir, scope, budget)?;
        let (tx, rx) = sync_channel::<Msg>(QUEUE);
        let c = core.clone();
        let writer = std::thread::Builder::new().name("store-writer".into()).spawn(move || {
            for msg in rx {
                match msg {
                    Msg::Put(key, rec) => c.put(&key, &rec),
                    Msg::Flush(done) => {
                        let _ = done.send(());
                    }
                }
            }
        })?;
        Ok(Self { core, queue: Mutex::new(Some(tx)), writer: Mutex::new(Some(writer)) })
    }

    /// The folder.
    pub fn dir(&self) -> &Path {
        &self.core.dir
    }

    /// The byte budget.
    pub fn budget(&self) -> u64 {
        self.core.budget
    }

    /// The entry of `key`, read whole and verified (header, length, checksum) before it is
    /// returned; a damaged file is deleted and counted. An entry still in the write queue is
    /// not found (the RAM tier above holds it).
    pub fn get(&self, key: &ChunkKey) -> Option<Record> {
        self.core.get(key)
    }

    /// A use of `key` served from memory: its last use, what eviction orders by, moves to now
    /// in this process's index and in the file's modification time that other processes list,
    /// at most once a [`TOUCH_EVERY`] per entry (a file written once, read from RAM at every job
    /// after, was the oldest on disk and the first a trim deleted). Nothing for an entry this
    /// process does not know of.
    pub fn touch(&self, key: &ChunkKey) {
        self.core.touch(key)
    }

    /// The file that holds (or would hold) the entry of `key`.
    pub fn path_of(&self, key: &ChunkKey) -> PathBuf {
        self.core.dir.join(self.core.name_of(key))
    }

    /// Whether a file for `key` is in the folder (not read nor checked: what a placement
    /// decision needs; [`DiskStore::get`] verifies before serving).
    pub fn holds(&self, key: &ChunkKey) -> bool {
        self.core.dir.join(self.core.name_of(key)).is_file()
    }

    /// Queues the entry of `key` for the writer (temporary file, fsync, rename, folder fsync,
    /// then a trim to the budget); waits only while the queue is full. A failed write is a
    /// warning, logged once, and a skipped write.
    pub fn put(&self, key: &ChunkKey, rec: Record) {
        let q = self.queue.lock().unwrap_or_else(|p| p.into_inner()).clone();
        match q {
            Some(tx) => {
                if let Err(std::sync::mpsc::SendError(Msg::Put(k, r))) = tx.send(Msg::Put(*key, rec)) {
                    self.core.put(&k, &r);
                }
            }
            None => self.core.put(key, &rec),
        }
    }

    /// Waits until every queued write is done.
    pub fn flush(&self) {
        let q = self.queue.lock().unwrap_or_else(|p| p.into_inner()).clone();
        if let Some(tx) = q {
            let (done, wait) = sync_channel(1);
            if tx.send(Msg::Flush(done)).is_ok() {
                let _ = wait.recv();
            }
        }
    }

    /// This process's counters (after the queued writes).
    pub fn stats(&self) -> DiskStats {
        self.core.stats()
    }

    /// Damaged files dropped and writes skipped since the last call, by any user of this
    /// process's store of the folder and scope (thread ranks and a service's ingester share
    /// one: each event is handed out once, to whichever asks first). What a service adds to
    /// its counters: every process reports its own, none twice.
    pub fn faults_since_report(&self) -> (u64, u64) {
        let mut g = self.core.lock();
        let now = (g.stats.corrupt, g.stats.write_failures);
        let delta = (now.0.saturating_sub(g.reported.0), now.1.saturating_sub(g.reported.1));
        g.reported = now;
        delta
    }
}

impl Drop for DiskStore {
    fn drop(&mut self) {
        // Closing the queue ends the writer once it has written what was queued.
        self.queue.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(h) = self.writer.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = h.join();
        }
    }
}

/// Why a file was not served.
enum Bad {
    /// Not there.
    Missing,
    /// Another model, type, device or version: not ours, left alone.
    Foreign,
    /// Damaged: deleted.
    Corrupt(String),
}

impl Core {
    /// The folder exists ([`shared_core`] made it).
    fn open(dir: &Path, scope: Scope, budget: u64) -> io::Result<Self> {
        let store = Self {
            dir: dir.to_path_buf(),
            scope,
            budget,
            state: Mutex::new(State {
                index: HashMap::new(),
                stats: DiskStats::default(),
                warned_write: false,
                warned_corrupt: false,
                reported: (0, 0),
            }),
        };
        let now = SystemTime::now();
        for e in fs::read_dir(dir)?.flatten() {
            let path = e.path();
            let name = e.file_name().to_string_lossy().into_owned();
            if is_tmp_name(&name) {
                let old = e
                    .metadata()
                    .and_then(|m| m.modified())
                    .is_ok_and(|t| now.duration_since(t).unwrap_or_default() > STALE_TMP);
                if old && fs::remove_file(&path).is_ok() {
                    store.lock().stats.stale_tmp += 1;
                }
                continue;
            }
            if !is_entry_name(&name) {
                continue;
            }
            match store.check_listed(&path) {
                Ok((bytes, used)) => {
                    // Counted: the budget holds for what earlier processes left too.
                    let mut g = store.lock();
                    if g.index.insert(name, (bytes, used)).is_none() {
                        g.stats.bytes += bytes;
                    }
                    g.stats.entries = g.index.len();
                }
                Err(Bad::Foreign) => store.lock().stats.foreign += 1,
                Err(Bad::Corrupt(why)) => store.drop_corrupt(&path, &why),
                Err(Bad::Missing) => {}
            }
        }
        let (found, found_bytes) = {
            let g = store.lock();
            (g.index.len(), g.stats.bytes)
        };
        store.trim(None);
        let evicted = store.lock().stats.evictions;
        if evicted > 0 {
            // Entries other runs made (an ingestion under a larger --store-gib): never silently.
            let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
            tracing::warn!(
                "chunk store: {} held {found} entries of this model ({:.3} GiB), over this process's budget of {:.3}                  GiB: deleted the {evicted} least recently used (give --store-gib the size the folder should keep)",
                dir.display(),
                gib(found_bytes),
                gib(budget)
            );
        }
        Ok(store)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn touch(&self, key: &ChunkKey) {
        let name = self.name_of(key);
        let now = SystemTime::now();
        {
            let mut g = self.lock();
            let Some((_, used)) = g.index.get_mut(&name) else { return };
            if now.duration_since(*used).unwrap_or_default() < TOUCH_EVERY {
                return;
            }
            *used = now;
        }
        let _ = File::options().write(true).open(self.dir.join(&name)).and_then(|f| f.set_modified(now));
    }

    /// The entry file of `key` in this scope.
    fn name_of(&self, key: &ChunkKey) -> String {
        let mut h = Sha256::new();
        h.update(b"flowprefill-disk-entry");
        h.update(FORMAT_VERSION.to_le_bytes());
        for s in [&self.scope.model, &self.scope.device] {
            h.update((s.len() as u64).to_le_bytes());
            h.update(s.as_bytes());
        }
        h.update([dtype_code(self.scope.dtype)]);
        h.update(key.bytes());
        let d = h.finalize();
        let hex = crate::hex(&d[..20]);
        format!("{hex}.{EXT}")
    }

    /// A listed file's header and size (not its checksum: that is checked before serving).
    fn check_listed(&self, path: &Path) -> Result<(u64, SystemTime), Bad> {
        let (h, meta) = read_header(path).map_err(|_| Bad::Missing)?;
        let h = h.ok_or_else(|| Bad::Corrupt("no readable header".into()))?;
        if !self.scope.owns(&h) {
            return Err(Bad::Foreign);
        }
        if meta.len() != h.file_len() {
            return Err(Bad::Corrupt(format!("{} bytes, the header says {}", meta.len(), h.file_len())));
        }
        Ok((meta.len(), meta.modified().unwrap_or(SystemTime::UNIX_EPOCH)))
    }

    fn drop_corrupt(&self, path: &Path, why: &str) {
        let _ = fs::remove_file(path);
        let mut g = self.lock();
        g.stats.corrupt += 1;
        if let Some(name) = path.file_name() {
            if let Some((b, _)) = g.index.remove(&*name.to_string_lossy()) {
                g.stats.bytes = g.stats.bytes.saturating_sub(b);
            }
        }
        g.stats.entries = g.index.len();
        if !g.warned_corrupt {
            g.warned_corrupt = true;
            tracing::warn!(
                "chunk store: dropped a damaged entry {} ({why}); later ones are counted only",
                path.display()
            );
        }
    }

    fn get(&self, key: &ChunkKey) -> Option<Record> {
        let name = self.name_of(key);
        let path = self.dir.join(&name);
        match self.read(&path, key) {
            Ok(rec) => {
                let now = SystemTime::now();
                // The last use: what eviction orders by (every process sees it).
                let _ = File::options().write(true).open(&path).and_then(|f| f.set_modified(now));
                let len = fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
                let mut g = self.lock();
                g.stats.hits += 1;
                if g.index.insert(name, (len, now)).is_none() {
                    g.stats.bytes += len;
                }
                g.stats.entries = g.index.len();
                Some(rec)
            }
            Err(bad) => {
                match bad {
                    Bad::Corrupt(why) => self.drop_corrupt(&path, &why),
                    Bad::Foreign => self.lock().stats.foreign += 1,
                    Bad::Missing => {}
                }
                self.lock().stats.misses += 1;
                None
            }
        }
    }

    /// Whether a verified file with header `h` is the entry of `key` in this scope.
    fn owned(&self, h: &format::Header, key: &ChunkKey) -> Result<(), Bad> {
        if !self.scope.owns(h) {
            return Err(Bad::Foreign);
        }
        if &h.key != key.bytes() {
            // A hash collision of names (or a file copied under another name): not this entry.
            return Err(Bad::Corrupt("the entry holds another chunk".into()));
        }
        Ok(())
    }

    fn read(&self, path: &Path, key: &ChunkKey) -> Result<Record, Bad> {
        // A file that cannot be opened or read (gone, another user's, too many open files, an
        // I/O error) is a miss, not damage: it is left for whoever can read it.
        let unreadable = |_: io::Error| Bad::Missing;
        let mut f = File::open(path).map_err(unreadable)?;
        let len = f.metadata().map_err(unreadable)?.len();
        let streamed = format::read_streamed(&mut f, len).map_err(|e| match e {
            format::ReadError::Damaged(why) => Bad::Corrupt(why),
            format::ReadError::Io(e) => unreadable(e),
        })?;
        if let Some((h, positions, layers)) = streamed {
            self.owned(&h, key)?;
            let form = if h.form == 0 { KeyForm::PreRope } else { KeyForm::Rotated };
            return Ok(Record { form, kv_dim: h.kv_dim as usize, positions, layers });
        }
        // A header of an unknown element type or a payload of another shape: never served; read
        // whole to say why (its checksum, then its scope, then its shape).
        let bytes = fs::read(path).map_err(unreadable)?;
        let h = check_whole(&bytes).map_err(Bad::Corrupt)?;
        self.owned(&h, key)?;
        Err(Bad::Corrupt("payload length does not match its shape".into()))
    }

    /// Writes the entry of `key` (temporary file, fsync, rename, folder fsync), then trims to
    /// the budget. An error (a full disk) is a warning, logged once, and a skipped write.
    fn put(&self, key: &ChunkKey, rec: &Record) {
        if rec.layers.iter().any(|(k, v)| k.dtype() != self.scope.dtype || v.dtype() != self.scope.dtype) {
            self.write_failed("an entry of another element type than the store's".into());
            return;
        }
        let name = self.name_of(key);
        let n = TMP_COUNTER.fetch_add(1, Ordering::Relaxed);
        let tmp = self.dir.join(format!(".{name}.{}.{n}.{TMP}", std::process::id()));
        match self.write(&tmp, &self.dir.join(&name), key, rec) {
            Ok(len) => {
                let mut g = self.lock();
                g.stats.writes += 1;
                if let Some((old, _)) = g.index.insert(name.clone(), (len, SystemTime::now())) {
                    g.stats.bytes = g.stats.bytes.saturating_sub(old);
                }
                g.stats.bytes += len;
                g.stats.entries = g.index.len();
                drop(g);
                self.trim(Some(&name));
            }
            Err(e) => {
                let _ = fs::remove_file(&tmp);
                self.write_failed(format!("{e}"));
            }
        }
    }

    fn write_failed(&self, why: String) {
        let mut g = self.lock();
        g.stats.write_failures += 1;
        if !g.warned_write {
            g.warned_write = true;
            tracing::warn!(
                "chunk store: an entry was not written to {} ({why}); the job goes on, later failures are counted only",
                self.dir.display()
            );
        }
    }

    fn write(&self, tmp: &Path, path: &Path, key: &ChunkKey, rec: &Record) -> io::Result<u64> {
        let mut bytes = encode_header(key, &self.scope, rec);
        bytes.reserve(rec.positions.len() * 4 + rec.kv_bytes() + 4);
        rec.positions.iter().for_each(|p| bytes.extend_from_slice(&p.to_le_bytes()));
        for (k, v) in &rec.layers {
            le_bytes(k, &mut bytes);
            le_bytes(v, &mut bytes);
        }
        let crc = crc32fast::hash(&bytes);
        bytes.extend_from_slice(&crc.to_le_bytes());
        let mut f = File::create(tmp)?;
        f.write_all(&bytes)?;
        f.sync_all()?;
        drop(f);
        fs::rename(tmp, path)?;
        // The rename itself survives a crash once the folder is synced.
        File::open(&self.dir)?.sync_all()?;
        Ok(bytes.len() as u64)
    }

    /// Deletes the least recently used entries (never `keep`) until this process's known
    /// bytes fit the budget.
    fn trim(&self, keep: Option<&str>) {
        let mut g = self.lock();
        while g.stats.bytes > self.budget {
            let victim = g
                .index
                .iter()
                .filter(|(n, _)| Some(n.as_str()) != keep)
                .min_by_key(|(_, (_, used))| *used)
                .map(|(n, _)| n.clone());
            let Some(v) = victim else { break };
            if let Some((b, _)) = g.index.remove(&v) {
                g.stats.bytes = g.stats.bytes.saturating_sub(b);
                g.stats.evictions += 1;
            }
            let _ = fs::remove_file(self.dir.join(&v));
        }
        g.stats.entries = g.index.len();
    }

    fn stats(&self) -> DiskStats {
        self.lock().stats
    }
}

/// Every entry file in `dir` (of any scope), with its header's row count and whether it
/// belongs to `scope` (`None`: all count as ours); newest first.
pub fn list(dir: &Path, scope: Option<&Scope>) -> io::Result<Vec<Listed>> {
    let mut out = Vec::new();
    for path in entry_files(dir)? {
        let Ok((h, meta)) = read_header(&path) else { continue };
        let ours = h.as_ref().is_some_and(|h| h.current() && scope.is_none_or(|s| s.owns(h)));
        let made_by = h.as_ref().map(|h| (h.model.clone(), h.device.clone(), dtype_name(h.dtype), h.version));
        out.push(Listed {
            path,
            bytes: meta.len(),
            used: meta.modified().unwrap_or(SystemTime::UNIX_EPOCH),
            rows: h.map_or(0, |h| h.rows),
            ours,
            made_by,
        });
    }
    out.sort_by_key(|l| std::cmp::Reverse(l.used));
    Ok(out)
}

/// The entry files of `dir`.
fn entry_files(dir: &Path) -> io::Result<Vec<PathBuf>> {
    Ok(fs::read_dir(dir)?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(is_entry_name))
        .collect())
}

/// Reads every entry file of `dir` whole and checks its header, length and checksum (any
/// scope): returns the intact ones' count and the damaged files.
pub fn verify(dir: &Path) -> io::Result<Verified> {
    let mut v = Verified::default();
    for path in entry_files(dir)? {
        let Ok(bytes) = fs::read(&path) else {
            // Gone since the listing, another user's, or an I/O error: not this check's to judge.
            if path.exists() {
                v.unreadable.push(path);
            }
            continue;
        };
        match check_whole(&bytes) {
            // Another format version's file is not this build's to judge (nor to delete).
            Ok(h) if !h.current() => v.other_versions.push(path),
            Ok(_) => v.ok += 1,
            Err(_) => v.damaged.push(path),
        }
    }
    Ok(v)
}

/// What [`verify`] found.
#[derive(Debug, Default)]
pub struct Verified {
    /// Entries whose length and checksum hold.
    pub ok: usize,
    /// Entries of this format version that do not.
    pub damaged: Vec<PathBuf>,
    /// Files of another format version (another build of flowprefill): not checked.
    pub other_versions: Vec<PathBuf>,
    /// Files that could not be read (permissions, an I/O error): not checked, not damaged.
    pub unreadable: Vec<PathBuf>,
}

/// Deletes every entry file of `dir` and dead writers' temporary files (of every scope; a
/// temporary file younger than a minute may be a live writer's, whose rename would then fail);
/// returns (files, bytes) deleted.
pub fn clear(dir: &Path) -> io::Result<(usize, u64)> {
    let (mut files, mut bytes) = (0, 0);
    let now = SystemTime::now();
    for e in fs::read_dir(dir)?.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let stale = || {
            e.metadata().and_then(|m| m.modified()).is_ok_and(|t| now.duration_since(t).unwrap_or_default() > STALE_TMP)
        };
        if is_entry_name(&name) || (is_tmp_name(&name) && stale()) {
            let len = e.metadata().map(|m| m.len()).unwrap_or(0);
            if fs::remove_file(e.path()).is_ok() {
                files += 1;
                bytes += len;
            }
        }
    }
    Ok((files, bytes))
}

/// Deletes the least recently used entry files of `dir` (of every scope) until at most
/// `max_bytes` remain; returns (files, bytes) deleted.
pub fn gc(dir: &Path, max_bytes: u64) -> io::Result<(usize, u64)> {
    let mut all = list(dir, None)?;
    let mut total: u64 = all.iter().map(|l| l.bytes).sum();
    let (mut files, mut freed) = (0, 0);
    while total > max_bytes {
        let Some(oldest) = all.pop() else { break };
        if fs::remove_file(&oldest.path).is_ok() {
            files += 1;
            freed += oldest.bytes;
        }
        total = total.saturating_sub(oldest.bytes);
    }
    Ok((files, freed))
}

#[cfg(test)]
mod tests;
