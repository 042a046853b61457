//! `serve` under `mpirun` (a module of the `serve` tests, built with the `mpi` feature: its
//! server and helpers).

use super::*;

/// `waits_on_rank_0_longer_than_the_comm_timeout_keep_the_ranks_up` under mpirun, where a
/// follower that times out would leave the world for good. Idle
/// and stalled for over twice the `--comm-timeout` of 4 s (the watchdog's limit is 4 times it);
/// with 2 s, the InfoFlow jobs themselves could meet it on a loaded 2-core machine.
#[test]
fn under_mpirun_an_idle_service_and_a_long_full_job_keep_the_follower() {
    let (mut child, addr) =
        mpirun_serve(&[("FLOWPREFILL_FAULT", "rank:0,phase:prefill,mode:stall:9000")], &["--comm-timeout", "4"]);
    std::thread::sleep(Duration::from_secs(9));
    let r = post_small_job(&addr);
    assert_eq!(r.status, 200, "after 9 s idle: {}", r.text());
    assert_eq!(json(&r)["ranks"], 2);
    let mut full = job(&docs(3, 6));
    full["method"] = "full".into();
    let r =
        http::request(&addr, "POST", "/v1/jobs", &[], full.to_string().as_bytes(), Duration::from_secs(120)).unwrap();
    assert_eq!(r.status, 200, "full with rank 0 stalled for 9 s: {}", r.text());
    let r = post_small_job(&addr);
    assert_eq!(r.status, 200, "the follower is still there: {}", r.text());
    Command::new("kill").args(["-USR1", &child.id().to_string()]).status().unwrap();
    let status = exit_within(&mut child, Duration::from_secs(60));
    assert!(status.success(), "a clean exit on SIGUSR1: {status:?}");
}

#[test]
fn under_mpirun_a_deadline_stops_every_rank_and_the_next_job_runs() {
    let (mut child, addr) = mpirun_serve(&[], &["--comm-timeout", "20"]);
    let post = |body: &serde_json::Value| {
        http::request(&addr, "POST", "/v1/jobs", &[], body.to_string().as_bytes(), Duration::from_secs(300)).unwrap()
    };
    // About 6000 context tokens over two processes with a 1 s deadline: rank 0 and the
    // follower stop between layers, the job ends on both, and the world stays in step.
    let mut body = job(&docs(60, 4));
    body["deadline_s"] = 1.0.into();
    let r = post(&body);
    assert_eq!(r.status, 504, "{}", r.text());
    assert!(r.text().contains("deadline"), "{}", r.text());
    let t = Instant::now();
    let r = post(&job(&docs(3, 6)));
    assert_eq!(r.status, 200, "the next job runs on the same processes: {}", r.text());
    assert!(t.elapsed() < Duration::from_secs(30), "{:?}", t.elapsed());
    assert_eq!(json(&r)["ranks"], 2);
    // `auto` picks a method on an MPI service too (it was refused: no chooser).
    let mut body = job(&docs(3, 6));
    body["method"] = "auto".into();
    let r = post(&body);
    assert_eq!(r.status, 200, "{}", r.text());
    let v = json(&r);
    assert!(v["auto"]["candidates"].as_array().is_some_and(|c| !c.is_empty()), "{v}");
    // mpirun forwards SIGUSR1 to every rank: rank 0 drains and stops the follower.
    Command::new("kill").args(["-USR1", &child.id().to_string()]).status().unwrap();
    let status = exit_within(&mut child, Duration::from_secs(60));
    assert!(status.success(), "a clean exit on SIGUSR1: {status:?}");
}

#[test]
fn under_mpirun_a_panic_on_rank_0_fails_the_job_and_stops_with_an_error() {
    let (mut child, addr) =
        mpirun_serve(&[("FLOWPREFILL_FAULT", "rank:0,phase:probe,mode:panic")], &["--comm-timeout", "10"]);
    let r = post_small_job(&addr);
    assert_eq!(r.status, 500, "{}", r.text());
    assert!(r.text().contains("rank 0 panicked"), "{}", r.text());
    // An MPI world cannot be rebuilt: the service stops with status 4 (a rank failure; rank 0
    // is the first to exit, docs/faults.md).
    let status = exit_within(&mut child, Duration::from_secs(60));
    assert_eq!(status.code(), Some(4), "{status:?}");
}

/// A follower that panics under mpirun: 503 naming it, then the service stops; mpirun's status
/// is the first failed rank's, the panicked follower's 70 (internal: a bug), as docs/faults.md
/// says.
#[test]
fn under_mpirun_a_panic_on_rank_1_gives_503_and_status_70() {
    let (mut child, addr) =
        mpirun_serve(&[("FLOWPREFILL_FAULT", "rank:1,phase:probe,mode:panic")], &["--comm-timeout", "10"]);
    let r = post_small_job(&addr);
    assert_eq!(r.status, 503, "{}", r.text());
    assert!(r.text().contains("rank 1 was lost") && r.text().contains("rank 1 panicked"), "{}", r.text());
    let status = exit_within(&mut child, Duration::from_secs(60));
    assert_eq!(status.code(), Some(70), "{status:?}");
}

/// A GPU lost on a follower under mpirun: its class travels with the job's abort, rank 0
/// answers 503 `device_failure` and stops the world; mpirun's status is rank 0's 69.
#[test]
fn under_mpirun_a_gpu_lost_on_rank_1_gives_503_and_status_69() {
    let (mut child, addr) =
        mpirun_serve(&[("FLOWPREFILL_FAULT", "rank:1,phase:probe,mode:device-lost")], &["--comm-timeout", "10"]);
    let r = post_small_job(&addr);
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(json(&r)["error"]["kind"], "device_failure", "{}", r.text());
    assert!(r.text().contains("an injected fault at rank 1's probe"), "{}", r.text());
    let status = exit_within(&mut child, Duration::from_secs(60));
    assert_eq!(status.code(), Some(69), "{status:?}");
}

#[test]
fn a_hung_mpi_rank_gives_503_and_status_4() {
    let (mut child, addr) =
        mpirun_serve(&[("FLOWPREFILL_FAULT", "rank:1,phase:probe,mode:hang")], &["--comm-timeout", "5"]);
    let r = post_small_job(&addr);
    assert_eq!(r.status, 503, "{}", r.text());
    assert!(r.text().contains("rank 1 did not answer"), "{}", r.text());
    let status = exit_within(&mut child, Duration::from_secs(60));
    assert_eq!(status.code(), Some(4), "an unrecoverable rank failure ends the job with status 4: {status:?}");
}

/// A follower stopped between jobs (SIGSTOP: stuck, or its host gone quiet) is noticed at the
/// next idle tick, which each follower now answers: /readyz stops saying ready within seconds,
/// naming the reason, and the service (an MPI world cannot be rebuilt) ends. Before, the idle
/// ticks went one way and /readyz said ready until a job waited out the deadline.
#[test]
fn under_mpirun_a_follower_stopped_between_jobs_is_noticed_before_a_job_comes() {
    let marker = format!("fp-idle-{}", std::process::id());
    let (mut child, addr) = mpirun_serve(&[("FP_TEST_MARKER", marker.as_str())], &["--comm-timeout", "5"]);
    let r = post_small_job(&addr);
    assert_eq!(r.status, 200, "{}", r.text());
    let follower = std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_string_lossy().parse::<u32>().ok())
        .find(|pid| {
            let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
            let has = |kv: &str| env.split(|&b| b == 0).any(|x| x == kv.as_bytes());
            has(&format!("FP_TEST_MARKER={marker}")) && has("OMPI_COMM_WORLD_RANK=1")
        })
        .expect("the follower's process");
    Command::new("kill").args(["-STOP", &follower.to_string()]).status().unwrap();
    let stopped = Instant::now();
    let noticed = loop {
        match http::request(&addr, "GET", "/readyz", &[], b"", Duration::from_secs(5)) {
            Ok(r) if r.status == 200 => {}
            Ok(r) => break Some(r.text()),
            // A /readyz that hangs (waiting on the stopped follower) is the failure; a service
            // that already ended (refused, or closed as it stopped) is not.
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                panic!("/readyz did not answer within 5 s: {e}")
            }
            Err(_) => break None,
        }
        assert!(stopped.elapsed() < Duration::from_secs(30), "still ready 30 s after the follower stopped");
        std::thread::sleep(Duration::from_millis(200));
    };
    if let Some(body) = &noticed {
        assert!(body.contains("did not answer"), "{body}");
    }
    Command::new("kill").args(["-CONT", &follower.to_string()]).status().unwrap();
    let status = exit_within(&mut child, Duration::from_secs(60));
    assert_eq!(status.code(), Some(4), "the world cannot be rebuilt: a rank failure: {status:?}");
}
