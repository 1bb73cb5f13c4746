//! The model crate's layering, checked on its sources: the CPU model (`layers/`,
//! `qwen3_hybrid.rs`, `state.rs`) and the GPU model (`gpu/`) are both built from `checkpoint/` and
//! import nothing of each other; `checkpoint/` imports neither; the GPU layer files import no
//! orchestration and form no cycle.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// The `.rs` files under `dir`, with their text.
fn sources(dir: &Path) -> Vec<(PathBuf, String)> {
    let mut out = Vec::new();
    let mut dirs = vec![dir.to_path_buf()];
    while let Some(d) = dirs.pop() {
        for e in fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                dirs.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                let text = fs::read_to_string(&p).unwrap();
                out.push((p, text));
            }
        }
    }
    out
}

/// The paths a file's `use` items and inline paths name (comments skipped).
fn code_lines(text: &str) -> impl Iterator<Item = &str> {
    text.lines()
        .map(str::trim_start)
        .filter(|l| !l.starts_with("//"))
}

fn names(text: &str, module: &str) -> bool {
    code_lines(text).any(|l| l.contains(module))
}

#[test]
fn the_cpu_and_gpu_models_import_nothing_of_each_other() {
    let root = src();
    for (p, text) in sources(&root.join("gpu")) {
        for cpu in [
            "crate::layers",
            "crate::qwen3_hybrid",
            "crate::state",
            "Qwen3Hybrid",
        ] {
            assert!(!names(&text, cpu), "{} names {cpu}", p.display());
        }
    }
    let cpu_files = sources(&root.join("layers"))
        .into_iter()
        .chain(sources(&root.join("checkpoint")))
        .chain(["qwen3_hybrid.rs", "state.rs"].map(|f| {
            let p = root.join(f);
            let text = fs::read_to_string(&p).unwrap();
            (p, text)
        }));
    for (p, text) in cpu_files {
        assert!(
            !names(&text, "gpu::"),
            "{} names the GPU model",
            p.display()
        );
    }
    for (p, text) in sources(&root.join("checkpoint")) {
        for m in ["crate::layers", "crate::qwen3_hybrid"] {
            assert!(!names(&text, m), "{} names {m}", p.display());
        }
    }
}

#[test]
fn gpu_layer_files_import_no_orchestration_and_form_no_cycle() {
    let dir = src().join("gpu").join("layers");
    let files: BTreeMap<String, String> = sources(&dir)
        .into_iter()
        .map(|(p, t)| (p.file_stem().unwrap().to_string_lossy().into_owned(), t))
        .collect();
    let orchestration = [
        "gpu::offload",
        "gpu::prefill",
        "gpu::pool",
        "gpu::upload",
        "gpu::synthetic",
        "gpu::host_experts",
        "gpu::GpuModel",
        "super::super::",
    ];
    let mut edges: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for (name, text) in &files {
        for o in orchestration {
            assert!(!names(text, o), "gpu/layers/{name}.rs names {o}");
        }
        // An import of a sibling: `super::sibling` from a kind's file, `sibling::` from mod.rs.
        for other in files.keys().filter(|o| *o != name) {
            let from_mod = name == "mod" && names(text, &format!("use {other}::"));
            let from_kind = other == "mod" && names(text, "use super::")
                || names(text, &format!("super::{other}::"));
            if from_mod || from_kind {
                edges.entry(name).or_default().insert(other);
            }
        }
    }
    // Depth-first search for a cycle.
    fn visit<'a>(
        n: &'a str,
        edges: &BTreeMap<&'a str, BTreeSet<&'a str>>,
        path: &mut Vec<&'a str>,
        done: &mut BTreeSet<&'a str>,
    ) {
        assert!(
            !path.contains(&n),
            "gpu/layers import cycle: {path:?} -> {n}"
        );
        if done.contains(n) {
            return;
        }
        path.push(n);
        for &m in edges.get(n).into_iter().flatten() {
            visit(m, edges, path, done);
        }
        path.pop();
        done.insert(n);
    }
    let mut done = BTreeSet::new();
    for n in files.keys() {
        visit(n, &edges, &mut Vec::new(), &mut done);
    }
}
