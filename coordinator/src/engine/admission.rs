//! Admission on every rank: the job's checks and memory plan, the ranks' agreement on the
//! outcome, and with it what each rank's chunk store holds (for cache-aware placement).

use super::Engine;
use crate::admit::{admit, Limits};
use crate::error::{CoordError, Result};
use crate::layout::Layout;
use crate::memory;
use crate::request::{Job, RunOptions};
use flowprefill_comm::{all_gather_value, Communicator, ErrorClass};
use flowprefill_kernels::Backend;

/// A rank's verdict on a job's admission, as the other ranks receive it.
#[derive(serde::Serialize, serde::Deserialize)]
struct Refusal {
    class: ErrorClass,
    message: String,
    api_message: String,
}

impl Refusal {
    fn of(e: &CoordError) -> Self {
        Self { class: e.class(), message: e.to_string(), api_message: e.api_message() }
    }

    /// Rank `rank`'s refusal as this rank's error.
    fn into_error(self, rank: usize) -> CoordError {
        CoordError::Remote { rank, class: self.class, message: self.message, api_message: self.api_message }
    }
}

/// What a rank tells the others when a job arrives: its verdict, and how well its chunk store
/// holds each chunk (for cache-aware sharding; empty when the job does not place by it).
#[derive(serde::Serialize, serde::Deserialize)]
struct Arrival {
    refusal: Option<Refusal>,
    held: Vec<u8>,
}

impl<B: Backend> Engine<B> {
    /// This rank's memory plan against its device's free memory (none: unknown, not checked);
    /// the chunk store gives back what the job lacks when that is enough.
    fn make_room(&self, opts: &RunOptions, layout: &Layout, rank: usize, ranks: usize) -> Result<()> {
        let room = memory::Room {
            rank,
            ranks,
            peers: self.memory_peers,
            reclaimable: self.store.reclaimable() + self.aux_store.reclaimable(),
            limit: self.memory_limit,
        };
        let short = memory::admit_memory(&self.lm, opts, layout, room)?;
        if short > 0 {
            let freed = self.store.evict(short);
            let freed = freed + self.aux_store.evict(short.saturating_sub(freed));
            tracing::info!(
                rank,
                "the chunk store gave back {} to make room for a job",
                flowprefill_kernels::gib(freed)
            );
        }
        Ok(())
    }

    /// After a job ran out of memory: evicts from the store what the same job lacks now, if
    /// that is enough for it to fit (a retry then finds the room).
    pub(super) fn room_after_failure(&self, job: &Job, rank: usize, ranks: usize) {
        if let Err(e) = self.lm.model.backend().settle() {
            tracing::warn!(rank, "settling the device after running out of memory: {e}");
        }
        let made = Layout::for_method(&self.lm, &job.request, job.options.method)
            .and_then(|layout| self.make_room(&job.options, &layout, rank, ranks));
        if let Err(e) = made {
            tracing::debug!(rank, "no room made after running out of memory: {e}");
        }
    }

    /// Every rank checks the job (see [`crate::admit`]) and its memory plan, and all agree on
    /// the outcome; with it each rank says how well its store holds each chunk, which every
    /// rank receives (`held[rank][chunk]`, empty unless the job places chunks by it).
    pub(super) fn agree(&self, comm: &mut dyn Communicator, job: &Job) -> Result<(Layout, Vec<Vec<u8>>)> {
        let (rank, ranks) = (comm.rank(), comm.size());
        let mine = admit(&self.lm, job, &Limits::NONE)
            .and_then(|a| self.make_room(&job.options, &a.layout, rank, ranks).map(|()| a));
        let opts = &job.options;
        let aware = ranks > 1 && opts.cache_slack > 0.0 && !opts.method.is_exact_prefill() && !opts.fresh;
        let arrival = Arrival {
            refusal: mine.as_ref().err().map(Refusal::of),
            held: match (&mine, aware) {
                (Ok(a), true) => self.held_levels(&a.layout, opts.prefix_mode()),
                _ => Vec::new(),
            },
        };
        let all: Vec<Arrival> = all_gather_value(comm, "job.admit", &arrival)?;
        let admitted = mine?;
        let mut held = Vec::with_capacity(all.len());
        for (r, a) in all.into_iter().enumerate() {
            if let Some(v) = a.refusal {
                return Err(v.into_error(r));
            }
            held.push(a.held);
        }
        if !aware {
            held.clear();
        }
        Ok((admitted.layout, held))
    }

    /// Every rank's memory plan for the options `auto` chose (admission planned `auto` itself,
    /// as a chunked method: `full` holds the whole context on rank 0): a refusal on any rank
    /// fails the job on every rank, before any work.
    pub(super) fn agree_memory(&self, comm: &mut dyn Communicator, opts: &RunOptions, layout: &Layout) -> Result<()> {
        let mine = self.make_room(opts, layout, comm.rank(), comm.size());
        let all: Vec<Option<Refusal>> = all_gather_value(comm, "auto.admit", &mine.as_ref().err().map(Refusal::of))?;
        mine?;
        match all.into_iter().enumerate().find_map(|(r, v)| v.map(|v| (r, v))) {
            Some((r, v)) => Err(v.into_error(r)),
            None => Ok(()),
        }
    }
}
