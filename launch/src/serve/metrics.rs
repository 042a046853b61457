//! Prometheus metrics of the service. Rank 0 aggregates: every job's per-rank statistics
//! (phase times, bytes per collective, selected tokens) travel back to rank 0 with the job,
//! so one `/metrics` endpoint covers every rank of a thread or MPI deployment, with a
//! `rank` label. Names carry their base unit (seconds, bytes) and counters end in `_total`, as
//! Prometheus' naming rules (`promtool check metrics`) ask; labels are bounded (method, phase,
//! rank, collective, kind, outcome), never request ids.
//!
//! The `metrics` crate's counters are integers; the two counters of seconds (op time, collective
//! waits) need fractions, so they are kept here (`SecondsCounter`) and [`render`] writes them
//! after the exporter's text, in the same format.

use flowprefill_coordinator::RunResult;
use flowprefill_worker::store::disk::DiskStats;
use metrics::{counter, gauge, histogram};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::{Mutex, OnceLock, PoisonError};
use std::time::Duration;

/// Time to first token from the request's arrival (reading the body, admission, the queue and
/// the computation: the client's wait), by method.
pub const TTFT_SECONDS: &str = "flowprefill_ttft_seconds";
/// Whole job (queueing excluded), by method.
pub const JOB_SECONDS: &str = "flowprefill_job_duration_seconds";
/// Time spent queued before a job starts.
pub const QUEUE_WAIT_SECONDS: &str = "flowprefill_queue_wait_seconds";
/// Wall time of each phase on each rank, by method, phase, rank.
pub const PHASE_SECONDS: &str = "flowprefill_phase_duration_seconds";
/// Counter of seconds of model work per op family (matmul, attention, norm_rope, other) and
/// rank: device time from CUDA events on a GPU, wall time on the CPU (rendered by [`render`]).
pub const OP_SECONDS: &str = "flowprefill_op_seconds_total";
/// Jobs that ran out of memory, by device (`cuda:N`, `cpu`).
pub const OUT_OF_MEMORY: &str = "flowprefill_out_of_memory_total";
/// Slowest minus fastest rank per phase, by phase.
pub const STRAGGLER_GAP_SECONDS: &str = "flowprefill_straggler_gap_seconds";
/// Payload bytes sent per collective, transport (`host` or the device plane, `nccl`) and rank.
pub const COLLECTIVE_BYTES: &str = "flowprefill_collective_bytes_total";
/// Counter of seconds spent waiting per collective, transport and rank (rendered by [`render`]).
pub const COLLECTIVE_WAIT_SECONDS: &str = "flowprefill_collective_wait_seconds_total";
/// Tokens recomputed per rank.
pub const SELECTED_TOKENS: &str = "flowprefill_selected_tokens_total";
/// Context tokens processed, by method.
pub const CONTEXT_TOKENS: &str = "flowprefill_context_tokens_total";
/// Recomputed fraction of the context per job, by method.
pub const RECOMPUTE_RATIO: &str = "flowprefill_recompute_ratio";
/// Chunk-store lookups that hit.
pub const CACHE_HITS: &str = "flowprefill_chunk_cache_hits_total";
/// Chunk-store lookups that missed (chunks prefilled).
pub const CACHE_MISSES: &str = "flowprefill_chunk_cache_misses_total";
/// Chunk-store hits by tier (`ram`, `disk`: read from the store's folder).
pub const STORE_HITS: &str = "flowprefill_store_hits_total";
/// Bytes rank 0's chunk store holds, by tier (`ram`, `disk`: what this process knows of the
/// shared folder).
pub const STORE_BYTES: &str = "flowprefill_store_bytes";
/// Damaged disk entries dropped (truncated, a wrong checksum), by every process's store.
pub const STORE_CORRUPT: &str = "flowprefill_store_corrupt_total";
/// Disk writes skipped after an error (a full disk), by every process's store.
pub const STORE_WRITE_FAILURES: &str = "flowprefill_store_write_failures_total";
/// Bytes held by rank 0's chunk store.
pub const CACHE_BYTES: &str = "flowprefill_chunk_cache_bytes";
/// Counter: context K/V bytes freed by eviction before decoding (`evict`), by policy.
pub const EVICTED_BYTES: &str = "flowprefill_kv_evicted_bytes_total";
/// Bytes a job can take on rank 0's device.
pub const MEMORY_FREE: &str = "flowprefill_memory_free_bytes";
/// Jobs waiting in the queue.
pub const QUEUE_DEPTH: &str = "flowprefill_queue_depth";
/// Jobs the queue can hold.
pub const QUEUE_CAPACITY: &str = "flowprefill_queue_capacity";
/// Jobs being computed (0 or 1: one model, one world).
pub const JOBS_IN_FLIGHT: &str = "flowprefill_jobs_in_flight";
/// The phase the job computing now is in on rank 0 (1; every other phase 0), set as phases
/// start and end: what a long job is doing before its histograms are recorded at its end.
pub const JOB_PHASE: &str = "flowprefill_job_phase";
/// When the job computing now started (Unix seconds; 0 when none is): `time() - ...` is its age.
pub const JOB_START_TIME: &str = "flowprefill_job_start_time_seconds";
/// Answer tokens generated, by method (cancelled jobs' too, and what failed jobs produced before they failed).
pub const GENERATED_TOKENS: &str = "flowprefill_generated_tokens_total";
/// `POST /v1/documents` requests waiting or prefilling (they share the device with the jobs).
pub const INGESTIONS_IN_FLIGHT: &str = "flowprefill_ingestions_in_flight";
/// Finished jobs, by method and outcome (ok; error: the server's fault; refused: the request's,
/// found by the ranks; cancelled; deadline).
pub const JOBS_TOTAL: &str = "flowprefill_jobs_total";
/// Errors answered, by kind.
pub const ERRORS_TOTAL: &str = "flowprefill_errors_total";
/// Counter: chunk-store misses (prefilled chunks), by rank.
pub const STORE_MISSES: &str = "flowprefill_store_misses_total";
/// Documents ingested by `POST /v1/documents`, by outcome (prefilled, held: already stored).
pub const DOCUMENTS_INGESTED: &str = "flowprefill_documents_ingested_total";
/// KL (nats) of a verified answer's first token distribution from the exact one, by method.
pub const QUALITY_KL: &str = "flowprefill_quality_kl";
/// Verified jobs, by method and verdict (`ok`, `breached`; `failed`: the exact twin failed).
pub const VERIFIED: &str = "flowprefill_verified_total";
/// Verified jobs answered from the exact computation after a breach, by method.
pub const QUALITY_FALLBACKS: &str = "flowprefill_quality_fallbacks_total";
/// Ranks of the world.
pub const RANKS: &str = "flowprefill_ranks";
/// Ranks currently usable.
pub const RANKS_UP: &str = "flowprefill_ranks_up";

/// Latency buckets in seconds, up to 2560 s: vLLM's TTFT buckets (mistral.rs uses the same),
/// long-context jobs on CPU take minutes.
pub const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    160.0, 320.0, 640.0, 1280.0, 2560.0,
];
/// KL buckets in nats: agreement to a few digits up to a different answer.
pub const KL_BUCKETS: &[f64] = &[0.0001, 0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0];
/// What an infinite KL (logits that are no distribution, a token given no chance) is recorded
/// as: past the last bucket, and finite, so that `_sum` keeps meaning something afterwards.
pub const KL_RECORDED_MAX: f64 = 100.0;
/// Buckets of a fraction in [0, 1].
pub const RATIO_BUCKETS: &[f64] = &[0.0, 0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0];

/// [`OP_SECONDS`], by op family and rank.
static OP_TIME: SecondsCounter<2> = SecondsCounter::new(
    OP_SECONDS,
    "Seconds of model work per op family (matmul, attention, norm_rope, other) and rank; device time on a GPU",
    ["op", "rank"],
);
/// [`COLLECTIVE_WAIT_SECONDS`], by collective, transport and rank.
static COLLECTIVE_WAIT_TIME: SecondsCounter<3> = SecondsCounter::new(
    COLLECTIVE_WAIT_SECONDS,
    "Seconds waited per collective, transport (host or nccl) and rank",
    ["collective", "transport", "rank"],
);

/// A Prometheus counter of seconds with fractions, by `N` labels: the `metrics` crate's
/// counters are integers (whole microseconds would put a non-base unit in the name and lose
/// the waits below one). Monotonic: only non-negative amounts are added.
struct SecondsCounter<const N: usize> {
    name: &'static str,
    help: &'static str,
    labels: [&'static str; N],
    series: Mutex<BTreeMap<[String; N], f64>>,
}

impl<const N: usize> SecondsCounter<N> {
    /// A counter `name` (ending in `_seconds_total`) with its HELP text and label names.
    const fn new(name: &'static str, help: &'static str, labels: [&'static str; N]) -> Self {
        SecondsCounter { name, help, labels, series: Mutex::new(BTreeMap::new()) }
    }

    /// Adds `seconds` to the series of label `values` (in the order of the label names),
    /// creating it at 0. A negative or non-finite amount adds nothing: a counter never goes down.
    fn add(&self, values: [String; N], seconds: f64) {
        let amount = if seconds.is_finite() && seconds > 0.0 { seconds } else { 0.0 };
        *self.series.lock().unwrap_or_else(PoisonError::into_inner).entry(values).or_insert(0.0) += amount;
    }

    /// Appends the family in the text exposition format (HELP, TYPE, a line per series, a blank
    /// line); nothing before the first [`add`](Self::add), as the exporter does.
    fn render_into(&self, out: &mut String) {
        let series = self.series.lock().unwrap_or_else(PoisonError::into_inner);
        if series.is_empty() {
            return;
        }
        let _ = writeln!(out, "# HELP {} {}", self.name, escape(self.help, false));
        let _ = writeln!(out, "# TYPE {} counter", self.name);
        for (values, seconds) in series.iter() {
            out.push_str(self.name);
            if N > 0 {
                out.push('{');
                for (i, (label, value)) in self.labels.iter().zip(values).enumerate() {
                    let comma = if i > 0 { "," } else { "" };
                    let _ = write!(out, "{comma}{label}=\"{}\"", escape(value, true));
                }
                out.push('}');
            }
            let _ = writeln!(out, " {seconds}");
        }
        out.push('\n');
    }
}

/// Escapes a HELP text (backslash, line feed) or, with `quote`, a label value (also `"`).
fn escape(s: &str, quote: bool) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '"' if quote => out.push_str("\\\""),
            c => out.push(c),
        }
    }
    out
}

/// The `/metrics` text: the exporter's families, then the counters of seconds.
pub fn render(prom: &PrometheusHandle) -> String {
    let mut out = prom.render();
    OP_TIME.render_into(&mut out);
    COLLECTIVE_WAIT_TIME.render_into(&mut out);
    out
}

/// Installs the global recorder once (the exporter renders on `/metrics`).
pub fn install() -> anyhow::Result<PrometheusHandle> {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    if let Some(h) = HANDLE.get() {
        return Ok(h.clone());
    }
    let mut b = PrometheusBuilder::new();
    for name in [TTFT_SECONDS, JOB_SECONDS, QUEUE_WAIT_SECONDS, PHASE_SECONDS, STRAGGLER_GAP_SECONDS] {
        b = b.set_buckets_for_metric(Matcher::Full(name.into()), LATENCY_BUCKETS)?;
    }
    b = b.set_buckets_for_metric(Matcher::Full(RECOMPUTE_RATIO.into()), RATIO_BUCKETS)?;
    b = b.set_buckets_for_metric(Matcher::Full(QUALITY_KL.into()), KL_BUCKETS)?;
    let h = b.install_recorder()?;
    describe();
    // The failures an alert counts exist from the start at 0: a series made by its first
    // increment shows no increase, so a process's first rank failure would never alert.
    for kind in ["rank_failure", "device_failure"] {
        counter!(ERRORS_TOTAL, "kind" => kind).absolute(0);
    }
    Ok(HANDLE.get_or_init(|| h).clone())
}

fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    describe_histogram!(
        TTFT_SECONDS,
        Unit::Seconds,
        "Time to first token from the request's arrival, queueing included"
    );
    describe_histogram!(JOB_SECONDS, Unit::Seconds, "Job duration, queueing excluded");
    describe_histogram!(QUEUE_WAIT_SECONDS, Unit::Seconds, "Time queued before a job starts");
    describe_histogram!(PHASE_SECONDS, Unit::Seconds, "Wall time per phase and rank");
    describe_histogram!(STRAGGLER_GAP_SECONDS, Unit::Seconds, "Slowest minus fastest rank per phase");
    describe_counter!(COLLECTIVE_BYTES, Unit::Bytes, "Payload bytes sent per collective, transport and rank");
    describe_counter!(OUT_OF_MEMORY, Unit::Count, "Jobs that ran out of memory, by device");
    describe_counter!(SELECTED_TOKENS, Unit::Count, "Tokens recomputed per rank");
    describe_counter!(CONTEXT_TOKENS, Unit::Count, "Context tokens processed");
    describe_histogram!(RECOMPUTE_RATIO, Unit::Count, "Recomputed fraction of the context per job");
    describe_counter!(CACHE_HITS, Unit::Count, "Chunk-store hits");
    describe_counter!(STORE_HITS, Unit::Count, "Chunk-store hits by tier (ram, disk) and rank");
    describe_counter!(STORE_MISSES, Unit::Count, "Chunk-store misses (chunks prefilled) by rank");
    describe_gauge!(STORE_BYTES, Unit::Bytes, "Bytes rank 0's chunk store holds, by tier (ram, disk)");
    describe_counter!(
        STORE_CORRUPT,
        Unit::Count,
        "Damaged disk files dropped, by every rank (never served; two ranks may both find one)"
    );
    describe_counter!(STORE_WRITE_FAILURES, Unit::Count, "Disk writes skipped after an error (a full disk)");
    describe_counter!(CACHE_MISSES, Unit::Count, "Chunk-store misses");
    describe_gauge!(CACHE_BYTES, Unit::Bytes, "Bytes in rank 0's chunk store");
    describe_counter!(EVICTED_BYTES, Unit::Bytes, "Context K/V bytes freed by eviction before decoding, all ranks");
    describe_gauge!(
        MEMORY_FREE,
        Unit::Bytes,
        "Bytes a job can take on the device of rank 0, by device (read at admission and /readyz)"
    );
    describe_gauge!(QUEUE_DEPTH, Unit::Count, "Jobs waiting");
    describe_gauge!(QUEUE_CAPACITY, Unit::Count, "Jobs the queue can hold");
    describe_gauge!(JOBS_IN_FLIGHT, Unit::Count, "Jobs computing");
    describe_gauge!(JOB_PHASE, Unit::Count, "1 for the phase rank 0's computing job is in, 0 for the others");
    describe_gauge!(JOB_START_TIME, Unit::Seconds, "Unix time the computing job started (0: none)");
    describe_counter!(GENERATED_TOKENS, Unit::Count, "Answer tokens generated, by method");
    describe_gauge!(INGESTIONS_IN_FLIGHT, Unit::Count, "Document ingestions waiting or prefilling");
    describe_counter!(JOBS_TOTAL, Unit::Count, "Finished jobs by outcome");
    describe_counter!(DOCUMENTS_INGESTED, Unit::Count, "Documents ingested into the chunk store, by outcome");
    describe_counter!(ERRORS_TOTAL, Unit::Count, "Errors answered by kind");
    describe_histogram!(QUALITY_KL, Unit::Count, "KL (nats) of a verified answer's first token from the exact one");
    describe_counter!(VERIFIED, Unit::Count, "Verified jobs, by method and verdict (ok, breached, failed)");
    describe_counter!(QUALITY_FALLBACKS, Unit::Count, "Verified jobs answered from the exact computation");
    describe_gauge!(RANKS, Unit::Count, "Ranks of the world");
    describe_gauge!(RANKS_UP, Unit::Count, "Ranks usable");
}

/// Counts `kind` errors.
pub fn error(kind: &'static str) {
    counter!(ERRORS_TOTAL, "kind" => kind).increment(1);
}

/// Free memory of `device` as admission sees it.
pub fn memory_free(device: &str, bytes: usize) {
    gauge!(MEMORY_FREE, "device" => device.to_string()).set(bytes as f64);
}

/// The chunk store's size by tier: after every job, and at every idle tick (an ingestion, a
/// failed job's release, an out-of-memory's room-making change it between jobs).
pub fn store_bytes(cache_bytes: usize, disk: Option<DiskStats>) {
    gauge!(CACHE_BYTES).set(cache_bytes as f64);
    gauge!(STORE_BYTES, "tier" => "ram").set(cache_bytes as f64);
    // Without a disk tier: 0 disk bytes, nothing dropped or skipped (the series exist either way).
    let d = disk.unwrap_or_default();
    gauge!(STORE_BYTES, "tier" => "disk").set(d.bytes as f64);
}

/// [`TTFT_SECONDS`] of a job that produced a token (a cancelled one too): `before` (from the
/// request's arrival to the job's start on the ranks) plus the engine's time to its first token.
pub fn record_first_token(r: &RunResult, before: Duration) {
    if r.tokens.is_empty() {
        return;
    }
    let method = method_label(r.method, r.opts.reorder);
    histogram!(TTFT_SECONDS, "method" => method).record((before + r.ttft).as_secs_f64());
}

/// Counts a job that ran out of memory on `device`.
pub fn out_of_memory(device: &str) {
    counter!(OUT_OF_MEMORY, "device" => device.to_string()).increment(1);
}

/// Counts a document ingested: its caches prefilled now, or held already.
pub fn document_ingested(prefilled: bool) {
    counter!(DOCUMENTS_INGESTED, "outcome" => if prefilled { "prefilled" } else { "held" }).increment(1);
}

/// A job's `method` label: the method (the one `auto` chose, once it has), `+reorder` when
/// reordered; the same for every outcome.
pub fn method_label(method: impl std::fmt::Display, reorder: bool) -> String {
    if reorder {
        format!("{method}+reorder")
    } else {
        method.to_string()
    }
}

/// Counts a finished job.
pub fn job_outcome(method: &str, outcome: &'static str) {
    counter!(JOBS_TOTAL, "method" => method.to_string(), "outcome" => outcome).increment(1);
}

/// Records everything a successful job reports; `cache_bytes` and `disk` are rank 0's chunk
/// store's RAM bytes and disk tier counters.
pub fn record_job(r: &RunResult, before: Duration, cache_bytes: usize, disk: Option<DiskStats>) {
    let method = method_label(r.method, r.opts.reorder);
    record_first_token(r, before);
    generated_tokens(r);
    histogram!(JOB_SECONDS, "method" => method.clone()).record(r.total.as_secs_f64());
    counter!(CONTEXT_TOKENS, "method" => method.clone()).increment(r.n_context_tokens as u64);
    if r.n_context_tokens > 0 {
        histogram!(RECOMPUTE_RATIO, "method" => method.clone())
            .record(r.n_selected() as f64 / r.n_context_tokens as f64);
    }
    counter!(CACHE_HITS).increment(r.cache_hits);
    counter!(CACHE_MISSES).increment(r.cache_misses);
    // Per rank: where cache-aware sharding sent each chunk shows as hits on that rank.
    for s in &r.rank_stats {
        let rank = s.rank.to_string();
        let ram = s.cache_hits.saturating_sub(s.cache_disk_hits);
        counter!(STORE_HITS, "tier" => "ram", "rank" => rank.clone()).increment(ram);
        counter!(STORE_HITS, "tier" => "disk", "rank" => rank.clone()).increment(s.cache_disk_hits);
        counter!(STORE_MISSES, "rank" => rank).increment(s.cache_misses);
    }
    store_bytes(cache_bytes, disk);
    store_faults_of(r);
    match (&r.quality, &r.verify_error) {
        (Some(q), _) => {
            histogram!(QUALITY_KL, "method" => method.clone()).record(q.kl.min(KL_RECORDED_MAX));
            let verdict = if q.breached { "breached" } else { "ok" };
            counter!(VERIFIED, "method" => method.clone(), "verdict" => verdict).increment(1);
            if q.fell_back {
                counter!(QUALITY_FALLBACKS, "method" => method.clone()).increment(1);
            }
        }
        (None, Some(_)) => counter!(VERIFIED, "method" => method.clone(), "verdict" => "failed").increment(1),
        (None, None) => {}
    }
    if let Some(e) = &r.eviction {
        let freed = e.bytes_before.saturating_sub(e.bytes_after) as u64;
        counter!(EVICTED_BYTES, "policy" => e.policy.to_string()).increment(freed);
    }
    let mut phases: Vec<&str> = Vec::new();
    for s in &r.rank_stats {
        let rank = s.rank.to_string();
        for (p, ms) in &s.phases {
            histogram!(PHASE_SECONDS, "method" => method.clone(), "phase" => p.clone(), "rank" => rank.clone())
                .record(ms / 1e3);
            if !phases.contains(&p.as_str()) {
                phases.push(p);
            }
        }
        for (family, ms) in &s.ops {
            OP_TIME.add([family.clone(), rank.clone()], ms / 1e3);
        }
        for (op, o) in &s.comm.ops {
            // `<collective>@<plane>`: buffers that went over a device plane (NCCL); the rest
            // went through the communicator (host).
            let (collective, transport) = op.split_once('@').unwrap_or((op.as_str(), "host"));
            let labels =
                [("collective", collective.to_string()), ("transport", transport.to_string()), ("rank", rank.clone())];
            counter!(COLLECTIVE_BYTES, &labels).increment(o.bytes_sent);
            COLLECTIVE_WAIT_TIME.add(labels.map(|(_, v)| v), o.wait_s);
        }
        counter!(SELECTED_TOKENS, "rank" => rank.clone()).increment(s.selected as u64);
    }
    for p in phases {
        let times: Vec<f64> =
            r.rank_stats.iter().filter_map(|s| s.phases.iter().find(|(n, _)| n == p).map(|x| x.1)).collect();
        if times.len() == r.rank_stats.len() && !times.is_empty() {
            let (lo, hi) = times.iter().fold((f64::MAX, f64::MIN), |(lo, hi), &t| (lo.min(t), hi.max(t)));
            histogram!(STRAGGLER_GAP_SECONDS, "phase" => p.to_string()).record((hi - lo) / 1e3);
        }
    }
    job_outcome(&method, "ok");
}

/// Sets the rank gauges.
pub fn ranks(total: usize, up: usize) {
    gauge!(RANKS).set(total as f64);
    gauge!(RANKS_UP).set(up as f64);
}

/// Damaged disk entries dropped and disk writes skipped, newly seen (by a job's ranks or an
/// ingestion).
pub fn store_faults(corrupt: u64, write_failures: u64) {
    counter!(STORE_CORRUPT).increment(corrupt);
    counter!(STORE_WRITE_FAILURES).increment(write_failures);
}

/// The store faults a job's ranks reported: every process's, each once (rank 0's store alone
/// missed those of the other processes under mpirun).
pub fn store_faults_of(r: &RunResult) {
    store_faults(
        r.rank_stats.iter().map(|s| s.disk_corrupt).sum(),
        r.rank_stats.iter().map(|s| s.disk_write_failures).sum(),
    );
}

/// Queue depth gauge.
pub fn queue_depth(n: usize) {
    gauge!(QUEUE_DEPTH).set(n as f64);
}

/// Queue capacity gauge.
pub fn queue_capacity(n: usize) {
    gauge!(QUEUE_CAPACITY).set(n as f64);
}

/// Jobs computing (0 or 1: the executor computes one at a time), with the start time of the
/// one computing now (0: none) and every phase at 0 until its first starts ([`job_phase`]).
pub fn jobs_in_flight(n: usize) {
    gauge!(JOBS_IN_FLIGHT).set(n as f64);
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
    gauge!(JOB_START_TIME).set(if n > 0 { now.map_or(0.0, |d| d.as_secs_f64()) } else { 0.0 });
    for p in flowprefill_coordinator::timings::phase::ALL {
        gauge!(JOB_PHASE, "phase" => p).set(0.0);
    }
}

/// The computing job left phase `left` for phase `entered` (`None`: between phases).
pub fn job_phase(left: Option<&'static str>, entered: Option<&'static str>) {
    if let Some(p) = left {
        gauge!(JOB_PHASE, "phase" => p).set(0.0);
    }
    if let Some(p) = entered {
        gauge!(JOB_PHASE, "phase" => p).set(1.0);
    }
}

/// Counts the answer tokens of a job (finished or cancelled).
pub fn generated_tokens(r: &RunResult) {
    counter!(GENERATED_TOKENS, "method" => method_label(r.method, r.opts.reorder)).increment(r.tokens.len() as u64);
}

/// Counts `n` answer tokens of a failed job of `method` (its label, [`method_label`]), from
/// the tally rank 0 kept as it took them; nothing when it failed before its first token.
pub fn generated_token_count(method: &str, n: u64) {
    if n > 0 {
        counter!(GENERATED_TOKENS, "method" => method.to_string()).increment(n);
    }
}

/// Moves [`INGESTIONS_IN_FLIGHT`] by `by` (one update: two concurrent ones cannot leave it
/// stale, as setting it from counts read apart could; by 0 at start, so the series exists).
pub fn ingestions_change(by: f64) {
    gauge!(INGESTIONS_IN_FLIGHT).increment(by);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seconds_counters_render_fractions_escape_labels_and_never_go_down() {
        let c = SecondsCounter::new("x_wait_seconds_total", "Seconds \\ waited\nper rank", ["op", "rank"]);
        let mut out = String::new();
        c.render_into(&mut out);
        assert_eq!(out, "", "no family before the first add");
        c.add(["matmul".into(), "0".into()], 0.25);
        c.add(["matmul".into(), "0".into()], 0.000_000_5);
        c.add(["a\"b\\c\nd".into(), "1".into()], -3.0);
        c.add(["a\"b\\c\nd".into(), "1".into()], f64::NAN);
        c.add(["matmul".into(), "0".into()], f64::INFINITY);
        c.render_into(&mut out);
        assert_eq!(
            out,
            "# HELP x_wait_seconds_total Seconds \\\\ waited\\nper rank\n\
             # TYPE x_wait_seconds_total counter\n\
             x_wait_seconds_total{op=\"a\\\"b\\\\c\\nd\",rank=\"1\"} 0\n\
             x_wait_seconds_total{op=\"matmul\",rank=\"0\"} 0.2500005\n\n"
        );
    }
}
