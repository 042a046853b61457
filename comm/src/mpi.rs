//! Ranks as MPI processes (`mpirun -np N flowprefill ...`), feature `mpi`.
//!
//! All MPI calls happen on one dedicated communication thread, which initialises MPI, so the
//! compute thread never blocks inside MPI:
//!
//! ```text
//!   compute thread                       comm thread (owns MPI)
//!   post(sends, from) ── job ──────────> isend all; until every `from` message is in and
//!   ... compute the current block ...                 every send completed: receive whatever
//!   wait() <── reply (deadline) ──────── messages     arrived (from anyone) into per-peer queues
//!   poll_abort() ─── poll ─────────────> receive whatever arrived; any abort of this job?
//!   (idle)                               every millisecond: receive whatever arrived
//! ```
//! Sends are immediate (non-blocking) and the comm thread keeps receiving everything that
//! arrives while it completes them, so two ranks sending to each other cannot deadlock whatever
//! the message size, and a message nobody waits for any more (a job that was aborted) is still
//! taken off the wire and dropped. The compute side waits with a deadline: a peer that died or
//! hangs becomes [`CommError::Timeout`] naming the rank the comm thread was waiting on. The comm
//! thread is then abandoned and the process should exit.
//!
//! Every comm thread also tells every other process of the world that it is alive, every
//! [`BEAT_EVERY`], in messages of their own tag, whatever its compute thread does (loading a
//! model, computing a block it takes part in or not). A wait with a silence limit
//! ([`Communicator::set_silence_limit`]: the start's agreement, which waits for slow loads for
//! up to half an hour, and [`MpiComm::use_group`]) names a peer whose process has gone silent
//! (killed, or its host gone) within that limit instead of at its deadline.

use crate::wire::{find_abort, seal_abort, seal_data, seal_leave, take_ready};
use crate::{check_rank, silence_limit, CommError, CommStats, Communicator, ErrorClass, Result, DEFAULT_TIMEOUT};
use mpi::point_to_point::{Destination, MatchedReceiveVec, Source};
use mpi::topology::Communicator as _;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// One exchange for the comm thread: sealed messages out, one message in from each `from`.
struct Exchange {
    sends: Vec<(usize, Vec<u8>)>,
    from: Vec<usize>,
    epoch: u64,
    op: String,
}

enum Job {
    Exchange(Exchange),
    Poll {
        epoch: u64,
        op: String,
    },
    /// Make the first `size` world ranks the active group (collective over the world).
    Group {
        size: usize,
    },
    Shutdown,
}

type Reply = Result<Vec<Vec<u8>>>;

/// The tag of every job's messages.
const DATA: mpi::Tag = 0;
/// The tag of the beats that say a process is alive.
const BEAT: mpi::Tag = 1;
/// The tag of [`MpiComm::use_group`]'s gate (every process of the world has reached it).
const GATE: mpi::Tag = 2;

/// How often each communication thread tells every other process it is alive.
pub const BEAT_EVERY: Duration = Duration::from_millis(500);

/// The one byte of a beat (a static buffer: a beat's send may outlive any stack frame).
static BEAT_BYTE: [u8; 1] = [0];

/// How often a wait with a silence limit looks at when its peer was last heard from.
const SILENCE_CHECK: Duration = Duration::from_millis(100);

/// When each process of the world was last heard from: written by the communication thread at
/// each beat it receives, read by the compute side while it waits.
struct Heard {
    start: Instant,
    /// Milliseconds after `start`, per world rank (0: not yet heard, counted from the start).
    ms: Vec<AtomicU64>,
}

impl Heard {
    fn new(processes: usize) -> Self {
        Self { start: Instant::now(), ms: (0..processes).map(|_| AtomicU64::new(0)).collect() }
    }

    fn mark(&self, rank: usize) {
        if let Some(m) = self.ms.get(rank) {
            m.store(self.start.elapsed().as_millis() as u64, Ordering::Relaxed);
        }
    }

    /// How long `rank` has been silent.
    fn quiet(&self, rank: usize) -> Duration {
        let last = self.ms.get(rank).map_or(0, |m| m.load(Ordering::Relaxed));
        self.start.elapsed().saturating_sub(Duration::from_millis(last))
    }

    /// The rank to say a wait is on, of the world ranks `missing` (in order): the first one
    /// that has missed its last beats, else the first one, so that a process that died behind
    /// one that is slow is named within the silence limit.
    fn waited_on(&self, missing: impl Iterator<Item = usize> + Clone) -> Option<usize> {
        let silent = missing.clone().find(|&r| self.quiet(r) > 3 * BEAT_EVERY);
        silent.or_else(|| missing.into_iter().next())
    }
}

type BeatSend = mpi::request::Request<'static, [u8], mpi::request::StaticScope>;

/// The communication thread's side of the beats.
struct Pulse {
    heard: Arc<Heard>,
    me: usize,
    sent: Option<Instant>,
    looked: Option<Instant>,
    /// Each peer's beat still in flight (a peer that stopped taking them, or is gone).
    in_flight: Vec<Option<BeatSend>>,
}

impl Pulse {
    fn new(heard: Arc<Heard>, me: usize) -> Self {
        let in_flight = (0..heard.ms.len()).map(|_| None).collect();
        Self { heard, me, sent: None, looked: None, in_flight }
    }

    /// Takes the beats that arrived (at most every few milliseconds) and sends this process's
    /// when one is due. Beats are sent without blocking, and a peer whose last one has not
    /// left yet gets none more: a stopped peer never holds up the thread.
    fn tick(&mut self, whole: &mpi::topology::SimpleCommunicator) {
        let due = |t: Option<Instant>, every: Duration| t.is_none_or(|t| t.elapsed() >= every);
        if due(self.looked, Duration::from_millis(5)) {
            while let Some(probed) = whole.any_process().immediate_matched_probe_with_tag(BEAT) {
                let (_, status) = probed.matched_receive_vec::<u8>();
                self.heard.mark(status.source_rank() as usize);
            }
            self.looked = Some(Instant::now());
        }
        if due(self.sent, BEAT_EVERY) {
            for (r, slot) in self.in_flight.iter_mut().enumerate().filter(|(r, _)| *r != self.me) {
                *slot = match slot.take().map(|req| req.test()) {
                    Some(Err(still)) => Some(still),
                    _ => Some(whole.process_at_rank(r as i32).immediate_send_with_tag(
                        mpi::request::StaticScope,
                        &BEAT_BYTE[..],
                        BEAT,
                    )),
                };
            }
            self.sent = Some(Instant::now());
        }
    }
}

impl Drop for Pulse {
    /// At the end, a beat that never left (its peer gone) is abandoned: a request dropped
    /// before it completed would panic.
    fn drop(&mut self) {
        for req in self.in_flight.drain(..).flatten() {
            if let Err(still) = req.test() {
                std::mem::forget(still);
            }
        }
    }
}

struct Pending {
    op: String,
    sent: usize,
    first_from: Option<usize>,
}

/// One MPI process rank.
pub struct MpiComm {
    rank: usize,
    size: usize,
    jobs: Sender<Job>,
    replies: Receiver<Reply>,
    /// The world rank the comm thread waits on (`usize::MAX`: none).
    waiting_on: Arc<AtomicUsize>,
    /// Bytes of the current exchange's sends not yet completed (for a timeout's message).
    unsent: Arc<AtomicU64>,
    heard: Arc<Heard>,
    timeout: Duration,
    silence: Option<Duration>,
    pending: Option<Pending>,
    stats: CommStats,
    plane: Option<Box<dyn crate::plane::Plane>>,
    thread: Option<JoinHandle<()>>,
    healthy: bool,
    epoch: u64,
    world_rank: usize,
    world_size: usize,
}

/// True when this process was started by an MPI launcher (OpenMPI, MPICH/PMI, PMIx).
pub fn launched_by_mpirun() -> bool {
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS"].iter().any(|v| std::env::var_os(v).is_some())
}

impl MpiComm {
    /// Initialises MPI on the communication thread. A process started without `mpirun` is
    /// rank 0 of a world of 1.
    pub fn init() -> Result<Self> {
        let (jobs_tx, jobs_rx) = channel::<Job>();
        let (reply_tx, reply_rx) = channel::<Reply>();
        let (init_tx, init_rx) = channel::<Result<(usize, usize, Arc<Heard>)>>();
        let waiting_on = Arc::new(AtomicUsize::new(usize::MAX));
        let waiting = waiting_on.clone();
        let unsent = Arc::new(AtomicU64::new(0));
        let in_flight = unsent.clone();
        let thread = std::thread::Builder::new()
            .name("mpi-comm".into())
            .spawn(move || comm_thread(jobs_rx, reply_tx, init_tx, Watch { waiting, unsent: in_flight }))
            .map_err(|e| CommError::Mpi(format!("cannot start the communication thread: {e}")))?;
        let (rank, size, heard) = init_rx
            .recv_timeout(Duration::from_secs(120))
            .map_err(|_| CommError::Mpi("MPI initialisation did not finish".into()))??;
        Ok(Self {
            rank,
            size,
            jobs: jobs_tx,
            replies: reply_rx,
            waiting_on,
            unsent,
            heard,
            timeout: DEFAULT_TIMEOUT,
            silence: None,
            pending: None,
            stats: CommStats::default(),
            plane: None,
            thread: Some(thread),
            healthy: true,
            epoch: 0,
            world_rank: rank,
            world_size: size,
        })
    }

    /// Makes the first `size` processes of the world the group this communicator works in
    /// (all of them: `size` = world size), so that one `mpirun` can measure several rank
    /// counts. Collective over the whole world: every process calls it with the same `size`,
    /// between jobs. Returns whether this process is in the group; a process outside it waits
    /// for the next call (which returns once the group's members make it too), with `timeout`.
    pub fn use_group(&mut self, size: usize, timeout: Duration) -> Result<bool> {
        if self.pending.is_some() || !self.healthy {
            return Err(CommError::Misuse("use_group between jobs only, on a healthy communicator".into()));
        }
        let world_rank = self.world_rank;
        if size == 0 || size > self.world_size {
            return Err(CommError::Misuse(format!("a group of {size} ranks in a world of {}", self.world_size)));
        }
        // A process outside the block waits for as long as the block runs; one that died
        // meanwhile is named after the communicator's own timeout of silence (at most a minute).
        let saved = std::mem::replace(&mut self.timeout, timeout);
        let silence = self.silence.replace(silence_limit(saved.min(timeout)));
        let got = self.call_as(Job::Group { size }, Ranks::World);
        (self.timeout, self.silence) = (saved, silence);
        let got = got.map_err(|e| named(e, "use_group"))?;
        let word = |i: usize| -> usize {
            got.get(i).and_then(|b| b.get(..4)).map_or(0, |b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
        };
        self.rank = word(0);
        self.size = word(1);
        self.epoch += 1;
        Ok(world_rank < size)
    }

    /// Rank in the whole world (not the group).
    pub fn world_rank(&self) -> usize {
        self.world_rank
    }

    /// Processes in the world.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// Sends a job to the comm thread and waits for its reply (the deadline applies).
    fn call(&mut self, job: Job) -> Reply {
        self.call_as(job, Ranks::Group)
    }

    fn call_as(&mut self, job: Job, ranks: Ranks) -> Reply {
        if !self.healthy {
            return Err(unhealthy());
        }
        self.jobs.send(job).map_err(|_| CommError::Mpi("the communication thread has stopped".into()))?;
        self.reply_as(ranks)
    }

    fn reply(&mut self) -> Reply {
        self.reply_as(Ranks::Group)
    }

    /// The comm thread's reply to the last job; an error names the rank waited on as `ranks`
    /// says. Refused once a reply was missed (a timeout, a silent peer, or the thread gone):
    /// the thread may still answer that old job, and its late reply would be taken for this
    /// one's (a poll would read a stale exchange's `Ok` as "no abort").
    fn reply_as(&mut self, ranks: Ranks) -> Reply {
        if !self.healthy {
            return Err(unhealthy());
        }
        let deadline = crate::deadline_after(self.timeout);
        let step = if self.silence.is_some() { SILENCE_CHECK } else { Duration::MAX };
        loop {
            let left = crate::time_left(deadline);
            let waited = match self.replies.recv_timeout(left.min(step)) {
                Ok(r) => return r,
                Err(RecvTimeoutError::Timeout) => self.waiting_on.load(Ordering::Relaxed),
                Err(RecvTimeoutError::Disconnected) => {
                    self.healthy = false;
                    return Err(CommError::Mpi("the communication thread stopped (MPI error)".into()));
                }
            };
            let rank = match ranks {
                // The group is a run of world ranks starting at this process's offset.
                Ranks::Group if waited != usize::MAX => {
                    waited.checked_sub(self.world_rank - self.rank).unwrap_or(waited)
                }
                _ => waited,
            };
            if let Some(limit) = self.silence.filter(|_| waited < self.world_size) {
                let quiet = self.heard.quiet(waited);
                if quiet > limit {
                    self.healthy = false;
                    return Err(CommError::RankLost {
                        rank,
                        op: "mpi".into(),
                        detail: format!(
                            "nothing heard from its process for {:.0} s: it died, or it or its host stopped",
                            quiet.as_secs_f64()
                        ),
                    });
                }
            }
            if crate::time_left(deadline).is_zero() {
                self.healthy = false;
                return Err(CommError::Timeout {
                    rank,
                    op: "mpi".into(),
                    secs: self.timeout.as_secs_f64(),
                    unsent: self.unsent.load(Ordering::Relaxed),
                });
            }
        }
    }
}

/// How an error names the rank a wait was on: in the current group (a job's exchanges) or
/// in the world ([`MpiComm::use_group`]).
#[derive(Clone, Copy)]
enum Ranks {
    Group,
    World,
}

/// The error of every call after the communicator failed (a missed reply: see
/// [`MpiComm::reply`]).
fn unhealthy() -> CommError {
    CommError::Misuse("the communicator failed earlier (a peer timed out or MPI stopped); the process must exit".into())
}

/// The most bytes one MPI message may carry: MPI counts in `i32` (rsmpi panics past it).
pub const MAX_MESSAGE: usize = i32::MAX as usize;

/// Refuses a sealed message to `to` longer than [`MAX_MESSAGE`], before anything is sent.
fn check_message(op: &str, to: usize, len: usize) -> Result<()> {
    if len > MAX_MESSAGE {
        return Err(CommError::TooLarge {
            op: op.to_string(),
            what: format!("the message to rank {to}"),
            size: len as u64,
            limit: MAX_MESSAGE as u64,
        });
    }
    Ok(())
}

/// A timeout or a silent peer of the communication thread's reply, named after the operation
/// waited for (the thread knows no collective's name for a group or a poll).
fn named(e: CommError, op: &str) -> CommError {
    match e {
        CommError::Timeout { rank, op: o, secs, unsent } if o == "mpi" => {
            CommError::Timeout { rank, op: op.to_string(), secs, unsent }
        }
        CommError::RankLost { rank, op: o, detail } if o == "mpi" => {
            CommError::RankLost { rank, op: op.to_string(), detail }
        }
        e => e,
    }
}

/// Waits a little when nothing arrived: spin briefly (a reply is often microseconds away),
/// then sleep in short steps so that a waiting rank leaves the cores to computing ones.
fn backoff(idle: &mut u32) {
    *idle += 1;
    if *idle < 64 {
        std::thread::yield_now();
    } else {
        std::thread::sleep(Duration::from_micros(50));
    }
}

/// Receives every job message that has arrived, into the sender's queue; true if any did.
fn drain(world: &mpi::topology::SimpleCommunicator, early: &mut [VecDeque<Vec<u8>>]) -> bool {
    let mut any = false;
    while let Some(probed) = world.any_process().immediate_matched_probe_with_tag(DATA) {
        let (v, status) = probed.matched_receive_vec::<u8>();
        if let Some(q) = early.get_mut(status.source_rank() as usize) {
            q.push_back(v);
        }
        any = true;
    }
    any
}

/// What the compute side can read of the comm thread's progress when a deadline passes.
struct Watch {
    /// The world rank the current exchange waits on (`usize::MAX`: none).
    waiting: Arc<AtomicUsize>,
    /// Bytes of the current exchange's sends not yet completed.
    unsent: Arc<AtomicU64>,
}

/// Where the communication thread talks: the active group (the world, or the first ranks of
/// it: see [`MpiComm::use_group`]), and the whole world for the beats.
struct Wires<'a> {
    group: &'a mpi::topology::SimpleCommunicator,
    whole: &'a mpi::topology::SimpleCommunicator,
    /// The world rank of the group's rank 0 (the group is a run of world ranks).
    offset: usize,
}

impl<'a> Wires<'a> {
    fn new(group: &'a mpi::topology::SimpleCommunicator, whole: &'a mpi::topology::SimpleCommunicator) -> Self {
        Self { group, whole, offset: (whole.rank() - group.rank()) as usize }
    }

    /// The world rank of the group's `rank`.
    fn world_rank(&self, rank: usize) -> usize {
        rank + self.offset
    }
}

fn exchange(
    wires: &Wires<'_>,
    pulse: &mut Pulse,
    early: &mut [VecDeque<Vec<u8>>],
    watch: &Watch,
    job: Exchange,
) -> Reply {
    let world = wires.group;
    let waiting = &watch.waiting;
    let Exchange { sends, from, epoch, op } = job;
    mpi::request::scope(|scope| {
        // (peer, bytes, request) of every send not yet completed.
        let mut reqs: Vec<(usize, usize, mpi::request::Request<'_, [u8], _>)> = sends
            .iter()
            .map(|(to, d)| (*to, d.len(), world.process_at_rank(*to as i32).immediate_send(scope, &d[..])))
            .collect();
        let mut pending = reqs.len();
        watch.unsent.store(reqs.iter().map(|r| r.1 as u64).sum(), Ordering::Relaxed);
        let mut got: Vec<Option<Vec<u8>>> = vec![None; from.len()];
        let mut outcome: Result<()> = Ok(());
        let mut idle = 0;
        loop {
            if outcome.is_ok() {
                for (slot, &src) in got.iter_mut().zip(&from) {
                    if slot.is_none() {
                        match take_ready(src, &op, epoch, &mut early[src]) {
                            Ok(d) => *slot = d,
                            Err(e) => {
                                outcome = Err(e);
                                break;
                            }
                        }
                    }
                }
            }
            reqs = reqs.into_iter().filter_map(|(to, n, r)| r.test().err().map(|r| (to, n, r))).collect();
            if reqs.len() != pending {
                pending = reqs.len();
                watch.unsent.store(reqs.iter().map(|r| r.1 as u64).sum(), Ordering::Relaxed);
            }
            let missing = got.iter().zip(&from).filter(|(g, _)| g.is_none()).map(|(_, &r)| wires.world_rank(r));
            let missing = if outcome.is_ok() { pulse.heard.waited_on(missing) } else { None };
            match (missing, reqs.first()) {
                (None, None) => break,
                (Some(r), _) => waiting.store(r, Ordering::Relaxed),
                (None, Some((to, _, _))) => waiting.store(wires.world_rank(*to), Ordering::Relaxed),
            }
            pulse.tick(wires.whole);
            if drain(world, early) {
                idle = 0;
            } else {
                backoff(&mut idle);
            }
        }
        waiting.store(usize::MAX, Ordering::Relaxed);
        watch.unsent.store(0, Ordering::Relaxed);
        outcome.map(|()| got.into_iter().map(Option::unwrap_or_default).collect())
    })
}

/// Every process of the world reaches this gate before any leaves it (a barrier made of
/// messages, so that the thread keeps beating and the compute side can name a silent process
/// while the others sit out a long block).
fn gate(whole: &mpi::topology::SimpleCommunicator, pulse: &mut Pulse, watch: &Watch) {
    let (me, n) = (whole.rank() as usize, whole.size() as usize);
    for r in (0..n).filter(|&r| r != me) {
        whole.process_at_rank(r as i32).send_with_tag(&[0u8][..], GATE);
    }
    let mut arrived: Vec<bool> = (0..n).map(|r| r == me).collect();
    let mut idle = 0;
    let heard = pulse.heard.clone();
    let missing = |arrived: &[bool]| {
        let missing = arrived.iter().enumerate().filter(|(_, a)| !**a).map(|(r, _)| r);
        heard.waited_on(missing)
    };
    while let Some(r) = missing(&arrived) {
        watch.waiting.store(r, Ordering::Relaxed);
        pulse.tick(whole);
        match whole.any_process().immediate_matched_probe_with_tag(GATE) {
            Some(probed) => {
                let (_, status) = probed.matched_receive_vec::<u8>();
                if let Some(a) = arrived.get_mut(status.source_rank() as usize) {
                    *a = true;
                }
                idle = 0;
            }
            None => backoff(&mut idle),
        }
    }
    watch.waiting.store(usize::MAX, Ordering::Relaxed);
}

type Init = Result<(usize, usize, Arc<Heard>)>;

fn comm_thread(jobs: Receiver<Job>, replies: Sender<Reply>, init: Sender<Init>, watch: Watch) {
    let Some((universe, _level)) = mpi::initialize_with_threading(mpi::Threading::Serialized) else {
        let _ = init.send(Err(CommError::Mpi("MPI was already initialised in this process".into())));
        return;
    };
    let whole = universe.world();
    let (world_rank, world_size) = (whole.rank() as usize, whole.size() as usize);
    let heard = Arc::new(Heard::new(world_size));
    let mut pulse = Pulse::new(heard.clone(), world_rank);
    let _ = init.send(Ok((world_rank, world_size, heard)));
    let mut size = world_size;
    let mut early: Vec<VecDeque<Vec<u8>>> = (0..size).map(|_| VecDeque::new()).collect();
    // The active group: the world, or the first ranks of it (see `MpiComm::use_group`).
    let mut group: Option<mpi::topology::SimpleCommunicator> = None;
    loop {
        let job = match jobs.recv_timeout(Duration::from_millis(1)) {
            Ok(j) => j,
            Err(RecvTimeoutError::Timeout) => {
                // Idle: keep taking messages off the wire, so that a peer's send completes
                // even when nobody here waits for it (an abort after this rank ended the job).
                drain(group.as_ref().unwrap_or(&whole), &mut early);
                pulse.tick(&whole);
                continue;
            }
            Err(RecvTimeoutError::Disconnected) => break,
        };
        let reply = match job {
            Job::Exchange(x) => {
                let wires = Wires::new(group.as_ref().unwrap_or(&whole), &whole);
                exchange(&wires, &mut pulse, &mut early, &watch, x)
            }
            Job::Poll { epoch, op } => {
                drain(group.as_ref().unwrap_or(&whole), &mut early);
                pulse.tick(&whole);
                (0..size)
                    .find_map(|r| find_abort(r, &op, epoch, &mut early[r]).transpose())
                    .map_or(Ok(Vec::new()), |e| e.and_then(Err))
            }
            Job::Group { size: want } => {
                gate(&whole, &mut pulse, &watch);
                let color = mpi::topology::Color::with_value(i32::from(world_rank >= want));
                group = whole.split_by_color(color);
                let g = group.as_ref().unwrap_or(&whole);
                size = g.size() as usize;
                early = (0..size).map(|_| VecDeque::new()).collect();
                Ok(vec![(g.rank() as u32).to_le_bytes().to_vec(), (size as u32).to_le_bytes().to_vec()])
            }
            Job::Shutdown => break,
        };
        if replies.send(reply).is_err() {
            break;
        }
    }
    drop(pulse);
    drop(group);
    drop(whole);
    drop(universe); // MPI_Finalize
}

impl crate::ProcessGroup for MpiComm {
    fn use_group(&mut self, size: usize, timeout: Duration) -> Result<bool> {
        MpiComm::use_group(self, size, timeout)
    }
    fn world_rank(&self) -> usize {
        MpiComm::world_rank(self)
    }
    fn world_size(&self) -> usize {
        MpiComm::world_size(self)
    }
}

impl Communicator for MpiComm {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn backend(&self) -> &'static str {
        "mpi"
    }
    fn timeout(&self) -> Duration {
        self.timeout
    }
    fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
        if let Some(p) = &mut self.plane {
            p.set_timeout(timeout);
        }
    }
    fn set_silence_limit(&mut self, limit: Option<Duration>) {
        self.silence = limit.map(silence_limit);
    }

    fn post(&mut self, op: &str, sends: Vec<(usize, Vec<u8>)>, from: Vec<usize>) -> Result<()> {
        if let Some(p) = &self.pending {
            return Err(CommError::Misuse(format!("`{op}` posted while `{}` is still pending (wait first)", p.op)));
        }
        if !self.healthy {
            return Err(unhealthy());
        }
        for &r in sends.iter().map(|(r, _)| r).chain(&from) {
            check_rank(r, self.size)?;
            if r == self.rank {
                return Err(CommError::Misuse(format!("`{op}`: rank {r} cannot message itself")));
            }
        }
        let sent = sends.iter().map(|(_, d)| d.len()).sum();
        let first_from = from.first().copied().or(sends.first().map(|s| s.0));
        let sends: Vec<(usize, Vec<u8>)> =
            sends.into_iter().map(|(to, d)| (to, seal_data(d, op, self.epoch))).collect();
        for (to, d) in &sends {
            check_message(op, *to, d.len())?;
        }
        self.jobs
            .send(Job::Exchange(Exchange { sends, from, epoch: self.epoch, op: op.to_string() }))
            .map_err(|_| CommError::Mpi("the communication thread has stopped".into()))?;
        self.pending = Some(Pending { op: op.to_string(), sent, first_from });
        Ok(())
    }

    fn wait(&mut self) -> Result<Vec<Vec<u8>>> {
        let p = self.pending.take().ok_or_else(|| CommError::Misuse("wait without a posted exchange".into()))?;
        let t0 = Instant::now();
        match self.reply() {
            Ok(got) => {
                let received = got.iter().map(Vec::len).sum();
                self.stats.record(&p.op, p.sent, received, t0.elapsed());
                Ok(got)
            }
            Err(CommError::Timeout { rank, secs, unsent, .. }) => {
                let rank = if rank == usize::MAX { p.first_from.unwrap_or(0) } else { rank };
                Err(CommError::Timeout { rank, op: p.op, secs, unsent })
            }
            Err(e) => Err(named(e, &p.op)),
        }
    }

    fn abort(&mut self, class: ErrorClass, reason: &str) {
        if !self.healthy {
            return;
        }
        // A posted exchange completes on the comm thread (peers answer it or abort it too):
        // take its reply so that replies stay in step, then tell every peer.
        if self.pending.take().is_some() && self.reply().is_err() {
            return;
        }
        let sends =
            (0..self.size).filter(|&r| r != self.rank).map(|r| (r, seal_abort(self.epoch, class, reason))).collect();
        let _ = self.call(Job::Exchange(Exchange { sends, from: vec![], epoch: self.epoch, op: "abort".into() }));
    }

    fn leave(&mut self, reason: &str) {
        if let Some(p) = &mut self.plane {
            p.abort(reason);
        }
        if !self.healthy {
            return;
        }
        if self.pending.take().is_some() && self.reply().is_err() {
            return;
        }
        let sends = (0..self.size).filter(|&r| r != self.rank).map(|r| (r, seal_leave(self.epoch, reason))).collect();
        let _ = self.call(Job::Exchange(Exchange { sends, from: vec![], epoch: self.epoch, op: "leave".into() }));
    }

    fn poll_abort(&mut self, op: &str) -> Result<()> {
        if let Some(p) = &self.pending {
            return Err(CommError::Misuse(format!("poll during `{}` (wait first)", p.op)));
        }
        if !self.healthy {
            return Err(unhealthy());
        }
        self.call(Job::Poll { epoch: self.epoch, op: op.to_string() }).map(|_| ()).map_err(|e| named(e, op))
    }

    fn end_job(&mut self) {
        if let Some(p) = &mut self.plane {
            p.end_job();
        }
        if self.pending.take().is_some() && self.healthy {
            let _ = self.reply();
        }
        self.epoch += 1;
    }

    fn epoch(&self) -> u64 {
        self.epoch
    }

    fn stats(&self) -> &CommStats {
        &self.stats
    }

    fn reset_stats(&mut self) {
        self.stats = CommStats::default();
    }

    fn note(&mut self, op: &str, sent: usize, received: usize, wait: Duration) {
        self.stats.record(op, sent, received, wait);
    }

    fn plane(&mut self) -> Option<&mut (dyn crate::plane::Plane + 'static)> {
        self.plane.as_deref_mut()
    }

    fn set_plane(&mut self, mut plane: Box<dyn crate::plane::Plane>) {
        plane.set_timeout(self.timeout);
        self.plane = Some(plane);
    }

    fn take_plane(&mut self) -> Option<Box<dyn crate::plane::Plane>> {
        self.plane.take()
    }
}

impl Drop for MpiComm {
    fn drop(&mut self) {
        // A stuck communication thread (failed peer) cannot be joined; the process exits
        // without MPI_Finalize and mpirun reports it.
        if self.healthy && self.pending.is_none() {
            let _ = self.jobs.send(Job::Shutdown);
            if let Some(t) = self.thread.take() {
                let _ = t.join();
            }
        }
    }
}

#[cfg(test)]
#[path = "mpi_tests.rs"]
mod tests;
