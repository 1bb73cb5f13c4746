//! The built-in default model (`models/tiny`: a 9M-parameter Qwen3.5-MoE-architecture model
//! trained on Jane Austen's novels, see its README), compiled into the binary so `generate` and
//! `chat` work with no download. On first use its files are written to the user cache
//! directory, keyed by a hash of their contents, and loaded from there like any model. Every
//! later use compares the cached files with the embedded bytes (the reference) and rewrites any
//! that differ, so a damaged or truncated copy is repaired rather than loaded.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

const FILES: &[(&str, &[u8])] = &[
    (
        "config.json",
        include_bytes!("../../../models/tiny/config.json"),
    ),
    (
        "generation_config.json",
        include_bytes!("../../../models/tiny/generation_config.json"),
    ),
    (
        "tokenizer.json",
        include_bytes!("../../../models/tiny/tokenizer.json"),
    ),
    (
        "tokenizer_config.json",
        include_bytes!("../../../models/tiny/tokenizer_config.json"),
    ),
    (
        "model.safetensors",
        include_bytes!("../../../models/tiny/model.safetensors"),
    ),
];

/// FNV-1a over every file's name and contents.
fn content_hash() -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for (name, bytes) in FILES {
        for &b in name.as_bytes().iter().chain(bytes.iter()) {
            h = (h ^ b as u64).wrapping_mul(0x100_0000_01b3);
        }
    }
    h
}

/// The directory holding the built-in model, written on first use.
pub fn dir() -> Result<PathBuf> {
    let models = deltamoe_compute::cache::dir().join("models");
    let dir = models.join(format!("tiny-{:016x}", content_hash()));
    if dir.join("model.safetensors").is_file() {
        repair(&dir).with_context(|| format!("repairing the built-in model in {} (set XDG_CACHE_HOME to a writable directory, or pass --model)", dir.display()))?;
        return Ok(dir);
    }
    // Write into a private temporary directory, then rename, so a concurrent or interrupted
    // first run never leaves a half-written model behind.
    let tmp = models.join(format!(".tiny-{}", std::process::id()));
    let write = || -> std::io::Result<()> {
        std::fs::create_dir_all(&tmp)?;
        for (name, bytes) in FILES {
            std::fs::write(tmp.join(name), bytes)?;
        }
        match std::fs::rename(&tmp, &dir) {
            Err(_) if dir.join("model.safetensors").is_file() => std::fs::remove_dir_all(&tmp),
            r => r,
        }
    };
    write().with_context(|| format!("writing the built-in model to {} (set XDG_CACHE_HOME to a writable directory, or pass --model)", dir.display()))?;
    Ok(dir)
}

/// Rewrites each cached file whose bytes differ from the embedded copy (length first, then the
/// bytes themselves), through a temporary file renamed over it so readers never see a partial
/// write.
fn repair(dir: &Path) -> std::io::Result<()> {
    for (name, bytes) in FILES {
        let path = dir.join(name);
        let intact = std::fs::metadata(&path).is_ok_and(|m| m.len() == bytes.len() as u64)
            && std::fs::read(&path).is_ok_and(|b| b == *bytes);
        if intact {
            continue;
        }
        eprintln!(
            "note: the cached built-in model file {} was damaged or missing; rewriting it",
            path.display()
        );
        let tmp = dir.join(format!(".{name}.{}", std::process::id()));
        std::fs::write(&tmp, bytes)?;
        std::fs::rename(&tmp, &path)?;
    }
    Ok(())
}
