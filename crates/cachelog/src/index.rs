//! An extent map: which value covers each byte range of a volume (pure).
//!
//! The cache index maps a volume's byte ranges to where their newest data lives in the log.
//! Writes of any 512-aligned size overlap earlier ones in any way, so a new extent cuts the
//! extents it overlaps and keeps their outer parts; the cut-off parts are returned to the
//! caller, who accounts for the log space they no longer reference.

use std::collections::BTreeMap;
use std::fmt::Debug;

/// A value that can describe a suffix of its extent: for a log location, the same record
/// `by` bytes further into its payload.
pub trait Piece: Clone + PartialEq + Debug {
    fn advance(&self, by: u64) -> Self;
}

/// One covered range: `[start, start + len)` holds `value`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Span<V> {
    pub start: u64,
    pub len: u64,
    /// `None` where nothing is mapped.
    pub value: Option<V>,
}

#[derive(Debug, Clone, Default)]
pub struct ExtentMap<V> {
    /// start → (end, value); extents never overlap.
    map: BTreeMap<u64, (u64, V)>,
    bytes: u64,
}

impl<V: Piece> ExtentMap<V> {
    pub fn new() -> ExtentMap<V> {
        ExtentMap {
            map: BTreeMap::new(),
            bytes: 0,
        }
    }

    /// Number of extents.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Bytes covered.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Extents in order: (start, len, value).
    pub fn iter(&self) -> impl Iterator<Item = (u64, u64, &V)> {
        self.map.iter().map(|(s, (e, v))| (*s, e - s, v))
    }

    /// Removes everything in `[start, start + len)`, returning the removed parts.
    pub fn remove(&mut self, start: u64, len: u64) -> Vec<(u64, u64, V)> {
        let end = start + len;
        let mut out = Vec::new();
        if len == 0 {
            return out;
        }
        let first = self
            .map
            .range(..=start)
            .next_back()
            .filter(|(_, (e, _))| *e > start)
            .map(|(s, _)| *s);
        // `first` covers an extent starting at `start` itself, if there is one.
        let keys: Vec<u64> = first
            .into_iter()
            .chain(self.map.range(start + 1..end).map(|(s, _)| *s))
            .collect();
        for k in keys {
            let Some((e, v)) = self.map.remove(&k) else {
                continue;
            };
            self.bytes -= e - k;
            if k < start {
                self.map.insert(k, (start, v.clone()));
                self.bytes += start - k;
            }
            if e > end {
                self.map.insert(end, (e, v.advance(end - k)));
                self.bytes += e - end;
            }
            let (cs, ce) = (k.max(start), e.min(end));
            out.push((cs, ce - cs, v.advance(cs - k)));
        }
        out
    }

    /// Maps `[start, start + len)` to `value`, returning the parts it displaced.
    pub fn insert(&mut self, start: u64, len: u64, value: V) -> Vec<(u64, u64, V)> {
        let end = start + len;
        // The two common cases take one lookup instead of the general cut's four to six
        // (the index was an eighth of a 4 KiB write's CPU, `perf`): a write over exactly one
        // earlier extent, and a write into a gap. Both are decided by the last extent that
        // starts before `end`, since extents are disjoint and sorted.
        if len > 0 {
            match self.map.range_mut(..end).next_back() {
                Some((&s, (e, v))) if s == start && *e == end => {
                    let old = std::mem::replace(v, value);
                    return vec![(start, len, old)];
                }
                Some((_, (e, _))) if *e > start => {}
                _ => {
                    self.map.insert(start, (end, value));
                    self.bytes += len;
                    return Vec::new();
                }
            }
        }
        let out = self.remove(start, len);
        if len > 0 {
            self.map.insert(start, (start + len, value));
            self.bytes += len;
        }
        out
    }

    /// The spans covering `[start, start + len)` in order, gaps included.
    pub fn lookup(&self, start: u64, len: u64) -> Vec<Span<V>> {
        if len == 0 {
            return Vec::new();
        }
        let end = start + len;
        let mut out = Vec::new();
        let mut at = start;
        let first = self
            .map
            .range(..=start)
            .next_back()
            .filter(|(_, (e, _))| *e > start);
        for (s, (e, v)) in first
            .into_iter()
            .chain(self.map.range(start.saturating_add(1)..end))
        {
            let (cs, ce) = ((*s).max(start), (*e).min(end));
            if cs > at {
                out.push(Span {
                    start: at,
                    len: cs - at,
                    value: None,
                });
            }
            out.push(Span {
                start: cs,
                len: ce - cs,
                value: Some(v.advance(cs - s)),
            });
            at = ce;
        }
        if at < end {
            out.push(Span {
                start: at,
                len: end - at,
                value: None,
            });
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A test value: which write, and how far into it.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    struct W {
        id: u32,
        at: u64,
    }

    impl Piece for W {
        fn advance(&self, by: u64) -> W {
            W {
                id: self.id,
                at: self.at + by,
            }
        }
    }

    const SECTORS: u64 = 64;

    #[derive(Debug, Clone)]
    enum Op {
        Insert(u64, u64),
        Remove(u64, u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        let any_range = (0..SECTORS, 1..16u64, any::<bool>()).prop_map(|(s, l, ins)| {
            let l = l.min(SECTORS - s);
            if ins {
                Op::Insert(s * 512, l * 512)
            } else {
                Op::Remove(s * 512, l * 512)
            }
        });
        // Whole 4 KiB blocks, as most VMs write: exact overwrites and writes into gaps,
        // the cases `insert` takes a short way for.
        let block = (0..SECTORS / 8).prop_map(|b| Op::Insert(b * 4096, 4096));
        prop_oneof![any_range, block]
    }

    /// An empty range has no spans, inside an extent, at its edge or in a gap (it panicked
    /// on an empty key range).
    #[test]
    fn an_empty_range_has_no_spans() {
        let mut m = ExtentMap::new();
        m.insert(4096, 8192, W { id: 1, at: 0 });
        for at in [0, 4096, 8192, 12288, 1 << 20] {
            assert!(m.lookup(at, 0).is_empty(), "at {at}");
        }
    }

    proptest! {
        /// Against a model that records, per sector, which write covers it and at what offset.
        #[test]
        fn behaves_like_a_sector_array(ops in proptest::collection::vec(op(), 1..60)) {
            let mut m = ExtentMap::new();
            let mut model: Vec<Option<W>> = vec![None; SECTORS as usize];
            for (id, op) in ops.iter().enumerate() {
                let (start, len, displaced) = match *op {
                    Op::Insert(s, l) => (s, l, m.insert(s, l, W { id: id as u32, at: 0 })),
                    Op::Remove(s, l) => (s, l, m.remove(s, l)),
                };
                // Displaced parts are exactly what the model held in the range.
                let mut from_model = Vec::new();
                for sec in start / 512..(start + len) / 512 {
                    if let Some(w) = model[sec as usize] {
                        from_model.push((sec * 512, w));
                    }
                    model[sec as usize] = match op {
                        Op::Insert(..) => Some(W { id: id as u32, at: sec * 512 - start }),
                        Op::Remove(..) => None,
                    };
                }
                let mut from_map = Vec::new();
                for (s, l, v) in displaced {
                    for k in 0..l / 512 {
                        from_map.push((s + k * 512, v.advance(k * 512)));
                    }
                }
                from_map.sort_by_key(|x| x.0);
                prop_assert_eq!(from_map, from_model);
            }
            // Lookups of every range agree with the model, and spans tile the range.
            for s in 0..SECTORS {
                for l in 1..=(SECTORS - s).min(8) {
                    let spans = m.lookup(s * 512, l * 512);
                    let mut at = s * 512;
                    for sp in &spans {
                        prop_assert_eq!(sp.start, at);
                        for k in 0..sp.len / 512 {
                            let sec = (sp.start / 512 + k) as usize;
                            prop_assert_eq!(sp.value.map(|v| v.advance(k * 512)), model[sec]);
                        }
                        at += sp.len;
                    }
                    prop_assert_eq!(at, (s + l) * 512);
                }
            }
            let covered = model.iter().filter(|x| x.is_some()).count() as u64 * 512;
            prop_assert_eq!(m.bytes(), covered);
        }
    }
}
