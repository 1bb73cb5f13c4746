//! `generate` and `score`.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use deltamoe_compute::cuda;
use deltamoe_engine::chat::ChatMessage;
use deltamoe_engine::generation_config::GenerationDefaults;
use deltamoe_engine::model_text::ModelText;
use deltamoe_engine::sampler::SamplingParams;
use deltamoe_engine::tokenizer::TextTokenizer;
use deltamoe_engine::{generate as run_generate, Engine, GenerateRequest};
use deltamoe_model::gpu::ExpertCache;
use deltamoe_model::{Logits, Progress, Qwen3Hybrid};
use indicatif::{ProgressBar, ProgressStyle};

use crate::{Device, ModelArgs};

#[derive(Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub(crate) model: ModelArgs,
    /// Prompt text (needs the model's tokenizer.json).
    #[arg(
        long,
        conflicts_with_all = ["prompt_tokens", "prompts_file"],
        required_unless_present_any = ["prompt_tokens", "prompts_file"]
    )]
    pub(crate) prompt: Option<String>,
    /// Prompt as comma-separated token ids, e.g. 1,2,3.
    #[arg(long, conflicts_with = "prompts_file")]
    pub(crate) prompt_tokens: Option<String>,
    /// Many prompts run as one batch: FILE holds one JSON string per line (blank lines are
    /// skipped). All of them go through the engine's scheduler together (continuous batching,
    /// chunked prefill between decode steps), each with the sampling flags and seed a run of
    /// that prompt alone would use. Prints one JSON object per prompt and line, in input
    /// order, each as soon as it and those before it are done: {"index": 0, "text": "...",
    /// "finish_reason": "stop" or "length", "prompt_tokens": N, "completion_tokens": M}
    /// ("error" instead of "text" when a prompt fails; the command then fails). --chat and
    /// --system apply to every prompt.
    #[arg(long, value_name = "FILE")]
    pub(crate) prompts_file: Option<PathBuf>,
    /// With --prompts-file: sequences decoded together at most (on CUDA their state is
    /// reserved up front). Default: 16.
    #[arg(long, requires = "prompts_file")]
    pub(crate) max_seqs: Option<usize>,
    /// Wrap the prompt in the model's chat template as a user message (text prompts only).
    #[arg(long, conflicts_with = "prompt_tokens")]
    pub(crate) chat: bool,
    /// System message for --chat.
    #[arg(long, requires = "chat")]
    pub(crate) system: Option<String>,
    /// Most tokens to generate (per prompt). When the prompt and this many tokens do not fit
    /// the model's context, fewer are generated (with a note on stderr): generation stops at
    /// the context, as llama.cpp's does.
    #[arg(long, default_value_t = 128)]
    pub(crate) max_tokens: usize,
    #[command(flatten)]
    pub(crate) sampling: SamplingArgs,
    /// Prefill in passes of at most N tokens (with --prompts-file: also at most N prompt
    /// tokens between two decode steps).
    #[arg(long)]
    pub(crate) prefill_chunk: Option<usize>,
    #[command(flatten)]
    pub(crate) speculative: SpeculativeArgs,
}

/// Sampling flags shared by `generate` and `chat`; unset ones come from generation_config.json.
#[derive(Args, Clone, Debug)]
pub struct SamplingArgs {
    /// Sampling temperature; 0 is greedy. Default: generation_config.json, else greedy.
    #[arg(long)]
    temperature: Option<f32>,
    /// Keep the k most likely tokens (0: off).
    #[arg(long)]
    top_k: Option<usize>,
    /// Nucleus sampling mass (1: off).
    #[arg(long)]
    top_p: Option<f32>,
    /// Drop tokens below this fraction of the top probability (0: off).
    #[arg(long)]
    min_p: Option<f32>,
    /// Penalise tokens already seen (1: off).
    #[arg(long)]
    repetition_penalty: Option<f32>,
    /// Random seed for sampling.
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

/// Speculative decoding, shared by `generate`, `chat` and `serve`.
#[derive(Args, Clone, Debug)]
pub struct SpeculativeArgs {
    /// Speculative decoding: the model's MTP layer drafts up to N tokens (1 to 4) that one
    /// pass of the model verifies, keeping those the model agrees with (greedy output is the
    /// same token for token; sampled output has the same distribution). Needs a checkpoint
    /// with its MTP layer (mtp.* tensors); on CUDA 1 to 3, models in MLX 4/8-bit, greedy steps
    /// of one sequence (others run plain). Default: off.
    #[arg(long, value_name = "N", default_value_t = 0)]
    speculative_tokens: usize,
}

impl SpeculativeArgs {
    /// Turns speculative decoding on in `engine` when asked.
    pub fn apply(&self, engine: &mut Engine) -> Result<()> {
        if self.speculative_tokens > 0 {
            engine.set_speculative(self.speculative_tokens)?;
        }
        Ok(())
    }
}

#[derive(Args)]
pub struct ScoreArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Comma-separated token ids, e.g. 1,2,3.
    #[arg(long)]
    tokens: String,
    /// Output .npy file: little-endian f32 logits [T, vocab].
    #[arg(long)]
    logits_out: PathBuf,
    /// Feed the tokens as prefills of at most N tokens (1: pure decode; default: all at once).
    #[arg(long)]
    prefill_chunk: Option<usize>,
}

/// Parse `1,2,3` into token ids, naming the flag and the bad item on error.
pub fn parse_ids(s: &str, flag: &str) -> Result<Vec<u32>> {
    let ids = s
        .split(',')
        .map(|p| p.trim())
        .filter(|p| !p.is_empty())
        .map(|p| p.parse::<u32>().with_context(|| format!("{flag}: `{p}` is not a token id (expected comma-separated non-negative integers)")))
        .collect::<Result<Vec<_>>>()?;
    if ids.is_empty() {
        bail!("{flag}: no token ids given; the prompt is empty");
    }
    Ok(ids)
}

/// Load the model of `--model` (weights memory-mapped on the host).
pub fn load_model(args: &ModelArgs) -> Result<Qwen3Hybrid> {
    load_dir(&args.dir()?)
}

/// A bar of source bytes (indicatif `template`) for work that reports [`Progress`], fed by
/// [`show_progress`].
pub fn bytes_bar(template: &str) -> ProgressBar {
    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template(template).unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar
}

/// `p` on `bar`: its length, position and the tensor at hand.
pub fn show_progress(bar: &ProgressBar, p: Progress) {
    bar.set_length(p.total);
    bar.set_position(p.done);
    bar.set_message(p.tensor.to_string());
}

/// Load the model at `dir`, a model directory or a GGUF file (named `--model` in errors;
/// safetensors weights memory-mapped on the host, GGUF ones unpacked into memory).
pub fn load_dir(dir: &Path) -> Result<Qwen3Hybrid> {
    let t0 = Instant::now();
    let bar = bytes_bar("unpacking {bar:40} {bytes}/{total_bytes} eta {eta} {wide_msg}");
    let model = Qwen3Hybrid::load_with_progress(dir, &mut |p| show_progress(&bar, p));
    bar.finish_and_clear();
    let model = model?;
    eprintln!(
        "loaded {} ({} layers, {}) from {} in {:.2} s",
        model.config().model_type,
        model.config().num_layers,
        model.config().layer_pattern(),
        dir.display(),
        t0.elapsed().as_secs_f64()
    );
    Ok(model)
}

/// An engine for `model` on the backend `--device` asks for: `cuda` fails with the reason
/// when no GPU is usable; `auto` takes CUDA when it is usable and the CPU otherwise. On CUDA
/// state for `seqs` sequences is reserved.
pub fn engine_for(mut model: Qwen3Hybrid, args: &ModelArgs, seqs: usize) -> Result<Engine> {
    let reason = cuda::unavailable_reason();
    let cache = args.expert_cache()?;
    let use_cuda = match (args.device, &reason) {
        (Device::Cpu, _) => false,
        (Device::Cuda, Some(why)) => bail!("--device cuda: {why}; use --device cpu"),
        (Device::Cuda, None) | (Device::Auto, None) => true,
        (Device::Auto, Some(_)) => false,
    };
    let gpus = args.gpus()?;
    if !use_cuda {
        if args.names_gpus() {
            bail!("--gpus names CUDA devices; drop it to run on the CPU");
        }
        eprintln!("backend: cpu, {} threads", rayon::current_num_threads());
        match cache {
            ExpertCache::Bytes(bytes) => offload_cpu(&mut model, &args.dir()?, bytes)?,
            _ => {
                if let Some(note) = weights_exceed_memory(&args.dir()?) {
                    eprintln!("{note}");
                }
            }
        }
        return Ok(Engine::new(model));
    }
    let t0 = Instant::now();
    let gpus = open_gpus(&gpus).context("--device cuda")?;
    let place = (cache, args.cpu_experts(), args.tensor_parallel());
    let engine = cuda_engine(model, gpus, (DEFAULT_CUDA_CONTEXT, seqs), place)?;
    eprintln!(
        "backend: {}, weights uploaded in {:.2} s",
        engine.backend_name(),
        t0.elapsed().as_secs_f64()
    );
    Ok(engine)
}

/// An engine for `model` on `gpus` with state for `seqs` sequences of `ctx` tokens, behind expert
/// cache `cache`: on several, the routed experts divided among them (and the mixers' heads with
/// `heads`); on one, the CPU computing experts outside the cache when `cpu_experts`.
pub fn cuda_engine(
    model: Qwen3Hybrid,
    gpus: Vec<Arc<cuda::Gpu>>,
    (ctx, seqs): (usize, usize),
    (cache, cpu_experts, heads): (ExpertCache, bool, bool),
) -> deltamoe_engine::Result<Engine> {
    if gpus.len() > 1 {
        return Engine::new_cuda_gpus(model, gpus, (ctx, seqs), (cache, heads));
    }
    let mut engine = Engine::new_cuda_with(model, gpus[0].clone(), ctx, seqs, cache)?;
    if cpu_experts {
        engine.set_host_experts(true)?;
    }
    Ok(engine)
}

/// The GPUs `ordinals` names, opened in order (the first compiles the kernels the others then
/// find cached).
pub fn open_gpus(ordinals: &[usize]) -> Result<Vec<Arc<cuda::Gpu>>> {
    ordinals
        .iter()
        .map(|&i| {
            let gpu = cuda::Gpu::new(i).with_context(|| format!("GPU {i}"))?;
            Ok(Arc::new(gpu))
        })
        .collect()
}

/// A note when a CPU model's safetensors files are larger than the host's available memory.
/// The CPU maps the weights rather than copying them, so the load succeeds, but pages are then
/// read from disk again as they are used and decoding crawls; the note says so with the numbers.
fn weights_exceed_memory(dir: &Path) -> Option<String> {
    let weights: u64 = std::fs::read_dir(dir)
        .ok()?
        .flatten()
        .filter(|e| e.path().extension().is_some_and(|x| x == "safetensors"))
        .filter_map(|e| e.metadata().ok())
        .map(|m| m.len())
        .sum();
    let available = deltamoe_model::host_memory::available()? as u64;
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    (weights > available).then(|| {
        format!(
            "note: the weights ({:.1} GiB) are larger than the available memory ({:.1} GiB); they \
             stay memory-mapped and are re-read from disk as they are used, so decoding will be \
             slow (--expert-cache GB bounds the routed experts held in memory)",
            gib(weights),
            gib(available)
        )
    })
}

/// Read the routed experts of a CPU model from its files in `dir` behind a cache of `bytes`
/// over all MoE layers (`--expert-cache`).
pub fn offload_cpu(model: &mut Qwen3Hybrid, dir: &Path, bytes: usize) -> Result<()> {
    let slots = model.expert_slots_for_bytes(bytes);
    model
        .offload_experts(dir, slots)
        .context("--expert-cache")?;
    eprintln!(
        "experts: read from {} on use, {slots} of {} cached per MoE layer",
        dir.display(),
        model.config().num_experts
    );
    Ok(())
}

/// Tokens of KV cache each CUDA sequence gets (capped by the model's max_position_embeddings).
const DEFAULT_CUDA_CONTEXT: usize = 32768;

/// The model's sampling defaults overridden by the flags given, checked for range.
pub fn sampling(a: &SamplingArgs, defaults: &GenerationDefaults) -> Result<SamplingParams> {
    let mut p = defaults.sampling.clone().unwrap_or_default();
    if let Some(v) = a.temperature {
        p.temperature = v;
    }
    if let Some(v) = a.top_k {
        p.top_k = v;
    }
    if let Some(v) = a.top_p {
        p.top_p = v;
    }
    if let Some(v) = a.min_p {
        p.min_p = v;
    }
    if let Some(v) = a.repetition_penalty {
        p.repetition_penalty = v;
    }
    p.seed = a.seed;
    p.validate()
        .context("check --temperature/--top-k/--top-p/--min-p/--repetition-penalty")?;
    Ok(p)
}

fn prompt_ids(a: &GenerateArgs, text_side: &ModelText) -> Result<Vec<u32>> {
    if let Some(ids) = &a.prompt_tokens {
        return parse_ids(ids, "--prompt-tokens");
    }
    let text = a.prompt.as_deref().unwrap_or_default();
    let Some(tok) = &text_side.tokenizer else {
        bail!(
            "--prompt: {} has no tokenizer.json; pass token ids with --prompt-tokens",
            text_side.origin.display()
        );
    };
    let ids = encode_prompt(a, text, text_side, tok)?;
    if ids.is_empty() {
        bail!("--prompt: the prompt is empty; give some text");
    }
    Ok(ids)
}

/// The ids of prompt `text`: wrapped in the chat template as a user message (after the
/// `--system` message) with `--chat`, else tokenized as is.
pub fn encode_prompt(
    a: &GenerateArgs,
    text: &str,
    text_side: &ModelText,
    tok: &TextTokenizer,
) -> Result<Vec<u32>> {
    if !a.chat {
        return Ok(tok.encode(text, true)?);
    }
    let Some(tpl) = &text_side.template else {
        bail!("--chat: {} has no chat template (tokenizer_config.json `chat_template`, chat_template.jinja or GGUF `tokenizer.chat_template`)", text_side.origin.display());
    };
    let mut msgs = Vec::new();
    if let Some(s) = &a.system {
        msgs.push(ChatMessage {
            role: "system".into(),
            content: s.clone(),
        });
    }
    msgs.push(ChatMessage {
        role: "user".into(),
        content: text.to_string(),
    });
    Ok(tok.encode(&tpl.render(&msgs, true)?, false)?)
}

/// Tokens to generate at most for a prompt of `prompt` tokens in a context of `ctx`, checked
/// before anything runs: a prompt longer than the context is an error; a `--max-tokens` that
/// runs past the context is lowered to what fits, with a note, so generation ends at the
/// context with exit 0 as llama.cpp's does. The last token generated is never fed, so a context
/// of `ctx` yields `ctx + 1 - prompt` tokens.
pub fn fit_context(prompt: usize, max_tokens: usize, ctx: usize) -> Result<usize> {
    if prompt > ctx {
        bail!("the prompt has {prompt} tokens but the model's context holds {ctx}; shorten the prompt");
    }
    let room = ctx + 1 - prompt;
    if max_tokens > room {
        eprintln!("note: the prompt ({prompt} tokens) and --max-tokens {max_tokens} exceed the context of {ctx} tokens; generating at most {room}");
        return Ok(room);
    }
    Ok(max_tokens)
}

pub fn generate(a: GenerateArgs) -> Result<()> {
    if let Some(file) = &a.prompts_file {
        return crate::batch::run(&a, file);
    }
    let text_side = ModelText::load(&a.model.dir()?)?;
    let tok = text_side.tokenizer.as_ref();
    let model = load_model(&a.model)?;
    let defaults = text_side.defaults(&model.config().eos_token_ids);
    let prompt = prompt_ids(&a, &text_side)?;
    let sampling = sampling(&a.sampling, &defaults)?;
    let mut engine = engine_for(model, &a.model, 1)?;
    a.speculative.apply(&mut engine)?;
    let req = GenerateRequest {
        prompt: &prompt,
        max_tokens: fit_context(prompt.len(), a.max_tokens, engine.max_context())?,
        sampling,
        eos: &defaults.eos_token_ids,
        prefill_chunk: a.prefill_chunk,
    };
    let mut out = std::io::stdout().lock();
    // A plain text prompt is echoed so the continuation reads on from it, as llama.cpp does.
    if let (Some(p), false, Some(_)) = (&a.prompt, a.chat, &tok) {
        write!(out, "{p}").ok();
    }
    let mut stream = tok.as_ref().map(|t| t.stream());
    let mut first = true;
    let (_, stats) = run_generate(&mut engine, &req, |id| {
        match stream.as_mut() {
            Some(s) => {
                if let Some(text) = s.push(id)? {
                    write!(out, "{text}").ok();
                }
            }
            None => {
                write!(out, "{}{id}", if first { "" } else { "," }).ok();
            }
        }
        first = false;
        out.flush().ok();
        Ok(true)
    })?;
    writeln!(out).ok();
    eprintln!(
        "prefill: {} tokens in {:.3} s ({:.1} tok/s) | decode: {} tokens in {:.3} s ({:.1} tok/s){}{}",
        stats.prompt_tokens,
        stats.prefill_secs,
        stats.prefill_tok_s(),
        stats.generated,
        stats.decode_secs,
        stats.decode_tok_s(),
        if engine.speculative_tokens() > 0 {
            format!(" | {:.2} tokens/step", stats.tokens_per_step())
        } else {
            String::new()
        },
        if stats.hit_eos {
            " | stopped at end-of-sequence".to_string()
        } else if stats.hit_context {
            format!(" | stopped at the context ({} tokens)", engine.max_context())
        } else {
            String::new()
        }
    );
    if let Some(o) = engine.expert_stats() {
        eprintln!(
            "experts: cache hit rate {:.3} over {} expert uses, {:.1} MB read from disk in {:.3} s, {} admitted",
            o.hit_rate(),
            o.hits + o.misses,
            o.bytes_read as f64 / 1e6,
            o.read_secs,
            o.admitted
        );
    }
    if let Some(o) = engine.offload_stats() {
        eprintln!(
            "experts: cache hit rate {:.3} over {} routed uses, {:.2} MB over PCIe per decoded token, {} admitted, {} written back to host memory",
            o.hit_rate(),
            o.hits + o.misses,
            o.pcie_bytes_per_token() / 1e6,
            o.admitted,
            o.written_back
        );
    }
    Ok(())
}

pub fn score(a: ScoreArgs) -> Result<()> {
    let tokens = parse_ids(&a.tokens, "--tokens")?;
    let model = load_model(&a.model)?;
    let vocab = model.config().vocab_size;
    let mut engine = engine_for(model, &a.model, 1)?;
    let id = engine.add_sequence()?;
    let t0 = Instant::now();
    let logits = engine.prefill(id, &tokens, a.prefill_chunk, Logits::All)?;
    let secs = t0.elapsed().as_secs_f64();
    crate::npy::write_f32(&a.logits_out, &[tokens.len(), vocab], &logits)?;
    eprintln!(
        "scored {} tokens in {:.3} s ({:.1} tok/s); logits [{}, {}] written to {}",
        tokens.len(),
        secs,
        tokens.len() as f64 / secs.max(1e-9),
        tokens.len(),
        vocab,
        a.logits_out.display()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fit_context_clamps_to_the_room_left() {
        assert_eq!(fit_context(3, 50, 8).unwrap(), 6);
        assert_eq!(fit_context(3, 4, 8).unwrap(), 4);
        assert_eq!(fit_context(8, 5, 8).unwrap(), 1);
        assert!(fit_context(9, 1, 8).is_err());
    }

    #[test]
    fn weights_larger_than_memory_get_a_note() {
        let Some(available) = deltamoe_model::host_memory::available() else {
            return;
        };
        let d = tempfile::tempdir().unwrap();
        let f = std::fs::File::create(d.path().join("model.safetensors")).unwrap();
        assert!(weights_exceed_memory(d.path()).is_none());
        // A sparse file twice the available memory: its length counts, no disk is used.
        f.set_len(2 * available as u64).unwrap();
        let note = weights_exceed_memory(d.path()).unwrap();
        assert!(
            note.contains("GiB") && note.contains("available memory"),
            "{note}"
        );
    }
}
