//! The user cache directory: `$XDG_CACHE_HOME/deltamoe`, else `~/.cache/deltamoe`, else the
//! system temp dir. Holds compiled kernels and the extracted built-in model.

use std::path::PathBuf;

pub fn dir() -> PathBuf {
    std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir)
        .join("deltamoe")
}
