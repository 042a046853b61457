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
//! listing at open plus what it wrote or read since) to its budget by deleting the least
//! recently used (file modification time, refreshed on each read).
//!
//! **A full disk** (or any write error) is a warning and a skipped write, never a failed job.

use super::ChunkKey;
use crate::kv::KeyForm;
use flowprefill_kernels::{DType, HostBuf};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime};

/// The file format's version, in every file's header.
pub const FORMAT_VERSION: u32 = 1;
const MAGIC: &[u8; 8] = b"FPKVSTOR";
/// Entry files end in this.
pub const EXT: &str = "fpkv";
/// Temporary files of writers end in this.
const TMP: &str = "fpkv-tmp";
/// A temporary file older than this is a dead writer's.
const STALE_TMP: Duration = Duration::from_secs(60);

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
    tmp_counter: AtomicU64,
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
    pub fn open(dir: &Path, scope: Scope, budget: u64) -> io::Result<Self> {
        let core = Arc::new(Core::open(dir, scope, budget)?);
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

fn dtype_code(d: DType) -> u8 {
    match d {
        DType::F32 => 0,
        DType::Bf16 => 1,
    }
}

fn form_code(f: KeyForm) -> u8 {
    match f {
        KeyForm::PreRope => 0,
        KeyForm::Rotated => 1,
    }
}

/// The fixed fields of a file's header.
#[derive(Debug, PartialEq)]
struct Header {
    version: u32,
    key: [u8; 32],
    model: String,
    device: String,
    dtype: u8,
    form: u8,
    layers: u32,
    kv_dim: u32,
    rows: u32,
    payload: u64,
    /// Bytes before the payload.
    start: u64,
}

impl Header {
    fn file_len(&self) -> u64 {
        self.start + self.payload + 4
    }
}

fn encode_header(key: &ChunkKey, scope: &Scope, rec: &Record) -> Vec<u8> {
    let rows = rec.positions.len();
    let payload = rows * 4 + rec.kv_bytes();
    let mut h = Vec::with_capacity(128);
    h.extend_from_slice(key.bytes());
    for s in [&scope.model, &scope.device] {
        h.extend_from_slice(&(s.len() as u16).to_le_bytes());
        h.extend_from_slice(s.as_bytes());
    }
    h.push(dtype_code(scope.dtype));
    h.push(form_code(rec.form));
    for v in [rec.layers.len() as u32, rec.kv_dim as u32, rows as u32] {
        h.extend_from_slice(&v.to_le_bytes());
    }
    h.extend_from_slice(&(payload as u64).to_le_bytes());
    let mut out = Vec::with_capacity(16 + h.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&(h.len() as u32).to_le_bytes());
    out.extend_from_slice(&h);
    out
}

/// Reads a header from the first bytes of a file (`None`: not one of ours at all).
fn decode_header(bytes: &[u8]) -> Option<Header> {
    let mut at = 0usize;
    let mut take = |n: usize| -> Option<&[u8]> {
        let s = bytes.get(at..at + n)?;
        at += n;
        Some(s)
    };
    if take(8)? != MAGIC {
        return None;
    }
    let u32_of = |b: &[u8]| u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    let version = u32_of(take(4)?);
    let hlen = u32_of(take(4)?) as usize;
    if hlen > 1 << 16 {
        return None;
    }
    let start = (16 + hlen) as u64;
    let h = bytes.get(16..16 + hlen)?;
    let mut p = 0usize;
    let mut get = |n: usize| -> Option<&[u8]> {
        let s = h.get(p..p + n)?;
        p += n;
        Some(s)
    };
    let key: [u8; 32] = get(32)?.try_into().ok()?;
    let mut string = || -> Option<String> {
        let n = u16::from_le_bytes(get(2)?.try_into().ok()?) as usize;
        String::from_utf8(get(n)?.to_vec()).ok()
    };
    let model = string()?;
    let device = string()?;
    let dtype = get(1)?[0];
    let form = get(1)?[0];
    let layers = u32_of(get(4)?);
    let kv_dim = u32_of(get(4)?);
    let rows = u32_of(get(4)?);
    let payload = u64::from_le_bytes(get(8)?.try_into().ok()?);
    Some(Header { version, key, model, device, dtype, form, layers, kv_dim, rows, payload, start })
}

fn le_bytes(buf: &HostBuf, out: &mut Vec<u8>) {
    #[cfg(target_endian = "little")]
    match buf {
        HostBuf::F32(v) => out.extend_from_slice(bytemuck::cast_slice(v)),
        HostBuf::Bf16(v) => out.extend_from_slice(bytemuck::cast_slice(v)),
    }
    #[cfg(not(target_endian = "little"))]
    match buf {
        HostBuf::F32(v) => v.iter().for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
        HostBuf::Bf16(v) => v.iter().for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
    }
}

fn from_le(bytes: &[u8], dtype: DType) -> HostBuf {
    match dtype {
        DType::F32 => {
            HostBuf::F32(bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
        }
        DType::Bf16 => HostBuf::Bf16(bytes.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect()),
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
    fn open(dir: &Path, scope: Scope, budget: u64) -> io::Result<Self> {
        fs::create_dir_all(dir)?;
        let store = Self {
            dir: dir.to_path_buf(),
            scope,
            budget,
            state: Mutex::new(State {
                index: HashMap::new(),
                stats: DiskStats::default(),
                warned_write: false,
                warned_corrupt: false,
            }),
            tmp_counter: AtomicU64::new(0),
        };
        let now = SystemTime::now();
        for e in fs::read_dir(dir)?.flatten() {
            let path = e.path();
            let name = e.file_name().to_string_lossy().into_owned();
            if name.ends_with(TMP) {
                let old = e
                    .metadata()
                    .and_then(|m| m.modified())
                    .is_ok_and(|t| now.duration_since(t).unwrap_or_default() > STALE_TMP);
                if old && fs::remove_file(&path).is_ok() {
                    store.lock().stats.stale_tmp += 1;
                }
                continue;
            }
            if !name.ends_with(EXT) {
                continue;
            }
            match store.check_listed(&path) {
                Ok((bytes, used)) => {
                    let mut g = store.lock();
                    g.index.insert(name, (bytes, used));
                }
                Err(Bad::Foreign) => store.lock().stats.foreign += 1,
                Err(Bad::Corrupt(why)) => store.drop_corrupt(&path, &why),
                Err(Bad::Missing) => {}
            }
        }
        store.trim(None);
        Ok(store)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
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
        let hex: String = d[..20].iter().map(|b| format!("{b:02x}")).collect();
        format!("{hex}.{EXT}")
    }

    fn ours(&self, h: &Header) -> bool {
        h.version == FORMAT_VERSION
            && h.model == self.scope.model
            && h.device == self.scope.device
            && h.dtype == dtype_code(self.scope.dtype)
    }

    /// A listed file's header and size (not its checksum: that is checked before serving).
    fn check_listed(&self, path: &Path) -> Result<(u64, SystemTime), Bad> {
        let meta = fs::metadata(path).map_err(|_| Bad::Missing)?;
        let mut head = vec![0u8; 4096.min(meta.len() as usize)];
        File::open(path).and_then(|mut f| f.read_exact(&mut head)).map_err(|_| Bad::Missing)?;
        let h = decode_header(&head).ok_or_else(|| Bad::Corrupt("no readable header".into()))?;
        if !self.ours(&h) {
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

    fn read(&self, path: &Path, key: &ChunkKey) -> Result<Record, Bad> {
        let bytes = match fs::read(path) {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(Bad::Missing),
            Err(e) => return Err(Bad::Corrupt(format!("unreadable: {e}"))),
        };
        let h = decode_header(&bytes).ok_or_else(|| Bad::Corrupt("no readable header".into()))?;
        if !self.ours(&h) {
            return Err(Bad::Foreign);
        }
        if bytes.len() as u64 != h.file_len() {
            return Err(Bad::Corrupt(format!("{} bytes, the header says {}", bytes.len(), h.file_len())));
        }
        let body = bytes.len() - 4;
        let want = u32::from_le_bytes([bytes[body], bytes[body + 1], bytes[body + 2], bytes[body + 3]]);
        if crc32fast::hash(&bytes[..body]) != want {
            return Err(Bad::Corrupt("checksum mismatch".into()));
        }
        if &h.key != key.bytes() {
            // A hash collision of names (or a file copied under another name): not this entry.
            return Err(Bad::Corrupt("the entry holds another chunk".into()));
        }
        let dtype = self.scope.dtype;
        let (rows, kv_dim, layers) = (h.rows as usize, h.kv_dim as usize, h.layers as usize);
        let per = rows * kv_dim * dtype.size();
        if h.payload as usize != rows * 4 + 2 * layers * per {
            return Err(Bad::Corrupt("payload length does not match its shape".into()));
        }
        let mut at = h.start as usize;
        let positions =
            bytes[at..at + rows * 4].chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        at += rows * 4;
        let mut out = Vec::with_capacity(layers);
        for _ in 0..layers {
            let k = from_le(&bytes[at..at + per], dtype);
            let v = from_le(&bytes[at + per..at + 2 * per], dtype);
            at += 2 * per;
            out.push((k, v));
        }
        let form = if h.form == 0 { KeyForm::PreRope } else { KeyForm::Rotated };
        Ok(Record { form, kv_dim, positions, layers: out })
    }

    /// Writes the entry of `key` (temporary file, fsync, rename, folder fsync), then trims to
    /// the budget. An error (a full disk) is a warning, logged once, and a skipped write.
    fn put(&self, key: &ChunkKey, rec: &Record) {
        if rec.layers.iter().any(|(k, v)| k.dtype() != self.scope.dtype || v.dtype() != self.scope.dtype) {
            self.write_failed("an entry of another element type than the store's".into());
            return;
        }
        let name = self.name_of(key);
        let n = self.tmp_counter.fetch_add(1, Ordering::Relaxed);
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
    for e in fs::read_dir(dir)?.flatten() {
        let path = e.path();
        if path.extension().and_then(|x| x.to_str()) != Some(EXT) {
            continue;
        }
        let Ok(meta) = e.metadata() else { continue };
        let mut head = vec![0u8; 4096.min(meta.len() as usize)];
        let h = File::open(&path).and_then(|mut f| f.read_exact(&mut head)).ok().and_then(|()| decode_header(&head));
        let ours = match (&h, scope) {
            (Some(h), Some(s)) => {
                h.version == FORMAT_VERSION
                    && h.model == s.model
                    && h.device == s.device
                    && h.dtype == dtype_code(s.dtype)
            }
            (Some(_), None) => true,
            (None, _) => false,
        };
        let made_by = h.as_ref().map(|h| {
            let dtype = match h.dtype {
                0 => "f32",
                1 => "bf16",
                _ => "?",
            };
            (h.model.clone(), h.device.clone(), dtype, h.version)
        });
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

/// Reads every entry file of `dir` whole and checks its header, length and checksum (any
/// scope): returns the intact ones' count and the damaged files.
pub fn verify(dir: &Path) -> io::Result<(usize, Vec<PathBuf>)> {
    let (mut ok, mut bad) = (0, Vec::new());
    for e in fs::read_dir(dir)?.flatten() {
        let path = e.path();
        if path.extension().and_then(|x| x.to_str()) != Some(EXT) {
            continue;
        }
        let Ok(bytes) = fs::read(&path) else { continue };
        let intact = decode_header(&bytes).is_some_and(|h| {
            bytes.len() as u64 == h.file_len() && {
                let body = bytes.len() - 4;
                let want = u32::from_le_bytes([bytes[body], bytes[body + 1], bytes[body + 2], bytes[body + 3]]);
                crc32fast::hash(&bytes[..body]) == want
            }
        });
        if intact {
            ok += 1;
        } else {
            bad.push(path);
        }
    }
    Ok((ok, bad))
}

/// Deletes every entry file of `dir` and writers' temporary files (of every scope); returns
/// (files, bytes) deleted.
pub fn clear(dir: &Path) -> io::Result<(usize, u64)> {
    let (mut files, mut bytes) = (0, 0);
    for e in fs::read_dir(dir)?.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.ends_with(EXT) || name.ends_with(TMP) {
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
mod tests {
    use super::*;

    fn scope(model: &str) -> Scope {
        Scope { model: model.into(), dtype: DType::F32, device: "cpu".into() }
    }

    fn record(rows: usize, seed: f32) -> Record {
        let layer = |o: f32| {
            (
                HostBuf::F32((0..rows * 4).map(|i| seed + o + i as f32 * 0.5).collect()),
                HostBuf::F32((0..rows * 4).map(|i| -seed - o - i as f32).collect()),
            )
        };
        Record {
            form: KeyForm::PreRope,
            kv_dim: 4,
            positions: (7..7 + rows as u32).collect(),
            layers: vec![layer(0.0), layer(1.0)],
        }
    }

    /// Writes and waits for the writer thread.
    fn put_now(s: &DiskStore, key: &ChunkKey, rec: Record) {
        s.put(key, rec);
        s.flush();
    }

    fn temp(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("fp-disk-{tag}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn an_entry_survives_a_new_store_and_another_scope_never_sees_it() {
        let dir = temp("scope");
        let key = ChunkKey::new(&[1, 2], 2, &[3, 4, 5]);
        let a = DiskStore::open(&dir, scope("m1"), 1 << 20).unwrap();
        assert!(a.get(&key).is_none());
        put_now(&a, &key, record(3, 1.0));
        drop(a);
        let b = DiskStore::open(&dir, scope("m1"), 1 << 20).unwrap();
        assert_eq!(b.stats().entries, 1, "listed at open");
        assert_eq!(b.get(&key), Some(record(3, 1.0)), "bit for bit");
        // Another model, element type or device kind: another name, and the file is foreign.
        let c = DiskStore::open(&dir, scope("m2"), 1 << 20).unwrap();
        assert!(c.get(&key).is_none());
        assert_eq!((c.stats().foreign, c.stats().entries), (1, 0));
        let d = DiskStore::open(&dir, Scope { dtype: DType::Bf16, ..scope("m1") }, 1 << 20).unwrap();
        assert!(d.get(&key).is_none());
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_damaged_file_is_dropped_and_counted_never_served() {
        let dir = temp("damage");
        let s = DiskStore::open(&dir, scope("m"), 1 << 20).unwrap();
        let (k1, k2, k3) = (ChunkKey::new(&[], 0, &[1]), ChunkKey::new(&[], 0, &[2]), ChunkKey::new(&[], 0, &[3]));
        for (i, k) in [k1, k2, k3].iter().enumerate() {
            put_now(&s, k, record(5, i as f32));
        }
        let path = |k: &ChunkKey| dir.join(s.core.name_of(k));
        // A flipped byte in the payload: the checksum catches it at read.
        let mut b = fs::read(path(&k1)).unwrap();
        let mid = b.len() / 2;
        b[mid] ^= 0x40;
        fs::write(path(&k1), &b).unwrap();
        assert!(s.get(&k1).is_none());
        assert!(!path(&k1).exists(), "deleted");
        // A truncated file: dropped at the next open (its length), and at read.
        let b = fs::read(path(&k2)).unwrap();
        fs::write(path(&k2), &b[..b.len() - 9]).unwrap();
        assert!(s.get(&k2).is_none());
        assert_eq!(s.stats().corrupt, 2);
        assert_eq!(s.get(&k3), Some(record(5, 2.0)), "the intact entry still serves");
        let b = fs::read(path(&k3)).unwrap();
        fs::write(path(&k3), &b[..100]).unwrap();
        // A dead writer's temporary file, old: removed at open.
        let tmp = dir.join(format!(".x.1.0.{TMP}"));
        fs::write(&tmp, b"partial").unwrap();
        File::options().write(true).open(&tmp).unwrap().set_modified(SystemTime::now() - STALE_TMP * 2).unwrap();
        let again = DiskStore::open(&dir, scope("m"), 1 << 20).unwrap();
        assert_eq!((again.stats().corrupt, again.stats().stale_tmp, again.stats().entries), (1, 1, 0));
        assert!(!tmp.exists());
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_budget_evicts_the_least_recently_used_and_gc_trims_the_folder() {
        let dir = temp("budget");
        let one = {
            let s = DiskStore::open(&dir, scope("m"), u64::MAX).unwrap();
            put_now(&s, &ChunkKey::new(&[], 0, &[0]), record(8, 0.0));
            s.stats().bytes
        };
        let _ = fs::remove_dir_all(&dir);
        let s = DiskStore::open(&dir, scope("m"), 2 * one).unwrap();
        let keys: Vec<ChunkKey> = (0..3).map(|i| ChunkKey::new(&[], 0, &[i])).collect();
        put_now(&s, &keys[0], record(8, 0.0));
        std::thread::sleep(Duration::from_millis(20));
        put_now(&s, &keys[1], record(8, 1.0));
        std::thread::sleep(Duration::from_millis(20));
        assert!(s.get(&keys[0]).is_some(), "0 used after 1");
        std::thread::sleep(Duration::from_millis(20));
        put_now(&s, &keys[2], record(8, 2.0));
        assert!(s.get(&keys[1]).is_none(), "the least recently used went");
        assert!(s.get(&keys[0]).is_some() && s.get(&keys[2]).is_some());
        assert_eq!((s.stats().entries, s.stats().evictions), (2, 1));
        assert_eq!(list(&dir, None).unwrap().len(), 2);
        assert_eq!(gc(&dir, one).unwrap(), (1, one));
        assert_eq!(list(&dir, Some(&scope("m"))).unwrap().len(), 1);
        let _ = fs::remove_dir_all(&dir);
    }

    /// The content of entry `i` of the child-process tests: a reader can tell a torn or mixed
    /// entry from the right one.
    fn numbered(i: u32) -> (ChunkKey, Record) {
        (ChunkKey::new(&[], 0, &[i]), record(16 + (i as usize % 7) * 8, i as f32))
    }

    /// Not a test on its own: the writer and reader the next two tests start as processes
    /// (`FP_DISK_CHILD` names the folder, `FP_DISK_SEED` its keys). It writes entries without
    /// end and reads others, and fails on an entry that is served with other content.
    #[test]
    #[ignore = "a child process of the crash and concurrency tests"]
    fn child_writer() {
        let Some(dir) = std::env::var_os("FP_DISK_CHILD") else { return };
        let seed: u32 = std::env::var("FP_DISK_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(0);
        let rounds: u32 = std::env::var("FP_DISK_ROUNDS").ok().and_then(|s| s.parse().ok()).unwrap_or(u32::MAX);
        let s = DiskStore::open(Path::new(&dir), scope("m"), u64::MAX).unwrap();
        for r in 0..rounds {
            let i = (seed.wrapping_add(r.wrapping_mul(7))) % 40;
            let (k, rec) = numbered(i);
            put_now(&s, &k, rec);
            let j = (i * 13 + 5) % 40;
            let (k, want) = numbered(j);
            if let Some(got) = s.get(&k) {
                assert_eq!(got, want, "entry {j} served with other content");
            }
        }
    }

    fn child(dir: &Path, seed: u32, rounds: Option<u32>) -> std::process::Child {
        let mut c = std::process::Command::new(std::env::current_exe().unwrap());
        c.args(["store::disk::tests::child_writer", "--exact", "--ignored", "--quiet", "--test-threads", "1"]);
        c.env("FP_DISK_CHILD", dir).env("FP_DISK_SEED", seed.to_string());
        if let Some(r) = rounds {
            c.env("FP_DISK_ROUNDS", r.to_string());
        }
        c.stdout(std::process::Stdio::null()).stderr(std::process::Stdio::piped()).spawn().unwrap()
    }

    /// Writers killed (SIGKILL) at 12 points of their writes: no damaged entry is left under an
    /// entry's name (every file verifies), a fresh store serves every listed entry with its
    /// content, and the killed writers' temporary files are never served.
    #[test]
    fn writers_killed_mid_write_leave_no_damaged_entry() {
        let dir = temp("crash");
        fs::create_dir_all(&dir).unwrap();
        for round in 0..12u32 {
            let mut c = child(&dir, round * 11, None);
            std::thread::sleep(Duration::from_millis(15 + (round as u64 * 37) % 60));
            c.kill().unwrap();
            let _ = c.wait();
        }
        let (ok, bad) = verify(&dir).unwrap();
        assert!(bad.is_empty(), "damaged entries under entry names: {bad:?}");
        assert!(ok > 0, "the writers wrote nothing in the time given");
        let s = DiskStore::open(&dir, scope("m"), u64::MAX).unwrap();
        assert_eq!((s.stats().entries, s.stats().corrupt), (ok, 0));
        for i in 0..40 {
            let (k, want) = numbered(i);
            if let Some(got) = s.get(&k) {
                assert_eq!(got, want, "entry {i}");
            }
        }
        let tmp =
            fs::read_dir(&dir).unwrap().flatten().filter(|e| e.file_name().to_string_lossy().ends_with(TMP)).count();
        println!(
            "12 writers killed: {ok} entries intact, 0 damaged, {tmp} temporary files left (removed after a minute)"
        );
        let _ = fs::remove_dir_all(&dir);
    }

    /// Two processes writing and reading one folder at once (the same entries among others):
    /// neither is served a torn or mixed entry, and the folder verifies after.
    #[test]
    fn two_processes_share_a_folder() {
        let dir = temp("share");
        fs::create_dir_all(&dir).unwrap();
        let (a, b) = (child(&dir, 1, Some(120)), child(&dir, 2, Some(120)));
        for (name, c) in [("a", a), ("b", b)] {
            let out = c.wait_with_output().unwrap();
            assert!(out.status.success(), "process {name}: {}", String::from_utf8_lossy(&out.stderr));
        }
        let (ok, bad) = verify(&dir).unwrap();
        assert!(bad.is_empty() && ok > 0, "{ok} intact, damaged {bad:?}");
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_write_that_fails_is_a_counted_warning() {
        let dir = temp("fail");
        let s = DiskStore::open(&dir, scope("m"), u64::MAX).unwrap();
        // The folder gone under the store: the write fails, the caller goes on.
        fs::remove_dir_all(&dir).unwrap();
        put_now(&s, &ChunkKey::new(&[], 0, &[1]), record(2, 0.0));
        assert_eq!((s.stats().write_failures, s.stats().writes), (1, 0));
        // An entry of another element type is refused the same way.
        fs::create_dir_all(&dir).unwrap();
        let mut r = record(2, 0.0);
        r.layers[0].0 = HostBuf::Bf16(vec![0; 8]);
        put_now(&s, &ChunkKey::new(&[], 0, &[2]), r);
        assert_eq!(s.stats().write_failures, 2);
        let _ = fs::remove_dir_all(&dir);
    }
}
