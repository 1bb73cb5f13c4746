//! `info`: architecture, layer pattern, parameter and byte counts by kind (with the stored bits
//! per weight, which shows quantization: packed words plus scales and biases), and the memory a
//! model needs for its weights and for each sequence at a given context length.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use deltamoe_model::gguf::GgufFile;
use deltamoe_model::gptq::Packing;
use deltamoe_model::{LayerKind, ModelConfig, ModelSource, WeightStore};

#[derive(Args)]
pub struct InfoArgs {
    /// Model directory or GGUF file.
    #[arg(long)]
    model: PathBuf,
    /// Context length for the per-sequence memory estimate.
    #[arg(long, default_value_t = 32768)]
    context: usize,
    /// Also show what each of these GPUs would hold with the routed experts divided among them
    /// (`--gpus` of the other commands; e.g. 0,1).
    #[arg(long, value_name = "LIST", value_delimiter = ',')]
    gpus: Vec<usize>,
    /// With --gpus: the attention and GDN heads and dense MLP rows divided among them too
    /// (`--tensor-parallel` of the other commands).
    #[arg(long, requires = "gpus")]
    tensor_parallel: bool,
}

/// Kinds of parameters, in display order.
const KINDS: [&str; 10] = [
    "embedding",
    "lm_head",
    "linear attention (GDN)",
    "full attention",
    "router",
    "routed experts",
    "shared expert",
    "dense mlp",
    "MTP layer",
    "norms",
];

/// Index of the MTP layer's parameters in [`KINDS`] (not counted as active per token).
const MTP: usize = 8;

fn kind_of(name: &str) -> &'static str {
    if name.starts_with("mtp.") {
        KINDS[MTP]
    } else if name.starts_with("model.embed_tokens.") {
        KINDS[0]
    } else if name.starts_with("lm_head.") {
        KINDS[1]
    } else if name.contains(".linear_attn.") {
        KINDS[2]
    } else if name.contains(".self_attn.") {
        KINDS[3]
    } else if name.contains(".mlp.gate.") {
        KINDS[4]
    } else if name.contains(".mlp.experts.") || name.contains(".mlp.switch_mlp.") {
        KINDS[5]
    } else if name.contains(".mlp.shared_expert") {
        KINDS[6]
    } else if name.contains(".mlp.") {
        KINDS[7]
    } else {
        KINDS[9]
    }
}

fn gib(b: f64) -> String {
    if b >= (1u64 << 30) as f64 {
        format!("{:.2} GiB", b / (1u64 << 30) as f64)
    } else if b >= (1u64 << 20) as f64 {
        format!("{:.2} MiB", b / (1u64 << 20) as f64)
    } else {
        format!("{:.1} KiB", b / 1024.0)
    }
}

/// Per-sequence state bytes (f32) at `ctx` tokens: KV caches plus GDN conv and recurrent states.
pub fn state_bytes(c: &ModelConfig, ctx: usize) -> (usize, usize) {
    let full = c
        .layer_kinds
        .iter()
        .filter(|k| **k == LayerKind::FullAttention)
        .count();
    let linear = c.num_layers - full;
    let kv = full * 2 * c.num_kv_heads * c.head_dim * ctx * 4;
    let gdn = linear
        * (c.linear_v_heads * c.linear_k_dim * c.linear_v_dim + (c.conv_kernel - 1) * c.conv_dim())
        * 4;
    (kv, gdn)
}

/// The block types of a GGUF file's tensors with their counts: `Q4_K ×120, F32 ×61`.
fn gguf_types(file: &GgufFile) -> String {
    let mut n = std::collections::BTreeMap::new();
    for t in file.tensors.values() {
        *n.entry(t.kind.name()).or_insert(0usize) += 1;
    }
    let mut v: Vec<_> = n.into_iter().collect();
    v.sort_by_key(|e| std::cmp::Reverse(e.1));
    v.iter()
        .map(|(k, c)| format!("{k} ×{c}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The quantization line of a checkpoint directory's store.
fn print_quantization(store: &WeightStore) {
    match store.quantization() {
        Some(q) => {
            let d = q.default_spec();
            println!(
                "quantization   MLX affine, default {} bits, group size {} (per-module entries in config.json apply; bits/w below include scales and biases)",
                d.bits, d.group_size
            );
        }
        None => match store.fp8() {
            Some(f) => println!(
                "quantization   FP8 e4m3, blocks of {}x{} with a scale each ({} modules kept unquantized; bits/w below include the scales)",
                f.block[0],
                f.block[1],
                f.not_converted.len()
            ),
            None => match store.gptq() {
                Some(g) => println!(
                    "quantization   {} {} bits, group size {} (repacked at load to affine; bits/w below count its f32 scales and biases on the CPU, CUDA holds f16 scales and zero points)",
                    match g.packing {
                        Packing::Gptq { v1: true } => "GPTQ (v1)",
                        Packing::Gptq { v1: false } => "GPTQ (v2)",
                        Packing::Awq => "AWQ",
                    },
                    g.bits,
                    g.group_size.map_or("per row".to_string(), |g| g.to_string()),
                ),
                None => println!("quantization   none"),
            },
        },
    }
}

pub fn run(a: InfoArgs) -> Result<()> {
    crate::check_gpus(&a.gpus)?;
    let source = ModelSource::resolve(&a.model)?;
    // A directory's files are mapped; a GGUF file is listed from its tensor table, not unpacked.
    let (c, tensors, store, types) = match &source {
        ModelSource::Dir(_) => {
            let (c, store) = source.open()?;
            (c, store.summary(), Some(store), None)
        }
        ModelSource::Gguf(f) => {
            let file = GgufFile::open(f)?;
            let (c, tensors) = deltamoe_model::gguf::summary(&file)?;
            (c, tensors, None, Some(gguf_types(&file)))
        }
    };
    let mut params = [0usize; KINDS.len()];
    let mut bytes = [0usize; KINDS.len()];
    for t in &tensors {
        let i = KINDS
            .iter()
            .position(|k| *k == kind_of(&t.name))
            .unwrap_or(KINDS.len() - 1);
        params[i] += t.params;
        bytes[i] += t.bytes;
    }
    let total: usize = params.iter().sum();
    let total_bytes: usize = bytes.iter().sum();
    let experts = params[5];
    let active = total - experts - params[MTP]
        + (experts * c.experts_per_token)
            .checked_div(c.num_experts)
            .unwrap_or(0);

    println!("model          {}", a.model.display());
    println!("model_type     {} ({:?})", c.model_type, c.family);
    println!(
        "layers         {} pattern {} (L = Gated DeltaNet, F = full attention)",
        c.num_layers,
        c.layer_pattern()
    );
    println!(
        "hidden         {}  vocab {}  tied embeddings {}",
        c.hidden_size, c.vocab_size, c.tie_word_embeddings
    );
    println!(
        "attention      {} heads, {} kv heads, head dim {}, rotary dim {}, rope theta {}",
        c.num_heads, c.num_kv_heads, c.head_dim, c.rotary_dim, c.rope_theta
    );
    println!(
        "gated deltanet {} key heads, {} value heads, dims {}/{}, conv {}",
        c.linear_k_heads, c.linear_v_heads, c.linear_k_dim, c.linear_v_dim, c.conv_kernel
    );
    if c.num_experts > 0 {
        println!(
            "moe            {} experts, top {}, expert dim {}, shared expert dim {}, renormalise {}",
            c.num_experts, c.experts_per_token, c.moe_intermediate_size, c.shared_expert_intermediate_size, c.norm_topk_prob
        );
    }
    let has_mtp = tensors.iter().any(|t| t.name.starts_with("mtp."));
    let mtp = match (c.mtp_layers, has_mtp) {
        (0, _) => "none".to_string(),
        (n, true) => format!("{n} layer (mtp.*)"),
        (n, false) => format!(
            "the config names {n} layer but the checkpoint has no mtp.* tensors (mlx-lm's converter drops them; convert keeps them)"
        ),
    };
    println!("mtp            {mtp}");
    if let Some(types) = &types {
        println!("quantization   GGUF {} (quantized matrices repacked at load to affine with f32 scales and biases, exactly, IQ4 as 8-bit codes; CUDA holds Q8_0/Q4_0/Q5_0/IQ4_NL scales as f16 with zero points, other scales and biases as bf16, 5-bit codes as 8-bit, Q6_K as bf16 values)", types);
    }
    if let Some(store) = &store {
        print_quantization(store);
    }
    println!();
    let bpw = |b: usize, p: usize| {
        if p == 0 {
            "-".to_string()
        } else {
            format!("{:.2}", b as f64 * 8.0 / p as f64)
        }
    };
    println!(
        "{:<24} {:>16} {:>12} {:>8}",
        "parameters", "count", "bytes", "bits/w"
    );
    for (i, k) in KINDS.iter().enumerate() {
        if params[i] > 0 || bytes[i] > 0 {
            println!(
                "{:<24} {:>16} {:>12} {:>8}",
                k,
                params[i],
                gib(bytes[i] as f64),
                bpw(bytes[i], params[i])
            );
        }
    }
    println!(
        "{:<24} {:>16} {:>12} {:>8}",
        "total",
        total,
        gib(total_bytes as f64),
        bpw(total_bytes, total)
    );
    println!("{:<24} {:>16}", "active per token", active);
    let (kv, gdn) = state_bytes(&c, a.context);
    println!();
    println!(
        "memory: weights {} ({})",
        gib(total_bytes as f64),
        match source {
            ModelSource::Gguf(_) => "unpacked into memory at load",
            ModelSource::Dir(_) => "memory-mapped",
        }
    );
    println!(
        "memory per sequence at {} tokens: {} (KV cache {} + GDN state {}, f32)",
        a.context,
        gib((kv + gdn) as f64),
        gib(kv as f64),
        gib(gdn as f64)
    );
    let moe_layers = c
        .ffn_kinds
        .iter()
        .filter(|k| **k == deltamoe_model::FfnKind::Moe)
        .count();
    if let Some(per_expert) = bytes[5].checked_div(moe_layers * c.num_experts) {
        println!(
            "cuda: all resident needs the weights plus the state of each sequence (dense f16/f32 \
             weights become bf16 on the GPU, FP8 stays FP8). With --expert-cache GB the GPU keeps the other \
             weights ({}) plus GB of the routed experts ({}, {} per expert, {} per layer); the \
             rest of them need that much pinned host memory (more host memory, when free, holds \
             clean copies of cached experts so evictions write nothing back); an expert outside \
             the cache costs {} over PCIe each time a token uses it.",
            gib((total_bytes - bytes[5]) as f64),
            gib(bytes[5] as f64),
            gib(per_expert as f64),
            c.num_experts,
            gib(per_expert as f64)
        );
    }
    gpu_shares(&a, &c, &bytes, total_bytes, moe_layers)
}

/// With several `--gpus`, what each holds: its share of the routed experts and every other
/// weight, of the mixers and dense MLPs only its share with `--tensor-parallel`.
fn gpu_shares(
    a: &InfoArgs,
    c: &ModelConfig,
    bytes: &[usize],
    total_bytes: usize,
    moe_layers: usize,
) -> Result<()> {
    let world = a.gpus.len();
    if world < 2 {
        return Ok(());
    }
    let divided = bytes[2] + bytes[3] + bytes[7];
    let other = match a.tensor_parallel {
        true => {
            deltamoe_model::checkpoint::heads::heads_config(c, world)?;
            total_bytes - bytes[5] - divided + divided / world
        }
        false => total_bytes - bytes[5],
    };
    let heads = match a.tensor_parallel {
        true => ", of the mixers and dense MLPs only its share,",
        false => "",
    };
    let per_expert = bytes[5]
        .checked_div(moe_layers * c.num_experts)
        .unwrap_or(0);
    for (rank, g) in a.gpus.iter().enumerate() {
        let own = deltamoe_model::gpu::expert_share(c.num_experts, rank, world);
        let experts = match moe_layers {
            0 => String::new(),
            _ => format!(
                "routed experts {}..{} of each MoE layer ({}) and ",
                own.start,
                own.end,
                gib((own.len() * per_expert * moe_layers) as f64)
            ),
        };
        println!(
            "--gpus {}: GPU {g} holds {experts}every other weight ({}){heads} plus the state of \
             each sequence",
            crate::list(&a.gpus),
            gib(other as f64)
        );
    }
    Ok(())
}
