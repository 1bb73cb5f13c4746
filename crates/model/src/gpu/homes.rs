//! Which host position holds each offloaded expert's data, and which expert each position holds:
//! the bookkeeping of [`super::host_store`], kept apart from its copies so it is tested without
//! a GPU.
//!
//! An expert outside the device cache always has a home (its data is read from there); a cached
//! one may keep one as a clean copy. When expert A (home p) is admitted to the cache and cached
//! expert B is evicted, A's data at p stays as its clean copy; B, if it has no home, is written
//! back over another cached expert's clean copy (which that expert then loses), else to p
//! itself (A's copy is given up; the copies go through a spare matrix). Every position always
//! holds some expert's data.

/// Where a swap writes the evicted expert's data.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum WriteBack {
    /// It has a clean copy (or nothing was evicted): nothing to write.
    None,
    /// To this position, which the admitted expert does not occupy.
    To(usize),
    /// To the admitted expert's own position, after its data has gone to the cache.
    Exchange,
}

/// The two tables: per expert its home (None: cached without a clean copy), per position the
/// expert whose data it holds.
#[derive(Debug)]
pub(crate) struct Homes {
    home: Vec<Option<usize>>,
    lodger: Vec<usize>,
}

impl Homes {
    /// `experts` experts, experts `0..slots` cached: experts `slots..` at positions `0..E−S`,
    /// clean copies of experts `0..copies` at positions `E−S..`.
    pub(crate) fn new(experts: usize, slots: usize, copies: usize) -> Homes {
        let s = slots.min(experts);
        let (c, out) = (copies.min(s), experts - s);
        let home = (0..experts)
            .map(|e| match e >= s {
                true => Some(e - s),
                false => (e < c).then_some(out + e),
            })
            .collect();
        Homes {
            home,
            lodger: (s..experts).chain(0..c).collect(),
        }
    }

    /// Host positions.
    pub(crate) fn positions(&self) -> usize {
        self.lodger.len()
    }

    pub(crate) fn home_of(&self, e: usize) -> Option<usize> {
        self.home.get(e).copied().flatten()
    }

    /// The expert whose data position `p` holds.
    pub(crate) fn lodger(&self, p: usize) -> Option<usize> {
        self.lodger.get(p).copied()
    }

    /// Expert `admitted` enters the cache and `evicted` leaves it (`cached` tells which experts
    /// are in the cache before the swap): update the tables and say where the evicted expert's
    /// data is written. None when `admitted` has no home (its data is nowhere on the host).
    pub(crate) fn swap(
        &mut self,
        admitted: usize,
        evicted: Option<usize>,
        cached: impl Fn(usize) -> bool,
    ) -> Option<WriteBack> {
        let p = self.home_of(admitted)?;
        let Some(v) = evicted.filter(|&v| self.home_of(v).is_none()) else {
            return Some(WriteBack::None);
        };
        let free = |q: &usize| self.lodger[*q] != admitted && cached(self.lodger[*q]);
        let q = (0..self.lodger.len()).find(free).unwrap_or(p);
        self.home[self.lodger[q]] = None;
        self.lodger[q] = v;
        self.home[v] = Some(q);
        Some(match q == p {
            true => WriteBack::Exchange,
            false => WriteBack::To(q),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::{Homes, WriteBack};

    /// Both tables agree, and every expert outside the cache has a home.
    fn check(h: &Homes, cached: &[bool]) {
        for (e, &c) in cached.iter().enumerate() {
            if let Some(p) = h.home_of(e) {
                assert_eq!(h.lodger(p), Some(e), "expert {e}");
            }
            assert!(
                c || h.home_of(e).is_some(),
                "expert {e} outside has no home"
            );
        }
        for p in 0..h.positions() {
            assert_eq!(h.home_of(h.lodger(p).unwrap()), Some(p), "position {p}");
        }
    }

    #[test]
    fn placement_puts_outside_experts_first_then_copies() {
        let h = Homes::new(6, 3, 2);
        assert_eq!(h.positions(), 5);
        let homes: Vec<_> = (0..6).map(|e| h.home_of(e)).collect();
        assert_eq!(homes, [Some(3), Some(4), None, Some(0), Some(1), Some(2)]);
        check(&h, &[true, true, true, false, false, false]);
        // More copies or slots than there are experts: capped.
        assert_eq!(Homes::new(4, 9, 9).positions(), 4);
    }

    #[test]
    fn evicting_an_expert_with_a_clean_copy_writes_nothing() {
        let mut h = Homes::new(6, 3, 3);
        let mut cached = [true, true, true, false, false, false];
        // Admit 3 (position 0), evict 1 (copy at 4).
        let w = h.swap(3, Some(1), |x| cached[x]);
        assert_eq!(w, Some(WriteBack::None));
        (cached[3], cached[1]) = (true, false);
        check(&h, &cached);
        assert_eq!(h.home_of(3), Some(0), "the admitted expert keeps its copy");
    }

    /// Admit `a`, evict `v`; check the tables after.
    fn swap(h: &mut Homes, cached: &mut [bool], a: usize, v: usize) -> Option<WriteBack> {
        let w = h.swap(a, Some(v), |x| cached[x]);
        (cached[a], cached[v]) = (true, false);
        check(h, cached);
        w
    }

    #[test]
    fn write_back_takes_another_clean_copy_else_exchanges() {
        // 4 experts, 2 cached, no copies: positions 0, 1 hold experts 2, 3.
        let mut h = Homes::new(4, 2, 0);
        let mut cached = [true, true, false, false];
        // Admit 2 (position 0), evict 0: no other clean copy: exchange.
        assert_eq!(swap(&mut h, &mut cached, 2, 0), Some(WriteBack::Exchange));
        assert_eq!((h.home_of(0), h.home_of(2)), (Some(0), None));
        // Admit 3 (position 1), evict 1: 2 has no copy: exchange again.
        assert_eq!(swap(&mut h, &mut cached, 3, 1), Some(WriteBack::Exchange));
        // 4 experts, 2 cached, 1 copy (expert 0 at position 2).
        let mut h = Homes::new(4, 2, 1);
        let mut cached = [true, true, false, false];
        // Admit 2 (position 0), evict 1 (no copy): 2's own position is kept; 0's copy is taken.
        assert_eq!(swap(&mut h, &mut cached, 2, 1), Some(WriteBack::To(2)));
        assert_eq!(h.home_of(0), None, "expert 0 lost its clean copy");
        assert_eq!(h.home_of(2), Some(0));
        // Admit 3 (position 1), evict 0 (no copy now): 2's clean copy at 0 is free to take.
        assert_eq!(swap(&mut h, &mut cached, 3, 0), Some(WriteBack::To(0)));
        assert_eq!(h.home_of(2), None);
    }

    #[test]
    fn a_random_walk_of_swaps_keeps_every_expert_housed() {
        let mut h = Homes::new(8, 3, 1);
        let mut cached = [true, true, true, false, false, false, false, false];
        let mut r = 12345u64;
        for _ in 0..200 {
            r = r
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let outside: Vec<usize> = (0..8).filter(|&e| !cached[e]).collect();
            let inside: Vec<usize> = (0..8).filter(|&e| cached[e]).collect();
            let a = outside[(r >> 33) as usize % outside.len()];
            let v = inside[(r >> 17) as usize % inside.len()];
            assert!(swap(&mut h, &mut cached, a, v).is_some());
        }
    }

    #[test]
    fn an_expert_without_a_home_cannot_be_admitted() {
        let mut h = Homes::new(4, 2, 0);
        assert_eq!(h.swap(0, None, |_| true), None);
    }
}
