//! An OpenAI-compatible HTTP server over a deltamoe [`Engine`]: chat and text completions
//! (JSON or server-sent events), reasoning and tool-call parsing, admission limits and
//! Prometheus metrics. Scheduling (continuous batching, prompt reuse) is the engine's
//! [`Scheduler`], driven on a dedicated engine thread.
//!
//! The engine is built and used on its own thread (it may not be `Send` on CUDA); the HTTP
//! handlers talk to it through channels.

pub mod api;
pub mod listen;
pub mod log;
pub mod metrics;
pub mod output;
pub mod parse;
pub mod prompt;
pub mod request;
pub mod routes;
pub mod worker;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;

use deltamoe_engine::chat::ChatTemplate;
use deltamoe_engine::generation_config::GenerationDefaults;
use deltamoe_engine::model_text::ModelText;
use deltamoe_engine::scheduler::{Scheduler, SchedulerConfig};
use deltamoe_engine::tokenizer::TextTokenizer;
use deltamoe_engine::{Engine, EngineError};

pub use crate::listen::{serve, ConnLimits};
pub use crate::log::LogFormat;
use crate::metrics::Metrics;
use crate::prompt::PLAIN_CHAT_TEMPLATE;
use crate::request::{unix_now, ModelInfo};
use crate::routes::App;
use crate::worker::{Job, Worker};

/// Builds the engine on the engine thread.
pub type EngineFactory = Box<dyn FnOnce() -> Result<Engine, EngineError> + Send>;

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error("{0}: no tokenizer.json; the server needs the model's tokenizer")]
    NoTokenizer(PathBuf),
    #[error("cannot start the engine thread: {0}")]
    Thread(String),
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

/// How the server runs.
#[derive(Clone, Debug)]
pub struct ServerOptions {
    /// The model name clients use.
    pub api_name: String,
    /// Sequences running at once (on CUDA also capped by the engine's free slots).
    pub max_seqs: usize,
    /// Requests that may wait for a sequence; more get 429.
    pub max_queue: usize,
    /// Tokens per sequence (prompt plus generated); default the engine's context.
    pub max_context: Option<usize>,
    /// Prompt cache budget in bytes (0 disables prompt reuse).
    pub prompt_cache_bytes: usize,
    /// A prompt cache checkpoint every this many prompt tokens (0: only at the ends).
    pub checkpoint_every: usize,
    /// Prompt tokens per prefill pass and per scheduler iteration.
    pub prefill_chunk: usize,
    /// Largest accepted request body.
    pub max_body_bytes: usize,
    /// Connection cap and timeouts.
    pub conn: ConnLimits,
    /// Tokenize special-token strings in chat message content as special tokens (the old,
    /// unsafe behaviour); by default content is text.
    pub allow_special_in_content: bool,
    /// The request log on stderr.
    pub log_format: LogFormat,
}

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            api_name: "deltamoe".into(),
            max_seqs: 4,
            max_queue: 64,
            max_context: None,
            prompt_cache_bytes: 1 << 30,
            checkpoint_every: 2048,
            prefill_chunk: 2048,
            max_body_bytes: 8 << 20,
            conn: ConnLimits::default(),
            allow_special_in_content: false,
            log_format: LogFormat::Text,
        }
    }
}

/// What the engine thread reports once the engine is built.
struct EngineFacts {
    max_context: usize,
    max_seqs: usize,
    eos: Vec<u32>,
    vocab_size: usize,
    backend: String,
    sequence_bytes: usize,
}

/// A started server: the engine thread runs; [`Server::router`] serves HTTP.
pub struct Server {
    app: Arc<App>,
    facts: EngineFacts,
    conn: ConnLimits,
    engine_thread: JoinHandle<()>,
}

impl Server {
    /// Serves the model whose tokenizer, chat template and generation defaults are `text`
    /// (from its directory or GGUF file), building the engine on its own thread with
    /// `factory`, and starts scheduling.
    pub fn start(
        text: ModelText,
        factory: EngineFactory,
        opts: ServerOptions,
    ) -> Result<Server, ServerError> {
        let tokenizer = text
            .tokenizer
            .ok_or_else(|| ServerError::NoTokenizer(text.origin.clone()))?;
        Self::launch(
            tokenizer,
            text.template,
            Some(text.generation),
            factory,
            opts,
        )
    }

    /// Starts a server for a model without files (synthetic random weights of a real shape):
    /// prompts are tokenized byte by byte ([`TextTokenizer::bytes`]), a chat's message
    /// contents are joined as plain text ([`PLAIN_CHAT_TEMPLATE`]), generation stops at the
    /// config's EOS ids and sampling defaults to greedy.
    pub fn start_synthetic(
        factory: EngineFactory,
        opts: ServerOptions,
    ) -> Result<Server, ServerError> {
        let template = ChatTemplate::from_str(PLAIN_CHAT_TEMPLATE)?;
        Self::launch(TextTokenizer::bytes(), Some(template), None, factory, opts)
    }

    /// Builds the engine and the app; generation defaults are the model files' `generation`
    /// when there are files, else the model config's alone.
    fn launch(
        tokenizer: TextTokenizer,
        template: Option<ChatTemplate>,
        generation: Option<GenerationDefaults>,
        factory: EngineFactory,
        opts: ServerOptions,
    ) -> Result<Server, ServerError> {
        let metrics = Arc::new(Metrics::default());
        let alive = Arc::new(AtomicBool::new(true));
        let (jobs, facts, thread) = spawn_engine(factory, &opts, metrics.clone(), alive.clone())?;
        let defaults = generation.unwrap_or_default().with_eos(&facts.eos);
        let mut stop_ids = defaults.eos_token_ids.clone();
        let template_eos = template.as_ref().and_then(|t| t.eos_token());
        stop_ids.extend(template_eos.and_then(|t| tokenizer.token_id(t)));
        let info = ModelInfo {
            name: opts.api_name.clone(),
            tokenizer,
            template,
            stop_ids,
            sampling: defaults.sampling.unwrap_or_default(),
            max_context: facts.max_context,
            vocab_size: facts.vocab_size,
            created: unix_now(),
            allow_special_in_content: opts.allow_special_in_content,
        };
        let app = Arc::new(App {
            info,
            jobs,
            metrics,
            load: Arc::new(AtomicUsize::new(0)),
            max_load: facts.max_seqs + opts.max_queue,
            max_body: opts.max_body_bytes,
            alive,
            log_format: opts.log_format,
        });
        Ok(Server {
            app,
            facts,
            conn: opts.conn.clone(),
            engine_thread: thread,
        })
    }

    /// The HTTP routes.
    /// Ends the engine thread once nothing else holds the app (the HTTP tasks have ended): the
    /// engine and its devices are released before the process exits.
    pub fn stop(self) {
        drop(self.app);
        let _ = self.engine_thread.join();
    }

    pub fn router(&self) -> axum::Router {
        routes::router(self.app.clone())
    }

    /// The connection cap and timeouts [`serve`] takes.
    pub fn conn_limits(&self) -> ConnLimits {
        self.conn.clone()
    }

    /// One line: backend, context, sequences and their state memory.
    pub fn describe(&self) -> String {
        let f = &self.facts;
        format!(
            "model {} on {}: context {} tokens, {} sequences at once (state up to {:.1} MiB each), {} more may wait",
            self.app.info.name,
            f.backend,
            f.max_context,
            f.max_seqs,
            f.sequence_bytes as f64 / (1 << 20) as f64,
            self.app.max_load - f.max_seqs,
        )
    }
}

type Spawned = (mpsc::Sender<Job>, EngineFacts, JoinHandle<()>);

/// Starts the engine thread and waits until the engine is built.
fn spawn_engine(
    factory: EngineFactory,
    opts: &ServerOptions,
    metrics: Arc<Metrics>,
    alive: Arc<AtomicBool>,
) -> Result<Spawned, ServerError> {
    let (jobs_tx, jobs_rx) = mpsc::channel();
    let (ready_tx, ready_rx) = mpsc::channel();
    let opts = opts.clone();
    let thread = std::thread::Builder::new()
        .name("deltamoe-engine".into())
        .spawn(move || {
            let engine = match factory() {
                Ok(e) => e,
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                    return;
                }
            };
            let facts = engine_facts(&engine, &opts);
            let cfg = SchedulerConfig {
                max_seqs: facts.max_seqs,
                prefill_chunk: opts.prefill_chunk.max(1),
                checkpoint_every: opts.checkpoint_every,
                cache_bytes: opts.prompt_cache_bytes,
                max_context: facts.max_context,
            };
            let _ = ready_tx.send(Ok(facts));
            Worker::new(Scheduler::new(engine, cfg), jobs_rx, metrics).run();
            alive.store(false, Ordering::Release);
        })
        .map_err(|e| ServerError::Thread(e.to_string()))?;
    let facts = ready_rx
        .recv()
        .map_err(|_| ServerError::Thread("the engine thread ended while starting".into()))??;
    Ok((jobs_tx, facts, thread))
}

fn engine_facts(engine: &Engine, opts: &ServerOptions) -> EngineFacts {
    let config = engine.config();
    let ctx = engine.max_context();
    let max_seqs = match engine.free_sequences() {
        Some(free) => opts.max_seqs.min(free),
        None => opts.max_seqs,
    };
    EngineFacts {
        max_context: opts.max_context.map_or(ctx, |c| c.min(ctx)),
        max_seqs: max_seqs.max(1),
        eos: config.eos_token_ids.clone(),
        vocab_size: config.vocab_size,
        backend: engine.backend_name(),
        sequence_bytes: engine.sequence_bytes(),
    }
}
