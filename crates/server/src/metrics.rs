//! Counters, gauges and latency summaries, rendered in the Prometheus text format at /metrics.
//! The engine thread publishes the scheduler's token, cache and sequence figures; the HTTP
//! handlers count requests by endpoint and status.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// Latency samples kept for the quantiles (the most recent ones).
const WINDOW: usize = 4096;

/// A Prometheus summary: quantiles over the last [`WINDOW`] samples, sum and count over all.
#[derive(Default)]
struct Summary {
    recent: Vec<f64>,
    next: usize,
    sum: f64,
    count: u64,
}

impl Summary {
    fn observe(&mut self, v: f64) {
        if self.recent.len() < WINDOW {
            self.recent.push(v);
        } else {
            self.recent[self.next] = v;
        }
        self.next = (self.next + 1) % WINDOW;
        self.sum += v;
        self.count += 1;
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} summary");
        let mut sorted = self.recent.clone();
        sorted.sort_by(f64::total_cmp);
        for q in [0.5, 0.9, 0.99] {
            let v = quantile(&sorted, q);
            let _ = writeln!(out, "{name}{{quantile=\"{q}\"}} {v}");
        }
        let _ = writeln!(out, "{name}_sum {}\n{name}_count {}", self.sum, self.count);
    }
}

/// The `q` quantile of sorted values (nearest rank); NaN when empty.
pub fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Every figure the server exports.
#[derive(Default)]
pub struct Metrics {
    requests: Mutex<BTreeMap<(&'static str, u16), u64>>,
    pub prompt_tokens: AtomicU64,
    pub prompt_tokens_prefilled: AtomicU64,
    pub prompt_tokens_cached: AtomicU64,
    pub generated_tokens: AtomicU64,
    pub cache_hits: AtomicU64,
    pub cache_misses: AtomicU64,
    pub cache_stores: AtomicU64,
    pub cache_evictions: AtomicU64,
    pub cache_bytes: AtomicU64,
    pub cache_entries: AtomicU64,
    pub cancelled: AtomicU64,
    pub decode_steps: AtomicU64,
    pub decode_rows: AtomicU64,
    pub accepted_drafts: AtomicU64,
    pub running: AtomicU64,
    pub waiting: AtomicU64,
    pub max_running: AtomicU64,
    pub sequence_bytes: AtomicU64,
    pub expert_hits: AtomicU64,
    pub expert_misses: AtomicU64,
    pub expert_admissions: AtomicU64,
    pub expert_pcie_bytes: AtomicU64,
    ttft: Mutex<Summary>,
    latency: Mutex<Summary>,
}

/// Adds `n` to a counter.
pub fn add(counter: &AtomicU64, n: usize) {
    counter.fetch_add(n as u64, Ordering::Relaxed);
}

/// Sets a gauge.
pub fn set(gauge: &AtomicU64, n: usize) {
    gauge.store(n as u64, Ordering::Relaxed);
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Metrics {
    /// Counts one answered request.
    pub fn request(&self, endpoint: &'static str, status: u16) {
        *lock(&self.requests).entry((endpoint, status)).or_default() += 1;
    }

    pub fn observe_ttft(&self, secs: f64) {
        lock(&self.ttft).observe(secs);
    }

    pub fn observe_latency(&self, secs: f64) {
        lock(&self.latency).observe(secs);
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "# HELP deltamoe_requests_total Requests answered, by endpoint and HTTP status.\n\
             # TYPE deltamoe_requests_total counter"
        );
        for ((endpoint, status), n) in lock(&self.requests).iter() {
            let _ = writeln!(
                out,
                "deltamoe_requests_total{{endpoint=\"{endpoint}\",status=\"{status}\"}} {n}"
            );
        }
        let figures: [(&str, &str, &str, &AtomicU64); 23] = [
            (
                "deltamoe_prompt_tokens_total",
                "counter",
                "Prompt tokens of admitted requests.",
                &self.prompt_tokens,
            ),
            (
                "deltamoe_prompt_tokens_prefilled_total",
                "counter",
                "Prompt tokens actually run through the model.",
                &self.prompt_tokens_prefilled,
            ),
            (
                "deltamoe_prompt_tokens_cached_total",
                "counter",
                "Prompt tokens reused from the prompt cache instead of prefilled.",
                &self.prompt_tokens_cached,
            ),
            (
                "deltamoe_generation_tokens_total",
                "counter",
                "Tokens generated.",
                &self.generated_tokens,
            ),
            (
                "deltamoe_prompt_cache_hits_total",
                "counter",
                "Requests that started from a cached prefix.",
                &self.cache_hits,
            ),
            (
                "deltamoe_prompt_cache_misses_total",
                "counter",
                "Requests with no cached prefix.",
                &self.cache_misses,
            ),
            (
                "deltamoe_prompt_cache_stores_total",
                "counter",
                "Snapshots stored in the prompt cache.",
                &self.cache_stores,
            ),
            (
                "deltamoe_prompt_cache_evictions_total",
                "counter",
                "Snapshots evicted to stay within the budget.",
                &self.cache_evictions,
            ),
            (
                "deltamoe_prompt_cache_bytes",
                "gauge",
                "Bytes held by prompt cache snapshots.",
                &self.cache_bytes,
            ),
            (
                "deltamoe_prompt_cache_entries",
                "gauge",
                "Snapshots in the prompt cache.",
                &self.cache_entries,
            ),
            (
                "deltamoe_requests_cancelled_total",
                "counter",
                "Requests dropped because the client went away or a stop string ended them.",
                &self.cancelled,
            ),
            (
                "deltamoe_decode_steps_total",
                "counter",
                "Batched decode steps run.",
                &self.decode_steps,
            ),
            (
                "deltamoe_decode_rows_total",
                "counter",
                "Sequences fed by decode steps (rows / steps = mean batch size).",
                &self.decode_rows,
            ),
            (
                "deltamoe_speculative_drafts_accepted_total",
                "counter",
                "Drafts of speculative decoding that verify passes kept (tokens beyond one a row).",
                &self.accepted_drafts,
            ),
            (
                "deltamoe_sequences_running",
                "gauge",
                "Sequences being prefilled or decoded.",
                &self.running,
            ),
            (
                "deltamoe_requests_waiting",
                "gauge",
                "Admitted requests waiting for a sequence slot.",
                &self.waiting,
            ),
            (
                "deltamoe_sequences_max",
                "gauge",
                "Sequences that may run at once.",
                &self.max_running,
            ),
            (
                "deltamoe_sequence_state_bytes",
                "gauge",
                "State bytes of one sequence at full context (KV plus conv and recurrent).",
                &self.sequence_bytes,
            ),
            (
                "deltamoe_expert_cache_hits_total",
                "counter",
                "Routed-expert uses in decode steps served from the GPU expert cache (offload).",
                &self.expert_hits,
            ),
            (
                "deltamoe_expert_cache_misses_total",
                "counter",
                "Routed-expert uses in decode steps read from host memory over PCIe (offload).",
                &self.expert_misses,
            ),
            (
                "deltamoe_expert_cache_admissions_total",
                "counter",
                "Experts copied into the GPU expert cache (offload).",
                &self.expert_admissions,
            ),
            (
                "deltamoe_expert_pcie_bytes_total",
                "counter",
                "Expert bytes moved over PCIe: kernel reads, admissions and prefill staging.",
                &self.expert_pcie_bytes,
            ),
            ("deltamoe_info", "gauge", "Always 1.", &ONE),
        ];
        for (name, kind, help, v) in figures {
            let v = v.load(Ordering::Relaxed);
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}"
            );
        }
        lock(&self.ttft).render(
            &mut out,
            "deltamoe_time_to_first_token_seconds",
            "From arrival to the first generated token.",
        );
        lock(&self.latency).render(
            &mut out,
            "deltamoe_request_duration_seconds",
            "From arrival to the last generated token.",
        );
        out
    }
}

static ONE: AtomicU64 = AtomicU64::new(1);

/// Reads one unlabelled sample from a Prometheus text exposition (for tests and tools).
pub fn sample(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_and_summaries() {
        let m = Metrics::default();
        m.request("chat", 200);
        m.request("chat", 200);
        m.request("chat", 429);
        add(&m.prompt_tokens, 12);
        for i in 1..=100 {
            m.observe_ttft(i as f64 / 100.0);
        }
        let text = m.render();
        assert!(text.contains("deltamoe_requests_total{endpoint=\"chat\",status=\"200\"} 2"));
        assert!(text.contains("deltamoe_requests_total{endpoint=\"chat\",status=\"429\"} 1"));
        assert_eq!(sample(&text, "deltamoe_prompt_tokens_total"), Some(12.0));
        assert_eq!(
            sample(&text, "deltamoe_time_to_first_token_seconds_count"),
            Some(100.0)
        );
        assert!(text.contains("deltamoe_time_to_first_token_seconds{quantile=\"0.5\"} 0.5\n"));
        assert!(text.contains("deltamoe_time_to_first_token_seconds{quantile=\"0.99\"} 0.99\n"));
    }

    #[test]
    fn quantile_nearest_rank() {
        let v = [1.0, 2.0, 3.0, 4.0];
        assert_eq!(quantile(&v, 0.5), 2.0);
        assert_eq!(quantile(&v, 0.99), 4.0);
        assert_eq!(quantile(&v, 0.0), 1.0);
        assert!(quantile(&[], 0.5).is_nan());
    }
}
