//! Prompt reuse: snapshots of sequence state (KV prefix, conv and recurrent states) keyed by the
//! tokens they have seen. A new prompt starts from the longest stored prefix that still leaves
//! at least one token to feed (the recurrent state cannot be rolled back, so only exact
//! prefixes count). The store keeps to a byte budget by evicting the least recently used.

use crate::engine::Snapshot;

/// What the cache needs from a stored state.
pub trait Cached {
    fn tokens(&self) -> &[u32];
    fn bytes(&self) -> usize;
}

impl Cached for Snapshot {
    fn tokens(&self) -> &[u32] {
        Snapshot::tokens(self)
    }
    fn bytes(&self) -> usize {
        Snapshot::bytes(self)
    }
}

struct Entry<S> {
    snap: S,
    last_used: u64,
}

/// Snapshots under a byte budget with least-recently-used eviction.
pub struct PrefixCache<S> {
    entries: Vec<Entry<S>>,
    budget: usize,
    bytes: usize,
    clock: u64,
}

/// What an insertion did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Inserted {
    pub stored: bool,
    pub evicted: usize,
}

impl<S: Cached> PrefixCache<S> {
    /// An empty cache holding at most `budget` bytes (0 disables it).
    pub fn new(budget: usize) -> Self {
        PrefixCache {
            entries: Vec::new(),
            budget,
            bytes: 0,
            clock: 0,
        }
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// True when a snapshot of `bytes` could be stored at all.
    pub fn fits(&self, bytes: usize) -> bool {
        bytes <= self.budget
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// The stored state with the longest token list that is a proper prefix of `prompt`
    /// (marked as used), or `None`.
    pub fn lookup(&mut self, prompt: &[u32]) -> Option<&S> {
        let best = self
            .entries
            .iter()
            .enumerate()
            .filter(|(_, e)| {
                let t = e.snap.tokens();
                !t.is_empty() && t.len() < prompt.len() && prompt.starts_with(t)
            })
            .max_by_key(|(_, e)| e.snap.tokens().len())
            .map(|(i, _)| i)?;
        let now = self.tick();
        let entry = &mut self.entries[best];
        entry.last_used = now;
        Some(&entry.snap)
    }

    /// True when a state for exactly `tokens` is stored.
    pub fn contains(&self, tokens: &[u32]) -> bool {
        self.entries.iter().any(|e| e.snap.tokens() == tokens)
    }

    /// Stores `snap`, evicting least recently used entries to stay within the budget. A
    /// snapshot larger than the whole budget, or of tokens already stored, is not kept.
    pub fn insert(&mut self, snap: S) -> Inserted {
        let size = snap.bytes();
        let now = self.tick();
        if let Some(e) = self
            .entries
            .iter_mut()
            .find(|e| e.snap.tokens() == snap.tokens())
        {
            e.last_used = now;
            return Inserted::default();
        }
        if snap.tokens().is_empty() || !self.fits(size) {
            return Inserted::default();
        }
        let mut evicted = 0;
        while self.bytes + size > self.budget {
            let Some(oldest) = self
                .entries
                .iter()
                .enumerate()
                .min_by_key(|(_, e)| e.last_used)
                .map(|(i, _)| i)
            else {
                break;
            };
            let gone = self.entries.swap_remove(oldest);
            self.bytes -= gone.snap.bytes();
            evicted += 1;
        }
        self.bytes += size;
        self.entries.push(Entry {
            snap,
            last_used: now,
        });
        Inserted {
            stored: true,
            evicted,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Fake(Vec<u32>, usize);

    impl Cached for Fake {
        fn tokens(&self) -> &[u32] {
            &self.0
        }
        fn bytes(&self) -> usize {
            self.1
        }
    }

    fn found(c: &mut PrefixCache<Fake>, prompt: &[u32]) -> Option<Vec<u32>> {
        c.lookup(prompt).map(|s| s.0.clone())
    }

    #[test]
    fn longest_proper_prefix_wins() {
        let mut c = PrefixCache::new(1000);
        c.insert(Fake(vec![1, 2], 10));
        c.insert(Fake(vec![1, 2, 3, 4], 10));
        c.insert(Fake(vec![1, 9], 10));
        assert_eq!(found(&mut c, &[1, 2, 3, 4, 5]), Some(vec![1, 2, 3, 4]));
        // An exact match leaves nothing to feed: the shorter prefix is used.
        assert_eq!(found(&mut c, &[1, 2, 3, 4]), Some(vec![1, 2]));
        assert_eq!(found(&mut c, &[1, 2, 3]), Some(vec![1, 2]));
        assert_eq!(found(&mut c, &[2, 1, 2]), None);
        assert_eq!(found(&mut c, &[1]), None);
    }

    #[test]
    fn evicts_least_recently_used_within_budget() {
        let mut c = PrefixCache::new(30);
        c.insert(Fake(vec![1], 10));
        c.insert(Fake(vec![2], 10));
        c.insert(Fake(vec![3], 10));
        // Touch [1] so [2] is the oldest.
        assert!(found(&mut c, &[1, 5]).is_some());
        let r = c.insert(Fake(vec![4], 10));
        assert_eq!(
            r,
            Inserted {
                stored: true,
                evicted: 1
            }
        );
        assert!(c.contains(&[1]) && !c.contains(&[2]) && c.contains(&[4]));
        assert_eq!((c.len(), c.bytes()), (3, 30));
        // Too large for the whole budget: not stored, nothing evicted.
        assert_eq!(c.insert(Fake(vec![5], 31)), Inserted::default());
        // A duplicate only refreshes the existing entry.
        assert_eq!(c.insert(Fake(vec![3], 10)), Inserted::default());
        assert_eq!(c.len(), 3);
    }

    #[test]
    fn zero_budget_stores_nothing() {
        let mut c = PrefixCache::new(0);
        assert!(!c.insert(Fake(vec![1], 1)).stored);
        assert!(c.is_empty());
    }
}
