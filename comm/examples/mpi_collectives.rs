//! `mpirun -np N target/release/examples/mpi_collectives` (build with `--features mpi`):
//! runs the collectives over MPI processes and checks their results; exits non-zero on a
//! mismatch. Run by `comm/tests/mpi.rs`.

#[cfg(feature = "mpi")]
fn main() {
    use flowprefill_comm::{
        all_gather_f32, all_gather_value, barrier, broadcast_value, post_f32, wait_f32, Communicator,
    };
    let mut c = flowprefill_comm::mpi::MpiComm::init().expect("MPI init");
    let (me, n) = (c.rank(), c.size());
    let g = all_gather_f32(&mut c, "gather", &vec![me as f32; me + 1]).expect("gather");
    for (src, v) in g.iter().enumerate() {
        assert_eq!(v, &vec![src as f32; src + 1]);
    }
    let big: Vec<f32> = (0..1_000_000).map(|i| (i + me) as f32).collect();
    let g = all_gather_f32(&mut c, "gather.big", &big).expect("big gather");
    assert!(g.iter().enumerate().all(|(src, v)| v.len() == big.len() && v[7] == (7 + src) as f32));
    let msg = (me == 0).then(|| "hello".to_string());
    let b: String = broadcast_value(&mut c, "bcast", 0, msg.as_ref()).expect("bcast");
    assert_eq!(b, "hello");
    if n > 1 {
        let (next, prev) = ((me + 1) % n, (me + n - 1) % n);
        let mut blk = big.clone();
        for _ in 0..n - 1 {
            post_f32(&mut c, "ring", next, &blk, prev).expect("post");
            blk = wait_f32(&mut c, "ring", prev).expect("wait");
        }
        assert_eq!(blk[0], ((me + 1) % n) as f32, "after n-1 steps the block of the next rank arrives");
    }
    let ranks: Vec<usize> = all_gather_value(&mut c, "ranks", &me).expect("ranks");
    assert_eq!(ranks, (0..n).collect::<Vec<_>>());
    barrier(&mut c, "barrier").expect("barrier");
    if n > 1 {
        use flowprefill_comm::{CommError, ErrorClass};
        // The last rank gives a job up: every other rank's gather says so, naming it.
        c.end_job();
        if me == n - 1 {
            c.abort(ErrorClass::Deadline, "deadline at layer 3");
        } else {
            match all_gather_f32(&mut c, "probe.layer3", &big) {
                Err(CommError::Aborted { rank, class: ErrorClass::Deadline, .. }) if rank == n - 1 => {}
                other => panic!("rank {me}: expected an abort from rank {}, got {other:?}", n - 1),
            }
        }
        c.end_job();
        // The next job is clean: what the aborted one left in flight is dropped.
        let g = all_gather_f32(&mut c, "after", &[me as f32]).expect("gather after an abort");
        assert!(g.iter().enumerate().all(|(src, v)| v == &vec![src as f32]));
        // A rank computing without communicating sees an abort by polling.
        c.end_job();
        if me == 0 {
            c.abort(ErrorClass::Cancelled, "client went away");
        } else {
            let t = std::time::Instant::now();
            loop {
                match c.poll_abort("chunk_prefill") {
                    Ok(()) => assert!(t.elapsed().as_secs() < 10, "rank {me}: the abort never arrived"),
                    Err(CommError::Aborted { rank: 0, class: ErrorClass::Cancelled, .. }) => break,
                    Err(e) => panic!("rank {me}: {e}"),
                }
                std::thread::sleep(std::time::Duration::from_millis(2));
            }
        }
        c.end_job();
        barrier(&mut c, "final").expect("barrier after aborts");
        // A rank that leaves the world is named by every other rank at once.
        c.end_job();
        if me == n - 1 {
            c.leave("rank is leaving: test");
        } else {
            match barrier(&mut c, "after leave") {
                Err(CommError::RankLost { rank, detail, .. }) if rank == n - 1 && detail.contains("test") => {}
                other => panic!("rank {me}: expected rank {} lost, got {other:?}", n - 1),
            }
        }
    }
    println!("rank {me}/{n}: ok, sent {} bytes", c.stats().bytes_sent());
}

#[cfg(not(feature = "mpi"))]
fn main() {
    eprintln!("built without the `mpi` feature");
    std::process::exit(2);
}
