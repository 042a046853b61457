//! Key/value caches.
//!
//! A cache holds, per layer, K and V rows (`[n, kv_dim]`) and one position per row. Keys are
//! kept in one of two forms:
//! * [`KeyForm::PreRope`]: K before RoPE. Chunk caches are stored this way so that placing a
//!   chunk anywhere is one exact rotation (RoPE is never applied twice);
//! * [`KeyForm::Rotated`]: K rotated to the stored positions, ready for attention (decoding).
//!
//! Rows are stored in the backend's KV element type ([`Backend::kv_dtype`]): f32, or bf16
//! (half the memory; a projection is rounded once when it lands in the cache, and placing a
//! pre-RoPE bf16 key rotates it in f32 and rounds once).

use crate::error::Result;
use flowprefill_kernels::rope::RopeTable;
use flowprefill_kernels::{Backend, DType};

/// Whether stored keys have RoPE applied.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyForm {
    /// Keys before RoPE; positions say where they were computed.
    PreRope,
    /// Keys rotated to their positions.
    Rotated,
}

/// K and V of one layer, `[n, kv_dim]` each.
pub struct LayerKv<B: Backend> {
    /// Keys.
    pub k: B::Buf,
    /// Values.
    pub v: B::Buf,
}

/// Per-layer K/V of a sequence of tokens with their positions.
pub struct KvCache<B: Backend> {
    layers: Vec<LayerKv<B>>,
    positions: Vec<u32>,
    form: KeyForm,
    kv_dim: usize,
    dtype: DType,
}

impl<B: Backend> std::fmt::Debug for KvCache<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvCache")
            .field("layers", &self.layers.len())
            .field("tokens", &self.positions.len())
            .field("form", &self.form)
            .field("dtype", &self.dtype)
            .finish()
    }
}

impl<B: Backend> KvCache<B> {
    /// An empty cache, of the backend's KV element type.
    pub fn new(backend: &B, n_layers: usize, kv_dim: usize, form: KeyForm) -> Result<Self> {
        let dtype = backend.kv_dtype();
        let layers = (0..n_layers)
            .map(|_| Ok(LayerKv { k: backend.zeros_as(0, dtype)?, v: backend.zeros_as(0, dtype)? }))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self { layers, positions: Vec::new(), form, kv_dim, dtype })
    }

    /// Makes room for `tokens` rows in every layer up front, so that appending up to that many
    /// (a prefill, then the decoded tokens) never reallocates on the device.
    pub fn reserve(&mut self, backend: &B, tokens: usize) -> Result<()> {
        for layer in &mut self.layers {
            backend.reserve(&mut layer.k, tokens * self.kv_dim)?;
            backend.reserve(&mut layer.v, tokens * self.kv_dim)?;
        }
        Ok(())
    }

    /// Builds a cache from filled layers.
    pub fn from_parts(
        backend: &B,
        layers: Vec<LayerKv<B>>,
        positions: Vec<u32>,
        form: KeyForm,
        kv_dim: usize,
    ) -> Result<Self> {
        let dtype = layers.first().map_or(backend.kv_dtype(), |l| backend.dtype(&l.k));
        for (l, layer) in layers.iter().enumerate() {
            for (name, buf) in [("k", &layer.k), ("v", &layer.v)] {
                if backend.dtype(buf) != dtype {
                    return Err(crate::error::internal(format!(
                        "cache layer {l} {name}: {} values in a {dtype} cache",
                        backend.dtype(buf)
                    )));
                }
                if backend.len(buf) != positions.len() * kv_dim {
                    return Err(crate::error::internal(format!(
                        "cache layer {l} {name}: {} values for {} positions of {kv_dim}",
                        backend.len(buf),
                        positions.len()
                    )));
                }
            }
        }
        Ok(Self { layers, positions, form, kv_dim, dtype })
    }

    /// Element type of the rows.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Tokens held.
    pub fn len(&self) -> usize {
        self.positions.len()
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.positions.is_empty()
    }

    /// Positions of the rows.
    pub fn positions(&self) -> &[u32] {
        &self.positions
    }

    /// Key form.
    pub fn form(&self) -> KeyForm {
        self.form
    }

    /// Values per row.
    pub fn kv_dim(&self) -> usize {
        self.kv_dim
    }

    /// Number of layers.
    pub fn n_layers(&self) -> usize {
        self.layers.len()
    }

    /// One layer.
    pub fn layer(&self, l: usize) -> &LayerKv<B> {
        &self.layers[l]
    }

    /// One layer, mutably (callers keep all layers and `positions` consistent).
    pub fn layer_mut(&mut self, l: usize) -> &mut LayerKv<B> {
        &mut self.layers[l]
    }

    /// All layers.
    pub fn layers(&self) -> &[LayerKv<B>] {
        &self.layers
    }

    /// Bytes of K and V held.
    pub fn bytes(&self) -> usize {
        2 * self.layers.len() * self.positions.len() * self.kv_dim * self.dtype.size()
    }

    /// Replaces the positions (rows unchanged).
    pub(crate) fn set_positions(&mut self, positions: Vec<u32>) {
        self.positions = positions;
    }

    /// Adds `rows` rows of zero keys and values at positions `first..first + rows` to every
    /// layer: the rows coming decode steps write in place ([`Backend::put_rows`]). Until a step
    /// writes one, causal masking hides it from every query before its position; its zeros keep
    /// a masked product finite.
    pub fn extend_ahead(&mut self, backend: &B, first: u32, rows: usize) -> Result<()> {
        let n = self.positions.len() + rows;
        for layer in &mut self.layers {
            backend.reserve(&mut layer.k, n * self.kv_dim)?;
            backend.resize(&mut layer.k, n * self.kv_dim)?;
            backend.reserve(&mut layer.v, n * self.kv_dim)?;
            backend.resize(&mut layer.v, n * self.kv_dim)?;
        }
        self.positions.extend(first..first + rows as u32);
        Ok(())
    }

    /// Drops rows beyond `n` in every layer.
    pub fn truncate(&mut self, backend: &B, n: usize) -> Result<()> {
        if n >= self.positions.len() {
            return Ok(());
        }
        for layer in &mut self.layers {
            backend.resize(&mut layer.k, n * self.kv_dim)?;
            backend.resize(&mut layer.v, n * self.kv_dim)?;
        }
        self.positions.truncate(n);
        Ok(())
    }

    /// A rotated copy placed at `positions` (one per row). For a pre-RoPE cache this is one
    /// rotation per key; a rotated cache can only be copied at its own positions.
    pub fn placed(&self, backend: &B, rope: &RopeTable, positions: &[u32], n_kv_heads: usize) -> Result<Self> {
        if positions.len() != self.positions.len() {
            return Err(crate::error::internal(format!(
                "placing {} cached tokens at {} positions",
                self.positions.len(),
                positions.len()
            )));
        }
        if self.form == KeyForm::Rotated && positions != self.positions.as_slice() {
            return Err(crate::error::internal("a rotated cache cannot be moved: keep chunk caches pre-RoPE"));
        }
        // Device to device, one pass per buffer: the keys rotated as they are copied, the
        // values copied; no host round trip, no zero fill.
        let mut layers = Vec::with_capacity(self.layers.len());
        for layer in &self.layers {
            let k = if self.form == KeyForm::PreRope {
                backend.rope_copy(&layer.k, n_kv_heads, positions, rope)?
            } else {
                backend.duplicate(&layer.k)?
            };
            layers.push(LayerKv { k, v: backend.duplicate(&layer.v)? });
        }
        Ok(Self {
            layers,
            positions: positions.to_vec(),
            form: KeyForm::Rotated,
            kv_dim: self.kv_dim,
            dtype: self.dtype,
        })
    }
}
