//! `--method auto` inside a job: once every rank has admitted it, rank 0 asks the chooser with
//! what the request looks like (token counts, the chunks some rank's store already holds) and
//! broadcasts the method it picks (or why none could be picked); every rank then runs that.

use super::{Engine, RunResult};
use crate::auto::{is_auto, label, Choice, Situation};
use crate::error::Result;
use crate::layout::Layout;
use crate::request::{Job, PrefixMode, RunOptions};
use flowprefill_comm::{broadcast_value, Communicator};
use flowprefill_kernels::Backend;
use flowprefill_worker::{Field, InputError};

/// What rank 0 broadcasts: the options to run and the choice, or why there is none.
type Resolved = std::result::Result<(RunOptions, Choice), String>;

impl<B: Backend> Engine<B> {
    /// `job` with `auto` replaced by the chooser's method and the choice (`None` for any other
    /// method). A collective when `job` is `auto`; `held` is every rank's [`Engine::held_levels`]
    /// when admission gathered them (several ranks), else empty.
    pub(super) fn resolve_auto(
        &self,
        comm: &mut dyn Communicator,
        job: &Job,
        layout: &Layout,
        held: &[Vec<u8>],
    ) -> Result<Option<(Job, Choice)>> {
        if !is_auto(&job.options) {
            return Ok(None);
        }
        let mine = (comm.rank() == 0).then(|| self.choose(comm.size(), job, layout, held));
        match broadcast_value(comm, "auto", 0, mine.as_ref())? {
            Ok((options, choice)) => Ok(Some((Job { request: job.request.clone(), options }, choice))),
            Err(m) => Err(InputError::new(Field::Method, m).into()),
        }
    }

    /// Rank 0's choice for `job` on `ranks` ranks.
    fn choose(&self, ranks: usize, job: &Job, layout: &Layout, held: &[Vec<u8>]) -> Resolved {
        let Some(chooser) = &self.chooser else {
            return Err(
                "auto needs a chooser (the projection's, which `flowprefill run` and `serve` attach); name a method"
                    .into(),
            );
        };
        // A chunk any rank holds costs no prefill where cache-aware placement puts it there (the
        // levels admission gathered, rank 0's among them; without them, rank 0's own). `auto`
        // looks chunks up alone (no prefix), as its approximate candidates do.
        let cached = if held.is_empty() {
            self.held_levels(layout, PrefixMode::None).into_iter().map(|l| l > 0).collect()
        } else {
            (0..layout.chunks.len()).map(|c| held.iter().any(|h| h.get(c).is_some_and(|&l| l > 0))).collect()
        };
        let s = Situation {
            opts: &job.options,
            ranks,
            head: layout.head.len(),
            chunks: layout.chunks.iter().map(Vec::len).collect(),
            prompt: layout.prompt.len(),
            cached,
            config: self.lm.model.config(),
            model: &self.lm.fingerprint,
            kv_bytes: self.lm.model.backend().kv_dtype().size(),
        };
        let (choice, mut options) = chooser.choose(&s).map_err(|m| format!("auto: {m}"))?;
        // Without verification the floor served the choice only (the gate needs --verify).
        if !options.verify {
            options.quality_floor = None;
        }
        tracing::info!("auto: {}", choice.why);
        Ok((options, choice))
    }

    /// Tells the chooser how far a verified answer was from the exact one.
    pub(super) fn learn(&self, r: &RunResult) {
        if let (Some(chooser), Some(q)) = (&self.chooser, &r.quality) {
            let recomputed = r.n_selected() as f64 / r.n_context_tokens.max(1) as f64;
            chooser.learn(&self.lm.fingerprint, &label(&r.opts), q.kl, recomputed);
        }
    }
}
