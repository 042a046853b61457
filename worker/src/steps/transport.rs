//! Buffer-typed collectives: what the distributed steps send each other is *control rows*
//! (positions, row or segment numbers: host data) plus backend buffers whose lengths follow
//! from the rows. One primitive, split-phase like the communicator's exchange, serves the ring
//! step, the all-gathers and the gather/broadcast of partials:
//!
//! ```text
//!   post_bufs(sends: (to, rows, buffers), from, lens)  ──> [compute] ──>  wait_bufs -> (rows, buffers) per sender
//!
//!   no device plane (thread and MPI ranks, CPU):  rows and buffers staged out into one message
//!                                                 through the communicator, staged in on arrival
//!   device plane (NCCL):  rows through the communicator (wait for them: they give the lengths),
//!                         buffers as one group of device sends/receives that runs while the
//!                         caller computes; complete() waits on the device, with the deadline
//! ```
//! Both give the same bits. `lens(rows)` is the number of elements of each buffer of a
//! message with those rows: senders are checked against it, receivers allocate by it. Each
//! buffer travels in its own element type (a bf16 KV cache crosses as bf16, half the bytes):
//! staged, every buffer is tagged with its type; on the device plane the control rows carry
//! the types, and receivers allocate buffers of those types to receive into.

use super::{comm_err, protocol};
use crate::error::{internal, Result, WorkerError};
use flowprefill_comm::plane::typed;
use flowprefill_comm::{CommError, Communicator, Packet, Unpack};
use flowprefill_kernels::{Backend, DType, HostBuf};
use std::time::Instant;

/// Lengths (elements) of the buffers of a message, from its control rows.
pub(crate) type Lens<'a> = &'a dyn Fn(&[u32]) -> Vec<usize>;

/// A message: control rows and the buffers they describe.
pub(crate) type Parcel<B> = (Vec<u32>, Vec<<B as Backend>::Buf>);

/// One message to send: (to, rows, buffers).
pub(crate) type Outgoing<'b, B> = (usize, Vec<u32>, Vec<&'b <B as Backend>::Buf>);

/// A posted exchange, completed by [`wait_bufs`].
pub(crate) enum Posted {
    /// Rows and buffers in one host message per peer.
    Staged { op: String, from: Vec<usize> },
    /// Rows already here; buffers in flight on the device plane.
    Device {
        op: String,
        from: Vec<usize>,
        rows: Vec<Vec<u32>>,
        lens: Vec<Vec<(usize, DType)>>,
        sent: usize,
        t0: Instant,
    },
}

/// Starts an exchange of rows and buffers (see the module docs).
pub(crate) fn post_bufs<B: Backend>(
    comm: &mut dyn Communicator,
    be: &B,
    op: &str,
    sends: Vec<Outgoing<'_, B>>,
    from: Vec<usize>,
    lens: Lens<'_>,
) -> Result<Posted> {
    for (to, rows, bufs) in &sends {
        let want = lens(rows);
        let have: Vec<usize> = bufs.iter().map(|b| be.len(b)).collect();
        if want != have {
            return Err(internal(format!(
                "`{op}` to rank {to}: buffers of {have:?} values for rows that need {want:?}"
            )));
        }
    }
    if comm.plane().is_none() {
        comm.post(op, staged(be, &sends)?, from.clone()).map_err(comm_err)?;
        return Ok(Posted::Staged { op: op.to_string(), from });
    }
    // Control first: rows and the buffers' element types tell every receiver what to receive.
    let control = sends
        .iter()
        .map(|(to, rows, bufs)| {
            let types: Vec<u32> = bufs.iter().map(|b| be.dtype(b).code()).collect();
            Ok((*to, Packet::new().u32s(rows).u32s(&types).into_bytes().map_err(comm_err)?))
        })
        .collect::<Result<Vec<_>>>()?;
    comm.post(op, control, from.clone()).map_err(comm_err)?;
    let got = comm.wait().map_err(comm_err)?;
    let (rows, typed_lens) = read_control(op, &from, &got, lens)?;
    // Empty buffers are not transferred (both sides know their length is zero).
    let dev_sends: Vec<(usize, &B::Buf)> = sends
        .iter()
        .flat_map(|(to, _, bufs)| bufs.iter().map(move |b| (*to, *b)))
        .filter(|(_, b)| be.len(b) > 0)
        .collect();
    let mut receives = Vec::new();
    for (&r, l) in from.iter().zip(&typed_lens) {
        for &(n, t) in l.iter().filter(|(n, _)| *n > 0) {
            receives.push((r, be.zeros_as(n, t)?));
        }
    }
    let sent = dev_sends.iter().map(|(_, b)| be.bytes(b)).sum();
    let plane = comm.plane().ok_or_else(|| internal("the device plane went away"))?;
    typed::<B::Buf>(plane).and_then(|p| p.issue(op, &dev_sends, receives)).map_err(comm_err)?;
    Ok(Posted::Device { op: op.to_string(), from, rows, lens: typed_lens, sent, t0: Instant::now() })
}

/// The host messages of a staged exchange: each peer's rows and its buffers' values, tagged
/// with their element type.
fn staged<B: Backend>(be: &B, sends: &[Outgoing<'_, B>]) -> Result<Vec<(usize, Vec<u8>)>> {
    let mut msgs: Vec<(usize, Vec<u8>)> = Vec::with_capacity(sends.len());
    for (i, (to, rows, bufs)) in sends.iter().enumerate() {
        // The same rows and buffers to several peers (an all-gather) are staged once.
        let same = i > 0 && {
            let (_, r0, b0) = &sends[i - 1];
            r0 == rows && b0.len() == bufs.len() && b0.iter().zip(bufs).all(|(a, b)| std::ptr::eq(*a, *b))
        };
        let bytes = match msgs.last() {
            Some((_, prev)) if same => prev.clone(),
            _ => {
                let mut p = Packet::new().u32s(rows);
                for b in bufs {
                    p = match be.stage_out(b)? {
                        HostBuf::F32(v) => p.u32s(&[DType::F32.code()]).f32s(&v),
                        HostBuf::Bf16(v) => p.u32s(&[DType::Bf16.code()]).u16s(&v),
                    };
                }
                p.into_bytes().map_err(comm_err)?
            }
        };
        msgs.push((*to, bytes));
    }
    Ok(msgs)
}

/// The rows each rank of `from` sends and the length and element type of each of its buffers,
/// from the control messages `got` of a device exchange.
#[allow(clippy::type_complexity)]
fn read_control(
    op: &str,
    from: &[usize],
    got: &[Vec<u8>],
    lens: Lens<'_>,
) -> Result<(Vec<Vec<u32>>, Vec<Vec<(usize, DType)>>)> {
    let mut rows = Vec::with_capacity(from.len());
    let mut typed_lens: Vec<Vec<(usize, DType)>> = Vec::with_capacity(from.len());
    for (&r, b) in from.iter().zip(got) {
        let mut u = Unpack::new(r, op, b);
        let v = u.u32s().map_err(protocol)?;
        let types = u.u32s().map_err(protocol)?;
        u.finish().map_err(protocol)?;
        let l = lens(&v);
        if types.len() != l.len() {
            return Err(WorkerError::Protocol {
                rank: r,
                detail: format!("`{op}`: {} buffer types for {} buffers", types.len(), l.len()),
            });
        }
        let mut tl = Vec::with_capacity(l.len());
        for (n, code) in l.into_iter().zip(types) {
            let t = DType::from_code(code).ok_or_else(|| WorkerError::Protocol {
                rank: r,
                detail: format!("`{op}`: unknown buffer type {code}"),
            })?;
            tl.push((n, t));
        }
        rows.push(v);
        typed_lens.push(tl);
    }
    Ok((rows, typed_lens))
}

/// Completes [`post_bufs`]: (rows, buffers) of each rank of `from`, in that order.
pub(crate) fn wait_bufs<B: Backend>(
    comm: &mut dyn Communicator,
    be: &B,
    posted: Posted,
    lens: Lens<'_>,
) -> Result<Vec<Parcel<B>>> {
    match posted {
        Posted::Staged { op, from } => {
            let got = comm.wait().map_err(comm_err)?;
            if got.len() != from.len() {
                return Err(internal(format!("`{op}`: {} messages for {} senders", got.len(), from.len())));
            }
            let mut out = Vec::with_capacity(got.len());
            for (&r, b) in from.iter().zip(&got) {
                let mut u = Unpack::new(r, &op, b);
                let rows = u.u32s().map_err(protocol)?;
                let mut bufs = Vec::new();
                for want in lens(&rows) {
                    let code = u.u32s().map_err(protocol)?;
                    let v = match code.as_slice() {
                        [c] if *c == DType::F32.code() => HostBuf::F32(u.f32s().map_err(protocol)?),
                        [c] if *c == DType::Bf16.code() => HostBuf::Bf16(u.u16s().map_err(protocol)?),
                        other => {
                            return Err(WorkerError::Protocol {
                                rank: r,
                                detail: format!("`{op}`: a buffer of unknown type {other:?}"),
                            })
                        }
                    };
                    if v.len() != want {
                        return Err(WorkerError::Protocol {
                            rank: r,
                            detail: format!(
                                "`{op}`: a buffer of {} values, expected {want} for {} rows",
                                v.len(),
                                rows.len()
                            ),
                        });
                    }
                    bufs.push(be.stage_in(&v)?);
                }
                u.finish().map_err(protocol)?;
                out.push((rows, bufs));
            }
            Ok(out)
        }
        Posted::Device { op, from, rows, lens, sent, t0 } => {
            // The plane waits apart from the communicator, which it asks for a peer's abort
            // meanwhile (a peer that gave up before its side of the exchange: see `plane::Watch`).
            let mut plane = comm.take_plane().ok_or_else(|| internal("the device plane went away"))?;
            let name = plane.name();
            let done = typed::<B::Buf>(plane.as_mut()).and_then(|p| p.complete(&mut || comm.poll_abort(&op)));
            comm.set_plane(plane);
            let mut got = match done {
                Ok(got) => got.into_iter(),
                Err(e) => {
                    // A peer that gave the job up between two looks (its own GPU lost, say) said
                    // why on the control channel: its reason and class are the job's, not this
                    // wait's timeout. A timeout or a lost transfer tore the plane down: such a
                    // peer stranded the exchange, and the world must be rebuilt.
                    let torn = matches!(e, CommError::Timeout { .. } | CommError::RankLost { .. });
                    if !matches!(e, CommError::Device { .. } | CommError::Aborted { .. } | CommError::Stranded { .. }) {
                        if let Err(found) = comm.poll_abort(&op) {
                            return Err(comm_err(if torn { found.stranded() } else { found }));
                        }
                    }
                    return Err(comm_err(e));
                }
            };
            let mut received = 0;
            let mut out = Vec::with_capacity(from.len());
            for (r, l) in rows.into_iter().zip(lens) {
                let mut bufs = Vec::with_capacity(l.len());
                for (n, t) in l {
                    let b = if n == 0 {
                        be.zeros_as(0, t)?
                    } else {
                        got.next().ok_or_else(|| internal(format!("`{op}`: the device plane lost a buffer")))?
                    };
                    received += be.bytes(&b);
                    bufs.push(b);
                }
                out.push((r, bufs));
            }
            comm.note(&format!("{op}@{name}"), sent, received, t0.elapsed());
            Ok(out)
        }
    }
}

/// [`post_bufs`] and [`wait_bufs`] in one.
pub(crate) fn exchange_bufs<B: Backend>(
    comm: &mut dyn Communicator,
    be: &B,
    op: &str,
    sends: Vec<Outgoing<'_, B>>,
    from: Vec<usize>,
    lens: Lens<'_>,
) -> Result<Vec<Parcel<B>>> {
    let posted = post_bufs(comm, be, op, sends, from, lens)?;
    wait_bufs(comm, be, posted, lens)
}

/// Every other rank's (rows, buffers), in rank order (this rank's own are not returned).
pub(crate) fn all_gather_bufs<B: Backend>(
    comm: &mut dyn Communicator,
    be: &B,
    op: &str,
    rows: &[u32],
    bufs: &[&B::Buf],
    lens: Lens<'_>,
) -> Result<Vec<(usize, Parcel<B>)>> {
    let (me, n) = (comm.rank(), comm.size());
    let others: Vec<usize> = (0..n).filter(|&r| r != me).collect();
    let sends = others.iter().map(|&r| (r, rows.to_vec(), bufs.to_vec())).collect();
    let got = exchange_bufs(comm, be, op, sends, others.clone(), lens)?;
    Ok(others.into_iter().zip(got).collect())
}

/// `lens` of messages whose rows each carry one row of every width in `widths`.
pub(crate) fn per_row<const N: usize>(widths: [usize; N]) -> impl Fn(&[u32]) -> Vec<usize> {
    move |rows: &[u32]| widths.iter().map(|w| rows.len() * w).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use flowprefill_comm::local::LocalComm;
    use flowprefill_comm::plane::{threads, Typed, GRACE};
    use flowprefill_comm::ErrorClass;
    use flowprefill_kernels::Cpu;
    use std::time::Duration;

    /// Two thread ranks with a device plane of host buffers (NCCL's contract).
    fn world() -> Vec<LocalComm> {
        let describe = |b: &HostBuf| format!("a {} buffer of {} values", b.dtype(), b.len());
        let ends = threads::group::<HostBuf>(2, HostBuf::clone, describe);
        let mut comms = LocalComm::group(2);
        for (c, end) in comms.iter_mut().zip(ends) {
            c.set_plane(Box::new(Typed::<HostBuf>(Box::new(end))));
        }
        comms
    }

    /// Rank 0 sends rank 1 two rows of 3 values each way; rank 1 runs `peer`.
    fn exchange_with(peer: impl FnOnce(&mut LocalComm) + Send) -> (Result<Vec<Parcel<Cpu>>>, Duration, LocalComm) {
        let mut comms = world();
        let mut c1 = comms.pop().expect("rank 1");
        let mut c0 = comms.pop().expect("rank 0");
        let be = Cpu::default();
        let buf = be.stage_in(&HostBuf::F32(vec![1.0; 6])).expect("buffer");
        std::thread::scope(|s| {
            s.spawn(|| peer(&mut c1));
            let t = Instant::now();
            let lens = per_row([3]);
            let got = exchange_bufs(&mut c0, &be, "ring.kv", vec![(1, vec![0, 1], vec![&buf])], vec![1], &lens);
            (got, t.elapsed(), c0)
        })
    }

    #[test]
    fn a_peer_that_fails_between_the_control_rows_and_its_transfers_is_seen_within_the_grace() {
        let (got, waited, mut c0) = exchange_with(|c1| {
            // Its control rows go out, then its receive buffers do not fit: no transfers.
            let control = Packet::new().u32s(&[0, 1]).u32s(&[DType::F32.code()]).into_bytes().expect("control");
            c1.post("ring.kv", vec![(0, control)], vec![0]).expect("post");
            c1.wait().expect("control rows");
            c1.abort(ErrorClass::Resource, "out of memory on cuda:1 for 6 values");
        });
        match got {
            Err(WorkerError::Comm(CommError::Stranded { rank: 1, class: ErrorClass::Resource, reason, .. })) => {
                assert!(reason.contains("out of memory on cuda:1"), "{reason}")
            }
            Err(e) => panic!("{e}"),
            Ok(_) => panic!("the exchange cannot complete"),
        }
        // Within the grace, not at the communicator's 60 s deadline.
        assert!(waited >= GRACE && waited < GRACE + Duration::from_secs(20), "{waited:?}");
        // The plane went back to the communicator (torn down: the world is rebuilt).
        assert!(c0.plane().is_some());
    }

    #[test]
    fn an_exchange_over_the_plane_puts_the_plane_back() {
        let (got, _, mut c0) = exchange_with(|c1| {
            let be = Cpu::default();
            let buf = be.stage_in(&HostBuf::F32(vec![2.0; 6])).expect("buffer");
            let lens = per_row([3]);
            exchange_bufs(c1, &be, "ring.kv", vec![(0, vec![4, 5], vec![&buf])], vec![0], &lens).expect("rank 1");
        });
        let got = got.expect("rank 0");
        let be = Cpu::default();
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].0, vec![4, 5]);
        assert_eq!(be.stage_out(&got[0].1[0]).expect("out"), HostBuf::F32(vec![2.0; 6]));
        assert!(c0.plane().is_some(), "the plane is back on the communicator");
    }
}
