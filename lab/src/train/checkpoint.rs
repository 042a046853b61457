//! A training run's checkpoint, written after every step: the trained values, AdamW's moments,
//! the step reached and the history, with the settings and the model they were made with (a run
//! resumes only under the same settings, for the same weights).
//!
//! ```text
//!   checkpoint.safetensors   tensors rows, m, v (f32)
//!                            metadata "flowprefill.checkpoint": {format, model, settings, step, history}
//!   written as checkpoint.partial, fsync'd, renamed over the old one, the folder fsync'd:
//!   a kill at any point leaves the old checkpoint or the new one, never parts of both
//! ```
//!
//! Checkpoints of the earlier two-file form (the tensors, and the step in `checkpoint.json`
//! beside them, renamed one after the other) are refused: a kill between the renames left one
//! step's values beside another step's count, and they name no model.

use super::{Result, TrainError};
use candle_core::{DType, Device, Tensor};
use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};

/// The metadata key of a checkpoint file.
const META: &str = "flowprefill.checkpoint";
/// The file form written; any other is refused.
const FORMAT: u32 = 2;
/// The tensors of a checkpoint, in the order they are checked.
const TENSORS: [&str; 3] = ["rows", "m", "v"];

/// The checkpoint: the trained values (KV Packet's rows, LookaheadKV's parameter vector),
/// AdamW's moments, the step reached, the history.
pub(crate) struct Checkpoint {
    pub(crate) rows: Tensor,
    pub(crate) m: Tensor,
    pub(crate) v: Tensor,
    pub(crate) step: usize,
    pub(crate) history: History,
}

/// The model a checkpoint was made with.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub(crate) struct ModelId {
    /// What the adapter will record ([`flowprefill_worker::LoadedModel::fingerprint`]).
    pub(crate) fingerprint: String,
    /// Every weight sampled ([`flowprefill_worker::LoadedModel::cache_identity`]): a fine-tune
    /// sharing the embedding differs here.
    pub(crate) weights: String,
    /// The model's name, for messages.
    pub(crate) name: String,
}

impl ModelId {
    /// The identity of `lm`.
    pub(crate) fn of<B: flowprefill_worker::Backend>(lm: &flowprefill_worker::LoadedModel<B>) -> Self {
        Self {
            fingerprint: lm.fingerprint.clone(),
            weights: lm.cache_identity.clone(),
            name: lm.model.config().name.clone(),
        }
    }

    fn said(&self) -> String {
        format!("{} (weights {})", self.name, self.fingerprint)
    }
}

/// What the checkpoint's metadata holds besides the tensors.
#[derive(serde::Serialize, serde::Deserialize)]
struct Meta<S> {
    format: u32,
    model: ModelId,
    settings: S,
    step: usize,
    history: History,
}

pub(crate) fn ckpt_err(path: &Path, detail: impl Into<String>) -> TrainError {
    TrainError::Checkpoint { path: path.to_path_buf(), detail: detail.into() }
}

/// The file's f32 bytes of `t` (little-endian).
fn f32_bytes(t: &Tensor, path: &Path) -> Result<Vec<u8>> {
    let values: Vec<f32> =
        t.flatten_all().and_then(|t| t.to_dtype(DType::F32)).and_then(|t| t.to_vec1()).map_err(|e| {
            ckpt_err(path, format!("cannot read the values to save ({e}); this is a bug in flowprefill"))
        })?;
    Ok(values.iter().flat_map(|x| x.to_le_bytes()).collect())
}

impl Checkpoint {
    /// Writes the checkpoint of `model` and `settings` to `path` as one file, through a
    /// temporary one that is synced before it replaces the old checkpoint.
    pub(crate) fn save<S: serde::Serialize>(&self, path: &Path, model: &ModelId, settings: &S) -> Result<()> {
        let meta =
            Meta { format: FORMAT, model: model.clone(), settings, step: self.step, history: self.history.clone() };
        let meta = serde_json::to_string(&meta).map_err(|e| {
            ckpt_err(path, format!("its metadata does not serialise ({e}); this is a bug in flowprefill"))
        })?;
        let bytes: Vec<(&str, Vec<u8>, Vec<usize>)> = [("rows", &self.rows), ("m", &self.m), ("v", &self.v)]
            .into_iter()
            .map(|(k, t)| Ok((k, f32_bytes(t, path)?, t.dims().to_vec())))
            .collect::<Result<_>>()?;
        let mut views = Vec::with_capacity(bytes.len());
        for (k, b, shape) in &bytes {
            let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), b)
                .map_err(|e| ckpt_err(path, format!("cannot describe `{k}` ({e}); this is a bug in flowprefill")))?;
            views.push((*k, view));
        }
        let data = safetensors::serialize(views, Some(HashMap::from([(META.to_string(), meta)])))
            .map_err(|e| ckpt_err(path, format!("cannot serialise ({e}); this is a bug in flowprefill")))?;
        write_synced(path, &data)
    }

    /// The checkpoint at `path`, if there is one: refused, before anything is computed, when it
    /// was made with another model or other settings, or is not a checkpoint of this form.
    pub(crate) fn load<S>(path: &Path, model: &ModelId, settings: &S) -> Result<Option<Self>>
    where
        S: serde::Serialize + serde::de::DeserializeOwned + PartialEq,
    {
        let old_json = path.with_extension("json");
        if !path.exists() {
            if old_json.exists() {
                return Err(old_form(path));
            }
            return Ok(None);
        }
        let data = std::fs::read(path).map_err(|e| {
            ckpt_err(path, format!("cannot be read ({e}); delete it (or give another --out) to start over"))
        })?;
        let corrupt = |d: String| {
            ckpt_err(path, format!("{d}; the file is damaged: delete it (or give another --out) to start over"))
        };
        let (_, header) =
            safetensors::SafeTensors::read_metadata(&data).map_err(|e| corrupt(format!("not safetensors ({e})")))?;
        let Some(json) = header.metadata().as_ref().and_then(|m| m.get(META)) else {
            return Err(if old_json.exists() { old_form(path) } else { corrupt(format!("no `{META}` metadata")) });
        };
        let meta: Meta<serde_json::Value> =
            serde_json::from_str(json).map_err(|e| corrupt(format!("its metadata does not parse ({e})")))?;
        if meta.format != FORMAT {
            return Err(corrupt(format!("it is of form {}, this flowprefill reads form {FORMAT}", meta.format)));
        }
        if meta.model != *model {
            return Err(TrainError::OtherModel {
                out: path.parent().map(Path::to_path_buf).unwrap_or_default(),
                made: meta.model.said(),
                given: model.said(),
            });
        }
        // Settings of another form are another method's run (KV Packet's and LookaheadKV's share
        // the checkpoint's name): never "damaged: delete it", which lost that run.
        let other = |why: String| TrainError::OtherRun {
            path: path.to_path_buf(),
            detail: format!("{why}; train with those, or give another --out (this one is left as it is)"),
        };
        let saved: S = serde_json::from_value(meta.settings.clone()).map_err(|e| {
            other(format!(
                "it is another method's run, or of another flowprefill ({e}; its settings: {})",
                meta.settings
            ))
        })?;
        if &saved != settings {
            return Err(other(format!("it was made with other settings ({})", meta.settings)));
        }
        let st = safetensors::SafeTensors::deserialize(&data).map_err(|e| corrupt(format!("not safetensors ({e})")))?;
        let take = |k: &str| -> Result<Tensor> {
            let t = st.tensor(k).map_err(|_| corrupt(format!("no `{k}` tensor")))?;
            if t.dtype() != safetensors::Dtype::F32 || t.data().len() != 4 * t.shape().iter().product::<usize>() {
                return Err(corrupt(format!("`{k}` is {:?} {:?}, not f32", t.dtype(), t.shape())));
            }
            let values: Vec<f32> =
                t.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
            Tensor::from_vec(values, t.shape(), &Device::Cpu).map_err(|e| corrupt(format!("`{k}`: {e}")))
        };
        let (rows, m, v) = (take("rows")?, take("m")?, take("v")?);
        Ok(Some(Self { rows, m, v, step: meta.step, history: meta.history }))
    }

    /// Refuses a checkpoint whose tensors are not of the shape of this run's initial values.
    pub(crate) fn check_shapes(&self, path: &Path, initial: &Tensor) -> Result<()> {
        for (name, t) in TENSORS.iter().zip([&self.rows, &self.m, &self.v]) {
            if t.dims() != initial.dims() {
                return Err(TrainError::CheckpointShape {
                    path: path.to_path_buf(),
                    tensor: name,
                    found: t.dims().to_vec(),
                    expected: initial.dims().to_vec(),
                });
            }
        }
        Ok(())
    }
}

/// The refusal of a checkpoint of the earlier two-file form.
fn old_form(path: &Path) -> TrainError {
    ckpt_err(
        path,
        format!(
            "a checkpoint of an earlier flowprefill (the values here and the step in {}, which a stopped run could \
             leave from different steps, and no model named): it cannot be resumed safely; delete both files (or give \
             another --out) to start over",
            path.with_extension("json").display()
        ),
    )
}

/// Writes `data` to `path` through `path.partial`: written, synced, renamed over `path`, the
/// folder synced (the rename survives a crash).
fn write_synced(path: &Path, data: &[u8]) -> Result<()> {
    // This process's: a name shared by two writers let one truncate the other's file.
    let tmp: PathBuf = path.with_extension(format!("partial.{}", std::process::id()));
    let fail = |what: &str, at: &Path, e: std::io::Error| {
        ckpt_err(
            path,
            format!(
                "cannot {what} {} ({e}); check the free space and permissions of --out, or give another --out",
                at.display()
            ),
        )
    };
    let mut f = std::fs::File::create(&tmp).map_err(|e| fail("create", &tmp, e))?;
    f.write_all(data).map_err(|e| fail("write", &tmp, e))?;
    f.sync_all().map_err(|e| fail("sync", &tmp, e))?;
    drop(f);
    std::fs::rename(&tmp, path).map_err(|e| fail("move into place", &tmp, e))?;
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    // A folder opens read-only for its fsync on Unix; elsewhere the rename is as durable as it gets.
    #[cfg(unix)]
    std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(|e| fail("sync the folder", dir, e))?;
    #[cfg(not(unix))]
    let _ = dir;
    Ok(())
}

/// A run's history, kept in the checkpoint and the adapter's metadata.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct History {
    /// Mean training loss of each step.
    pub train: Vec<f64>,
    /// Validation loss after each epoch `(epoch, loss)`.
    pub validation: Vec<(usize, f64)>,
    /// Validation loss of the reference: KV Packet's `none` (no packets), LookaheadKV's SnapKV
    /// (its scores as the loss takes the adapter's: unpooled).
    pub none_val: f64,
    /// Validation loss of the adapter before training.
    pub initial_val: f64,
    /// Training seconds so far (all sessions of a resumed run).
    pub seconds: f64,
    /// The same held-out losses with the scores pooled as eviction pools them (LookaheadKV;
    /// `None` for a method that pools nothing).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pooled: Option<Pooled>,
}

/// Held-out losses of a method whose scores eviction pools (LookaheadKV: the mean over
/// [`flowprefill_worker::evict::SNAPKV_POOL`] neighbouring rows before the top N), on that
/// transform for the reference and the adapter alike.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Pooled {
    /// The reference's (SnapKV's pooled scores).
    pub reference: f64,
    /// The adapter's before training.
    pub initial: f64,
    /// The adapter's after each epoch `(epoch, loss)`.
    pub validation: Vec<(usize, f64)>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(name: &str) -> ModelId {
        ModelId { fingerprint: format!("fp-{name}"), weights: format!("w-{name}"), name: name.into() }
    }

    fn tensor(rows: usize, cols: usize, at: f32) -> Tensor {
        let v: Vec<f32> = (0..rows * cols).map(|i| at + i as f32 * 0.25).collect();
        Tensor::from_vec(v, (rows, cols), &Device::Cpu).unwrap()
    }

    fn checkpoint(rows: usize) -> Checkpoint {
        Checkpoint {
            rows: tensor(rows, 4, 1.0),
            m: tensor(rows, 4, -2.0),
            v: tensor(rows, 4, 0.5),
            step: 7,
            history: History { train: vec![0.5, 0.25], none_val: 1.5, ..History::default() },
        }
    }

    fn dir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("flowprefill-ckpt-{tag}-{}", std::process::id()));
        std::fs::remove_dir_all(&d).ok();
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    /// One file holds the values, the moments, the step and the history (no JSON beside it, no
    /// temporary file left), and reads back bit for bit.
    #[test]
    fn one_file_reads_back_exactly() {
        let d = dir("one");
        let path = d.join("checkpoint.safetensors");
        let c = checkpoint(3);
        c.save(&path, &model("a"), &"settings").unwrap();
        let mut files: Vec<String> =
            std::fs::read_dir(&d).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        files.sort();
        assert_eq!(files, ["checkpoint.safetensors"]);
        let back = Checkpoint::load(&path, &model("a"), &"settings".to_string()).unwrap().expect("a checkpoint");
        assert_eq!(back.step, 7);
        assert_eq!(back.history.train, c.history.train);
        for (a, b) in [(&back.rows, &c.rows), (&back.m, &c.m), (&back.v, &c.v)] {
            assert_eq!(a.to_vec2::<f32>().unwrap(), b.to_vec2::<f32>().unwrap());
        }
        back.check_shapes(&path, &tensor(3, 4, 0.0)).expect("the same shape");
        std::fs::remove_dir_all(d).ok();
    }

    /// Another model (other weights, or only another fine-tune of the same embedding) is refused
    /// naming --out and --model; tensors of another shape are refused naming the tensor.
    #[test]
    fn another_model_and_other_shapes_are_refused() {
        let d = dir("model");
        let path = d.join("checkpoint.safetensors");
        checkpoint(3).save(&path, &model("a"), &1u32).unwrap();
        let e = Checkpoint::load(&path, &model("b"), &1u32).err().expect("another model").to_string();
        assert!(e.contains("a (weights fp-a)") && e.contains("b (weights fp-b)"), "{e}");
        assert!(e.contains("--out") && e.contains("--model") && e.contains(&d.display().to_string()), "{e}");
        let tuned = ModelId { weights: "w-tuned".into(), ..model("a") };
        assert!(Checkpoint::load(&path, &tuned, &1u32).is_err(), "same embedding, other weights");
        let c = Checkpoint::load(&path, &model("a"), &1u32).unwrap().unwrap();
        let e = c.check_shapes(&path, &tensor(2, 4, 0.0)).unwrap_err().to_string();
        assert!(e.contains("`rows`") && e.contains("[3, 4]") && e.contains("[2, 4]") && e.contains("--out"), "{e}");
        let e = Checkpoint::load(&path, &model("a"), &2u32).err().expect("other settings").to_string();
        assert!(e.contains("other settings"), "{e}");
        std::fs::remove_dir_all(d).ok();
    }

    /// A checkpoint of the earlier two-file form (tensors without metadata, the step in a JSON
    /// file beside them) is refused with what to do, and so is a JSON file alone.
    #[test]
    fn the_earlier_two_file_form_is_refused() {
        let d = dir("old");
        let path = d.join("checkpoint.safetensors");
        let tensors = HashMap::from([("rows".to_string(), tensor(2, 4, 0.0))]);
        candle_core::safetensors::save(&tensors, &path).unwrap();
        std::fs::write(path.with_extension("json"), r#"{"step": 3, "settings": 1, "history": {}}"#).unwrap();
        let e = Checkpoint::load(&path, &model("a"), &1u32).err().expect("refused").to_string();
        assert!(e.contains("earlier flowprefill") && e.contains("delete both"), "{e}");
        std::fs::remove_file(&path).unwrap();
        let e = Checkpoint::load(&path, &model("a"), &1u32).err().expect("refused").to_string();
        assert!(e.contains("earlier flowprefill"), "{e}");
        std::fs::remove_dir_all(d).ok();
    }

    /// A write that cannot happen names the file and what to change.
    #[test]
    fn a_failed_write_names_the_path_and_what_to_do() {
        let d = dir("write");
        let path = d.join("missing").join("checkpoint.safetensors");
        let e = checkpoint(1).save(&path, &model("a"), &1u32).unwrap_err().to_string();
        assert!(e.contains("checkpoint.partial") && e.contains("--out"), "{e}");
        std::fs::remove_dir_all(d).ok();
    }
}
