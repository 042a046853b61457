//! NCCL as the device plane of a multi-GPU world: the kernels crate's [`NcclPlane`] (grouped
//! `ncclSend`/`ncclRecv` of GPU buffers) behind the communicator's [`BufPlane`] of the
//! run-time device buffer [`DevBuf`]. It lives here, where the device and the communicator
//! meet, so that `kernels` knows nothing of `comm`.

use flowprefill_comm::plane::{grace_for, unfinished, BufPlane, Look, Typed, Watch};
use flowprefill_comm::{broadcast_bytes, CommError, Communicator};
use flowprefill_kernels::cuda::nccl::{self, NcclPlane, PlaneError};
use flowprefill_kernels::device::{DevBuf, Device};
use flowprefill_kernels::{KernelError, Result};
use std::time::Duration;

/// NCCL between the GPUs of a world: [`attach`] puts this on each rank's communicator; it
/// moves the GPU variant of [`DevBuf`].
struct NcclDevicePlane(NcclPlane);

/// The communicator's error for a plane's.
fn comm_error(e: PlaneError) -> CommError {
    match e {
        PlaneError::Misuse(m) => CommError::Misuse(m),
        PlaneError::BadRank { rank, size } => CommError::BadRank { rank, size },
        PlaneError::Lost { rank, op, detail } => CommError::RankLost { rank, op, detail },
        PlaneError::DeviceLost { rank, op, detail } => CommError::Device { rank, op, detail },
        PlaneError::Timeout { rank, op, secs } => CommError::Timeout { rank, op, secs, unsent: 0 },
    }
}

impl BufPlane<DevBuf> for NcclDevicePlane {
    fn name(&self) -> &'static str {
        "nccl"
    }
    fn issue(
        &mut self,
        op: &str,
        sends: &[(usize, &DevBuf)],
        receives: Vec<(usize, DevBuf)>,
    ) -> flowprefill_comm::Result<()> {
        if let Some(why) = self.0.down() {
            return Err(CommError::PlaneDown { op: op.to_string(), why });
        }
        let mut on_gpu = Vec::with_capacity(sends.len());
        for &(peer, b) in sends {
            match b {
                DevBuf::Cuda(d) => on_gpu.push((peer, d)),
                DevBuf::Cpu(_) => {
                    return Err(CommError::Misuse(format!(
                        "`{op}`: a CPU buffer cannot go over NCCL (the model is not on the GPU)"
                    )))
                }
            }
        }
        let mut into = Vec::with_capacity(receives.len());
        for (peer, b) in receives {
            match b {
                DevBuf::Cuda(d) => into.push((peer, d)),
                DevBuf::Cpu(_) => {
                    return Err(CommError::Misuse(format!(
                        "`{op}`: NCCL cannot receive into a CPU buffer (the model is not on the GPU)"
                    )))
                }
            }
        }
        self.0.issue(op, &on_gpu, into).map_err(comm_error)
    }
    fn complete(&mut self, look: Look<'_>) -> flowprefill_comm::Result<Vec<DevBuf>> {
        let mut watch = Watch::new(look, grace_for(self.0.pending_bytes(), self.0.timeout()));
        // The watch's error (a peer's abort past its grace, a lost peer) is the one to report.
        let mut why = None;
        let got = self.0.complete_until(&mut || {
            let e = watch.check().err()?;
            let text = e.to_string();
            why = Some(e);
            Some(text)
        });
        match (got, why) {
            (Ok(bufs), _) => {
                watch.finish()?;
                Ok(bufs.into_iter().map(DevBuf::Cuda).collect())
            }
            (Err(_), Some(e)) => Err(e),
            (Err(e), None) => Err(watch.fail(comm_error(e))),
        }
    }
    fn abort(&mut self, reason: &str) {
        self.0.abort(reason)
    }
    fn set_timeout(&mut self, timeout: Duration) {
        self.0.set_timeout(timeout)
    }
    fn end_job(&mut self) {
        let grace = grace_for(self.0.pending_bytes(), self.0.timeout());
        self.0.end_job_within(grace, &|op, limit| unfinished(op, limit, &"its transfers never completed"))
    }
    fn down(&self) -> Option<String> {
        self.0.down()
    }
}

/// Gives the ranks of `comm` NCCL between their GPUs (every rank calls it at once, each with
/// its own GPU): rank 0 makes the unique id and broadcasts it over `comm`, each rank creates
/// its communicator (with `comm`'s deadline) and a plane on its own stream. A world of one
/// needs none. Errors name the rank and what failed.
pub fn attach(device: &Device, comm: &mut dyn Communicator) -> Result<()> {
    let backend_err = |detail: String| KernelError::Backend { backend: "nccl", detail };
    let (rank, size) = (comm.rank(), comm.size());
    let Device::Cuda(be) = device else {
        return Err(backend_err(format!("rank {rank}: NCCL moves GPU buffers, but this rank runs on the CPU")));
    };
    if size == 1 {
        return Ok(());
    }
    // Rank 0 sends an empty id when it cannot make one, so nobody waits for it in vain.
    let made = if rank == 0 { Some(nccl::unique_id()) } else { None };
    let bytes = match &made {
        Some(Ok(id)) => id.to_vec(),
        _ => Vec::new(),
    };
    if let Some(Err(e)) = made {
        let _ = broadcast_bytes(comm, "nccl.id", 0, bytes);
        return Err(e);
    }
    let got = broadcast_bytes(comm, "nccl.id", 0, bytes)
        .map_err(|e| backend_err(format!("rank {rank}: the NCCL unique id: {e}")))?;
    let id: [u8; nccl::ID_BYTES] =
        got.try_into().map_err(|_| backend_err(format!("rank {rank}: rank 0 could not make an NCCL unique id")))?;
    let nc = nccl::communicator(be.ordinal(), rank, size, &id, comm.timeout())?;
    let plane = NcclPlane::new(nc, be, comm.timeout())?;
    comm.set_plane(Box::new(Typed::<DevBuf>(Box::new(NcclDevicePlane(plane)))));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plane_errors_read_as_the_communicators() {
        let cases = [
            PlaneError::Misuse("`x` issued while another device exchange is pending".into()),
            PlaneError::BadRank { rank: 5, size: 2 },
            PlaneError::Lost { rank: 1, op: "ring.kv".into(), detail: "ncclSend to rank 1: X".into() },
            PlaneError::Timeout { rank: 1, op: "ring.kv".into(), secs: 30.0 },
            PlaneError::DeviceLost { rank: 1, op: "ring.kv".into(), detail: "wait: CUDA_ERROR_ILLEGAL_ADDRESS".into() },
        ];
        for e in cases {
            let text = e.to_string();
            let mapped = comm_error(e);
            assert_eq!(mapped.to_string(), text, "the user reads the same message");
        }
        assert!(matches!(
            comm_error(PlaneError::Timeout { rank: 3, op: "o".into(), secs: 1.0 }),
            CommError::Timeout { rank: 3, .. }
        ));
        assert!(matches!(
            comm_error(PlaneError::Lost { rank: 2, op: "o".into(), detail: "d".into() }),
            CommError::RankLost { rank: 2, .. }
        ));
        // This GPU's failure is the device's class (the process stops: exit 69, `device_failure`).
        let own = comm_error(PlaneError::DeviceLost { rank: 0, op: "o".into(), detail: "d".into() });
        // The control channel still works: the rank tells the others (an abort of this class)
        // rather than the world being taken for broken, which would answer for a lost peer.
        assert!(matches!(own, CommError::Device { .. }) && own.world_intact());
        assert_eq!(crate::WorkerError::Comm(own).class(), flowprefill_comm::ErrorClass::Device);
    }

    #[test]
    fn a_cpu_device_gets_no_nccl() {
        let mut comms = flowprefill_comm::local::LocalComm::group(2);
        let dev = Device::Cpu(flowprefill_kernels::Cpu::default());
        let e = attach(&dev, &mut comms[0]).expect_err("the CPU has no NCCL").to_string();
        assert!(e.contains("runs on the CPU"), "{e}");
    }
}
