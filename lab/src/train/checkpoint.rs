//! A training run's checkpoint, written after every step: the trained values, AdamW's moments,
//! the step reached and the history, with the settings they were made with (a run resumes only
//! under the same settings).

use super::{Result, TrainError};
use candle_core::{Device, Tensor};
use std::collections::HashMap;
use std::path::Path;

/// The checkpoint: the trained values (KV Packet's rows, LookaheadKV's parameter vector),
/// AdamW's moments, the step reached, the history.
pub(crate) struct Checkpoint {
    pub(crate) rows: Tensor,
    pub(crate) m: Tensor,
    pub(crate) v: Tensor,
    pub(crate) step: usize,
    pub(crate) history: History,
}

pub(crate) fn ckpt_err(path: &Path, detail: impl Into<String>) -> TrainError {
    TrainError::Checkpoint { path: path.to_path_buf(), detail: detail.into() }
}

impl Checkpoint {
    pub(crate) fn save<S: serde::Serialize>(&self, path: &Path, settings: &S) -> Result<()> {
        let meta = serde_json::json!({ "settings": settings, "step": self.step, "history": self.history });
        let tensors: HashMap<String, Tensor> = [("rows", &self.rows), ("m", &self.m), ("v", &self.v)]
            .into_iter()
            .map(|(k, t)| (k.to_string(), t.clone()))
            .collect();
        let tmp = path.with_extension("partial");
        candle_core::safetensors::save(&tensors, &tmp)?;
        // candle writes no metadata: the step and the history go in a JSON file beside it.
        let json = path.with_extension("json");
        let text = serde_json::to_string_pretty(&meta).map_err(|e| ckpt_err(path, e.to_string()))?;
        std::fs::write(json.with_extension("json.partial"), text).map_err(|e| ckpt_err(path, e.to_string()))?;
        std::fs::rename(&tmp, path).map_err(|e| ckpt_err(path, e.to_string()))?;
        std::fs::rename(json.with_extension("json.partial"), &json).map_err(|e| ckpt_err(path, e.to_string()))?;
        Ok(())
    }

    pub(crate) fn load<S>(path: &Path, settings: &S) -> Result<Option<Self>>
    where
        S: serde::Serialize + serde::de::DeserializeOwned + PartialEq,
    {
        if !path.exists() {
            return Ok(None);
        }
        let json = path.with_extension("json");
        let text = std::fs::read_to_string(&json).map_err(|e| {
            ckpt_err(path, format!("{} cannot be read ({e}); delete the checkpoint to start over", json.display()))
        })?;
        let meta: serde_json::Value = serde_json::from_str(&text).map_err(|e| {
            ckpt_err(path, format!("{} does not parse ({e}); delete the checkpoint to start over", json.display()))
        })?;
        let saved: S = serde_json::from_value(meta["settings"].clone())
            .map_err(|e| ckpt_err(path, format!("its settings do not parse ({e})")))?;
        if &saved != settings {
            return Err(ckpt_err(
                path,
                format!(
                    "it was made with other settings ({}); train with those, or give another --out to start over",
                    serde_json::to_string(&saved).unwrap_or_default()
                ),
            ));
        }
        let mut t = candle_core::safetensors::load(path, &Device::Cpu)
            .map_err(|e| ckpt_err(path, format!("unreadable ({e}); delete it to start over")))?;
        let mut take =
            |k: &str| t.remove(k).ok_or_else(|| ckpt_err(path, format!("no `{k}` tensor; delete it to start over")));
        let (rows, m, v) = (take("rows")?, take("m")?, take("v")?);
        let step = meta["step"].as_u64().ok_or_else(|| ckpt_err(path, "no step"))? as usize;
        let history: History = serde_json::from_value(meta["history"].clone())
            .map_err(|e| ckpt_err(path, format!("its history does not parse ({e})")))?;
        Ok(Some(Self { rows, m, v, step, history }))
    }
}

/// A run's history, kept in the checkpoint and the adapter's metadata.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct History {
    /// Mean training loss of each step.
    pub train: Vec<f64>,
    /// Validation loss after each epoch `(epoch, loss)`.
    pub validation: Vec<(usize, f64)>,
    /// Validation loss of the reference: KV Packet's `none` (no packets), LookaheadKV's SnapKV.
    pub none_val: f64,
    /// Validation loss of the adapter before training.
    pub initial_val: f64,
    /// Training seconds so far (all sessions of a resumed run).
    pub seconds: f64,
}
