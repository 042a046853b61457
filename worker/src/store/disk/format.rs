//! The disk tier's file format: a header that names the chunk and the scope, the payload
//! (positions, then per layer K and V, little-endian), a CRC-32 of both at the end; and the
//! checks every reader makes (a header that belongs to the scope, the length it announces, the
//! checksum).

use super::{Record, Scope};
use crate::kv::KeyForm;
use crate::store::ChunkKey;
use flowprefill_kernels::{DType, HostBuf};
use std::fs::{File, Metadata};
use std::io::{self, Read};
use std::path::Path;

/// The version of the file format and of the numbers an entry holds, in every file's header and
/// in its name: bumped when the layout changes and also when a prefill's numbers change for the
/// same model file (a file of another version is never served, and left alone). 2 (2026-11-28):
/// linear RoPE scaling read from the model file (such models' caches of version 1 were computed
/// at the wrong angles) and the GPU's bf16 attention outputs (2026-11-27).
pub const FORMAT_VERSION: u32 = 2;
const MAGIC: &[u8; 8] = b"FPKVSTOR";

pub(super) fn dtype_code(d: DType) -> u8 {
    match d {
        DType::F32 => 0,
        DType::Bf16 => 1,
    }
}

pub(super) fn form_code(f: KeyForm) -> u8 {
    match f {
        KeyForm::PreRope => 0,
        KeyForm::Rotated => 1,
    }
}

/// The fixed fields of a file's header.
#[derive(Debug, PartialEq)]
pub(super) struct Header {
    pub(super) version: u32,
    pub(super) key: [u8; 32],
    pub(super) model: String,
    pub(super) device: String,
    pub(super) dtype: u8,
    pub(super) form: u8,
    pub(super) layers: u32,
    pub(super) kv_dim: u32,
    pub(super) rows: u32,
    pub(super) payload: u64,
    /// Bytes before the payload.
    pub(super) start: u64,
}

impl Header {
    /// The header of a file of another format `version`: every other field empty, so that no
    /// scope owns it.
    fn of_version(version: u32) -> Header {
        Header {
            version,
            key: [0; 32],
            model: String::new(),
            device: String::new(),
            dtype: u8::MAX,
            form: u8::MAX,
            layers: 0,
            kv_dim: 0,
            rows: 0,
            payload: 0,
            start: 0,
        }
    }

    /// Whether the file is of this build's format version (the rest of the header was read).
    pub(super) fn current(&self) -> bool {
        self.version == FORMAT_VERSION
    }

    pub(super) fn file_len(&self) -> u64 {
        self.start + self.payload + 4
    }
}

pub(super) fn encode_header(key: &ChunkKey, scope: &Scope, rec: &Record) -> Vec<u8> {
    let rows = rec.positions.len();
    let payload = rows * 4 + rec.kv_bytes();
    let mut h = Vec::with_capacity(128);
    h.extend_from_slice(key.bytes());
    for s in [&scope.model, &scope.device] {
        h.extend_from_slice(&(s.len() as u16).to_le_bytes());
        h.extend_from_slice(s.as_bytes());
    }
    h.push(dtype_code(scope.dtype));
    h.push(form_code(rec.form));
    for v in [rec.layers.len() as u32, rec.kv_dim as u32, rows as u32] {
        h.extend_from_slice(&v.to_le_bytes());
    }
    h.extend_from_slice(&(payload as u64).to_le_bytes());
    let mut out = Vec::with_capacity(16 + h.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&(h.len() as u32).to_le_bytes());
    out.extend_from_slice(&h);
    out
}

/// Reads a header from the first bytes of a file (`None`: not one of ours at all).
pub(super) fn decode_header(bytes: &[u8]) -> Option<Header> {
    let mut at = 0usize;
    let mut take = |n: usize| -> Option<&[u8]> {
        let s = bytes.get(at..at + n)?;
        at += n;
        Some(s)
    };
    if take(8)? != MAGIC {
        return None;
    }
    let u32_of = |b: &[u8]| u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    let version = u32_of(take(4)?);
    if version != FORMAT_VERSION {
        // Another version's file: its layout may differ, so nothing past the version is read
        // (read as this version's, it looked damaged and was deleted). Only the version counts.
        return Some(Header::of_version(version));
    }
    let hlen = u32_of(take(4)?) as usize;
    if hlen > 1 << 16 {
        return None;
    }
    let start = (16 + hlen) as u64;
    let h = bytes.get(16..16 + hlen)?;
    let mut p = 0usize;
    let mut get = |n: usize| -> Option<&[u8]> {
        let s = h.get(p..p + n)?;
        p += n;
        Some(s)
    };
    let key: [u8; 32] = get(32)?.try_into().ok()?;
    let mut string = || -> Option<String> {
        let n = u16::from_le_bytes(get(2)?.try_into().ok()?) as usize;
        String::from_utf8(get(n)?.to_vec()).ok()
    };
    let model = string()?;
    let device = string()?;
    let dtype = get(1)?[0];
    let form = get(1)?[0];
    let layers = u32_of(get(4)?);
    let kv_dim = u32_of(get(4)?);
    let rows = u32_of(get(4)?);
    let payload = u64::from_le_bytes(get(8)?.try_into().ok()?);
    Some(Header { version, key, model, device, dtype, form, layers, kv_dim, rows, payload, start })
}

pub(super) fn le_bytes(buf: &HostBuf, out: &mut Vec<u8>) {
    #[cfg(target_endian = "little")]
    match buf {
        HostBuf::F32(v) => out.extend_from_slice(bytemuck::cast_slice(v)),
        HostBuf::Bf16(v) => out.extend_from_slice(bytemuck::cast_slice(v)),
    }
    #[cfg(not(target_endian = "little"))]
    match buf {
        HostBuf::F32(v) => v.iter().for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
        HostBuf::Bf16(v) => v.iter().for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
    }
}

impl Scope {
    /// Whether a file with header `h` holds an entry of this scope (model, device kind, element
    /// type, format version).
    pub(super) fn owns(&self, h: &Header) -> bool {
        h.version == FORMAT_VERSION
            && h.model == self.model
            && h.device == self.device
            && h.dtype == dtype_code(self.dtype)
    }
}

/// The element type named in a header, for listings.
pub(super) fn dtype_name(code: u8) -> &'static str {
    match code {
        0 => "f32",
        1 => "bf16",
        _ => "?",
    }
}

/// The header of the file at `path` (its first bytes: `None` when they are not a header) and
/// the file's metadata.
pub(super) fn read_header(path: &Path) -> io::Result<(Option<Header>, Metadata)> {
    let meta = std::fs::metadata(path)?;
    let mut head = vec![0u8; 4096.min(meta.len() as usize)];
    File::open(path)?.read_exact(&mut head)?;
    Ok((decode_header(&head), meta))
}

/// Why [`read_streamed`] returned no entry.
#[derive(Debug)]
pub(super) enum ReadError {
    /// The file is damaged (truncated, a wrong checksum, no header): it may be deleted.
    Damaged(String),
    /// Reading failed (an I/O error of the device, a file that shrank while it was read): the
    /// file may be intact and is left alone.
    Io(io::Error),
}

/// What [`read_streamed`] read: the header, the positions and each layer's K and V.
pub(super) type Streamed = (Header, Vec<u32>, Vec<(HostBuf, HostBuf)>);

/// A whole file (of `len` bytes) read straight into its typed buffers, the checksum computed
/// as each part arrives, returned only once the length and the checksum hold (`Err`: why the
/// file is damaged, as [`check_whole`] says it). One allocation and one copy of each byte,
/// where reading the file whole and then decoding it made two of each (the disk tier's reads
/// are host work that a GPU waits for: 2 GB/s on an H200's host, 2026-11-27). `None`: a
/// header of an unknown element type or a payload not of its announced shape, for the
/// whole-file path to classify (such a file is never served).
pub(super) fn read_streamed(f: &mut impl Read, len: u64) -> Result<Option<Streamed>, ReadError> {
    const NO_HEADER: &str = "no readable header";
    let damaged = |why: &str| ReadError::Damaged(why.into());
    // A file shorter than what it announces (or than a header) is damaged; any other error of
    // the read itself is the device's or the system's, not the file's.
    let short = |e: io::Error| match e.kind() {
        io::ErrorKind::UnexpectedEof => ReadError::Damaged(NO_HEADER.into()),
        _ => ReadError::Io(e),
    };
    let mut head = vec![0u8; 16];
    f.read_exact(&mut head).map_err(short)?;
    if &head[..8] != MAGIC {
        return Err(damaged(NO_HEADER));
    }
    if u32::from_le_bytes([head[8], head[9], head[10], head[11]]) != FORMAT_VERSION {
        // Another version's file: for the whole-file path, which finds it another's.
        return Ok(None);
    }
    let hlen = u32::from_le_bytes([head[12], head[13], head[14], head[15]]) as usize;
    if hlen > 1 << 16 {
        return Err(damaged(NO_HEADER));
    }
    head.resize(16 + hlen, 0);
    f.read_exact(&mut head[16..]).map_err(short)?;
    let h = decode_header(&head).ok_or_else(|| damaged(NO_HEADER))?;
    if len != h.file_len() {
        return Err(ReadError::Damaged(format!("{len} bytes, the header says {}", h.file_len())));
    }
    let dtype = match h.dtype {
        0 => DType::F32,
        1 => DType::Bf16,
        _ => return Ok(None),
    };
    let (rows, kv_dim, layers) = (h.rows as u64, h.kv_dim as u64, h.layers as u64);
    let per = rows.checked_mul(kv_dim);
    let shape = per.and_then(|p| p.checked_mul(2 * layers * dtype.size() as u64)).and_then(|b| b.checked_add(rows * 4));
    let (Some(per), true) = (per, shape == Some(h.payload)) else { return Ok(None) };
    // The file holds `payload` bytes (its length was checked), so these allocations do too.
    let mut crc = crc32fast::Hasher::new();
    crc.update(&head);
    // The length was checked: an end of file from here on is a file that shrank while it was
    // read (nobody writes in place), and any other error the device's; neither is damage.
    let mut read = |bytes: &mut [u8]| -> Result<(), ReadError> {
        f.read_exact(bytes).map_err(ReadError::Io)?;
        crc.update(bytes);
        Ok(())
    };
    let mut positions = vec![0u32; rows as usize];
    read(bytemuck::cast_slice_mut(&mut positions))?;
    positions.iter_mut().for_each(|p| *p = u32::from_le(*p));
    let mut part = || -> Result<HostBuf, ReadError> {
        Ok(match dtype {
            // The file's values are little-endian: no change on a little-endian host.
            DType::F32 => {
                let mut v = vec![0f32; per as usize];
                read(bytemuck::cast_slice_mut(&mut v))?;
                v.iter_mut().for_each(|x| *x = f32::from_bits(u32::from_le(x.to_bits())));
                HostBuf::F32(v)
            }
            DType::Bf16 => {
                let mut v = vec![0u16; per as usize];
                read(bytemuck::cast_slice_mut(&mut v))?;
                v.iter_mut().for_each(|x| *x = u16::from_le(*x));
                HostBuf::Bf16(v)
            }
        })
    };
    let out = (0..layers).map(|_| Ok((part()?, part()?))).collect::<Result<Vec<_>, ReadError>>()?;
    let mut tail = [0u8; 4];
    f.read_exact(&mut tail).map_err(ReadError::Io)?;
    if crc.finalize() != u32::from_le_bytes(tail) {
        return Err(damaged("checksum mismatch"));
    }
    Ok(Some((h, positions, out)))
}

/// A whole file's header after checking its length and checksum: what must hold before any
/// byte of it is used.
pub(super) fn check_whole(bytes: &[u8]) -> Result<Header, String> {
    let h = decode_header(bytes).ok_or("no readable header")?;
    if !h.current() {
        // Another version's layout: not this build's to check (no scope owns it).
        return Ok(h);
    }
    if bytes.len() as u64 != h.file_len() {
        return Err(format!("{} bytes, the header says {}", bytes.len(), h.file_len()));
    }
    let body = bytes.len() - 4;
    let want = u32::from_le_bytes([bytes[body], bytes[body + 1], bytes[body + 2], bytes[body + 3]]);
    if crc32fast::hash(&bytes[..body]) != want {
        return Err("checksum mismatch".into());
    }
    Ok(h)
}
