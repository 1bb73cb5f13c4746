//! `deltamoe`: run Qwen3.5 / Qwen3.6 / Qwen3-Next hybrid models.

mod batch;
mod bench;
mod bench_cpu;
mod bench_gpus;
mod bench_spec;
mod chat;
mod commands;
mod convert;
mod embedded;
mod info;
mod npy;
mod perplexity;
mod serve;
mod synthetic;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand, ValueEnum};

#[derive(Parser)]
#[command(
    name = "deltamoe",
    version,
    about = "Inference for hybrid linear-attention MoE LLMs (Qwen3.5/3.6 MoE, Qwen3-Next)"
)]
struct Cli {
    /// Worker threads for the CPU backend (default: all cores; more than the machine's cores
    /// are capped to them, with a warning).
    #[arg(long, global = true)]
    threads: Option<usize>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text (or token ids) from a prompt, streamed to stdout, or from many prompts
    /// (--prompts-file) run as one batch.
    Generate(commands::GenerateArgs),
    /// Chat with a model in the terminal (needs a chat template).
    Chat(chat::ChatArgs),
    /// Perplexity of a text file over consecutive windows of --ctx tokens.
    Perplexity(perplexity::PerplexityArgs),
    /// Feed tokens and write their logits as a [T, vocab] f32 .npy file.
    Score(commands::ScoreArgs),
    /// Describe a model: architecture, parameters and memory needs.
    Info(info::InfoArgs),
    /// Measure prefill and decode speed on a model or a synthetic config.
    Bench(bench::BenchArgs),
    /// Quantize an HF checkpoint to MLX affine 2-8 bit weights (loads in deltamoe and mlx-lm),
    /// or with --fp8 to fine-grained FP8 in the layout of Qwen's FP8 checkpoints.
    Convert(convert::ConvertArgs),
    /// Serve the model over an OpenAI-compatible HTTP API.
    Serve(serve::ServeArgs),
}

/// Where to run.
#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum Device {
    Cpu,
    Cuda,
    /// CUDA when a GPU is usable, else the CPU.
    Auto,
}

/// Options shared by commands that load a model.
#[derive(Args, Clone, Debug)]
pub struct ModelArgs {
    /// Model directory (HF or mlx-lm layout: config.json, *.safetensors, tokenizer files) or GGUF file (a split model's first part).
    /// Default: the small model built into deltamoe.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Backend to run on.
    #[arg(long, value_enum, default_value_t = Device::Auto)]
    device: Device,
    /// Keep at most this many GB of routed experts in the expert cache. CUDA: the cache is on
    /// the GPU, the other experts stay in pinned host memory and are read over PCIe (models
    /// larger than the GPU, or than the GPU and the host each, when the two together hold
    /// them). CPU: the cache is in memory, the other experts are read from the
    /// safetensors files when used (0: every use reads). Default: all resident.
    #[arg(long, value_name = "GB")]
    expert_cache: Option<f64>,
    /// CUDA with --expert-cache: let the CPU compute the share of the experts outside the GPU's
    /// cache that it computes faster than PCIe moves them (bitwise the same logits; off: every
    /// such expert is read over PCIe).
    #[arg(long)]
    cpu_experts: bool,
    /// CUDA: run on these GPUs (device numbers, e.g. 0,1), the routed experts divided among them
    /// and every other weight on each (expert parallel over NCCL; with --expert-cache GB, each
    /// GPU caches its share of the GB). One number picks that GPU. Default: GPU 0.
    #[arg(long, value_name = "LIST", value_delimiter = ',')]
    gpus: Vec<usize>,
    /// With several --gpus: divide each attention and GDN layer's heads and each dense MLP's
    /// rows among them too (tensor parallel: each GPU holds its share of those weights and of the
    /// mixers' state, one all-reduce after each mixer and dense MLP). The head counts must
    /// divide by the number of GPUs.
    #[arg(long)]
    tensor_parallel: bool,
}

impl ModelArgs {
    /// The GPUs `--gpus` names (GPU 0 when it is left out), checked: no number twice, and with
    /// several, none of the one-GPU options.
    pub fn gpus(&self) -> anyhow::Result<Vec<usize>> {
        check_gpus(&self.gpus)?;
        if self.tensor_parallel && self.gpus.len() < 2 {
            anyhow::bail!(
                "--tensor-parallel divides heads among GPUs: name two or more with --gpus"
            );
        }
        if self.gpus.len() > 1 && self.cpu_experts {
            anyhow::bail!(
                "--gpus {}: --cpu-experts runs on one GPU; drop it or name one GPU",
                list(&self.gpus)
            );
        }
        Ok(match self.gpus.is_empty() {
            true => vec![0],
            false => self.gpus.clone(),
        })
    }

    /// Whether the mixers' heads and dense MLPs are divided among the GPUs (`--tensor-parallel`).
    pub fn tensor_parallel(&self) -> bool {
        self.tensor_parallel
    }

    /// Whether `--gpus` was given.
    pub fn names_gpus(&self) -> bool {
        !self.gpus.is_empty()
    }

    /// The expert cache `--expert-cache` asks for (checked).
    pub fn expert_cache(&self) -> anyhow::Result<deltamoe_model::gpu::ExpertCache> {
        use deltamoe_model::gpu::ExpertCache;
        match self.expert_cache {
            None => Ok(ExpertCache::All),
            Some(gb) if gb.is_finite() && gb >= 0.0 => {
                Ok(ExpertCache::Bytes((gb * (1u64 << 30) as f64) as usize))
            }
            Some(gb) => anyhow::bail!("--expert-cache {gb}: expected a size in GB, 0 or more"),
        }
    }

    /// Whether the CPU may compute offloaded experts (CUDA with `--expert-cache`).
    pub fn cpu_experts(&self) -> bool {
        self.cpu_experts
    }

    /// The model directory: `--model`, or the built-in model.
    pub fn dir(&self) -> anyhow::Result<PathBuf> {
        match &self.model {
            Some(d) => Ok(d.clone()),
            None => embedded::dir(),
        }
    }
}

/// `--gpus` checked: each device at most once.
pub fn check_gpus(gpus: &[usize]) -> anyhow::Result<()> {
    let twice = gpus
        .iter()
        .enumerate()
        .find(|(i, g)| gpus[..*i].contains(g));
    match twice {
        Some((_, g)) => anyhow::bail!("--gpus {}: GPU {g} is named twice", list(gpus)),
        None => Ok(()),
    }
}

/// Device numbers as `--gpus` takes them.
pub fn list(gpus: &[usize]) -> String {
    gpus.iter()
        .map(|g| g.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

/// `--threads n` checked and capped at the machine's cores: more threads than cores only add
/// contention, and a huge count spends minutes spawning threads before any output.
fn capped_threads(n: usize) -> anyhow::Result<usize> {
    if n == 0 {
        anyhow::bail!("--threads 0: expected at least 1 (leave it out to use every core)");
    }
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    if n > cores {
        eprintln!("warning: --threads {n}: this machine has {cores} cores; using {cores}");
        return Ok(cores);
    }
    Ok(n)
}

/// One-shot commands end quietly when their reader goes away (`deltamoe info | head -1`), as
/// other command-line tools do: SIGPIPE goes back to its default action. Rust starts with it
/// ignored, which makes a write to a closed pipe an error that `println!` turns into a panic.
/// `serve` keeps it ignored: a client closing its socket must not end the server.
#[cfg(unix)]
fn end_on_closed_pipe() {
    // SAFETY: sets SIGPIPE's disposition to the default action, a plain libc call with constant
    // arguments; no handler runs Rust code.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

#[cfg(not(unix))]
fn end_on_closed_pipe() {}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if !matches!(cli.command, Command::Serve(_)) {
        end_on_closed_pipe();
    }
    if let Some(n) = cli.threads {
        let n = match capped_threads(n) {
            Ok(n) => n,
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::FAILURE;
            }
        };
        if let Err(e) = rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build_global()
        {
            eprintln!("error: --threads {n}: {e}");
            return ExitCode::FAILURE;
        }
    }
    let result = match cli.command {
        Command::Generate(a) => commands::generate(a),
        Command::Chat(a) => chat::run(a),
        Command::Perplexity(a) => perplexity::run(a),
        Command::Score(a) => commands::score(a),
        Command::Info(a) => info::run(a),
        Command::Bench(a) => bench::run(a),
        Command::Convert(a) => convert::run(a),
        Command::Serve(a) => serve::run(a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // One line: the outermost context followed by its causes.
            let msg: Vec<String> = e.chain().map(|c| c.to_string()).collect();
            eprintln!("error: {}", msg.join(": "));
            ExitCode::FAILURE
        }
    }
}
