//! The engine thread: continuous batching over one [`Engine`].
//!
//! Each loop iteration takes new requests, admits waiting ones while sequence slots are free
//! (starting each from the longest cached prefix of its prompt), prefills prompt chunks up to
//! a token budget, and then runs one [`Engine::step`] for every sequence that is decoding, so
//! new prompts are prefilled between decode steps and running sequences keep moving. A request
//! whose receiver is gone (client disconnected, or a stop string ended it) is dropped at the
//! next iteration.

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, TryRecvError};
use std::sync::Arc;
use std::time::Instant;

use deltamoe_engine::engine::Snapshot;
use deltamoe_engine::sampler::SamplingParams;
use deltamoe_engine::{Engine, EngineError, SeqId};
use deltamoe_model::Logits;
use tokio::sync::mpsc::UnboundedSender;

use crate::metrics::{add, set, Metrics};
use crate::prefix_cache::PrefixCache;

/// Why generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence id (or, set by the handler, a stop string).
    Stop,
    /// `max_tokens` or the context was reached.
    Length,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// What the engine thread tells a request's handler.
#[derive(Debug)]
pub enum Event {
    /// The request got a sequence; `cached` prompt tokens came from the prompt cache.
    Started {
        cached: usize,
    },
    Token(u32),
    Finished(FinishReason),
    Failed(String),
}

/// Counts a request from submission until the engine thread lets go of it.
pub struct Ticket(Arc<AtomicUsize>);

impl Ticket {
    /// Takes a place if fewer than `limit` requests are in flight.
    pub fn take(load: &Arc<AtomicUsize>, limit: usize) -> Option<Ticket> {
        let mut now = load.load(Ordering::Relaxed);
        loop {
            if now >= limit {
                return None;
            }
            match load.compare_exchange(now, now + 1, Ordering::AcqRel, Ordering::Relaxed) {
                Ok(_) => return Some(Ticket(load.clone())),
                Err(seen) => now = seen,
            }
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// One generation request.
pub struct Job {
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    pub max_tokens: usize,
    /// Ids that end generation (not emitted).
    pub stop_ids: Vec<u32>,
    pub events: UnboundedSender<Event>,
    pub arrived: Instant,
    pub ticket: Ticket,
}

/// Scheduling limits.
#[derive(Clone, Debug)]
pub struct SchedulerConfig {
    /// Sequences decoded together at most.
    pub max_seqs: usize,
    /// Prompt tokens per prefill pass, and per loop iteration over all sequences.
    pub prefill_chunk: usize,
    /// Store a prompt cache checkpoint every this many prompt tokens (0: only at the ends).
    pub checkpoint_every: usize,
    /// Prompt cache budget in bytes (0 disables the cache).
    pub cache_bytes: usize,
    /// Tokens one sequence may hold.
    pub max_context: usize,
}

/// A request holding a sequence.
struct Active {
    job: Job,
    seq: SeqId,
    /// Prompt tokens in the sequence's state.
    fed: usize,
    /// The token the next step feeds, once the prompt head is prefilled.
    next: Option<u32>,
    generated: usize,
}

pub struct Scheduler {
    engine: Engine,
    cfg: SchedulerConfig,
    jobs: Receiver<Job>,
    waiting: VecDeque<Job>,
    running: Vec<Active>,
    cache: PrefixCache<Snapshot>,
    metrics: Arc<Metrics>,
}

/// End of a prefill pass from `start` towards `head`: at most `chunk` tokens, ending on the
/// next checkpoint boundary when one comes first.
pub fn chunk_end(start: usize, head: usize, chunk: usize, every: usize) -> usize {
    let mut end = head.min(start + chunk.max(1));
    if let Some(n) = start.checked_div(every) {
        end = end.min((n + 1) * every);
    }
    end
}

impl Scheduler {
    pub fn new(
        engine: Engine,
        cfg: SchedulerConfig,
        jobs: Receiver<Job>,
        metrics: Arc<Metrics>,
    ) -> Scheduler {
        set(&metrics.max_running, cfg.max_seqs);
        set(&metrics.sequence_bytes, engine.sequence_bytes());
        Scheduler {
            cache: PrefixCache::new(cfg.cache_bytes),
            engine,
            cfg,
            jobs,
            waiting: VecDeque::new(),
            running: Vec::new(),
            metrics,
        }
    }

    /// Serves until every job sender is gone and no work is left.
    pub fn run(mut self) {
        while self.receive() {
            let turn = catch_unwind(AssertUnwindSafe(|| self.iteration()));
            if turn.is_err() {
                self.fail_all("the engine panicked; the request was dropped");
            }
            self.publish();
        }
    }

    fn iteration(&mut self) {
        self.drop_cancelled();
        self.admit();
        self.prefill();
        self.decode();
    }

    /// Moves new jobs to the waiting queue, blocking when idle. False when the server is gone.
    fn receive(&mut self) -> bool {
        if self.running.is_empty() && self.waiting.is_empty() {
            match self.jobs.recv() {
                Ok(job) => self.waiting.push_back(job),
                Err(_) => return false,
            }
        }
        loop {
            match self.jobs.try_recv() {
                Ok(job) => self.waiting.push_back(job),
                Err(TryRecvError::Empty) => return true,
                Err(TryRecvError::Disconnected) => {
                    return !(self.running.is_empty() && self.waiting.is_empty())
                }
            }
        }
    }

    fn publish(&self) {
        set(&self.metrics.running, self.running.len());
        set(&self.metrics.waiting, self.waiting.len());
        set(&self.metrics.cache_bytes, self.cache.bytes());
        set(&self.metrics.cache_entries, self.cache.len());
        if let Some(o) = self.engine.offload_stats() {
            set(&self.metrics.expert_hits, o.hits as usize);
            set(&self.metrics.expert_misses, o.misses as usize);
            set(&self.metrics.expert_admissions, o.admitted as usize);
            let pcie = o.far_bytes + o.admit_bytes + o.staged_host_bytes;
            set(&self.metrics.expert_pcie_bytes, pcie as usize);
        }
    }

    fn drop_cancelled(&mut self) {
        let before = self.waiting.len();
        self.waiting.retain(|j| !j.events.is_closed());
        let mut gone = before - self.waiting.len();
        let (closed, open): (Vec<Active>, Vec<Active>) = std::mem::take(&mut self.running)
            .into_iter()
            .partition(|a| a.job.events.is_closed());
        self.running = open;
        for a in closed {
            self.engine.remove_sequence(a.seq);
            gone += 1;
        }
        add(&self.metrics.cancelled, gone);
    }

    /// Starts waiting jobs while there is room (on CUDA, while state slots are free).
    fn admit(&mut self) {
        while self.running.len() < self.cfg.max_seqs {
            let Some(job) = self.waiting.pop_front() else {
                return;
            };
            match self.open(&job) {
                Ok((seq, cached)) => self.start(job, seq, cached),
                Err(EngineError::Capacity(_)) => {
                    self.waiting.push_front(job);
                    return;
                }
                Err(e) => send(&job, Event::Failed(e.to_string())),
            }
        }
    }

    /// A sequence for `job`, restored from the longest cached prefix when there is one;
    /// returns it and the prompt tokens it already holds.
    fn open(&mut self, job: &Job) -> Result<(SeqId, usize), EngineError> {
        if job.prompt.is_empty() {
            return Err(EngineError::Input("the prompt is empty".into()));
        }
        let (seq, cached) = match self.cache.lookup(&job.prompt) {
            Some(snap) => (self.engine.restore(snap)?, snap.tokens().len()),
            None => (self.engine.add_sequence()?, 0),
        };
        if let Err(e) = self.engine.set_sampling(seq, &job.sampling) {
            self.engine.remove_sequence(seq);
            return Err(e);
        }
        Ok((seq, cached))
    }

    /// Counts the admission and puts the request among the running ones.
    fn start(&mut self, job: Job, seq: SeqId, cached: usize) {
        let m = &self.metrics;
        add(
            if cached > 0 {
                &m.cache_hits
            } else {
                &m.cache_misses
            },
            1,
        );
        add(&m.prompt_tokens, job.prompt.len());
        add(&m.prompt_tokens_cached, cached);
        send(&job, Event::Started { cached });
        let head = job.prompt.len() - 1;
        let next = (cached == head).then(|| job.prompt[head]);
        self.running.push(Active {
            job,
            seq,
            fed: cached,
            next,
            generated: 0,
        });
    }

    /// Prefills prompt chunks, oldest request first, up to one chunk's worth of tokens in all
    /// (at least one pass). Each sequence's pass boundaries depend only on its own prompt, so
    /// results do not depend on what else is running.
    fn prefill(&mut self) {
        let mut budget = self.cfg.prefill_chunk;
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            if self.running[i].next.is_some() {
                i += 1;
                continue;
            }
            match self.prefill_pass(i) {
                Ok(n) => {
                    budget = budget.saturating_sub(n);
                    i += 1;
                }
                Err(e) => self.fail(i, &e.to_string()),
            }
        }
    }

    /// One prefill pass of running request `i`; returns the tokens fed.
    fn prefill_pass(&mut self, i: usize) -> Result<usize, EngineError> {
        let a = &self.running[i];
        let head = a.job.prompt.len() - 1;
        let (start, seq) = (a.fed, a.seq);
        let end = chunk_end(
            start,
            head,
            self.cfg.prefill_chunk,
            self.cfg.checkpoint_every,
        );
        let part = &a.job.prompt[start..end];
        self.engine.prefill(seq, part, None, Logits::Last)?;
        add(&self.metrics.prompt_tokens_prefilled, end - start);
        let a = &mut self.running[i];
        a.fed = end;
        let every = self.cfg.checkpoint_every;
        if end == head {
            a.next = Some(a.job.prompt[head]);
            self.checkpoint(seq);
        } else if end.checked_rem(every) == Some(0) {
            self.checkpoint(seq);
        }
        Ok(end - start)
    }

    /// Stores a snapshot of `seq` in the prompt cache, if it is new and fits.
    fn checkpoint(&mut self, seq: SeqId) {
        let Some(s) = self.engine.sequence(seq) else {
            return;
        };
        if s.tokens.is_empty() || self.cache.contains(&s.tokens) || !self.cache.fits(1) {
            return;
        }
        let Ok(snap) = self.engine.snapshot(seq) else {
            return;
        };
        let done = self.cache.insert(snap);
        add(&self.metrics.cache_stores, done.stored as usize);
        add(&self.metrics.cache_evictions, done.evicted);
    }

    /// One batched step for every sequence whose prompt head is in.
    fn decode(&mut self) {
        let batch: Vec<(SeqId, u32)> = self
            .running
            .iter()
            .filter_map(|a| a.next.map(|t| (a.seq, t)))
            .collect();
        if batch.is_empty() {
            return;
        }
        add(&self.metrics.decode_steps, 1);
        add(&self.metrics.decode_rows, batch.len());
        let picked = match self.engine.step(&batch) {
            Ok(p) => p,
            Err(e) => {
                let msg = e.to_string();
                let ids: Vec<SeqId> = batch.iter().map(|b| b.0).collect();
                self.fail_where(|a| ids.contains(&a.seq), &msg);
                return;
            }
        };
        let mut finished = Vec::new();
        for (&(seq, _), tok) in batch.iter().zip(picked) {
            if let Some(i) = self.running.iter().position(|a| a.seq == seq) {
                if let Some(reason) = self.on_token(i, tok) {
                    finished.push((seq, reason));
                }
            }
        }
        for (seq, reason) in finished {
            if let Some(i) = self.running.iter().position(|a| a.seq == seq) {
                self.finish(i, reason);
            }
        }
    }

    /// Handles the token a step picked for request `i`; returns why it ends, if it does.
    fn on_token(&mut self, i: usize, tok: u32) -> Option<FinishReason> {
        let max_context = self.cfg.max_context;
        let m = &self.metrics;
        let a = &mut self.running[i];
        if a.generated == 0 {
            add(&m.prompt_tokens_prefilled, 1);
            m.observe_ttft(a.job.arrived.elapsed().as_secs_f64());
        }
        if a.job.stop_ids.contains(&tok) {
            return Some(FinishReason::Stop);
        }
        a.generated += 1;
        add(&m.generated_tokens, 1);
        send(&a.job, Event::Token(tok));
        let held = a.job.prompt.len() + a.generated;
        if a.generated >= a.job.max_tokens || held >= max_context {
            return Some(FinishReason::Length);
        }
        a.next = Some(tok);
        None
    }

    /// Ends request `i`: its state becomes a prompt cache checkpoint, its sequence is freed.
    fn finish(&mut self, i: usize, reason: FinishReason) {
        let a = self.running.swap_remove(i);
        self.metrics
            .observe_latency(a.job.arrived.elapsed().as_secs_f64());
        send(&a.job, Event::Finished(reason));
        self.checkpoint(a.seq);
        self.engine.remove_sequence(a.seq);
    }

    fn fail(&mut self, i: usize, msg: &str) {
        let a = self.running.swap_remove(i);
        send(&a.job, Event::Failed(msg.to_string()));
        self.engine.remove_sequence(a.seq);
    }

    fn fail_where(&mut self, pred: impl Fn(&Active) -> bool, msg: &str) {
        while let Some(i) = self.running.iter().position(&pred) {
            self.fail(i, msg);
        }
    }

    fn fail_all(&mut self, msg: &str) {
        self.fail_where(|_| true, msg);
    }
}

/// Sends an event; a closed receiver is noticed by [`Scheduler::drop_cancelled`].
fn send(job: &Job, ev: Event) {
    let _ = job.events.send(ev);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_stop_at_checkpoints_and_the_head() {
        assert_eq!(chunk_end(0, 1000, 256, 0), 256);
        assert_eq!(chunk_end(0, 100, 256, 0), 100);
        assert_eq!(chunk_end(0, 1000, 256, 200), 200);
        assert_eq!(chunk_end(200, 1000, 256, 200), 400);
        assert_eq!(chunk_end(390, 1000, 256, 200), 400);
        assert_eq!(chunk_end(5, 6, 0, 0), 6);
    }

    #[test]
    fn tickets_bound_the_load() {
        let load = Arc::new(AtomicUsize::new(0));
        let a = Ticket::take(&load, 2).unwrap();
        let _b = Ticket::take(&load, 2).unwrap();
        assert!(Ticket::take(&load, 2).is_none());
        drop(a);
        assert!(Ticket::take(&load, 2).is_some());
        assert_eq!(load.load(Ordering::Relaxed), 1);
    }
}
