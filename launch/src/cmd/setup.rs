//! Under mpirun: every process starts MPI before its model loads, and the ranks check that they
//! were started alike (the same flowprefill, model, device kind and number formats) before
//! their first job.
//!
//! Each process reads its own flags and `FLOWPREFILL_*` variables, and OpenMPI passes the
//! launching shell's variables to other hosts only when asked (`mpirun -x NAME`): a rank on
//! another host could load another model (a wrong answer when its shape is the same), store
//! its K/V in another format (a truncated message at the first exchange) or run on another
//! device kind (a collective the others never make). Nothing else compares them.

use anyhow::Result;
use flowprefill_comm::Communicator;
use flowprefill_kernels::Backend;
use flowprefill_worker::LoadedModel;
use std::time::Duration;

/// How long a rank waits at the check for the others to finish loading their model (a model
/// on a network filesystem loads at different speeds on different hosts), as long as they are
/// alive: a rank whose process has been silent for the communicator's timeout (within 10 s and
/// a minute: a process beats twice a second however long its load takes) is named at once.
pub const LOAD_WAIT: Duration = Duration::from_secs(1800);

/// What must be the same on every rank, as (what, value) pairs.
pub fn of<B: Backend>(lm: &LoadedModel<B>) -> Vec<(String, String)> {
    let backend = lm.model.backend();
    let none = || "none".to_string();
    [
        // The build (its sources, features and profile), not only the version: two builds of
        // one version may differ on the wire, and a debug rank runs ~15x slower than its peers.
        // The commit is not compared: two commits of the same sources agree.
        ("flowprefill", format!("{} (build {}; {})", env!("CARGO_PKG_VERSION"), crate::BUILD, crate::BUILD_CONFIG)),
        ("model", format!("{} ({})", lm.model.config().name, lm.cache_identity)),
        ("device kind", backend.name().to_string()),
        ("KV dtype", backend.kv_dtype().to_string()),
        ("activations", backend.act_dtype().to_string()),
        ("KV Packet adapter", lm.adapter.as_ref().map_or_else(none, |a| a.hash.clone())),
        ("LookaheadKV adapter", lm.model.lookahead_hash().map_or_else(none, str::to_string)),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

/// Where a rank computes: its host and device (`cuda:N`, or the backend's name).
pub fn place<B: Backend>(lm: &LoadedModel<B>) -> (String, String) {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map_or_else(|| "?".to_string(), |h| h.trim().to_string());
    let backend = lm.model.backend();
    let device = backend.memory().map_or_else(|| backend.name().to_string(), |m| m.device);
    (host, device)
}

/// Ranks that share one GPU of one host, one line per GPU: NCCL takes one GPU per rank (it
/// failed with a bare "duplicate GPU"). Ranks on the CPU may share it, and a GPU whose ordinal
/// is not known (no `cuda:N`: the driver did not say) is not compared.
pub fn shared_gpus(places: &[(String, String)]) -> Vec<String> {
    let mut said = Vec::new();
    for (i, (host, device)) in places.iter().enumerate() {
        if !device.starts_with("cuda:") || places[..i].contains(&(host.clone(), device.clone())) {
            continue;
        }
        let ranks: Vec<String> = places
            .iter()
            .enumerate()
            .filter(|(_, p)| **p == (host.clone(), device.clone()))
            .map(|(r, _)| r.to_string())
            .collect();
        if ranks.len() > 1 {
            said.push(format!("ranks {} all on {device} of {host}", ranks.join(", ")));
        }
    }
    said
}

/// Each rank's differences from rank 0's setup (`all[r]` is rank r's), one line per rank that
/// differs: "rank 1: KV dtype bf16 (rank 0: f32)".
pub fn differences(all: &[Vec<(String, String)>]) -> Vec<String> {
    let Some(first) = all.first() else { return Vec::new() };
    all.iter()
        .enumerate()
        .skip(1)
        .filter_map(|(r, theirs)| {
            let mut said = Vec::new();
            for (what, zero) in first {
                let v = theirs.iter().find(|(k, _)| k == what).map_or("not said", |(_, v)| v.as_str());
                if v != zero {
                    said.push(format!("{what} {v} (rank 0: {zero})"));
                }
            }
            (!said.is_empty()).then(|| format!("rank {r}: {}", said.join(", ")))
        })
        .collect()
}

/// Every rank's setup gathered on every rank, and the same verdict on each: a usage error
/// naming each rank that differs from rank 0 and how, on all of them (so that every process
/// exits with the same status). Waits up to [`LOAD_WAIT`] for a rank still loading, and names
/// one whose process went silent.
pub fn agree<B: Backend>(comm: &mut dyn Communicator, lm: &LoadedModel<B>) -> Result<()> {
    if comm.size() == 1 {
        return Ok(());
    }
    let mine = serde_json::to_vec(&(of(lm), place(lm)))?;
    let timeout = comm.timeout();
    comm.set_timeout(timeout.max(LOAD_WAIT));
    comm.set_silence_limit(Some(timeout));
    let gathered = flowprefill_comm::all_gather_bytes(comm, "setup.agree", mine);
    comm.set_silence_limit(None);
    comm.set_timeout(timeout);
    type Setup = (Vec<(String, String)>, (String, String));
    let (all, places): (Vec<_>, Vec<_>) = gathered?
        .iter()
        .map(|b| serde_json::from_slice::<Setup>(b))
        .collect::<std::result::Result<Vec<Setup>, _>>()?
        .into_iter()
        .unzip();
    let differ = differences(&all);
    crate::ensure_usage!(
        differ.is_empty(),
        "the ranks were not started alike: {}; every rank must load the same model with the same settings: give \
         them as flags, or pass the FLOWPREFILL_* variables to every host (`mpirun -x FLOWPREFILL_MODEL -x \
         FLOWPREFILL_KV_DTYPE ...`)",
        differ.join("; ")
    );
    let shared = shared_gpus(&places);
    crate::ensure_usage!(
        shared.is_empty(),
        "{}: the ranks move K/V over NCCL, which takes one GPU per rank; start at most as many processes per host as \
         it has GPUs (mpirun -np, or --map-by), or give each rank its own --device cuda:N",
        shared.join("; ")
    );
    Ok(())
}

/// Without the `mpi` feature, a process that an MPI launcher started as one of several
/// (`OMPI_COMM_WORLD_SIZE`, `PMI_SIZE` above 1) is refused with a usage error: each copy would
/// run the whole command alone, racing the others on one output, and exit 0. Every command that
/// computes across ranks calls it before loading anything.
pub fn refuse_mpirun_without_mpi() -> Result<()> {
    match mpirun_refusal(cfg!(feature = "mpi"), flowprefill_comm::launcher_size()) {
        Some(why) => Err(crate::exit::usage(why)),
        None => Ok(()),
    }
}

/// Why a process that a launcher started as one of `processes` is refused, for a build with or
/// without MPI (`mpi_built`); `None` where it may run.
fn mpirun_refusal(mpi_built: bool, processes: usize) -> Option<String> {
    (!mpi_built && processes > 1).then(|| {
        format!(
            "started by mpirun as one of {processes} processes, but this build has no MPI: each process would run \
             the whole command alone on one output; rebuild with `cargo build --release --features mpi` (or run \
             without mpirun, with --ranks for thread ranks)"
        )
    })
}

#[cfg(test)]
mod tests {
    /// Runs in every build (the command-level test, `errors.rs`, only in a build without MPI,
    /// which CI does not make): a build without MPI started as one of several processes is
    /// refused, saying to rebuild; one process, or a build with MPI, runs.
    #[test]
    fn only_a_build_without_mpi_under_mpirun_is_refused() {
        let why = super::mpirun_refusal(false, 2).expect("refused");
        assert!(why.contains("one of 2 processes") && why.contains("--features mpi"), "{why}");
        assert_eq!(super::mpirun_refusal(false, 1), None);
        assert_eq!(super::mpirun_refusal(false, 0), None);
        assert_eq!(super::mpirun_refusal(true, 4), None);
    }

    use super::differences;

    fn setup(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn ranks_sharing_a_gpu_are_named_and_the_cpu_may_be_shared() {
        let at = |h: &str, d: &str| (h.to_string(), d.to_string());
        let places = [
            at("a", "cuda:0"),
            at("a", "cuda:1"),
            at("b", "cuda:0"),
            at("a", "cuda:0"),
            at("a", "cpu"),
            at("a", "cpu"),
            at("b", "cuda"),
            at("b", "cuda"),
        ];
        assert_eq!(super::shared_gpus(&places), vec!["ranks 0, 3 all on cuda:0 of a".to_string()]);
        assert!(super::shared_gpus(&places[..3]).is_empty());
    }

    #[test]
    fn each_rank_that_differs_from_rank_0_is_named_with_what_differs() {
        let zero = setup(&[("model", "m (a1)"), ("KV dtype", "f32")]);
        let same = zero.clone();
        let other = setup(&[("model", "m (b2)"), ("KV dtype", "bf16")]);
        let short = setup(&[("model", "m (a1)")]);
        assert!(differences(&[zero.clone(), same.clone()]).is_empty());
        assert_eq!(
            differences(&[zero, same, other, short]),
            vec![
                "rank 2: model m (b2) (rank 0: m (a1)), KV dtype bf16 (rank 0: f32)".to_string(),
                "rank 3: KV dtype not said (rank 0: f32)".to_string(),
            ]
        );
    }
}
