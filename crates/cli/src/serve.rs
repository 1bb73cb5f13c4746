//! `serve`: the OpenAI-compatible HTTP server (crates/server) on a model directory, or on
//! random weights of a named real shape (`--synthetic`, CUDA only) to load-test real sizes
//! without downloading a checkpoint.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;
use deltamoe_compute::cuda;
use deltamoe_engine::model_text::ModelText;
use deltamoe_engine::{Engine, EngineError};
use deltamoe_model::Qwen3Hybrid;
use deltamoe_server::{ConnLimits, EngineFactory, LogFormat, Server, ServerOptions};

use crate::{synthetic, Device, ModelArgs};
use deltamoe_model::gpu::{DevFormat, ExpertCache};

#[derive(Args)]
pub struct ServeArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Serve random weights of a named real shape instead of a model directory (CUDA only;
    /// made in device memory as `bench --synthetic` makes them): qwen3.6-35b-a3b,
    /// qwen3-next-80b-a3b, qwen3.5-397b-a17b. Prompts are tokenized byte by byte (one token
    /// per UTF-8 byte), chat messages joined as plain text; replies are random tokens.
    #[arg(long, conflicts_with = "model", value_name = "NAME")]
    synthetic: Option<String>,
    /// With --synthetic: matrices MLX-affine quantized to this many bits (2, 4 or 8; default
    /// bf16).
    #[arg(long, requires = "synthetic", conflicts_with = "model")]
    bits: Option<u32>,
    /// With --synthetic --bits: the quantization group size (32, 64 or 128; default 64).
    #[arg(long, requires = "bits")]
    group_size: Option<usize>,
    /// With --synthetic: matrices in fine-grained FP8 (routers and lm_head bf16).
    #[arg(long, requires = "synthetic", conflicts_with_all = ["model", "bits"])]
    fp8: bool,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0: any free port).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Sequences decoded together. On CUDA their state is reserved up front; the default there
    /// is as many as the free device memory holds (measured after loading, at most 256); on the
    /// CPU the default is 4.
    #[arg(long)]
    max_seqs: Option<usize>,
    /// Requests that may wait for a sequence; more are answered 429 with Retry-After.
    #[arg(long, default_value_t = 64)]
    max_queue: usize,
    /// Tokens per sequence, prompt plus reply (default: 32768 on CUDA, the model's maximum on
    /// the CPU; never more than the model's maximum).
    #[arg(long)]
    ctx: Option<usize>,
    /// Memory for prompt cache snapshots, in MiB (0: no prompt reuse).
    #[arg(long, default_value_t = 1024)]
    prompt_cache_mb: usize,
    /// Also store a prompt cache snapshot every N prompt tokens (0: only after the prompt and
    /// at the end of each reply).
    #[arg(long, default_value_t = 2048)]
    checkpoint_every: usize,
    /// Prompt tokens per prefill pass; decoding sequences step between passes (larger: more
    /// prompt throughput, longer pauses of the decoding sequences while a prompt arrives).
    #[arg(long, default_value_t = 2048)]
    prefill_chunk: usize,
    /// Largest request body, in MiB.
    #[arg(long, default_value_t = 8)]
    max_body_mb: usize,
    /// Seconds a client may take to send a request's head; slower (half-sent) connections are
    /// closed.
    #[arg(long, default_value_t = 10.0)]
    header_timeout: f64,
    /// Seconds a client may take to send a request's body after its head; slower bodies are
    /// answered 408.
    #[arg(long, default_value_t = 30.0)]
    body_timeout: f64,
    /// Seconds an open connection may sit with no request and no traffic before it is closed.
    #[arg(long, default_value_t = 60.0)]
    idle_timeout: f64,
    /// Open connections at most; more are answered 503 and closed.
    #[arg(long, default_value_t = 512)]
    max_connections: usize,
    /// Seconds requests in flight get to finish after Ctrl-C or SIGTERM; then they are cut
    /// (a second signal exits at once).
    #[arg(long, default_value_t = 30.0)]
    shutdown_timeout: f64,
    /// Tokenize special-token strings (such as <|im_end|>) in chat message content as special
    /// tokens, as older servers did; by default content is plain text and cannot end its turn.
    #[arg(long)]
    allow_special_in_content: bool,
    /// The request log on stderr, one line per request: text, json (one object per line) or
    /// off.
    #[arg(long, value_enum, default_value_t = LogArg::Text)]
    log_format: LogArg,
    /// Model name clients use (default: the model directory's name).
    #[arg(long)]
    api_name: Option<String>,
    /// Speculative decoding with the model's MTP layer drafting up to N tokens a step (1 to 4;
    /// not with --synthetic); see `generate --help`. Default: off.
    #[arg(
        long,
        value_name = "N",
        default_value_t = 0,
        conflicts_with = "synthetic"
    )]
    speculative_tokens: usize,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum LogArg {
    Text,
    Json,
    Off,
}

/// Tokens of KV cache each CUDA sequence gets unless --ctx says otherwise.
const DEFAULT_CUDA_CONTEXT: usize = 32768;

/// Sequences served at once on the CPU unless `--max-seqs` says otherwise.
const CPU_MAX_SEQS: usize = 4;

/// True when `device` resolves to CUDA; `cuda` without a usable GPU is an error.
fn use_cuda(device: Device) -> Result<bool> {
    let reason = cuda::unavailable_reason();
    match (device, reason) {
        (Device::Cpu, _) => Ok(false),
        (Device::Cuda, Some(why)) => bail!("--device cuda: {why}; use --device cpu"),
        (Device::Cuda, None) | (Device::Auto, None) => Ok(true),
        (Device::Auto, Some(_)) => Ok(false),
    }
}

/// Where the weights go on CUDA: the GPUs (`--gpus`), and on one GPU the expert cache and
/// whether the CPU computes experts outside it.
struct Placement {
    gpus: Vec<usize>,
    cache: ExpertCache,
    cpu_experts: bool,
    heads: bool,
}

impl Placement {
    fn of(m: &ModelArgs) -> Result<Placement> {
        Ok(Placement {
            gpus: m.gpus()?,
            cache: m.expert_cache()?,
            cpu_experts: m.cpu_experts(),
            heads: m.tensor_parallel(),
        })
    }

    /// The GPUs, opened in order.
    fn open(&self, flag: &str) -> std::result::Result<Vec<Arc<cuda::Gpu>>, EngineError> {
        let gpus = crate::commands::open_gpus(&self.gpus);
        gpus.map_err(|e| EngineError::Input(format!("{flag}: {e:#}")))
    }
}

/// Builds the engine on the server's engine thread.
fn factory(
    dir: std::path::PathBuf,
    cuda: bool,
    (ctx, max_seqs): (Option<usize>, usize),
    place: Placement,
    drafts: usize,
) -> EngineFactory {
    Box::new(move || {
        let mut model = Qwen3Hybrid::load(&dir)?;
        let cache = place.cache;
        let mut engine = if cuda {
            let gpus = place.open("--device cuda")?;
            let ctx = ctx.unwrap_or(DEFAULT_CUDA_CONTEXT);
            let experts = (cache, place.cpu_experts, place.heads);
            crate::commands::cuda_engine(model, gpus, (ctx, max_seqs), experts)?
        } else {
            if let ExpertCache::Bytes(bytes) = cache {
                let slots = model.expert_slots_for_bytes(bytes);
                model.offload_experts(&dir, slots)?;
            }
            Engine::new(model)
        };
        engine.set_speculative(drafts)?;
        Ok(engine)
    })
}

fn options(a: &ServeArgs, name: String, cuda: bool) -> Result<ServerOptions> {
    if a.max_seqs == Some(0) {
        bail!("--max-seqs must be at least 1");
    }
    if a.prefill_chunk == 0 {
        bail!("--prefill-chunk must be at least 1");
    }
    let secs = |name: &str, v: f64| {
        if v.is_finite() && v > 0.0 {
            Ok(Duration::from_secs_f64(v))
        } else {
            bail!("--{name} must be a positive number of seconds")
        }
    };
    if a.max_connections == 0 {
        bail!("--max-connections must be at least 1");
    }
    let conn = ConnLimits {
        header_timeout: secs("header-timeout", a.header_timeout)?,
        body_timeout: secs("body-timeout", a.body_timeout)?,
        idle_timeout: secs("idle-timeout", a.idle_timeout)?,
        max_connections: a.max_connections,
        shutdown_timeout: secs("shutdown-timeout", a.shutdown_timeout)?,
    };
    Ok(ServerOptions {
        conn,
        allow_special_in_content: a.allow_special_in_content,
        log_format: match a.log_format {
            LogArg::Text => LogFormat::Text,
            LogArg::Json => LogFormat::Json,
            LogArg::Off => LogFormat::Off,
        },
        api_name: name,
        // On CUDA without --max-seqs the engine reserves what fits and the server runs as
        // many sequences as it got.
        max_seqs: a
            .max_seqs
            .unwrap_or(if cuda { usize::MAX / 4 } else { CPU_MAX_SEQS }),
        max_queue: a.max_queue,
        max_context: a.ctx,
        prompt_cache_bytes: a.prompt_cache_mb << 20,
        checkpoint_every: a.checkpoint_every,
        prefill_chunk: a.prefill_chunk,
        max_body_bytes: a.max_body_mb.max(1) << 20,
    })
}

/// Builds a synthetic model (random weights of `cfg` on the GPUs) on the engine thread.
fn synthetic_factory(
    cfg: deltamoe_model::ModelConfig,
    quant: DevFormat,
    (ctx, max_seqs): (Option<usize>, usize),
    place: Placement,
) -> EngineFactory {
    Box::new(move || {
        let cuda_err = |e: cuda::CudaError| EngineError::Input(format!("--synthetic: {e}"));
        let gpus = place.open("--synthetic")?;
        let ctx = ctx.unwrap_or(DEFAULT_CUDA_CONTEXT);
        if gpus.len() > 1 {
            let make = synthetic::shard_maker(&cfg, quant, (place.cache, gpus.len(), place.heads));
            return Engine::new_cuda_shards(cfg, gpus, make, ctx, max_seqs);
        }
        let model = synthetic::gpu_model(&cfg, gpus[0].clone(), quant, place.cache);
        let mut engine = Engine::new_cuda_model(cfg, model.map_err(cuda_err)?, ctx, max_seqs)?;
        if place.cpu_experts {
            engine.set_host_experts(true)?;
        }
        Ok(engine)
    })
}

/// `serve --synthetic NAME`: checks the flags (an unknown shape, bad --bits, or no usable
/// GPU is a one-line error before anything is made), then serves the shape on CUDA.
fn run_synthetic(a: &ServeArgs, shape: &str) -> Result<()> {
    let cfg = synthetic::shape(shape)?;
    let quant = synthetic::quant(a.bits, a.group_size, a.fp8, false, false)?;
    match (a.model.device, cuda::unavailable_reason()) {
        (Device::Cpu, _) => bail!(
            "--synthetic {shape}: synthetic weights are made on the GPU only; use --device cuda"
        ),
        (_, Some(why)) => bail!("--synthetic {shape} needs a CUDA GPU: {why}"),
        (_, None) => {}
    }
    let name = a.api_name.clone().unwrap_or_else(|| shape.to_string());
    let opts = options(a, name, true)?;
    let place = Placement::of(&a.model)?;
    let factory = synthetic_factory(cfg, quant, (a.ctx, a.max_seqs.unwrap_or(0)), place);
    let server = Server::start_synthetic(factory, opts)
        .with_context(|| format!("serving --synthetic {shape}"))?;
    eprintln!(
        "{} (synthetic {}, byte-level tokenizer)",
        server.describe(),
        synthetic::precision(quant)
    );
    run_server(a, server)
}

pub fn run(a: ServeArgs) -> Result<()> {
    if let Some(shape) = &a.synthetic {
        return run_synthetic(&a, shape);
    }
    let dir = a.model.dir()?;
    let text = ModelText::load(&dir)?;
    // A GGUF file is named without its extension, as llama.cpp's server names it.
    let file_name = match dir.is_file() {
        true => dir.file_stem(),
        false => dir.file_name(),
    };
    let name = match (&a.api_name, &a.model.model) {
        (Some(n), _) => n.clone(),
        (None, None) => "deltamoe-tiny".to_string(),
        (None, Some(_)) => file_name
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "deltamoe".into()),
    };
    let cuda = use_cuda(a.model.device)?;
    if !cuda && a.model.names_gpus() {
        bail!("--gpus names CUDA devices; drop it to run on the CPU");
    }
    let place = Placement::of(&a.model)?;
    let opts = options(&a, name, cuda)?;
    let slots = a.max_seqs.unwrap_or(0);
    let server = Server::start(
        text,
        factory(
            dir.clone(),
            cuda,
            (a.ctx, slots),
            place,
            a.speculative_tokens,
        ),
        opts,
    )
    .with_context(|| format!("serving {}", dir.display()))?;
    eprintln!("{}", server.describe());
    run_server(&a, server)
}

/// Listens and serves until Ctrl-C or SIGTERM.
fn run_server(a: &ServeArgs, server: Server) -> Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let served = runtime.block_on(listen(&a.host, a.port, &server));
    // The connections' tasks end with the runtime; then the engine (and its GPUs' threads) is
    // released before the process exits.
    drop(runtime);
    server.stop();
    served
}

async fn listen(host: &str, port: u16, server: &Server) -> Result<()> {
    let listener = tokio::net::TcpListener::bind((host, port))
        .await
        .with_context(|| {
            format!("cannot listen on {host}:{port}; pick another --port or --host")
        })?;
    let addr: SocketAddr = listener.local_addr()?;
    eprintln!("listening on http://{addr} (OpenAI API at http://{addr}/v1); Ctrl-C stops");
    let limits = server.conn_limits();
    let grace = limits.shutdown_timeout.as_secs_f64();
    let shutdown = async move {
        signal().await;
        eprintln!("shutting down: requests in flight get {grace} s (a second Ctrl-C exits now)");
        tokio::spawn(async {
            signal().await;
            eprintln!("second signal: exiting now");
            std::process::exit(130);
        });
    };
    deltamoe_server::serve(listener, server.router(), limits, shutdown).await?;
    Ok(())
}

/// The next Ctrl-C (SIGINT) or SIGTERM.
async fn signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let Ok(mut term) = signal(SignalKind::terminate()) else {
        let _ = tokio::signal::ctrl_c().await;
        return;
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}
