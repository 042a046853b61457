//! Fault injection for the failure tests: `FLOWPREFILL_FAULT=rank:R,phase:P,mode:M` makes
//! rank R misbehave when it reaches phase P (`chunk_prefill`, `probe`, `recompute`,
//! `final_prompt`, `decode`). Modes: `exit` (the process exits with status 3, like a crashed
//! MPI rank), `panic` (the rank's thread panics), `hang` (the rank stops answering). It fires
//! once per process. Unset, it costs one lookup per phase.

use std::sync::OnceLock;

#[derive(Clone, Debug, PartialEq, Eq)]
struct Fault {
    rank: usize,
    phase: String,
    mode: String,
}

fn parse(s: &str) -> Option<Fault> {
    let mut f = Fault { rank: usize::MAX, phase: String::new(), mode: String::new() };
    for part in s.split(',') {
        let (k, v) = part.split_once(':')?;
        match k.trim() {
            "rank" => f.rank = v.trim().parse().ok()?,
            "phase" => f.phase = v.trim().to_string(),
            "mode" => f.mode = v.trim().to_string(),
            _ => return None,
        }
    }
    (f.rank != usize::MAX && !f.phase.is_empty() && !f.mode.is_empty()).then_some(f)
}

fn configured() -> Option<&'static Fault> {
    static F: OnceLock<Option<Fault>> = OnceLock::new();
    F.get_or_init(|| std::env::var("FLOWPREFILL_FAULT").ok().and_then(|s| parse(&s))).as_ref()
}

/// Misbehaves here if the environment asks this rank to (once per process, so that a
/// service can recover by rebuilding its ranks).
pub fn point(rank: usize, phase: &str) {
    static FIRED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    let Some(f) = configured() else { return };
    if f.rank != rank || f.phase != phase || FIRED.swap(true, std::sync::atomic::Ordering::Relaxed) {
        return;
    }
    tracing::warn!(rank, phase, mode = %f.mode, "injected fault");
    match f.mode.as_str() {
        "exit" => std::process::exit(3),
        "panic" => panic!("injected fault: rank {rank} at {phase}"),
        "hang" => loop {
            std::thread::sleep(std::time::Duration::from_secs(3600));
        },
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_specs() {
        assert_eq!(
            parse("rank:1,phase:probe,mode:hang"),
            Some(Fault { rank: 1, phase: "probe".into(), mode: "hang".into() })
        );
        assert_eq!(parse("rank:x,phase:probe,mode:hang"), None);
        assert_eq!(parse("phase:probe"), None);
    }
}
