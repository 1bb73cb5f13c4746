//! Where a model's files are. `--model` names a model directory (`config.json` and safetensors,
//! as on the Hugging Face hub or from mlx-lm), a GGUF file (as llama.cpp's `-m`; of a split
//! model, `NAME-00001-of-0000N.gguf`, the first part), or a directory holding one GGUF model.

use std::path::{Path, PathBuf};

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::weights::WeightStore;
use crate::Progress;

/// A model's files.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ModelSource {
    /// A directory with `config.json` and safetensors.
    Dir(PathBuf),
    /// A GGUF file (the first part of a split model).
    Gguf(PathBuf),
}

impl ModelSource {
    /// The model at `path`; fails naming the path and what to pass instead.
    pub fn resolve(path: &Path) -> Result<ModelSource> {
        let bad = |msg: String| ModelError::Input(format!("--model {}: {msg}", path.display()));
        if path.is_file() {
            if !is_gguf(path) {
                return Err(bad("a file that is not .gguf; pass a model directory (config.json and *.safetensors) or a .gguf file".into()));
            }
            if let Some((k, n)) = split_part(path) {
                if k != 1 {
                    return Err(bad(format!("part {k} of a GGUF model split in {n}; pass its first part (-00001-of-{n:05}.gguf)")));
                }
            }
            return Ok(ModelSource::Gguf(path.to_path_buf()));
        }
        if !path.is_dir() {
            return Err(bad(
                "no such file or directory; pass a model directory or a .gguf file".into(),
            ));
        }
        if path.join("config.json").is_file() {
            return Ok(ModelSource::Dir(path.to_path_buf()));
        }
        let firsts = gguf_models(path).map_err(|err| ModelError::Io {
            path: path.to_path_buf(),
            err,
        })?;
        match firsts.as_slice() {
            [] => Ok(ModelSource::Dir(path.to_path_buf())),
            [one] => Ok(ModelSource::Gguf(one.clone())),
            many => {
                let names: Vec<_> = many
                    .iter()
                    .filter_map(|p| p.file_name())
                    .map(|n| n.to_string_lossy())
                    .collect();
                Err(bad(format!(
                    "holds several GGUF models ({}); pass one of the files",
                    names.join(", ")
                )))
            }
        }
    }

    /// The model's config and weights.
    pub fn open(&self) -> Result<(ModelConfig, WeightStore)> {
        self.open_with_progress(&mut |_| {})
    }

    /// [`Self::open`], reporting a GGUF file's tensors as they are unpacked (a directory's
    /// weights are mapped, not read, and report nothing).
    pub fn open_with_progress(
        &self,
        progress: &mut dyn FnMut(Progress),
    ) -> Result<(ModelConfig, WeightStore)> {
        match self {
            ModelSource::Dir(d) => Ok((ModelConfig::from_dir(d)?, WeightStore::open(d)?)),
            ModelSource::Gguf(f) => crate::gguf::load_with_progress(f, progress),
        }
    }
}

fn is_gguf(p: &Path) -> bool {
    p.extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
}

/// `(k, n)` of a split part named `NAME-0000k-of-0000n.gguf`.
fn split_part(p: &Path) -> Option<(usize, usize)> {
    let stem = p.file_stem()?.to_str()?;
    let (head, n) = stem.rsplit_once("-of-")?;
    let (_, k) = head.rsplit_once('-')?;
    let digits = |s: &str| s.len() == 5 && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(k) || !digits(n) {
        return None;
    }
    Some((k.parse().ok()?, n.parse().ok()?))
}

/// The GGUF models in `dir`: each unsplit .gguf file and each split model's first part, sorted.
fn gguf_models(dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let p = entry?.path();
        if p.is_file() && is_gguf(&p) && split_part(&p).is_none_or(|(k, _)| k == 1) {
            out.push(p);
        }
    }
    out.sort();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_resolve_to_directories_files_and_first_parts() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path();
        assert_eq!(split_part(Path::new("m-00002-of-00003.gguf")), Some((2, 3)));
        assert_eq!(split_part(Path::new("m-2-of-3.gguf")), None);
        let err = |q: &Path| ModelSource::resolve(q).unwrap_err().to_string();
        assert!(err(&p.join("absent")).contains("no such file"));
        std::fs::write(p.join("notes.txt"), "").unwrap();
        assert!(err(&p.join("notes.txt")).contains("not .gguf"));
        assert_eq!(
            ModelSource::resolve(p).unwrap(),
            ModelSource::Dir(p.to_path_buf())
        );
        for part in ["m-00001-of-00002.gguf", "m-00002-of-00002.gguf"] {
            std::fs::write(p.join(part), "").unwrap();
        }
        let first = p.join("m-00001-of-00002.gguf");
        assert_eq!(
            ModelSource::resolve(p).unwrap(),
            ModelSource::Gguf(first.clone())
        );
        assert_eq!(
            ModelSource::resolve(&first).unwrap(),
            ModelSource::Gguf(first)
        );
        assert!(err(&p.join("m-00002-of-00002.gguf")).contains("first part"));
        std::fs::write(p.join("other.gguf"), "").unwrap();
        assert!(err(p).contains("several GGUF models"));
        std::fs::write(p.join("config.json"), "{}").unwrap();
        assert_eq!(
            ModelSource::resolve(p).unwrap(),
            ModelSource::Dir(p.to_path_buf())
        );
    }
}
