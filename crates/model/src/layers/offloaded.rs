//! The routed experts of one CPU MoE layer read from the checkpoint files ([`ExpertStore`])
//! instead of the memory mapping, behind a cache of `slots` experts held in memory.
//!
//! Per forward pass: the experts the tokens use that are cached run from their slots (hits);
//! the others are read from disk for that pass and dropped after it (misses). The residency
//! policy ([`Residency`], default [`Policy`]) sees the pass's routed ids and picks the experts to
//! admit; an admitted expert read for this pass moves into its slot without a second read.
//! Slots start with experts `0..slots`. The state sits behind a mutex so the model stays
//! shareable across threads; it is locked only around the bookkeeping, never across a read or
//! an expert's product. An admitted slot is empty until its weights are in, so a concurrent pass
//! reads that expert from disk rather than waiting.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use super::Mlp;
use crate::error::Result;
use crate::expert_store::ExpertStore;
use crate::residency::{Policy, Residency, Swap};

/// What offload did since the caches were filled. A use is one expert run over the tokens of one
/// forward pass that route to it (one read when it misses, whatever the token count).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ExpertStats {
    pub hits: u64,
    pub misses: u64,
    /// Experts moved into the cache.
    pub admitted: u64,
    /// Bytes read from disk (misses and admissions) and the time the reads took.
    pub bytes_read: u64,
    pub read_secs: f64,
}

impl ExpertStats {
    pub fn hit_rate(&self) -> f64 {
        self.hits as f64 / (self.hits + self.misses).max(1) as f64
    }

    /// The sum of two layers' counts.
    pub fn add(&self, o: &ExpertStats) -> ExpertStats {
        ExpertStats {
            hits: self.hits + o.hits,
            misses: self.misses + o.misses,
            admitted: self.admitted + o.admitted,
            bytes_read: self.bytes_read + o.bytes_read,
            read_secs: self.read_secs + o.read_secs,
        }
    }
}

#[derive(Debug)]
struct CacheState {
    res: Residency,
    /// Each slot's weights; `None` while an admitted expert is being read.
    slots: Vec<Option<Arc<Mlp>>>,
    stats: ExpertStats,
}

/// One layer's offloaded experts: layer `layer` of `store` behind its cache.
#[derive(Debug)]
pub struct OffloadedExperts {
    store: Arc<ExpertStore>,
    layer: usize,
    state: Mutex<CacheState>,
}

impl OffloadedExperts {
    /// A cache of `slots` experts (at most all of them), filled with experts `0..slots`.
    pub fn new(store: Arc<ExpertStore>, layer: usize, slots: usize) -> Result<OffloadedExperts> {
        let experts = store.layer(layer).len();
        let res = Residency::new(experts, slots, Policy::default());
        let slots = (0..res.slots())
            .map(|e| store.read(layer, e).map(|m| Some(Arc::new(m))))
            .collect::<Result<Vec<_>>>()?;
        Ok(OffloadedExperts {
            store,
            layer,
            state: Mutex::new(CacheState {
                res,
                slots,
                stats: ExpertStats::default(),
            }),
        })
    }

    pub fn slots(&self) -> usize {
        self.lock().res.slots()
    }

    pub fn stats(&self) -> ExpertStats {
        self.lock().stats
    }

    /// Run `f(expert, weights)` for each of `used` (distinct experts, in the order given), with
    /// `routed` every token's routed experts of this pass (for the policy).
    pub fn run(
        &self,
        used: &[usize],
        routed: &[usize],
        mut f: impl FnMut(usize, &Mlp),
    ) -> Result<()> {
        let (cached, admit) = self.begin(used, routed);
        let mut admitted: Vec<(usize, Arc<Mlp>)> = Vec::with_capacity(admit.len());
        for (&e, hit) in used.iter().zip(cached) {
            let w = match hit {
                Some(w) => w,
                None => self.read(e)?,
            };
            f(e, &w);
            if admit.iter().any(|s| s.expert == e) {
                admitted.push((e, w));
            }
        }
        for s in &admit {
            if !admitted.iter().any(|(e, _)| *e == s.expert) {
                admitted.push((s.expert, self.read(s.expert)?));
            }
        }
        let mut st = self.lock();
        for (e, w) in admitted {
            if let Some(slot) = st.res.slot_of(e) {
                st.slots[slot] = Some(w);
            }
        }
        Ok(())
    }

    /// Look up `used` in the cache, let the policy see the pass and plan its admissions (their
    /// slots emptied until [`OffloadedExperts::run`] fills them).
    fn begin(&self, used: &[usize], routed: &[usize]) -> (Vec<Option<Arc<Mlp>>>, Vec<Swap>) {
        let mut st = self.lock();
        let cached: Vec<Option<Arc<Mlp>>> = used
            .iter()
            .map(|&e| st.res.slot_of(e).and_then(|s| st.slots[s].clone()))
            .collect();
        let missed: Vec<usize> = used
            .iter()
            .zip(&cached)
            .filter(|(_, c)| c.is_none())
            .map(|(&e, _)| e)
            .collect();
        st.stats.hits += (used.len() - missed.len()) as u64;
        st.stats.misses += missed.len() as u64;
        st.res.observe(routed);
        let admit = st.res.plan(&missed);
        for s in &admit {
            st.res.apply(*s);
            st.slots[s.slot] = None;
        }
        st.stats.admitted += admit.len() as u64;
        (cached, admit)
    }

    /// Expert `e` from disk, counted in the stats.
    fn read(&self, e: usize) -> Result<Arc<Mlp>> {
        let t0 = Instant::now();
        let w = self.store.read(self.layer, e)?;
        let secs = t0.elapsed().as_secs_f64();
        let mut st = self.lock();
        st.stats.bytes_read += self.store.layer(self.layer)[e].len() as u64;
        st.stats.read_secs += secs;
        Ok(Arc::new(w))
    }

    /// The state; a panic elsewhere while it was locked leaves it consistent (every update is a
    /// few plain assignments), so a poisoned lock is taken as is.
    fn lock(&self) -> MutexGuard<'_, CacheState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}
