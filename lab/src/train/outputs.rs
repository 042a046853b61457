//! Where a training run writes (its folder, checkpoint and adapter) and the folder's lock.

use super::checkpoint::ckpt_err;
use super::run::Method;
use super::{Result, TrainError};
use std::path::PathBuf;

/// Where a run writes: `checkpoint.safetensors`, `loss.png`, and the adapter.
pub struct Outputs {
    /// The run's folder.
    pub dir: PathBuf,
    /// The adapter file to write at the end.
    pub adapter: PathBuf,
}

impl Outputs {
    /// The run's folder `dir`; the adapter at `adapter`, or in `dir` as
    /// [`Method::ADAPTER_FILE`].
    pub fn new<M: Method>(dir: PathBuf, adapter: Option<PathBuf>) -> Self {
        let adapter = adapter.unwrap_or_else(|| dir.join(M::ADAPTER_FILE));
        Self { dir, adapter }
    }

    pub(crate) fn checkpoint(&self) -> PathBuf {
        self.dir.join("checkpoint.safetensors")
    }

    /// The run's folder, and the adapter's before any work (an adapter path elsewhere fails
    /// now, not after the training); the folder's lock, held while the run lives: two runs in
    /// one folder (a run left going, and the same command "run again to continue") rewrote one
    /// checkpoint, each truncating the other's (`None` where the file system cannot lock).
    pub(crate) fn create(&self) -> Result<Option<std::fs::File>> {
        std::fs::create_dir_all(&self.dir)
            .map_err(|e| ckpt_err(&self.dir, format!("cannot create the folder: {e}")))?;
        if let Some(dir) = self.adapter.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)
                .map_err(|e| ckpt_err(dir, format!("cannot create the adapter's folder: {e}")))?;
        }
        if self.adapter.is_dir() {
            return Err(TrainError::Settings(format!(
                "the adapter's path {} is a folder; give a file's path (--adapter-out)",
                self.adapter.display()
            )));
        }
        let path = self.dir.join(".train.lock");
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(|e| ckpt_err(&path, format!("cannot open the run's lock: {e}")))?;
        match file.try_lock() {
            Ok(()) => Ok(Some(file)),
            Err(std::fs::TryLockError::WouldBlock) => Err(TrainError::OtherRun {
                path: self.checkpoint(),
                detail: format!(
                    "another training is running in {} (it holds {}): wait for it to end, or give another --out",
                    self.dir.display(),
                    path.display()
                ),
            }),
            Err(std::fs::TryLockError::Error(_)) => Ok(None),
        }
    }
}
