//! Reading GGUF files: metadata with lenient numeric types, tensors dequantized to f32.
//!
//! Parsing and dequantization use candle-core's GGUF reader (it knows every ggml block type).
//! Everything is dequantized to f32 at load: candle's CPU Q4_1 matmul is scalar (~20 tok/s)
//! and its Q8_1 activation quantization changes greedy answers of SmolLM2-135M
//! (see shared/notes/platform.md), while f32 weights feed the packed GEMM at ~200 GFLOP/s.

use crate::error::{io_err, Result, WorkerError};
use candle_core::quantized::gguf_file::{Content, Value};
use std::collections::HashMap;
use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};

/// An open GGUF file.
pub struct GgufFile {
    path: PathBuf,
    content: Content,
    reader: BufReader<File>,
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
            detail: format!("cannot open it ({e}); check the path given to --model, or run `flowprefill fetch-model`"),
        })?;
        let mut reader = BufReader::new(file);
        let content = Content::read(&mut reader).map_err(|e| WorkerError::ModelFile {
            path: path.to_path_buf(),
            detail: format!(
                "not a readable GGUF file ({e}); if it is the cached default model, delete it and run \
                 `flowprefill fetch-model`"
            ),
        })?;
        Ok(Self { path: path.to_path_buf(), content, reader })
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

    /// Reads a tensor and dequantizes it to f32; returns `(shape, values)`.
    pub fn tensor_f32(&mut self, name: &str) -> Result<(Vec<usize>, Vec<f32>)> {
        let path = self.path.clone();
        let bad =
            |detail: String| WorkerError::UnsupportedTensor { path: path.clone(), name: name.to_string(), detail };
        let info = self.content.tensor_infos.get(name).ok_or_else(|| bad("missing from the file".into()))?;
        let dtype = info.ggml_dtype;
        let q = self
            .content
            .tensor(&mut self.reader, name, &candle_core::Device::Cpu)
            .map_err(|e| bad(format!("cannot read it ({e}); the file may be truncated or corrupt")))?;
        let shape = q.shape().dims().to_vec();
        let t = q
            .dequantize(&candle_core::Device::Cpu)
            .map_err(|e| bad(format!("cannot dequantize type {dtype:?} ({e})")))?;
        let values = t
            .flatten_all()
            .and_then(|t| t.to_dtype(candle_core::DType::F32))
            .and_then(|t| t.to_vec1::<f32>())
            .map_err(|e| bad(format!("cannot convert to f32 ({e})")))?;
        Ok((shape, values))
    }
}

/// Opens a file for hashing or copying, with the path in the error.
pub(crate) fn open_file(path: &Path) -> Result<File> {
    File::open(path).map_err(io_err(format!("opening {}", path.display())))
}
