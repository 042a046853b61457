//! The MPI communicator's logic without MPI: its comm thread faked by the test.

use super::*;
use crate::MIN_SILENCE;

#[test]
fn a_message_past_mpi_count_is_refused_before_sending() {
    // `len as i32` inside rsmpi panicked for more than i32::MAX bytes.
    check_message("ring.kv", 1, MAX_MESSAGE).unwrap();
    let e = check_message("ring.kv", 1, MAX_MESSAGE + 1).unwrap_err();
    assert!(matches!(&e, CommError::TooLarge { op, size, .. } if op == "ring.kv" && *size == 1 << 31), "{e}");
    assert!(e.to_string().contains("rank 1"), "{e}");
}

/// A communicator whose comm thread is the test: it holds the other ends of the job and
/// reply channels (no MPI).
fn fake() -> (MpiComm, Receiver<Job>, Sender<Reply>) {
    let (jobs, job_rx) = channel();
    let (reply_tx, replies) = channel();
    let comm = MpiComm {
        rank: 0,
        size: 2,
        jobs,
        replies,
        waiting_on: Arc::new(AtomicUsize::new(1)),
        unsent: Arc::new(AtomicU64::new(0)),
        heard: Arc::new(Heard::new(2)),
        timeout: Duration::from_millis(50),
        silence: None,
        pending: None,
        stats: CommStats::default(),
        plane: None,
        thread: None,
        healthy: true,
        epoch: 0,
        world_rank: 0,
        world_size: 2,
    };
    (comm, job_rx, reply_tx)
}

#[test]
fn after_a_timeout_a_late_reply_is_not_taken_for_a_poll() {
    let (mut c, jobs, replies) = fake();
    // The comm thread does not answer the poll in time: a timeout, the communicator failed.
    let e = c.poll_abort("prefill").unwrap_err();
    assert!(matches!(&e, CommError::Timeout { rank: 1, op, .. } if op == "prefill"), "{e}");
    // Its late answer to that poll arrives; the next poll must not read it as "no abort".
    replies.send(Ok(Vec::new())).unwrap();
    let e = c.poll_abort("prefill").unwrap_err();
    assert!(matches!(&e, CommError::Misuse(m) if m.contains("failed earlier")), "{e}");
    assert!(c.post("x", vec![(1, vec![1])], vec![1]).is_err());
    assert_eq!(jobs.try_iter().count(), 1, "only the first poll reached the comm thread");
}

#[test]
fn a_wait_on_several_ranks_is_said_to_be_on_one_that_missed_its_beats() {
    let mut heard = Heard::new(3);
    heard.start = Instant::now().checked_sub(Duration::from_secs(5)).unwrap();
    heard.mark(1);
    // Rank 1 beats, rank 2 has not for 5 s: the wait is on rank 2, behind rank 1.
    assert_eq!(heard.waited_on([1, 2].into_iter()), Some(2));
    heard.mark(2);
    assert_eq!(heard.waited_on([1, 2].into_iter()), Some(1), "both alive: the first");
    assert_eq!(heard.waited_on(std::iter::empty()), None);
}

/// A wait far longer than a peer should take to answer (the start's agreement) ends once
/// the peer waited on is silent past the limit, naming it and the operation; a peer still
/// beating is waited for past the limit.
#[test]
fn a_silent_peer_is_named_lost_long_before_the_deadline_and_a_beating_one_is_waited_for() {
    let (mut c, _jobs, replies) = fake();
    c.set_timeout(Duration::from_secs(600));
    // Below the floor, a limit is raised to it.
    c.set_silence_limit(Some(Duration::from_secs(1)));
    assert_eq!(c.silence, Some(MIN_SILENCE));
    assert_eq!(
        (silence_limit(Duration::from_secs(3)), silence_limit(Duration::from_secs(600))),
        (MIN_SILENCE, DEFAULT_TIMEOUT)
    );
    // Here 2 s, to keep the test short.
    c.silence = Some(Duration::from_secs(2));
    // Rank 1 beats (its comm thread marks it) for 5 s, then the reply comes.
    let heard = c.heard.clone();
    let t = Instant::now();
    let beating = std::thread::spawn(move || {
        for _ in 0..100 {
            heard.mark(1);
            std::thread::sleep(Duration::from_millis(50));
        }
        replies.send(Ok(Vec::new())).unwrap();
        replies
    });
    c.poll_abort("setup.agree").unwrap();
    assert!(t.elapsed() >= Duration::from_secs(4), "waited past the limit while rank 1 beat");
    let _replies = beating.join().unwrap();
    // Now silent: named within the limit (plus a check's step), not at the deadline.
    let t = Instant::now();
    let e = c.poll_abort("setup.agree").unwrap_err();
    assert!(t.elapsed() < Duration::from_secs(60), "{:?}", t.elapsed());
    assert!(
        matches!(&e, CommError::RankLost { rank: 1, op, detail } if op == "setup.agree" && detail.contains("nothing heard from its process")),
        "{e}"
    );
    assert!(c.poll_abort("x").is_err(), "the communicator failed");
}

/// A process outside the group (world ranks 2-3 of 4 after `use_group(2)`: this is world rank
/// 3, group rank 1): a wait on world rank 2 is named as group rank 0, and `use_group`'s own
/// waits by world rank.
#[test]
fn a_wait_is_named_by_the_rank_of_the_group_it_is_in() {
    let (mut c, _jobs, _replies) = fake();
    (c.world_rank, c.world_size, c.rank, c.size) = (3, 4, 1, 2);
    c.waiting_on.store(2, Ordering::Relaxed);
    let e = c.poll_abort("probe").unwrap_err();
    assert!(matches!(&e, CommError::Timeout { rank: 0, op, .. } if op == "probe"), "{e}");
    let (mut c, _jobs, _replies) = fake();
    (c.world_rank, c.world_size, c.rank, c.size) = (3, 4, 1, 2);
    c.waiting_on.store(2, Ordering::Relaxed);
    let e = c.use_group(4, Duration::from_millis(50)).unwrap_err();
    assert!(matches!(&e, CommError::Timeout { rank: 2, op, .. } if op == "use_group"), "{e}");
}
