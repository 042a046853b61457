//! `mpirun -np N target/release/examples/mpi_collectives` (build with `--features mpi`):
//! runs the collectives over MPI processes and checks their results; exits non-zero on a
//! mismatch. Used by the MPI integration test.

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
    println!("rank {me}/{n}: ok, sent {} bytes", c.stats().bytes_sent());
}

#[cfg(not(feature = "mpi"))]
fn main() {
    eprintln!("built without the `mpi` feature");
    std::process::exit(2);
}
