//! The engine's scheduler driven directly, without HTTP: several requests submitted at once,
//! stepped until done (fewer sequences than requests, chunked prefill between decode steps,
//! prompt reuse from cached prefixes), each giving the single-sequence greedy tokens; and
//! cancellation and failures.

#[allow(dead_code)]
mod common;

use std::collections::BTreeMap;

use common::{fixtures, greedy, prompts};
use deltamoe_engine::sampler::SamplingParams;
use deltamoe_engine::scheduler::{Event, FinishReason, Request, RequestId, Scheduler};
use deltamoe_engine::{Engine, SchedulerConfig};
use deltamoe_model::Qwen3Hybrid;

fn config(engine: &Engine, max_seqs: usize, prefill_chunk: usize) -> SchedulerConfig {
    SchedulerConfig {
        max_seqs,
        prefill_chunk,
        checkpoint_every: 32,
        cache_bytes: 1 << 30,
        max_context: engine.max_context(),
    }
}

fn request(prompt: &[u32], max_tokens: usize) -> Request {
    Request {
        prompt: prompt.to_vec(),
        sampling: SamplingParams::default(),
        max_tokens,
        stop_ids: Vec::new(),
    }
}

/// Steps until idle; returns every request's events in order.
fn run(s: &mut Scheduler) -> BTreeMap<RequestId, Vec<Event>> {
    let mut events: BTreeMap<RequestId, Vec<Event>> = BTreeMap::new();
    while !s.is_idle() {
        for (id, ev) in s.step() {
            events.entry(id).or_default().push(ev);
        }
    }
    events
}

fn tokens(events: &[Event]) -> Vec<u32> {
    events
        .iter()
        .filter_map(|e| match e {
            Event::Token(t) => Some(*t),
            _ => None,
        })
        .collect()
}

#[test]
fn batched_requests_equal_single_sequence_greedy() {
    for dir in fixtures() {
        let mut engine = Engine::new(Qwen3Hybrid::load(&dir).unwrap());
        let ps = prompts(&dir);
        let single: Vec<Vec<u32>> = ps.iter().map(|p| greedy(&mut engine, p)).collect();
        let cfg = config(&engine, 2, 24);
        let mut s = Scheduler::new(engine, cfg);
        // Each prompt twice: the copies wait for a sequence and then start from the cached
        // prompt head of the first run.
        let rows: Vec<usize> = vec![0, 1, 0, 1];
        let ids: Vec<RequestId> = rows
            .iter()
            .map(|&i| s.submit(request(&ps[i].tokens, ps[i].greedy.len())))
            .collect();
        let events = run(&mut s);
        for (&i, id) in rows.iter().zip(&ids) {
            let ev = &events[id];
            let name = format!("{} prompt{i} {id:?}", dir.display());
            assert_eq!(tokens(ev), single[i], "{name}");
            assert!(matches!(ev[0], Event::Started { .. }), "{name}");
            let last = ev.last().unwrap();
            assert_eq!(last, &Event::Finished(FinishReason::Length), "{name}");
        }
        let st = s.stats();
        assert!(st.cache_hits >= 2, "{st:?}");
        assert!(st.decode_rows > st.decode_steps, "no step batched: {st:?}");
        assert_eq!((st.running, st.waiting), (0, 0));
    }
}

#[test]
fn cancelled_and_failed_requests_end_quietly() {
    let dir = &fixtures()[0];
    let engine = Engine::new(Qwen3Hybrid::load(dir).unwrap());
    let p = &prompts(dir)[0];
    let cfg = config(&engine, 1, 256);
    let mut s = Scheduler::new(engine, cfg);
    let empty = s.submit(request(&[], 4));
    let bad = s.submit(Request {
        sampling: SamplingParams {
            top_p: 0.0,
            ..SamplingParams::default()
        },
        ..request(&p.tokens, 4)
    });
    let kept = s.submit(request(&p.tokens, 3));
    let waiting = s.submit(request(&p.tokens, 3));
    let first = s.step();
    let failed = |id| {
        first
            .iter()
            .any(|(i, e)| *i == id && matches!(e, Event::Failed(_)))
    };
    assert!(failed(empty) && failed(bad), "{first:?}");
    assert!(s.cancel(waiting));
    assert!(!s.cancel(waiting));
    let mut kept_events: Vec<Event> = first
        .iter()
        .filter(|(id, _)| *id == kept)
        .map(|(_, e)| e.clone())
        .collect();
    let rest = run(&mut s);
    assert!(rest.keys().all(|id| *id == kept), "{rest:?}");
    kept_events.extend(rest.get(&kept).cloned().unwrap_or_default());
    assert_eq!(tokens(&kept_events).len(), 3);
    let end = Event::Finished(FinishReason::Length);
    assert_eq!(kept_events.last(), Some(&end));
}
