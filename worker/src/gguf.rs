//! Reading GGUF files: metadata with lenient numeric types, tensors converted to f32 or bf16.
//!
//! Parsing and dequantization use candle-core's GGUF reader (it knows every ggml block type).
//! Tensors are read as stored ([`GgufFile::raw_tensor`]: one positioned read, callable from
//! several threads) and converted in parallel ([`RawTensor::to_f32`], [`RawTensor::to_bf16`]):
//! f32/f16/bf16 element by element, quantized types by candle in blocks of rows. Everything is
//! dequantized at load: candle's CPU Q4_1 matmul is scalar (~20 tok/s) and its Q8_1 activation
//! quantization changes greedy answers of SmolLM2-135M (see shared/notes/platform.md), while
//! f32 weights feed the packed GEMM at ~200 GFLOP/s.

use crate::error::{io_err, Result, WorkerError};
use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::quantized::GgmlDType;
use rayon::prelude::*;
use std::collections::HashMap;
use std::fs::File;
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

/// An open GGUF file.
pub struct GgufFile {
    path: PathBuf,
    content: Content,
    /// The file, for positioned reads ([`GgufFile::raw_tensor`]).
    raw: File,
    /// Its length when opened: every tensor's bytes must lie below it.
    len: u64,
}

/// A tensor's bytes as the file stores them.
pub struct RawTensor {
    /// Name.
    pub name: String,
    /// Shape, outermost first (`[out, in]` for a linear layer).
    pub shape: Vec<usize>,
    /// Stored element or block type.
    pub dtype: GgmlDType,
    /// The bytes.
    pub bytes: Vec<u8>,
}

/// Bytes read from each end of every tensor for [`GgufFile::content_digest`].
pub const DIGEST_SAMPLE: usize = 64 << 10;

/// Values per parallel piece of a conversion.
const PIECE: usize = 1 << 16;

impl RawTensor {
    /// Elements.
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    /// True when it has no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn bad(&self, path: &Path, detail: String) -> WorkerError {
        WorkerError::UnsupportedTensor { path: path.to_path_buf(), name: self.name.clone(), detail }
    }

    /// Rows of the quantized pieces: whole rows of whole blocks, about [`PIECE`] values each.
    fn piece_rows(&self) -> (usize, usize) {
        let cols = self.shape.last().copied().unwrap_or(1).max(1);
        (cols, (PIECE / cols).max(1))
    }

    /// The values as f32 into `out` (`len()` long), converted in parallel. `path` names the file
    /// in errors.
    pub fn to_f32(&self, out: &mut [f32], path: &Path) -> Result<()> {
        self.convert(out, path, |x| x, |b| half::bf16::from_bits(b).to_f32())
    }

    /// The values as bf16 bits (rounded to nearest even) into `out`, converted in parallel; a
    /// bf16 tensor is copied as it is.
    pub fn to_bf16(&self, out: &mut [u16], path: &Path) -> Result<()> {
        self.convert(out, path, |x| half::bf16::from_f32(x).to_bits(), |b| b)
    }

    /// The conversion into `out`: `from_f32` for values read as f32 (f32, f16, dequantized
    /// blocks), `from_bf16` for bf16 bits.
    fn convert<T: Send + Copy>(
        &self,
        out: &mut [T],
        path: &Path,
        from_f32: impl Fn(f32) -> T + Sync,
        from_bf16: impl Fn(u16) -> T + Sync,
    ) -> Result<()> {
        let n = self.len();
        if out.len() != n {
            return Err(self.bad(path, format!("{} values for a tensor of {n}", out.len())));
        }
        let (bs, ts) = (self.dtype.block_size(), self.dtype.type_size());
        if !n.is_multiple_of(bs) || self.bytes.len() != n / bs * ts {
            return Err(
                self.bad(path, format!("{} bytes do not hold {n} values of {:?}", self.bytes.len(), self.dtype))
            );
        }
        let b = &self.bytes;
        match self.dtype {
            GgmlDType::F32 => out.par_chunks_mut(PIECE).zip(b.par_chunks(PIECE * 4)).for_each(|(o, c)| {
                for (x, v) in o.iter_mut().zip(c.chunks_exact(4)) {
                    *x = from_f32(f32::from_le_bytes([v[0], v[1], v[2], v[3]]));
                }
            }),
            GgmlDType::F16 => out.par_chunks_mut(PIECE).zip(b.par_chunks(PIECE * 2)).for_each(|(o, c)| {
                for (x, v) in o.iter_mut().zip(c.chunks_exact(2)) {
                    *x = from_f32(half::f16::from_le_bytes([v[0], v[1]]).to_f32());
                }
            }),
            GgmlDType::BF16 => out.par_chunks_mut(PIECE).zip(b.par_chunks(PIECE * 2)).for_each(|(o, c)| {
                for (x, v) in o.iter_mut().zip(c.chunks_exact(2)) {
                    *x = from_bf16(u16::from_le_bytes([v[0], v[1]]));
                }
            }),
            dtype => {
                // Quantized: whole rows (of whole blocks) per piece, dequantized by candle.
                let (cols, rows) = self.piece_rows();
                if cols % bs != 0 {
                    return Err(self.bad(path, format!("rows of {cols} values are not whole blocks of {bs}")));
                }
                let row_bytes = cols / bs * ts;
                let failed = std::sync::Mutex::new(None);
                out.par_chunks_mut(rows * cols).zip(b.par_chunks(rows * row_bytes)).for_each(|(o, c)| {
                    let piece = candle_core::quantized::ggml_file::qtensor_from_ggml(
                        dtype,
                        c,
                        vec![o.len() / cols, cols],
                        &candle_core::Device::Cpu,
                    )
                    .and_then(|q| q.dequantize(&candle_core::Device::Cpu))
                    .and_then(|t| t.flatten_all())
                    .and_then(|t| t.to_dtype(candle_core::DType::F32))
                    .and_then(|t| t.to_vec1::<f32>());
                    match piece {
                        Ok(v) => o.iter_mut().zip(v).for_each(|(x, v)| *x = from_f32(v)),
                        Err(e) => {
                            let mut f = failed.lock().unwrap_or_else(|p| p.into_inner());
                            f.get_or_insert_with(|| format!("cannot dequantize type {dtype:?} ({e})"));
                        }
                    }
                });
                if let Some(e) = failed.into_inner().unwrap_or_else(|p| p.into_inner()) {
                    return Err(self.bad(path, e));
                }
            }
        }
        Ok(())
    }
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile").field("path", &self.path).field("tensors", &self.content.tensor_infos.len()).finish()
    }
}

impl GgufFile {
    /// Opens and parses the header; errors say whether the file is missing or not a GGUF.
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).map_err(|e| WorkerError::ModelFile {
            path: path.to_path_buf(),
            detail: format!(
                "cannot open it ({e}); check the path given (--model, --aux-model, --tokenizer), or run \
                 `flowprefill fetch-model`"
            ),
        })?;
        let raw = file.try_clone().map_err(io_err(format!("opening {}", path.display())))?;
        let len = file.metadata().map_err(io_err(format!("reading the length of {}", path.display())))?.len();
        let mut reader = BufReader::new(file);
        let unreadable = |e: String| WorkerError::ModelFile {
            path: path.to_path_buf(),
            detail: format!(
                "not a readable GGUF file ({e}); if it is the cached default model, delete it and run \
                 `flowprefill fetch-model`"
            ),
        };
        // candle divides by `general.alignment` after parsing everything: 0 would panic there.
        if let Some(0) = alignment_of(&mut reader, len).map_err(|e| unreadable(e.to_string()))? {
            return Err(unreadable(
                "its metadata `general.alignment` is 0; tensor data alignment must be a positive number of \
                 bytes (32 when absent)"
                    .into(),
            ));
        }
        let content = Content::read(&mut reader).map_err(|e| {
            let message = first_line(&e.to_string()).to_string();
            match unsupported_type(&message) {
                // A valid file of a quantization this reader lacks: not a damaged one.
                Some(detail) => WorkerError::ModelFile { path: path.to_path_buf(), detail },
                None => unreadable(message),
            }
        })?;
        // One part of a split model (llama.cpp's gguf-split): the other parts hold tensors this
        // file's metadata counts on; merged, it is one model like any other.
        let part = |key| {
            let v: &Value = content.metadata.get(key)?;
            v.to_u64().or_else(|_| v.to_u32().map(u64::from)).or_else(|_| v.to_u16().map(u64::from)).ok()
        };
        if let Some(parts) = part("split.count").filter(|&n| n > 1) {
            let no = part("split.no").map_or(String::new(), |n| format!("part {} ", n + 1));
            return Err(WorkerError::ModelFile {
                path: path.to_path_buf(),
                detail: format!(
                    "{no}of a model split into {parts} files (llama.cpp's gguf-split); flowprefill reads one file: \
                     merge the parts first (llama-gguf-split --merge FIRST_PART.gguf MERGED.gguf)"
                ),
            });
        }
        Ok(Self { path: path.to_path_buf(), content, raw, len })
    }

    /// Number of tensors in the file.
    pub fn tensor_count(&self) -> usize {
        self.content.tensor_infos.len()
    }

    /// Where a tensor's bytes are: `(offset, bytes)`, with checked arithmetic, after checking
    /// they lie inside the file (a corrupt or hostile header can claim any shape and offset;
    /// nothing is allocated for a tensor before this).
    pub fn tensor_extent(&self, name: &str) -> Result<(u64, u64)> {
        let bad =
            |detail: String| WorkerError::UnsupportedTensor { path: self.path.clone(), name: name.to_string(), detail };
        let info = self.content.tensor_infos.get(name).ok_or_else(|| bad("missing from the file".into()))?;
        let dims = info.shape.dims();
        let n = dims.iter().try_fold(1usize, |a, &d| a.checked_mul(d)).ok_or_else(|| {
            bad(format!("its shape {dims:?} has more values than can be counted: the file is corrupt"))
        })?;
        let (bs, ts) = (info.ggml_dtype.block_size(), info.ggml_dtype.type_size());
        if n % bs != 0 {
            return Err(bad(format!("{n} values are not whole blocks of {bs} ({:?})", info.ggml_dtype)));
        }
        let bytes = (n / bs).checked_mul(ts).and_then(|b| u64::try_from(b).ok());
        let at = self.content.tensor_data_offset.checked_add(info.offset);
        match (at, bytes) {
            (Some(at), Some(bytes)) if at.checked_add(bytes).is_some_and(|end| end <= self.len) => Ok((at, bytes)),
            _ => Err(bad(format!(
                "its {} bytes (shape {dims:?}, {:?}) at offset {} do not fit in the file's {} bytes: the file \
                 is truncated or corrupt; download or write it again",
                bytes.map_or("countless".to_string(), |b| b.to_string()),
                info.ggml_dtype,
                at.map_or("past 2^64".to_string(), |a| a.to_string()),
                self.len
            ))),
        }
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// All metadata.
    pub fn metadata(&self) -> &HashMap<String, Value> {
        &self.content.metadata
    }

    /// Names of all tensors (sorted).
    pub fn tensor_names(&self) -> Vec<String> {
        let mut v: Vec<String> = self.content.tensor_infos.keys().cloned().collect();
        v.sort();
        v
    }

    /// True when the file has a tensor of that name.
    pub fn has_tensor(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    /// Shape of a tensor, row-major (outermost first: `[out, in]` for a linear layer).
    pub fn tensor_shape(&self, name: &str) -> Option<Vec<usize>> {
        self.content.tensor_infos.get(name).map(|t| t.shape.dims().to_vec())
    }

    fn meta_err(&self, key: &str, detail: impl Into<String>) -> WorkerError {
        WorkerError::Metadata { path: self.path.clone(), key: key.to_string(), detail: detail.into() }
    }

    /// A metadata value, or `None`.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.content.metadata.get(key)
    }

    /// A string value.
    pub fn get_str(&self, key: &str) -> Result<&str> {
        match self.get(key) {
            Some(Value::String(s)) => Ok(s),
            Some(v) => Err(self.meta_err(key, format!("expected a string, found {:?}", v.value_type()))),
            None => Err(self.meta_err(key, "missing")),
        }
    }

    /// An unsigned integer of any width/signedness (non-negative).
    pub fn get_usize(&self, key: &str) -> Result<usize> {
        let v = self.get(key).ok_or_else(|| self.meta_err(key, "missing"))?;
        let n: i128 = match v {
            Value::U8(x) => *x as i128,
            Value::I8(x) => *x as i128,
            Value::U16(x) => *x as i128,
            Value::I16(x) => *x as i128,
            Value::U32(x) => *x as i128,
            Value::I32(x) => *x as i128,
            Value::U64(x) => *x as i128,
            Value::I64(x) => *x as i128,
            other => return Err(self.meta_err(key, format!("expected an integer, found {:?}", other.value_type()))),
        };
        usize::try_from(n).map_err(|_| self.meta_err(key, format!("{n} is not a valid count")))
    }

    /// An optional unsigned integer.
    pub fn get_usize_opt(&self, key: &str) -> Result<Option<usize>> {
        if self.get(key).is_none() {
            return Ok(None);
        }
        self.get_usize(key).map(Some)
    }

    /// A float of any width.
    pub fn get_f64(&self, key: &str) -> Result<f64> {
        match self.get(key) {
            Some(Value::F32(x)) => Ok(*x as f64),
            Some(Value::F64(x)) => Ok(*x),
            Some(v) => Err(self.meta_err(key, format!("expected a float, found {:?}", v.value_type()))),
            None => Err(self.meta_err(key, "missing")),
        }
    }

    /// An optional float.
    pub fn get_f64_opt(&self, key: &str) -> Result<Option<f64>> {
        if self.get(key).is_none() {
            return Ok(None);
        }
        self.get_f64(key).map(Some)
    }

    /// An optional bool.
    pub fn get_bool_opt(&self, key: &str) -> Option<bool> {
        match self.get(key) {
            Some(Value::Bool(b)) => Some(*b),
            _ => None,
        }
    }

    /// An array of strings.
    pub fn get_str_array(&self, key: &str) -> Result<Vec<&str>> {
        match self.get(key) {
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| match v {
                    Value::String(s) => Ok(s.as_str()),
                    other => Err(self.meta_err(key, format!("expected strings, found {:?}", other.value_type()))),
                })
                .collect(),
            Some(v) => Err(self.meta_err(key, format!("expected an array, found {:?}", v.value_type()))),
            None => Err(self.meta_err(key, "missing")),
        }
    }

    /// An optional array of integers.
    pub fn get_int_array_opt(&self, key: &str) -> Result<Option<Vec<i64>>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| match v {
                    Value::I32(x) => Ok(*x as i64),
                    Value::U32(x) => Ok(*x as i64),
                    Value::I8(x) => Ok(*x as i64),
                    Value::U8(x) => Ok(*x as i64),
                    Value::I64(x) => Ok(*x),
                    other => Err(self.meta_err(key, format!("expected integers, found {:?}", other.value_type()))),
                })
                .collect::<Result<Vec<_>>>()
                .map(Some),
            Some(v) => Err(self.meta_err(key, format!("expected an array, found {:?}", v.value_type()))),
        }
    }

    /// What the model computes with, as a hex digest: every metadata value but the tokenizer's
    /// (its token ids are in every chunk key already), the tensor table (names, shapes, types,
    /// offsets), and the first and last [`DIGEST_SAMPLE`] bytes of every tensor: a fine-tune, a
    /// requantization or another RoPE base changes it, at the cost of reading a few MB.
    pub fn content_digest(&self) -> Result<String> {
        use sha2::{Digest, Sha256};
        use std::os::unix::fs::FileExt;
        let mut h = Sha256::new();
        let mut keys: Vec<&String> =
            self.content.metadata.keys().filter(|k| !k.starts_with("tokenizer.") && *k != "general.name").collect();
        keys.sort();
        for k in keys {
            h.update(format!("{k}={:?};", self.content.metadata[k]).as_bytes());
        }
        let mut names: Vec<&String> = self.content.tensor_infos.keys().collect();
        names.sort();
        let mut sample = vec![0u8; DIGEST_SAMPLE];
        for name in names {
            let info = &self.content.tensor_infos[name];
            let (at, len) = self.tensor_extent(name)?;
            h.update(format!("{name}:{:?}:{:?}:{}:{len};", info.shape.dims(), info.ggml_dtype, info.offset).as_bytes());
            let take = len.min(DIGEST_SAMPLE as u64) as usize;
            for from in [at, at + len - take as u64] {
                self.raw.read_exact_at(&mut sample[..take], from).map_err(|e| WorkerError::UnsupportedTensor {
                    path: self.path.clone(),
                    name: name.clone(),
                    detail: format!(
                        "cannot read it ({e}): the file is truncated or corrupt; download or write it again"
                    ),
                })?;
                h.update(&sample[..take]);
            }
        }
        Ok(crate::hex(&h.finalize()[..16]))
    }

    /// Reads a tensor as stored, with one positioned read (no seek: several threads may read
    /// tensors of one file at once).
    pub fn raw_tensor(&self, name: &str) -> Result<RawTensor> {
        use std::os::unix::fs::FileExt;
        let bad =
            |detail: String| WorkerError::UnsupportedTensor { path: self.path.clone(), name: name.to_string(), detail };
        let info = self.content.tensor_infos.get(name).ok_or_else(|| bad("missing from the file".into()))?;
        let shape = info.shape.dims().to_vec();
        // Checked against the file's length first: nothing is allocated for bytes it lacks.
        let (at, len) = self.tensor_extent(name)?;
        let len = usize::try_from(len).map_err(|_| bad(format!("{len} bytes do not fit this machine's memory")))?;
        let mut bytes = vec![0u8; len];
        self.raw.read_exact_at(&mut bytes, at).map_err(|e| {
            bad(format!(
                "cannot read its {} bytes at offset {at} ({e}): the file is truncated or corrupt; download or write it again",
                bytes.len()
            ))
        })?;
        Ok(RawTensor { name: name.to_string(), shape, dtype: info.ggml_dtype, bytes })
    }

    /// Reads a tensor and converts it to f32; returns `(shape, values)`.
    pub fn tensor_f32(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>)> {
        let raw = self.raw_tensor(name)?;
        let mut values = vec![0f32; raw.len()];
        raw.to_f32(&mut values, &self.path)?;
        Ok((raw.shape, values))
    }
}

/// The last `general.alignment` of a GGUF's metadata, if it is of an integer type candle's
/// reader takes (`Some(0)` is what it would divide by), read without allocating for any value;
/// `reader` (at the file's start, `len` bytes long) is put back there. `None` where the
/// metadata cannot be walked (candle then says why) or has no such key.
fn alignment_of(reader: &mut BufReader<File>, len: u64) -> std::io::Result<Option<u64>> {
    let found = MetaWalk { r: &mut *reader, pos: 0, end: len }.alignment().unwrap_or(None);
    reader.seek(SeekFrom::Start(0))?;
    Ok(found)
}

/// [`alignment_of`]'s reader: the header, then each key and value, values skipped through the
/// buffer (no seek, no allocation), every length checked against the file's end first.
struct MetaWalk<'a> {
    r: &'a mut BufReader<File>,
    pos: u64,
    end: u64,
}

impl MetaWalk<'_> {
    fn bad() -> std::io::Error {
        std::io::Error::new(std::io::ErrorKind::InvalidData, "unexpected metadata")
    }

    fn bytes<const N: usize>(&mut self) -> std::io::Result<[u8; N]> {
        let mut b = [0u8; N];
        self.r.read_exact(&mut b)?;
        self.pos += N as u64;
        Ok(b)
    }

    fn u32(&mut self) -> std::io::Result<u32> {
        self.bytes::<4>().map(u32::from_le_bytes)
    }

    /// A count or a string length: u32 in GGUF v1, u64 after.
    fn len(&mut self, v1: bool) -> std::io::Result<u64> {
        if v1 {
            self.u32().map(u64::from)
        } else {
            self.bytes::<8>().map(u64::from_le_bytes)
        }
    }

    fn skip(&mut self, n: u64) -> std::io::Result<()> {
        if n > self.end.saturating_sub(self.pos) {
            return Err(Self::bad());
        }
        let mut left = n;
        while left > 0 {
            let buf = self.r.fill_buf()?;
            if buf.is_empty() {
                return Err(Self::bad());
            }
            let k = buf.len().min(usize::try_from(left).unwrap_or(usize::MAX));
            self.r.consume(k);
            left -= k as u64;
        }
        self.pos += n;
        Ok(())
    }

    /// Byte size of a fixed-size value type (GGUF value type numbers).
    fn fixed(t: u32) -> Option<u64> {
        match t {
            0 | 1 | 7 => Some(1),
            2 | 3 => Some(2),
            4..=6 => Some(4),
            10..=12 => Some(8),
            _ => None,
        }
    }

    /// Skips one value of type `t` (arrays nested to a depth of 8).
    fn value(&mut self, t: u32, v1: bool, depth: u32) -> std::io::Result<()> {
        if let Some(n) = Self::fixed(t) {
            return self.skip(n);
        }
        match t {
            8 => {
                let n = self.len(v1)?;
                self.skip(n)
            }
            9 if depth < 8 => {
                let et = self.u32()?;
                let n = self.len(v1)?;
                match Self::fixed(et) {
                    Some(size) => self.skip(n.checked_mul(size).ok_or_else(Self::bad)?),
                    // Each element takes at least 4 bytes: more than the file holds is corrupt.
                    None if n > self.end.saturating_sub(self.pos) / 4 => Err(Self::bad()),
                    None => (0..n).try_for_each(|_| self.value(et, v1, depth + 1)),
                }
            }
            _ => Err(Self::bad()),
        }
    }

    fn alignment(&mut self) -> std::io::Result<Option<u64>> {
        if &self.bytes::<4>()? != b"GGUF" {
            return Ok(None);
        }
        let v1 = self.u32()? == 1;
        let _tensors = self.len(v1)?;
        let kvs = self.len(v1)?;
        let mut found = None;
        for _ in 0..kvs {
            let key_len = self.len(v1)?;
            let is_alignment = if key_len == KEY_ALIGNMENT.len() as u64 {
                self.bytes::<17>()? == *KEY_ALIGNMENT
            } else {
                self.skip(key_len)?;
                false
            };
            let t = self.u32()?;
            // The integer types candle reads the alignment from (U8 to I32; others: default).
            if is_alignment && t <= 5 {
                let n = Self::fixed(t).ok_or_else(Self::bad)? as usize;
                let mut b = [0u8; 8];
                self.r.read_exact(&mut b[..n])?;
                self.pos += n as u64;
                found = Some(u64::from_le_bytes(b));
            } else {
                self.value(t, v1, 0)?;
            }
        }
        Ok(found)
    }
}

/// The tensor types of ggml that the GGUF reader (candle's) does not read, by number: a valid
/// model file in one of them is named as such, not as a damaged file.
const UNREAD_TYPES: &[(u32, &str)] = &[
    (4, "Q4_2"),
    (5, "Q4_3"),
    (16, "IQ2_XXS"),
    (17, "IQ2_XS"),
    (18, "IQ3_XXS"),
    (19, "IQ1_S"),
    (20, "IQ4_NL"),
    (21, "IQ3_S"),
    (22, "IQ2_S"),
    (23, "IQ4_XS"),
    (24, "I8"),
    (25, "I16"),
    (26, "I32"),
    (27, "I64"),
    (28, "F64"),
    (29, "IQ1_M"),
    (34, "TQ1_0"),
    (35, "TQ2_0"),
    (39, "MXFP4"),
];

/// The message for candle's "unknown dtype for tensor N" (N is the type's number, not a
/// tensor's): the quantization by name, what is read, what to do.
fn unsupported_type(message: &str) -> Option<String> {
    let n: u32 = message.strip_prefix("unknown dtype for tensor ")?.trim().parse().ok()?;
    let name = UNREAD_TYPES.iter().find(|(k, _)| *k == n).map_or(format!("ggml type {n}"), |(_, s)| s.to_string());
    Some(format!(
        "its tensors are quantized as {name}, which flowprefill does not read (it reads F32, F16, BF16, Q4_0, Q4_1, \
         Q5_0, Q5_1, Q8_0 and Q2_K to Q6_K); use a file of one of those (Q4_K_M, Q8_0 and F16 are the usual ones), \
         or convert this one (llama.cpp: llama-quantize --allow-requantize IN.gguf OUT.gguf Q4_K_M)"
    ))
}

/// The metadata key of the tensor data's alignment.
const KEY_ALIGNMENT: &[u8; 17] = b"general.alignment";

/// The message of a candle error without the backtrace candle appends to it when
/// `RUST_BACKTRACE` is set (after a line break).
fn first_line(message: &str) -> &str {
    message.lines().next().unwrap_or("").trim_end()
}

/// Opens a file for hashing or copying, with the path in the error.
pub(crate) fn open_file(path: &Path) -> Result<File> {
    File::open(path).map_err(io_err(format!("opening {}", path.display())))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ModelConfig;
    use crate::gguf_write::testfile::TestGguf;

    fn open(g: &TestGguf, tag: &str) -> (crate::gguf_write::testfile::TempFile, Result<GgufFile>) {
        let f = g.write(tag);
        let opened = GgufFile::open(f.path());
        (f, opened)
    }

    #[test]
    fn an_alignment_of_zero_is_refused_not_a_panic() {
        // candle's reader divides by `general.alignment` (it panicked: divide by zero).
        for v in [Value::U32(0), Value::U8(0), Value::I32(0), Value::U16(0)] {
            let g = TestGguf::tiny().set("general.alignment", v.clone());
            let e = open(&g, "align0").1.expect_err("alignment 0");
            let msg = e.to_string();
            assert!(matches!(e, WorkerError::ModelFile { .. }) && msg.contains("general.alignment"), "{v:?}: {msg}");
        }
        // Other alignments, and 0 in a type candle does not read it from, still open.
        for v in [Value::U32(32), Value::U64(0), Value::I32(-1)] {
            let g = TestGguf::tiny().set("general.alignment", v.clone());
            open(&g, "align-ok").1.unwrap_or_else(|e| panic!("{v:?}: {e}"));
        }
    }

    #[test]
    fn the_metadata_walk_skips_every_value_type() {
        // Strings, arrays of strings and nested arrays before the key, one key after it.
        let g = TestGguf::tiny()
            .set("a.strings", Value::Array(vec![Value::String("x".into()), Value::String("yz".into())]))
            .set("a.nested", Value::Array(vec![Value::Array(vec![Value::U8(1), Value::U8(2)]), Value::Array(vec![])]))
            .set("a.floats", Value::Array(vec![Value::F64(1.0); 3]))
            .set("a.bool", Value::Bool(true))
            .set("general.alignment", Value::U16(0))
            .set("z.after", Value::String("after".into()));
        let f = g.write("walk");
        let file = File::open(f.path()).unwrap();
        let len = file.metadata().unwrap().len();
        let mut r = BufReader::new(file);
        assert_eq!(alignment_of(&mut r, len).unwrap(), Some(0));
        assert_eq!(r.stream_position().unwrap(), 0, "the reader is put back at the start");
        // A truncated header is not this walk's to report: None, and candle says why.
        let cut = &g.bytes()[..60];
        let p = std::env::temp_dir().join(format!("fp-test-{}-walk-cut.gguf", std::process::id()));
        std::fs::write(&p, cut).unwrap();
        let mut r = BufReader::new(File::open(&p).unwrap());
        assert_eq!(alignment_of(&mut r, cut.len() as u64).unwrap(), None);
        let e = GgufFile::open(&p).unwrap_err().to_string();
        assert!(e.contains("not a readable GGUF"), "{e}");
        let _ = std::fs::remove_file(p);
    }

    #[test]
    fn a_tensor_larger_than_the_file_is_refused_before_allocating() {
        // token_embd claims [2^36, 8] f32 (2 TiB) in a file of a few KB: it aborted allocating.
        let mut g = TestGguf::tiny();
        g.tensor("token_embd.weight").1 = vec![1 << 36, 8];
        let (_f, file) = open(&g, "huge");
        let file = file.unwrap();
        for e in [
            file.raw_tensor("token_embd.weight").map(|_| ()).unwrap_err(),
            file.content_digest().map(|_| ()).unwrap_err(),
            ModelConfig::from_gguf(&file).map(|_| ()).unwrap_err(),
        ] {
            let msg = e.to_string();
            assert!(msg.contains("token_embd.weight") && msg.contains("truncated or corrupt"), "{msg}");
        }
        // A shape whose count overflows, and an offset past 2^64: errors, not wrapped offsets.
        let mut g = TestGguf::tiny();
        g.tensor("output_norm.weight").1 = vec![usize::MAX / 2, 4];
        g.tensor("blk.0.attn_norm.weight").3 = u64::MAX - 10;
        let (_f, file) = open(&g, "overflow");
        let file = file.unwrap();
        let e = file.raw_tensor("output_norm.weight").map(|_| ()).unwrap_err().to_string();
        assert!(e.contains("more values than can be counted"), "{e}");
        let e = file.raw_tensor("blk.0.attn_norm.weight").map(|_| ()).unwrap_err().to_string();
        assert!(e.contains("truncated or corrupt"), "{e}");
        assert!(file.content_digest().is_err());
    }

    /// A valid file in a quantization candle does not read (IQ4_XS, type 23: candle says
    /// "unknown dtype for tensor 23") is named by its quantization, not called damaged; a part
    /// of a split model says to merge the parts.
    #[test]
    fn an_unread_quantization_and_a_split_model_are_named_not_called_damaged() {
        let mut g = TestGguf::tiny();
        g.tensor("output_norm.weight").2 = 23;
        let e = open(&g, "iq4").1.map(|_| ()).unwrap_err().to_string();
        assert!(e.contains("quantized as IQ4_XS, which flowprefill does not read") && e.contains("Q4_K_M"), "{e}");
        assert!(!e.contains("not a readable GGUF") && !e.contains("fetch-model"), "{e}");
        let mut g = TestGguf::tiny();
        g.tensor("output_norm.weight").2 = 200;
        let e = open(&g, "type200").1.map(|_| ()).unwrap_err().to_string();
        assert!(e.contains("quantized as ggml type 200"), "{e}");
        let g = TestGguf::tiny().set("split.count", Value::U16(3)).set("split.no", Value::U16(0));
        let e = open(&g, "split").1.map(|_| ()).unwrap_err().to_string();
        assert!(e.contains("part 1 of a model split into 3 files") && e.contains("llama-gguf-split --merge"), "{e}");
        // A file that says it is the only part opens.
        let g = TestGguf::tiny().set("split.count", Value::U16(1));
        open(&g, "split1").1.unwrap();
    }

    #[test]
    fn a_truncated_file_names_the_tensor() {
        let g = TestGguf::tiny();
        let bytes = g.bytes();
        let p = std::env::temp_dir().join(format!("fp-test-{}-trunc.gguf", std::process::id()));
        std::fs::write(&p, &bytes[..bytes.len() - 40]).unwrap();
        let file = GgufFile::open(&p).unwrap();
        let last = g.tensors.iter().max_by_key(|t| t.3).unwrap().0.clone();
        let e = file.raw_tensor(&last).map(|_| ()).unwrap_err().to_string();
        assert!(e.contains(&last) && e.contains("truncated"), "{e}");
        assert!(file.content_digest().is_err());
        let _ = std::fs::remove_file(p);
    }
}
