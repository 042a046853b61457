//! The bytes that travel between ranks: one codec for numeric payloads (sections of `u32`,
//! `f32` or `u16` (bf16 bits) values through `bytemuck`), bincode for control messages, and the envelope every
//! message carries (the job epoch and whether it is data or an abort).
//!
//! ```text
//!   numeric payload:  [len u32][values ...] [len u32][values ...] ...      (Packet / Unpack)
//!   envelope:         [payload ...][op tag u32][epoch u64][kind u8]       (a trailer, so that
//!                                                                           framing never copies)
//!   op tag: a hash of the collective's name; a data message of another collective than the
//!   one waited for means the ranks are out of step (a bug), reported as such at once instead
//!   of being decoded as something else.
//! ```
//! Values are in the machine's byte order: every rank of a world runs the same binary on the
//! same architecture. Decoding copies into aligned vectors (`pod_collect_to_vec`), since a
//! received buffer has no alignment guarantee.

use crate::{CommError, ErrorClass, Result};
use serde::de::DeserializeOwned;
use serde::Serialize;

/// A numeric message under construction: sections of `u32` or `f32` values. A section of more
/// than `u32::MAX` values (its length prefix) is not written: [`Packet::into_bytes`] reports it.
#[derive(Debug, Default)]
pub struct Packet {
    bytes: Vec<u8>,
    /// Values of the first section too long for its length prefix.
    too_long: Option<usize>,
}

/// Values one section of a [`Packet`] holds at most.
pub const MAX_SECTION: usize = u32::MAX as usize;

impl Packet {
    /// An empty packet.
    pub fn new() -> Self {
        Self::default()
    }

    fn section<T: bytemuck::Pod>(mut self, values: &[T]) -> Self {
        match u32::try_from(values.len()) {
            Ok(n) if self.too_long.is_none() => {
                self.bytes.extend_from_slice(bytemuck::bytes_of(&n));
                self.bytes.extend_from_slice(bytemuck::cast_slice(values));
            }
            Ok(_) => {}
            Err(_) => {
                self.too_long.get_or_insert(values.len());
            }
        }
        self
    }

    /// Appends a section of `u32` values.
    pub fn u32s(self, values: &[u32]) -> Self {
        self.section(values)
    }

    /// Appends a section of `f32` values.
    pub fn f32s(self, values: &[f32]) -> Self {
        self.section(values)
    }

    /// Appends a section of `u16` values (bf16 bits).
    pub fn u16s(self, values: &[u16]) -> Self {
        self.section(values)
    }

    /// The encoded bytes, or [`CommError::TooLarge`] if a section had more than
    /// [`MAX_SECTION`] values (its length would have been truncated, and the receiver would
    /// have read the rest as other sections).
    pub fn into_bytes(self) -> Result<Vec<u8>> {
        match self.too_long {
            None => Ok(self.bytes),
            Some(n) => Err(CommError::TooLarge {
                op: "packet".into(),
                what: "a section of values".into(),
                size: n as u64,
                limit: MAX_SECTION as u64,
            }),
        }
    }
}

/// Reads the sections of a [`Packet`] back, in the order they were written. Every malformed
/// input is a [`CommError::Decode`] naming the sender and the collective.
#[derive(Debug)]
pub struct Unpack<'a> {
    rank: usize,
    op: &'a str,
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Unpack<'a> {
    /// A reader of `bytes`, received from `rank` during `op`.
    pub fn new(rank: usize, op: &'a str, bytes: &'a [u8]) -> Self {
        Self { rank, op, bytes, at: 0 }
    }

    fn bad(&self, detail: String) -> CommError {
        CommError::Decode { rank: self.rank, op: self.op.to_string(), detail }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.bytes.len()).ok_or_else(|| {
            self.bad(format!("truncated: {} bytes wanted at offset {} of {}", n, self.at, self.bytes.len()))
        })?;
        let s = &self.bytes[self.at..end];
        self.at = end;
        Ok(s)
    }

    fn section<T: bytemuck::Pod>(&mut self) -> Result<Vec<T>> {
        let n: u32 = bytemuck::pod_read_unaligned(self.take(4)?);
        let len = (n as usize)
            .checked_mul(std::mem::size_of::<T>())
            .ok_or_else(|| self.bad(format!("section of {n} values is too large")))?;
        Ok(bytemuck::pod_collect_to_vec(self.take(len)?))
    }

    /// The next section, as `u32` values.
    pub fn u32s(&mut self) -> Result<Vec<u32>> {
        self.section()
    }

    /// The next section, as `f32` values.
    pub fn f32s(&mut self) -> Result<Vec<f32>> {
        self.section()
    }

    /// The next section, as `u16` values (bf16 bits).
    pub fn u16s(&mut self) -> Result<Vec<u16>> {
        self.section()
    }

    /// Checks that nothing is left over.
    pub fn finish(self) -> Result<()> {
        if self.at == self.bytes.len() {
            Ok(())
        } else {
            Err(self.bad(format!("{} bytes left over after the last section", self.bytes.len() - self.at)))
        }
    }
}

/// Encodes a control message.
pub fn encode<T: Serialize>(value: &T) -> Result<Vec<u8>> {
    bincode::serde::encode_to_vec(value, bincode::config::standard()).map_err(|e| CommError::Decode {
        rank: usize::MAX,
        op: "encoding a control message".into(),
        detail: e.to_string(),
    })
}

/// Decodes a control message from `rank`.
pub fn decode<T: DeserializeOwned>(rank: usize, op: &str, bytes: &[u8]) -> Result<T> {
    bincode::serde::decode_from_slice(bytes, bincode::config::standard())
        .map(|(v, _)| v)
        .map_err(|e| CommError::Decode { rank, op: op.into(), detail: e.to_string() })
}

const KIND_DATA: u8 = 0;
const KIND_ABORT: u8 = 1;
const KIND_LEAVE: u8 = 2;
const TRAILER: usize = 13;

/// FNV-1a of a collective's name: what a data message says it belongs to.
pub(crate) fn op_tag(op: &str) -> u32 {
    op.bytes().fold(0x811c_9dc5u32, |h, b| (h ^ b as u32).wrapping_mul(0x0100_0193))
}

fn seal(mut payload: Vec<u8>, tag: u32, epoch: u64, kind: u8) -> Vec<u8> {
    payload.extend_from_slice(bytemuck::bytes_of(&tag));
    payload.extend_from_slice(bytemuck::bytes_of(&epoch));
    payload.push(kind);
    payload
}

/// Seals a data payload of collective `op` for sending in job `epoch`.
pub(crate) fn seal_data(payload: Vec<u8>, op: &str, epoch: u64) -> Vec<u8> {
    seal(payload, op_tag(op), epoch, KIND_DATA)
}

/// An abort notice for job `epoch`: why this rank gave the job up.
pub(crate) fn seal_abort(epoch: u64, class: ErrorClass, reason: &str) -> Vec<u8> {
    seal(encode(&(class, reason)).unwrap_or_default(), 0, epoch, KIND_ABORT)
}

/// A farewell: this rank is leaving the world (it panicked, or lost another rank) and will
/// send nothing more. Whatever the job, a peer that reads it reports the rank lost at once.
pub(crate) fn seal_leave(epoch: u64, reason: &str) -> Vec<u8> {
    seal(reason.as_bytes().to_vec(), 0, epoch, KIND_LEAVE)
}

/// What a received message means to a rank in job `epoch`.
#[derive(Debug)]
pub(crate) enum Opened {
    /// A message of an earlier job (ended by an abort): dropped.
    Stale,
    /// The payload of a data message of this job.
    Data(Vec<u8>),
    /// The sender gave this job up.
    Abort { class: ErrorClass, reason: String },
    /// The sender is already in a later job (this one ended elsewhere); the message is kept
    /// for the next job.
    Ahead(Vec<u8>),
    /// The sender left the world, for this reason.
    Left(String),
}

/// Opens a sealed message received from `rank` while in job `epoch`, waiting for `op`.
pub(crate) fn open(rank: usize, epoch: u64, op: &str, mut msg: Vec<u8>) -> Result<Opened> {
    if msg.len() < TRAILER {
        return Err(CommError::Decode { rank, op: "envelope".into(), detail: format!("{} bytes", msg.len()) });
    }
    let kind = msg[msg.len() - 1];
    if kind == KIND_LEAVE {
        msg.truncate(msg.len() - TRAILER);
        return Ok(Opened::Left(String::from_utf8_lossy(&msg).into_owned()));
    }
    let e = epoch_of(&msg).unwrap_or(epoch);
    if e < epoch {
        return Ok(Opened::Stale);
    }
    if e > epoch {
        return Ok(Opened::Ahead(msg));
    }
    let tag: u32 = bytemuck::pod_read_unaligned(&msg[msg.len() - TRAILER..msg.len() - 9]);
    msg.truncate(msg.len() - TRAILER);
    match kind {
        KIND_DATA if tag != op_tag(op) => Err(CommError::OutOfStep { rank, op: op.to_string() }),
        KIND_DATA => Ok(Opened::Data(msg)),
        KIND_ABORT => {
            let (class, reason): (ErrorClass, String) = decode(rank, "abort", &msg)?;
            Ok(Opened::Abort { class, reason })
        }
        k => Err(CommError::Decode { rank, op: "envelope".into(), detail: format!("unknown message kind {k}") }),
    }
}

fn epoch_of(msg: &[u8]) -> Option<u64> {
    (msg.len() >= TRAILER).then(|| bytemuck::pod_read_unaligned(&msg[msg.len() - 9..msg.len() - 1]))
}

/// Whether a sealed message belongs to a job before `epoch` (it will be dropped on arrival).
pub(crate) fn is_stale(epoch: u64, msg: &[u8]) -> bool {
    epoch_of(msg).is_some_and(|e| e < epoch)
}

/// Whether a sealed message is an abort of job `epoch`, or from a later job (the job ended
/// elsewhere): what [`crate::Communicator::poll_abort`] looks for among early arrivals.
pub(crate) fn ends_job(epoch: u64, msg: &[u8]) -> bool {
    let kind = msg.last().copied();
    kind == Some(KIND_LEAVE) || epoch_of(msg).is_some_and(|e| e > epoch || (e == epoch && kind == Some(KIND_ABORT)))
}

/// The error for a peer that left.
fn left(rank: usize, op: &str, reason: String) -> CommError {
    CommError::RankLost { rank, op: op.to_string(), detail: format!("it left the world: {reason}") }
}

/// The error a rank reports when it learns during `op` that `rank` ended the job: with the
/// peer's class and reason for an abort, or because the peer is already in a later job.
pub(crate) fn aborted_by(rank: usize, op: &str, abort: Option<(ErrorClass, String)>) -> CommError {
    let (class, reason) =
        abort.unwrap_or_else(|| (ErrorClass::Peer, "it had already moved on to a later job".to_string()));
    CommError::Aborted { rank, op: op.to_string(), class, reason }
}

/// Takes the first message in `queue` that ends job `epoch` (see [`ends_job`]), as the error
/// to report; stale messages are dropped on the way.
pub(crate) fn find_abort(
    rank: usize,
    op: &str,
    epoch: u64,
    queue: &mut std::collections::VecDeque<Vec<u8>>,
) -> Result<Option<CommError>> {
    queue.retain(|m| m.last() == Some(&KIND_LEAVE) || !is_stale(epoch, m));
    let Some(i) = queue.iter().position(|m| ends_job(epoch, m)) else { return Ok(None) };
    if queue[i].last() != Some(&KIND_LEAVE) && epoch_of(&queue[i]).is_some_and(|e| e > epoch) {
        return Ok(Some(aborted_by(rank, op, None)));
    }
    // A farewell stays queued: the peer is gone for every later wait too.
    let msg = if queue[i].last() == Some(&KIND_LEAVE) { queue[i].clone() } else { queue.remove(i).unwrap_or_default() };
    match open(rank, epoch, op, msg)? {
        Opened::Abort { class, reason } => Ok(Some(aborted_by(rank, op, Some((class, reason))))),
        Opened::Left(reason) => Ok(Some(left(rank, op, reason))),
        _ => Ok(None),
    }
}

/// The next message of job `epoch` from `rank` among those already in `queue`: data is
/// returned, stale messages are dropped, `None` when nothing usable has arrived yet. An abort,
/// or a message of a later job (kept in `queue`), becomes [`CommError::Aborted`].
pub(crate) fn take_ready(
    rank: usize,
    op: &str,
    epoch: u64,
    queue: &mut std::collections::VecDeque<Vec<u8>>,
) -> Result<Option<Vec<u8>>> {
    while let Some(msg) = queue.pop_front() {
        match open(rank, epoch, op, msg)? {
            Opened::Stale => continue,
            Opened::Data(d) => return Ok(Some(d)),
            Opened::Abort { class, reason } => return Err(aborted_by(rank, op, Some((class, reason)))),
            Opened::Ahead(m) => {
                queue.push_front(m);
                return Err(aborted_by(rank, op, None));
            }
            Opened::Left(reason) => {
                // It stays queued: the peer is gone for every later wait too.
                queue.push_front(seal_leave(epoch, &reason));
                return Err(left(rank, op, reason));
            }
        }
    }
    Ok(None)
}

/// The next message of job `epoch` from `rank`, from `queue` or else from `recv` (blocking);
/// see [`take_ready`].
pub(crate) fn next_message(
    rank: usize,
    op: &str,
    epoch: u64,
    queue: &mut std::collections::VecDeque<Vec<u8>>,
    mut recv: impl FnMut() -> Result<Vec<u8>>,
) -> Result<Vec<u8>> {
    loop {
        if let Some(d) = take_ready(rank, op, epoch, queue)? {
            return Ok(d);
        }
        queue.push_back(recv()?);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packets_round_trip_and_reject_garbage() {
        let b = Packet::new().u32s(&[1, 2, 3]).f32s(&[0.5, -1.0]).f32s(&[]).into_bytes().unwrap();
        let mut u = Unpack::new(2, "t", &b);
        assert_eq!(u.u32s().unwrap(), vec![1, 2, 3]);
        assert_eq!(u.f32s().unwrap(), vec![0.5, -1.0]);
        assert_eq!(u.f32s().unwrap(), Vec::<f32>::new());
        u.finish().unwrap();
        // Unaligned input decodes the same.
        let mut shifted = vec![0u8];
        shifted.extend_from_slice(&b);
        let mut u = Unpack::new(2, "t", &shifted[1..]);
        assert_eq!(u.u32s().unwrap(), vec![1, 2, 3]);
        // Truncation, a huge length and leftovers are decode errors naming the sender.
        assert!(Unpack::new(2, "t", &b[..b.len() - 1]).u32s().is_ok(), "the first section is intact");
        let mut u = Unpack::new(2, "t", &b[..b.len() - 7]);
        u.u32s().unwrap();
        let e = u.f32s().unwrap_err().to_string();
        assert!(e.contains("rank 2") && e.contains("truncated"), "{e}");
        let e = Unpack::new(3, "t", &[0xff, 0xff, 0xff, 0xff]).f32s().unwrap_err().to_string();
        assert!(e.contains("rank 3"), "{e}");
        let mut u = Unpack::new(1, "t", &b);
        u.u32s().unwrap();
        assert!(u.finish().unwrap_err().to_string().contains("left over"));
    }

    #[test]
    fn a_section_past_its_length_prefix_is_an_error_not_a_truncated_length() {
        // 2^32 zero-sized values (no memory): the length prefix would have read 0, and the
        // receiver would have taken the values for other sections.
        let huge = vec![(); MAX_SECTION + 1];
        let e = Packet::new().u32s(&[1]).section(&huge).u32s(&[2]).into_bytes().unwrap_err();
        assert!(matches!(e, CommError::TooLarge { size, limit, .. } if size == 1 << 32 && limit == u32::MAX as u64));
        assert!(e.to_string().contains("too large for one message"), "{e}");
    }

    #[test]
    fn encoding_errors_name_this_rank_not_rank_usize_max() {
        let e = CommError::Decode { rank: usize::MAX, op: "encoding a control message".into(), detail: "x".into() };
        assert_eq!(e.to_string(), "this rank's message (encoding a control message): x");
        let e = CommError::Decode { rank: 3, op: "probe".into(), detail: "x".into() };
        assert_eq!(e.to_string(), "message from rank 3 during `probe`: x");
    }

    #[test]
    fn envelopes_sort_messages_by_epoch_and_kind() {
        let d = seal_data(vec![7, 8], "probe.gather", 5);
        assert!(matches!(open(1, 5, "probe.gather", d.clone()).unwrap(), Opened::Data(p) if p == vec![7, 8]));
        assert!(matches!(open(1, 6, "probe.gather", d.clone()).unwrap(), Opened::Stale));
        assert!(matches!(open(1, 4, "probe.gather", d.clone()).unwrap(), Opened::Ahead(_)));
        // Data of another collective than the one waited for: the ranks are out of step.
        let e = open(1, 5, "recompute.q", d.clone()).unwrap_err();
        assert!(matches!(&e, CommError::OutOfStep { rank: 1, op } if op == "recompute.q"), "{e}");
        assert!(!e.world_intact());
        assert!(!ends_job(5, &d) && ends_job(4, &d) && !ends_job(6, &d));
        let a = seal_abort(5, ErrorClass::Deadline, "too slow");
        assert!(ends_job(5, &a) && !ends_job(6, &a));
        match open(1, 5, "anything", a).unwrap() {
            Opened::Abort { class, reason } => assert_eq!((class, reason.as_str()), (ErrorClass::Deadline, "too slow")),
            o => panic!("{o:?}"),
        }
        assert!(open(1, 5, "x", vec![1, 2]).is_err());
    }
}
