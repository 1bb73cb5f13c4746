//! The scheduler: continuous batching of generation requests over one [`Engine`], without any
//! transport. Submit [`Request`]s, call [`Scheduler::step`] until [`Scheduler::is_idle`], and
//! read the [`Event`]s each step returns; [`Scheduler::cancel`] drops a request at any time.
//!
//! Each step admits waiting requests while sequences are free (at most `max_seqs`, and on CUDA
//! only while the engine has free state slots: admission by memory), starting each from the
//! longest cached prefix of its prompt; prefills prompt chunks up to a token budget; then runs
//! one [`Engine::speculate`] for every sequence that is decoding (a step of one token each unless
//! the engine decodes speculatively). So new prompts are prefilled
//! between decode steps and running sequences keep moving.

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};

use deltamoe_model::Logits;

use crate::engine::{Engine, Snapshot};
use crate::error::{EngineError, Result};
use crate::prefix_cache::PrefixCache;
use crate::sampler::SamplingParams;
use crate::sequence::SeqId;

/// Identifies a request within a [`Scheduler`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub u64);

/// One generation request.
#[derive(Clone, Debug)]
pub struct Request {
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    /// Tokens to generate at most.
    pub max_tokens: usize,
    /// Ids that end generation (not emitted).
    pub stop_ids: Vec<u32>,
}

/// Why generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence id (or, set by a caller, a stop string).
    Stop,
    /// `max_tokens` or the context was reached.
    Length,
}

impl FinishReason {
    /// OpenAI's name for it.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// What happened to a request in a step. `Finished` and `Failed` are its last event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// The request got a sequence; `cached` prompt tokens came from the prompt cache.
    Started {
        cached: usize,
    },
    /// A generated token.
    Token(u32),
    Finished(FinishReason),
    Failed(String),
}

/// Scheduling limits.
#[derive(Clone, Debug)]
pub struct SchedulerConfig {
    /// Sequences decoded together at most.
    pub max_seqs: usize,
    /// Prompt tokens per prefill pass, and per step over all sequences.
    pub prefill_chunk: usize,
    /// Store a prompt cache checkpoint every this many prompt tokens (0: only at the ends).
    pub checkpoint_every: usize,
    /// Prompt cache budget in bytes (0 disables the cache).
    pub cache_bytes: usize,
    /// Tokens one sequence may hold.
    pub max_context: usize,
}

/// Counters since the scheduler started, and its current load.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SchedulerStats {
    /// Prompt tokens of admitted requests.
    pub prompt_tokens: usize,
    /// Prompt tokens run through the model.
    pub prompt_tokens_prefilled: usize,
    /// Prompt tokens reused from the prompt cache.
    pub prompt_tokens_cached: usize,
    pub generated_tokens: usize,
    /// Admissions that started from a cached prefix, and those that did not.
    pub cache_hits: usize,
    pub cache_misses: usize,
    /// Snapshots stored in, and evicted from, the prompt cache.
    pub cache_stores: usize,
    pub cache_evictions: usize,
    /// Batched decode steps and the rows they fed.
    pub decode_steps: usize,
    pub decode_rows: usize,
    /// Drafts that speculative decoding's verify passes kept (tokens beyond one a row).
    pub accepted_drafts: usize,
    /// Requests holding a sequence, and those waiting for one.
    pub running: usize,
    pub waiting: usize,
    /// Bytes and snapshots in the prompt cache.
    pub cache_bytes: usize,
    pub cache_entries: usize,
}

/// A request waiting for a sequence.
struct Queued {
    id: RequestId,
    req: Request,
}

/// A request holding a sequence.
struct Active {
    id: RequestId,
    req: Request,
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
    waiting: VecDeque<Queued>,
    running: Vec<Active>,
    cache: PrefixCache<Snapshot>,
    stats: SchedulerStats,
    /// Events of the step under way.
    events: Vec<(RequestId, Event)>,
    next_id: u64,
}

/// End of a prefill pass from `start` towards `head`: at most `chunk` tokens, ending on the
/// next checkpoint boundary when one comes first.
pub fn chunk_end(start: usize, head: usize, chunk: usize, every: usize) -> usize {
    let mut end = head.min(start.saturating_add(chunk.max(1)));
    if let Some(n) = start.checked_div(every) {
        end = end.min((n + 1) * every);
    }
    end
}

impl Scheduler {
    pub fn new(engine: Engine, cfg: SchedulerConfig) -> Scheduler {
        Scheduler {
            cache: PrefixCache::new(cfg.cache_bytes),
            engine,
            cfg,
            waiting: VecDeque::new(),
            running: Vec::new(),
            stats: SchedulerStats::default(),
            events: Vec::new(),
            next_id: 0,
        }
    }

    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    /// Queues `req`; its events carry the returned id. A request the engine cannot run (an
    /// empty prompt, bad sampling values) fails with [`Event::Failed`] when admitted.
    pub fn submit(&mut self, req: Request) -> RequestId {
        let id = RequestId(self.next_id);
        self.next_id += 1;
        self.waiting.push_back(Queued { id, req });
        id
    }

    /// Drops request `id`, waiting or running, with no further events. False when it is not
    /// held (unknown, or already ended).
    pub fn cancel(&mut self, id: RequestId) -> bool {
        if let Some(i) = self.waiting.iter().position(|q| q.id == id) {
            self.waiting.remove(i);
            return true;
        }
        let Some(i) = self.running.iter().position(|a| a.id == id) else {
            return false;
        };
        let a = self.running.remove(i);
        self.engine.remove_sequence(a.seq);
        true
    }

    /// True when no request is waiting or running.
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    /// The counters and the current load.
    pub fn stats(&self) -> SchedulerStats {
        SchedulerStats {
            running: self.running.len(),
            waiting: self.waiting.len(),
            cache_bytes: self.cache.bytes(),
            cache_entries: self.cache.len(),
            ..self.stats.clone()
        }
    }

    /// One scheduling iteration: admit, prefill, decode. Returns the events, in order. Should
    /// the engine panic, every running request fails and the scheduler goes on.
    pub fn step(&mut self) -> Vec<(RequestId, Event)> {
        let turn = catch_unwind(AssertUnwindSafe(|| {
            self.admit();
            self.prefill();
            self.decode();
        }));
        if turn.is_err() {
            self.fail_where(|_| true, "the engine panicked; the request was dropped");
        }
        std::mem::take(&mut self.events)
    }

    fn emit(&mut self, id: RequestId, ev: Event) {
        self.events.push((id, ev));
    }

    /// Starts waiting requests while there is room (on CUDA, while state slots are free).
    fn admit(&mut self) {
        while self.running.len() < self.cfg.max_seqs {
            let Some(q) = self.waiting.pop_front() else {
                return;
            };
            match self.open(&q.req) {
                Ok((seq, cached)) => self.start(q, seq, cached),
                Err(EngineError::Capacity(_)) => {
                    self.waiting.push_front(q);
                    return;
                }
                Err(e) => self.emit(q.id, Event::Failed(e.to_string())),
            }
        }
    }

    /// A sequence for `req`, restored from the longest cached prefix when there is one;
    /// returns it and the prompt tokens it already holds.
    fn open(&mut self, req: &Request) -> Result<(SeqId, usize)> {
        if req.prompt.is_empty() {
            return Err(EngineError::Input("the prompt is empty".into()));
        }
        let (seq, cached) = match self.cache.lookup(&req.prompt) {
            Some(snap) => (self.engine.restore(snap)?, snap.tokens().len()),
            None => (self.engine.add_sequence()?, 0),
        };
        if let Err(e) = self.engine.set_sampling(seq, &req.sampling) {
            self.engine.remove_sequence(seq);
            return Err(e);
        }
        Ok((seq, cached))
    }

    /// Counts the admission and puts the request among the running ones.
    fn start(&mut self, q: Queued, seq: SeqId, cached: usize) {
        let s = &mut self.stats;
        if cached > 0 {
            s.cache_hits += 1;
        } else {
            s.cache_misses += 1;
        }
        s.prompt_tokens += q.req.prompt.len();
        s.prompt_tokens_cached += cached;
        self.emit(q.id, Event::Started { cached });
        let head = q.req.prompt.len() - 1;
        let next = (cached == head).then(|| q.req.prompt[head]);
        self.running.push(Active {
            id: q.id,
            req: q.req,
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
    fn prefill_pass(&mut self, i: usize) -> Result<usize> {
        let a = &self.running[i];
        let head = a.req.prompt.len() - 1;
        let (start, seq) = (a.fed, a.seq);
        let every = self.cfg.checkpoint_every;
        let end = chunk_end(start, head, self.cfg.prefill_chunk, every);
        let part = &a.req.prompt[start..end];
        self.engine.prefill(seq, part, None, Logits::Last)?;
        self.stats.prompt_tokens_prefilled += end - start;
        let a = &mut self.running[i];
        a.fed = end;
        if end == head {
            a.next = Some(a.req.prompt[head]);
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
        self.stats.cache_stores += done.stored as usize;
        self.stats.cache_evictions += done.evicted;
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
        self.stats.decode_steps += 1;
        self.stats.decode_rows += batch.len();
        let picked = match self.engine.speculate(&batch) {
            Ok(p) => p,
            Err(e) => {
                let ids: Vec<SeqId> = batch.iter().map(|b| b.0).collect();
                self.fail_where(|a| ids.contains(&a.seq), &e.to_string());
                return;
            }
        };
        let mut finished = Vec::new();
        for (&(seq, _), toks) in batch.iter().zip(picked) {
            self.stats.accepted_drafts += toks.len().saturating_sub(1);
            let Some(i) = self.running.iter().position(|a| a.seq == seq) else {
                continue;
            };
            if let Some(reason) = toks.into_iter().find_map(|tok| self.on_token(i, tok)) {
                finished.push((seq, reason));
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
        let a = &mut self.running[i];
        if a.generated == 0 {
            self.stats.prompt_tokens_prefilled += 1;
        }
        if a.req.stop_ids.contains(&tok) {
            return Some(FinishReason::Stop);
        }
        a.generated += 1;
        self.stats.generated_tokens += 1;
        let held = a.req.prompt.len() + a.generated;
        let full = a.generated >= a.req.max_tokens || held >= self.cfg.max_context;
        if !full {
            a.next = Some(tok);
        }
        let id = a.id;
        self.emit(id, Event::Token(tok));
        full.then_some(FinishReason::Length)
    }

    /// Ends request `i`: its state becomes a prompt cache checkpoint, its sequence is freed.
    fn finish(&mut self, i: usize, reason: FinishReason) {
        let a = self.running.swap_remove(i);
        self.emit(a.id, Event::Finished(reason));
        self.checkpoint(a.seq);
        self.engine.remove_sequence(a.seq);
    }

    fn fail(&mut self, i: usize, msg: &str) {
        let a = self.running.swap_remove(i);
        self.emit(a.id, Event::Failed(msg.to_string()));
        self.engine.remove_sequence(a.seq);
    }

    fn fail_where(&mut self, pred: impl Fn(&Active) -> bool, msg: &str) {
        while let Some(i) = self.running.iter().position(&pred) {
            self.fail(i, msg);
        }
    }
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
        assert_eq!(chunk_end(5, 600, usize::MAX, 0), 600);
    }
}
