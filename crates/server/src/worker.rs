//! The engine thread: feeds HTTP requests to the engine's [`Scheduler`] and sends each request's
//! events back to its handler.
//!
//! Each loop iteration takes new jobs (blocking while there is no work), cancels the requests
//! whose receiver is gone (client disconnected, or a stop string ended it), runs one scheduler
//! step, delivers its events and publishes the metrics.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, TryRecvError};
use std::sync::Arc;
use std::time::Instant;

use deltamoe_engine::sampler::SamplingParams;
use deltamoe_engine::scheduler::{Event, Request, RequestId, Scheduler};
use tokio::sync::mpsc::UnboundedSender;

use crate::metrics::{add, set, Metrics};

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

/// One generation request from a handler.
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

/// Where a submitted request's events go.
struct Client {
    events: UnboundedSender<Event>,
    arrived: Instant,
    /// A token was picked for it (its time to first token is observed).
    picked: bool,
    _ticket: Ticket,
}

pub struct Worker {
    scheduler: Scheduler,
    jobs: Receiver<Job>,
    clients: HashMap<RequestId, Client>,
    metrics: Arc<Metrics>,
}

impl Worker {
    pub fn new(scheduler: Scheduler, jobs: Receiver<Job>, metrics: Arc<Metrics>) -> Worker {
        set(&metrics.max_running, scheduler.config().max_seqs);
        set(&metrics.sequence_bytes, scheduler.engine().sequence_bytes());
        Worker {
            scheduler,
            jobs,
            clients: HashMap::new(),
            metrics,
        }
    }

    /// Serves until every job sender is gone and no work is left.
    pub fn run(mut self) {
        while self.receive() {
            self.drop_cancelled();
            let events = self.scheduler.step();
            // Published before the events go out: a client that has its answer finds the
            // counters already holding it.
            self.publish();
            self.deliver(events);
        }
    }

    /// Submits new jobs, blocking when idle. False when the server is gone.
    fn receive(&mut self) -> bool {
        if self.scheduler.is_idle() {
            match self.jobs.recv() {
                Ok(job) => self.submit(job),
                Err(_) => return false,
            }
        }
        loop {
            match self.jobs.try_recv() {
                Ok(job) => self.submit(job),
                Err(TryRecvError::Empty) => return true,
                Err(TryRecvError::Disconnected) => return !self.scheduler.is_idle(),
            }
        }
    }

    fn submit(&mut self, job: Job) {
        let id = self.scheduler.submit(Request {
            prompt: job.prompt,
            sampling: job.sampling,
            max_tokens: job.max_tokens,
            stop_ids: job.stop_ids,
        });
        let client = Client {
            events: job.events,
            arrived: job.arrived,
            picked: false,
            _ticket: job.ticket,
        };
        self.clients.insert(id, client);
    }

    /// Cancels the requests whose handler stopped listening.
    fn drop_cancelled(&mut self) {
        let gone: Vec<RequestId> = self
            .clients
            .iter()
            .filter(|(_, c)| c.events.is_closed())
            .map(|(&id, _)| id)
            .collect();
        for id in &gone {
            self.scheduler.cancel(*id);
            self.clients.remove(id);
        }
        add(&self.metrics.cancelled, gone.len());
    }

    /// Sends each event to its request's handler; a request's last event lets it go.
    fn deliver(&mut self, events: Vec<(RequestId, Event)>) {
        for (id, ev) in events {
            let Some(c) = self.clients.get_mut(&id) else {
                continue;
            };
            let secs = c.arrived.elapsed().as_secs_f64();
            if matches!(ev, Event::Token(_) | Event::Finished(_)) && !c.picked {
                c.picked = true;
                self.metrics.observe_ttft(secs);
            }
            let last = matches!(ev, Event::Finished(_) | Event::Failed(_));
            if matches!(ev, Event::Finished(_)) {
                self.metrics.observe_latency(secs);
            }
            // A closed receiver is noticed by `drop_cancelled`.
            let _ = c.events.send(ev);
            if last {
                self.clients.remove(&id);
            }
        }
    }

    fn publish(&self) {
        let (m, s) = (&self.metrics, self.scheduler.stats());
        set(&m.prompt_tokens, s.prompt_tokens);
        set(&m.prompt_tokens_prefilled, s.prompt_tokens_prefilled);
        set(&m.prompt_tokens_cached, s.prompt_tokens_cached);
        set(&m.generated_tokens, s.generated_tokens);
        set(&m.cache_hits, s.cache_hits);
        set(&m.cache_misses, s.cache_misses);
        set(&m.cache_stores, s.cache_stores);
        set(&m.cache_evictions, s.cache_evictions);
        set(&m.decode_steps, s.decode_steps);
        set(&m.accepted_drafts, s.accepted_drafts);
        set(&m.decode_rows, s.decode_rows);
        set(&m.running, s.running);
        set(&m.waiting, s.waiting);
        set(&m.cache_bytes, s.cache_bytes);
        set(&m.cache_entries, s.cache_entries);
        if let Some(o) = self.scheduler.engine().offload_stats() {
            set(&m.expert_hits, o.hits as usize);
            set(&m.expert_misses, o.misses as usize);
            set(&m.expert_admissions, o.admitted as usize);
            let pcie = o.far_bytes + o.admit_bytes + o.staged_host_bytes;
            set(&m.expert_pcie_bytes, pcie as usize);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
