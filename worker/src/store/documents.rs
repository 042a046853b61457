//! Ingested documents by id: the texts behind the chunk caches `flowprefill ingest` and
//! `POST /v1/documents` put in the store, so that a job can name its documents by id instead of
//! sending them again (`"document_ids"`).
//!
//! A document's id is the first 16 hex digits of the SHA-256 of its text with surrounding
//! whitespace removed (what the layout tokenizes), so the same text has the same id in every
//! process and on every machine, and ingesting it twice is one entry. The text lives in
//! `<store>/documents/<id>.txt`, written as the chunk entries are (temporary file, fsync,
//! rename, folder fsync): a reader sees the whole text or none. Ids are checked before they
//! touch a path (16 lowercase hex digits), so a request cannot name another file.

use sha2::{Digest, Sha256};
use std::fs::{self, File};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

/// Why [`Documents::resolve`] failed.
#[derive(Debug, thiserror::Error)]
pub enum ResolveError {
    /// No document has this id here (the folder looked in).
    #[error(
        "unknown document id `{id}` in {folder}: ingest the document first (`flowprefill ingest`, POST \
         /v1/documents), or give the --store it was ingested into",
        folder = folder.display()
    )]
    Unknown {
        /// The id asked for.
        id: String,
        /// The folder looked in.
        folder: PathBuf,
    },
    /// Its text could not be read.
    #[error("document `{0}` cannot be read: {1}")]
    Io(String, #[source] io::Error),
}

/// Hex digits of an id.
pub const ID_LEN: usize = 16;

/// The documents folder of a store.
#[derive(Clone, Debug)]
pub struct Documents {
    dir: PathBuf,
}

/// The id of `text` (see the module docs).
pub fn id_of(text: &str) -> String {
    let digest = Sha256::digest(text.trim().as_bytes());
    crate::hex(&digest[..ID_LEN / 2])
}

/// Whether `id` has an id's form (16 lowercase hex digits).
pub fn is_id(id: &str) -> bool {
    id.len() == ID_LEN && id.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

impl Documents {
    /// The documents of the store folder `store` (`<store>/documents`, made if missing).
    pub fn open(store: &Path) -> io::Result<Self> {
        let dir = store.join("documents");
        fs::create_dir_all(&dir)?;
        Ok(Self { dir })
    }

    /// Removes what writers killed between their temporary file and the rename left behind: a
    /// temporary file older than a minute is nobody's now (a live writer's is younger). Called
    /// by ingestion, which writes here, not by every lookup (it reads the whole folder).
    pub fn remove_dead_writes(&self) -> io::Result<()> {
        let now = std::time::SystemTime::now();
        for e in fs::read_dir(&self.dir)?.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let ours = name.strip_prefix('.').and_then(|n| n.strip_suffix(".tmp")).and_then(|n| n.split_once('.'));
            let old = e
                .metadata()
                .and_then(|m| m.modified())
                .is_ok_and(|t| now.duration_since(t).unwrap_or_default() > std::time::Duration::from_secs(60));
            if ours.is_some_and(|(id, pid)| is_id(id) && pid.bytes().all(|b| b.is_ascii_digit())) && old {
                let _ = fs::remove_file(e.path());
            }
        }
        Ok(())
    }

    /// The documents of the store folder `store`, for reading only: nothing is made (a
    /// mistyped folder is not created by looking an id up in it).
    pub fn at(store: &Path) -> Self {
        Self { dir: store.join("documents") }
    }

    /// The folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn path(&self, id: &str) -> PathBuf {
        self.dir.join(format!("{id}.txt"))
    }

    /// Keeps `text` under its id; returns the id and whether it was new.
    pub fn put(&self, text: &str) -> io::Result<(String, bool)> {
        let id = id_of(text);
        let path = self.path(&id);
        if path.is_file() {
            return Ok((id, false));
        }
        let tmp = self.dir.join(format!(".{id}.{}.tmp", std::process::id()));
        let write = || -> io::Result<()> {
            let mut f = File::create(&tmp)?;
            f.write_all(text.trim().as_bytes())?;
            f.sync_all()?;
            drop(f);
            fs::rename(&tmp, &path)
        };
        if let Err(e) = write() {
            // A full disk: no half-written temporary file stays behind (nothing removes it later).
            let _ = fs::remove_file(&tmp);
            return Err(e);
        }
        File::open(&self.dir)?.sync_all()?;
        Ok((id, true))
    }

    /// The text of `id` (upper-case hex digits read as lower-case): `Ok(None)` for an id not
    /// ingested or not of an id's form.
    pub fn get(&self, id: &str) -> io::Result<Option<String>> {
        let id = id.trim().to_ascii_lowercase();
        if !is_id(&id) {
            return Ok(None);
        }
        match fs::read_to_string(self.path(&id)) {
            Ok(t) => Ok(Some(t)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// The texts of `ids`, in order; the first id not held is an error naming it.
    pub fn resolve(&self, ids: &[String]) -> Result<Vec<String>, ResolveError> {
        ids.iter()
            .map(|id| match self.get(id) {
                Ok(Some(t)) => Ok(t),
                Ok(None) => Err(ResolveError::Unknown { id: id.clone(), folder: self.dir.clone() }),
                Err(e) => Err(ResolveError::Io(id.clone(), e)),
            })
            .collect()
    }

    /// The ids held, sorted.
    pub fn ids(&self) -> io::Result<Vec<String>> {
        let mut ids: Vec<String> = fs::read_dir(&self.dir)?
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.strip_suffix(".txt").map(str::to_string))
            .filter(|id| is_id(id))
            .collect();
        ids.sort();
        Ok(ids)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("fp-docs-{tag}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn a_text_keeps_one_id_and_reads_back_whole() {
        let dir = temp("roundtrip");
        let docs = Documents::open(&dir).unwrap();
        let (id, new) = docs.put("  The vault code is 4417.\n").unwrap();
        assert!(new && is_id(&id), "{id}");
        assert_eq!(id, id_of("The vault code is 4417."), "surrounding whitespace is not part of the text");
        assert_eq!(docs.put("The vault code is 4417.").unwrap(), (id.clone(), false), "ingested twice: one entry");
        assert_eq!(docs.get(&id).unwrap().as_deref(), Some("The vault code is 4417."));
        let upper = format!(" {} ", id.to_ascii_uppercase());
        assert_eq!(docs.get(&upper).unwrap().as_deref(), Some("The vault code is 4417."), "the id in capitals");
        // A dead writer's temporary file goes at the next ingestion; a live one's (young) stays.
        let (dead, live) =
            (dir.join("documents/.0123456789abcdef.77.tmp"), dir.join("documents/.0123456789abcdef.78.tmp"));
        fs::write(&dead, "half").unwrap();
        fs::write(&live, "half").unwrap();
        let old = std::time::SystemTime::now() - std::time::Duration::from_secs(120);
        File::options().write(true).open(&dead).unwrap().set_modified(old).unwrap();
        docs.remove_dead_writes().unwrap();
        assert!(!dead.exists() && live.exists());
        fs::remove_file(&live).unwrap();
        assert_ne!(id_of("another text"), id);
        assert_eq!(docs.ids().unwrap(), vec![id.clone()]);
        assert_eq!(docs.resolve(&[id.clone(), id.clone()]).unwrap().len(), 2);
        let e = docs.resolve(&[id.clone(), "00000000deadbeef".into()]).unwrap_err().to_string();
        assert!(e.contains("`00000000deadbeef`") && e.contains("ingest"), "{e}");
        assert!(e.contains(&docs.dir().display().to_string()), "names the folder it looked in: {e}");
        // Looking up in a folder that does not exist makes nothing.
        let typo = dir.join("typo");
        assert!(Documents::at(&typo).resolve(std::slice::from_ref(&id)).is_err());
        assert!(!typo.exists(), "a lookup made the folder");
        // Another process (a new handle) sees it.
        assert_eq!(Documents::open(&dir).unwrap().get(&id).unwrap().as_deref(), Some("The vault code is 4417."));
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn unknown_and_malformed_ids_name_no_file() {
        let dir = temp("ids");
        let docs = Documents::open(&dir).unwrap();
        fs::write(dir.join("secret.txt"), "not a document").unwrap();
        for bad in ["", "../secret", "../../etc/passwd", "0123456789ABCDEG", "0123456789abcde", "secret"] {
            assert_eq!(docs.get(bad).unwrap(), None, "{bad:?}");
        }
        assert_eq!(docs.get("0123456789abcdef").unwrap(), None, "well formed, not ingested");
        let _ = fs::remove_dir_all(&dir);
    }
}
