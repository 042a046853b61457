//! The chunk KV store: pre-RoPE chunk caches keyed by content.
//!
//! A chunk's cache depends only on the model, the head it was prefilled behind (none, the
//! shared prefix, the anchor block) and its tokens, never on the query, so a second query over
//! the same documents reuses it. Entries are immutable (`Arc`): recomputed KV is query-specific
//! and lives in placed copies, never here. Memory is bounded by a byte budget with
//! least-recently-used eviction.
//!
//! Under the RAM tier, an optional disk tier ([`disk::DiskStore`]) keeps chunk caches across
//! processes and restarts: [`ChunkStore::lookup_many`] tries RAM, then disk (an entry read from disk
//! is promoted to RAM, on the device), and [`ChunkStore::insert_persist`] writes through.

pub mod disk;
pub mod documents;

use crate::kv::{KvCache, LayerKv};
use flowprefill_kernels::Backend;
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

/// Content key of a chunk cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ChunkKey([u8; 32]);

impl ChunkKey {
    /// Key of `tokens` prefilled from position `start` behind `head` (its token ids, in order).
    pub fn new(head: &[u32], start: u32, tokens: &[u32]) -> Self {
        let mut h = Sha256::new();
        h.update(b"flowprefill-chunk-v1");
        h.update((head.len() as u64).to_le_bytes());
        for t in head {
            h.update(t.to_le_bytes());
        }
        h.update(start.to_le_bytes());
        h.update((tokens.len() as u64).to_le_bytes());
        for t in tokens {
            h.update(t.to_le_bytes());
        }
        Self(h.finalize().into())
    }

    /// Key of a whole context's cache prefilled from position 0 with its keys rotated (what
    /// full prefill with `--evict` keeps, so that another eviction of the same context skips
    /// the prefill); never equal to a chunk's key.
    pub fn context(tokens: &[u32]) -> Self {
        let mut h = Sha256::new();
        h.update(b"flowprefill-context-v1");
        h.update((tokens.len() as u64).to_le_bytes());
        for t in tokens {
            h.update(t.to_le_bytes());
        }
        Self(h.finalize().into())
    }

    /// The key of the same chunk made with the adapter `hash` (KV Packet): packet caches and
    /// plain caches, or packets of two adapters, never share a key.
    pub fn with_adapter(self, hash: &str) -> Self {
        let mut h = Sha256::new();
        h.update(b"flowprefill-packet-v1");
        h.update(self.0);
        h.update(hash.as_bytes());
        Self(h.finalize().into())
    }

    /// The key's bytes.
    pub fn bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// Short hex form for logs.
    pub fn short(&self) -> String {
        crate::hex(&self.0[..6])
    }
}

/// Counters of a store (the RAM tier's; [`ChunkStore::disk_stats`] has the disk tier's).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct StoreStats {
    /// Entries held.
    pub entries: usize,
    /// Bytes held.
    pub bytes: usize,
    /// Lookups that found an entry.
    pub hits: u64,
    /// Lookups that did not.
    pub misses: u64,
    /// Entries evicted for the budget.
    pub evictions: u64,
}

struct Entry<B: Backend> {
    kv: Arc<KvCache<B>>,
    last_used: u64,
}

struct Inner<B: Backend> {
    map: HashMap<ChunkKey, Entry<B>>,
    tick: u64,
    stats: StoreStats,
}

/// Entries made by a job and not yet written to the disk tier.
type Pending<B> = Vec<(ChunkKey, Arc<KvCache<B>>)>;

/// A bounded, thread-safe chunk cache store.
pub struct ChunkStore<B: Backend> {
    inner: Mutex<Inner<B>>,
    budget_bytes: usize,
    disk: Option<disk::DiskStore>,
    /// [`ChunkStore::insert_persist`]'s entries until [`ChunkStore::persist_pending`].
    pending: Mutex<Pending<B>>,
}

impl<B: Backend> std::fmt::Debug for ChunkStore<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChunkStore").field("budget_bytes", &self.budget_bytes).field("stats", &self.stats()).finish()
    }
}

impl<B: Backend> ChunkStore<B> {
    /// A store that keeps at most `budget_bytes` of K/V (the newest entry is always kept).
    pub fn new(budget_bytes: usize) -> Self {
        Self {
            inner: Mutex::new(Inner { map: HashMap::new(), tick: 0, stats: StoreStats::default() }),
            budget_bytes,
            disk: None,
            pending: Mutex::new(Vec::new()),
        }
    }

    /// The same store with a disk tier under it.
    pub fn with_disk(mut self, disk: disk::DiskStore) -> Self {
        self.disk = Some(disk);
        self
    }

    /// The disk tier, if any.
    pub fn disk(&self) -> Option<&disk::DiskStore> {
        self.disk.as_ref()
    }

    /// The disk tier's counters, if there is one.
    pub fn disk_stats(&self) -> Option<disk::DiskStats> {
        self.disk.as_ref().map(|d| d.stats())
    }

    /// The cache of every key, in order, with `true` where it came from disk (`None`: neither
    /// tier has it; a disk entry that cannot be made a cache of this backend counts as a miss):
    /// RAM first, then the disk tier (entries read, verified, uploaded to `backend` in their
    /// element type and kept in RAM) with the files read and verified on several threads
    /// (reading, checking and decoding a file is host work: one thread kept a GPU waiting
    /// 100-140 ms for 17 chunks of 512 tokens, H200, 2026-11-27) and uploaded in order; at most
    /// a few records are held at once. A key given twice is read once.
    pub fn lookup_many(&self, keys: &[ChunkKey], backend: &B) -> Vec<Option<(Arc<KvCache<B>>, bool)>> {
        let mut out: Vec<Option<(Arc<KvCache<B>>, bool)>> =
            keys.iter().map(|k| self.get(k).map(|kv| (kv, false))).collect();
        let Some(d) = &self.disk else { return out };
        let mut first_of: HashMap<ChunkKey, usize> = HashMap::new();
        let mut missing = Vec::new();
        for (i, k) in keys.iter().enumerate() {
            if out[i].is_none() && !first_of.contains_key(k) {
                first_of.insert(*k, i);
                missing.push(i);
            }
        }
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).clamp(1, READ_THREADS);
        for wave in missing.chunks(threads) {
            let wave_keys: Vec<ChunkKey> = wave.iter().map(|&i| keys[i]).collect();
            for (&i, rec) in wave.iter().zip(read_records(d, &wave_keys)) {
                let Some(rec) = rec else { continue };
                match from_record(backend, rec) {
                    Ok(kv) => {
                        let kv = Arc::new(kv);
                        self.insert_arc(keys[i], kv.clone());
                        out[i] = Some((kv, true));
                    }
                    Err(e) => tracing::warn!("chunk store: a disk entry could not be loaded ({e}); prefilling instead"),
                }
            }
        }
        // A key given again: what its first place found (a RAM hit now).
        for (i, k) in keys.iter().enumerate() {
            if out[i].is_none() {
                if let Some(&j) = first_of.get(k).filter(|&&j| j != i) {
                    out[i] = out[j].as_ref().map(|(kv, _)| (kv.clone(), false));
                }
            }
        }
        out
    }

    /// How well this store holds `key`, without counting a lookup: 2 in RAM, 1 on the disk
    /// tier only, 0 not at all (what cache-aware sharding places by).
    pub fn holds(&self, key: &ChunkKey) -> u8 {
        if self.lock().map.contains_key(key) {
            2
        } else if self.disk.as_ref().is_some_and(|d| d.holds(key)) {
            1
        } else {
            0
        }
    }

    /// [`ChunkStore::insert`], and the entry kept for the disk tier (if any) until
    /// [`ChunkStore::persist_pending`]: the job that made it calls that at its end, so that
    /// copying its caches to the host and writing them stays off its time to first token (on
    /// a GPU, 17 chunks of 512 tokens of SmolLM2 written on the way cost about 165 ms of a
    /// 300 ms TTFT, H200, 2026-11-27).
    pub fn insert_persist(&self, key: ChunkKey, kv: KvCache<B>) -> Arc<KvCache<B>> {
        let kv = self.insert(key, kv);
        if self.disk.is_some() {
            self.pending.lock().unwrap_or_else(|p| p.into_inner()).push((key, kv.clone()));
        }
        kv
    }

    /// Drops the entries [`ChunkStore::insert_persist`] kept for the disk tier, and every entry
    /// in RAM, without touching the device: after a job whose device failed, its caches (and
    /// any other of that device) cannot be trusted, and reading them back would wait on the
    /// device. Nothing of them is written ([`ChunkStore::clear`]: earlier jobs' queued writes,
    /// already on the host, finish first); the disk tier's files stay.
    pub fn forget_pending(&self) {
        self.pending.lock().unwrap_or_else(|p| p.into_inner()).clear();
        self.clear();
    }

    /// Writes the entries [`ChunkStore::insert_persist`] kept to the disk tier: each copied
    /// to the host in one batch and queued for the tier's writer (a failed copy or write is
    /// the tier's warning, never the job's error). Returns how many were queued.
    pub fn persist_pending(&self, backend: &B) -> usize {
        let pending = std::mem::take(&mut *self.pending.lock().unwrap_or_else(|p| p.into_inner()));
        let Some(d) = &self.disk else { return 0 };
        let (mut queued, total) = (0, pending.len());
        for (key, kv) in pending {
            match to_record(backend, &kv) {
                Ok(rec) => {
                    d.put(&key, rec);
                    queued += 1;
                }
                Err(e) => {
                    // The device failed (a job that failed with it, say): the rest would too.
                    tracing::warn!("chunk store: {} of {total} entries not written to disk ({e})", total - queued);
                    break;
                }
            }
        }
        queued
    }

    fn lock(&self) -> MutexGuard<'_, Inner<B>> {
        // A panic while holding the lock cannot leave the map inconsistent (every mutation is
        // a single insert/remove), so a poisoned lock is still usable.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The cache for `key`, counting a hit or a miss.
    pub fn get(&self, key: &ChunkKey) -> Option<Arc<KvCache<B>>> {
        let mut g = self.lock();
        g.tick += 1;
        let tick = g.tick;
        match g.map.get_mut(key) {
            Some(e) => {
                e.last_used = tick;
                let kv = e.kv.clone();
                g.stats.hits += 1;
                drop(g);
                // A use the disk tier's eviction must see too (else the hottest entries, served
                // from RAM, are the oldest on disk and the first its trims delete).
                if let Some(d) = &self.disk {
                    d.touch(key);
                }
                Some(kv)
            }
            None => {
                g.stats.misses += 1;
                None
            }
        }
    }

    /// Stores a cache and returns the shared handle; evicts least recently used entries while
    /// over budget.
    pub fn insert(&self, key: ChunkKey, kv: KvCache<B>) -> Arc<KvCache<B>> {
        let kv = Arc::new(kv);
        self.insert_arc(key, kv.clone());
        kv
    }

    fn insert_arc(&self, key: ChunkKey, kv: Arc<KvCache<B>>) {
        let mut g = self.lock();
        g.tick += 1;
        let tick = g.tick;
        let bytes = kv.bytes();
        if let Some(old) = g.map.insert(key, Entry { kv: kv.clone(), last_used: tick }) {
            g.stats.bytes -= old.kv.bytes();
            g.stats.entries -= 1;
        }
        g.stats.bytes += bytes;
        g.stats.entries += 1;
        while g.stats.bytes > self.budget_bytes && g.map.len() > 1 {
            let victim = g.map.iter().filter(|(k, _)| **k != key).min_by_key(|(_, e)| e.last_used).map(|(k, _)| *k);
            let Some(victim) = victim else { break };
            if let Some(e) = g.map.remove(&victim) {
                g.stats.bytes -= e.kv.bytes();
                g.stats.entries -= 1;
                g.stats.evictions += 1;
            }
        }
    }

    /// Evicts least recently used entries no job is using until `bytes` are given back (or
    /// nothing more can be); returns the bytes given back. Entries a running job holds stay:
    /// dropping them would free nothing.
    pub fn evict(&self, bytes: usize) -> usize {
        let mut g = self.lock();
        let mut freed = 0;
        while freed < bytes {
            let victim = g
                .map
                .iter()
                .filter(|(_, e)| Arc::strong_count(&e.kv) == 1)
                .min_by_key(|(_, e)| e.last_used)
                .map(|(k, _)| *k);
            let Some(e) = victim.and_then(|k| g.map.remove(&k)) else { break };
            let b = e.kv.bytes();
            freed += b;
            g.stats.bytes -= b;
            g.stats.entries -= 1;
            g.stats.evictions += 1;
        }
        freed
    }

    /// Bytes of the entries no job is using (what [`ChunkStore::evict`] can give back).
    pub fn reclaimable(&self) -> usize {
        self.lock().map.values().filter(|e| Arc::strong_count(&e.kv) == 1).map(|e| e.kv.bytes()).sum()
    }

    /// Current counters.
    pub fn stats(&self) -> StoreStats {
        self.lock().stats
    }

    /// Drops every entry (counters of hits/misses are kept), once the disk tier's queued writes
    /// are done: a caller that empties the folder next (a benchmark's cold run) finds no write
    /// landing after it.
    pub fn clear(&self) {
        if let Some(d) = &self.disk {
            d.flush();
        }
        let mut g = self.lock();
        g.map.clear();
        g.stats.entries = 0;
        g.stats.bytes = 0;
    }

    /// The byte budget.
    pub fn budget_bytes(&self) -> usize {
        self.budget_bytes
    }
}

/// Files the disk tier reads at once in [`ChunkStore::lookup_many`] (threads, and records held).
const READ_THREADS: usize = 8;

/// The disk tier's records of `keys` (each read and verified by [`disk::DiskStore::get`]), read
/// on a thread each.
fn read_records(d: &disk::DiskStore, keys: &[ChunkKey]) -> Vec<Option<disk::Record>> {
    if keys.len() < 2 {
        return keys.iter().map(|k| d.get(k)).collect();
    }
    std::thread::scope(|s| {
        let handles: Vec<_> = keys.iter().map(|k| s.spawn(move || d.get(k))).collect();
        // A reader that panicked found nothing (the chunk is prefilled instead).
        handles.into_iter().map(|h| h.join().ok().flatten()).collect()
    })
}

/// A cache as host data for the disk tier (every layer's K and V in one batch: on a GPU one
/// wait, not one per buffer).
fn to_record<B: Backend>(be: &B, kv: &KvCache<B>) -> crate::Result<disk::Record> {
    let bufs: Vec<&B::Buf> = kv.layers().iter().flat_map(|l| [&l.k, &l.v]).collect();
    let mut host = be.download_many(&bufs)?.into_iter();
    let layers = kv.layers().iter().filter_map(|_| Some((host.next()?, host.next()?))).collect::<Vec<_>>();
    if layers.len() != kv.layers().len() {
        let detail = "the batch returned fewer buffers than asked".to_string();
        return Err(flowprefill_kernels::KernelError::Shape { op: "download_many", detail }.into());
    }
    Ok(disk::Record { form: kv.form(), kv_dim: kv.kv_dim(), positions: kv.positions().to_vec(), layers })
}

/// A disk record as a cache of `be` (its buffers uploaded in the record's element type, in
/// one batch).
fn from_record<B: Backend>(be: &B, rec: disk::Record) -> crate::Result<KvCache<B>> {
    let hosts: Vec<&flowprefill_kernels::HostBuf> = rec.layers.iter().flat_map(|(k, v)| [k, v]).collect();
    let mut bufs = be.upload_many(&hosts)?.into_iter();
    let layers =
        rec.layers.iter().filter_map(|_| Some(LayerKv { k: bufs.next()?, v: bufs.next()? })).collect::<Vec<_>>();
    if layers.len() != rec.layers.len() {
        let detail = "the batch returned fewer buffers than asked".to_string();
        return Err(flowprefill_kernels::KernelError::Shape { op: "upload_many", detail }.into());
    }
    KvCache::from_parts(be, layers, rec.positions, rec.form, rec.kv_dim)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::{KeyForm, LayerKv};
    use flowprefill_kernels::{Cpu, HostBuf};

    fn cache(rows: usize) -> KvCache<Cpu> {
        let layer = || LayerKv { k: HostBuf::from(vec![0.0; rows * 2]), v: HostBuf::from(vec![0.0; rows * 2]) };
        KvCache::from_parts(&Cpu, vec![layer()], (0..rows as u32).collect(), KeyForm::PreRope, 2).expect("cache")
    }

    #[test]
    fn a_persisted_entry_reaches_the_disk_only_when_the_job_ends_and_reads_back_equal() {
        let dir = std::env::temp_dir().join(format!("fp-store-pending-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let scope = disk::Scope { model: "m".into(), dtype: flowprefill_kernels::DType::F32, device: "cpu".into() };
        let open = || disk::DiskStore::open(&dir, scope.clone(), 1 << 30).expect("disk tier");
        let store = ChunkStore::<Cpu>::new(1 << 20).with_disk(open());
        let key = ChunkKey::new(&[], 0, &[9, 8, 7]);
        let rows = 5;
        let layer = |o: f32| LayerKv {
            k: HostBuf::from((0..rows * 2).map(|i| o + i as f32).collect::<Vec<f32>>()),
            v: HostBuf::from((0..rows * 2).map(|i| o - i as f32).collect::<Vec<f32>>()),
        };
        let kv = KvCache::from_parts(
            &Cpu,
            vec![layer(0.5), layer(3.0)],
            (4..4 + rows as u32).collect(),
            KeyForm::PreRope,
            2,
        )
        .expect("cache");
        let made = store.insert_persist(key, kv);
        let d = store.disk().expect("disk tier");
        d.flush();
        assert!(!d.holds(&key), "written before the job ended");
        assert_eq!(store.persist_pending(&Cpu), 1);
        assert_eq!(store.persist_pending(&Cpu), 0, "written once");
        d.flush();
        assert!(d.holds(&key));
        // A new process's store reads it back (batched upload) equal to what was made; a key
        // given twice is read once (then a RAM hit), an unknown one is a miss.
        let again = ChunkStore::<Cpu>::new(1 << 20).with_disk(open());
        let unknown = ChunkKey::new(&[], 0, &[1]);
        let found = again.lookup_many(&[key, unknown, key], &Cpu);
        assert_eq!(
            found.iter().map(|f| f.as_ref().map(|(_, disk)| *disk)).collect::<Vec<_>>(),
            [Some(true), None, Some(false)]
        );
        let (read, _) = found[0].clone().expect("a disk hit");
        assert!(Arc::ptr_eq(&read, &found[2].clone().expect("the same entry").0));
        assert_eq!(again.disk_stats().map(|s| s.hits), Some(1), "read once");
        assert_eq!(read.positions(), made.positions());
        for (a, b) in read.layers().iter().zip(made.layers()) {
            assert_eq!(
                (Cpu.download(&a.k).unwrap(), Cpu.download(&a.v).unwrap()),
                (Cpu.download(&b.k).unwrap(), Cpu.download(&b.v).unwrap())
            );
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// An entry served from RAM is a use the disk tier's eviction sees: written before another,
    /// then hit in RAM, it outlives the other at the next trim (by file times: what every
    /// process orders by); before, the hottest entry was the oldest on disk and went first.
    #[test]
    fn a_hit_in_ram_keeps_its_disk_entry_from_eviction() {
        let dir = std::env::temp_dir().join(format!("fp-store-touch-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let scope = disk::Scope { model: "m".into(), dtype: flowprefill_kernels::DType::F32, device: "cpu".into() };
        let open = |budget: u64| disk::DiskStore::open(&dir, scope.clone(), budget).expect("disk tier");
        let (hot, cold, new) = (ChunkKey::new(&[], 0, &[1]), ChunkKey::new(&[], 0, &[2]), ChunkKey::new(&[], 0, &[3]));
        let one = {
            let store = ChunkStore::<Cpu>::new(1 << 20).with_disk(open(u64::MAX));
            for k in [hot, cold] {
                store.insert_persist(k, cache(8));
            }
            store.persist_pending(&Cpu);
            let d = store.disk().expect("disk tier");
            d.flush();
            d.stats().bytes / 2
        };
        // Written minutes ago, `hot` first.
        let now = std::time::SystemTime::now();
        let d = open(u64::MAX);
        for (k, age) in [(hot, 300), (cold, 200)] {
            let f = std::fs::File::options().write(true).open(d.path_of(&k)).expect("entry file");
            f.set_modified(now - std::time::Duration::from_secs(age)).expect("file time");
        }
        drop(d);
        // A process that holds `hot` in RAM (as one that made it does) and serves it from there,
        // then writes `new` with room for two entries.
        let store = ChunkStore::<Cpu>::new(1 << 20).with_disk(open(2 * one + one / 2));
        store.insert(hot, cache(8));
        assert!(store.get(&hot).is_some(), "a RAM hit");
        store.insert_persist(new, cache(8));
        store.persist_pending(&Cpu);
        let d = store.disk().expect("disk tier");
        d.flush();
        assert!(d.holds(&hot), "the entry used last was evicted");
        assert!(!d.holds(&cold) && d.holds(&new), "the entry unused for longest stayed");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn eviction_gives_back_the_oldest_entries_no_job_holds() {
        let store = ChunkStore::<Cpu>::new(1 << 20);
        let (a, b, c) = (ChunkKey::new(&[], 0, &[1]), ChunkKey::new(&[], 0, &[2]), ChunkKey::new(&[], 0, &[3]));
        let held = store.insert(a, cache(10)); // oldest, but a job holds it
        drop(store.insert(b, cache(20)));
        drop(store.insert(c, cache(30)));
        let per_row = 2 * 2 * 4;
        assert_eq!(store.reclaimable(), 50 * per_row);
        // Asked for one byte: the oldest free entry (b) goes, the held one stays.
        assert_eq!(store.evict(1), 20 * per_row);
        assert!(store.get(&a).is_some() && store.get(&b).is_none() && store.get(&c).is_some());
        // Asked for more than there is: everything free goes, no more.
        assert_eq!(store.evict(usize::MAX), 30 * per_row);
        let s = store.stats();
        assert_eq!((s.entries, s.bytes, s.evictions), (1, 10 * per_row, 2));
        drop(held);
        assert_eq!(store.reclaimable(), 10 * per_row);
    }
}
