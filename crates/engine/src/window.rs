//! Destage windows (pure): which staged writes go to the datastore together, and what exactly
//! to write for them.
//!
//! A window is a prefix of the volume's staging queue: writes with `ser` in
//! `(checkpoint, last]`. All of a window's datastore writes are issued concurrently; only after
//! every one of them and a datastore FLUSH has completed does the checkpoint move to `last`.
//! So between checkpoints the datastore may hold a mixture, but at each checkpoint it is
//! exactly the volume as of `last`: a prefix (DESIGN §2).
//!
//! Because the storage may apply concurrent writes in any order, a window never sends two
//! writes to the same bytes: [`coalesce`] keeps only the newest version of every byte.
//!
//! Two ways to close a window:
//! - **batch** (FVP §5): at the first write that overlaps an earlier write of the window, or at
//!   the datastore's queue depth — little is held back, destaging starts at once;
//! - **held** (SLIM's interval): everything staged when the window's hold time has passed, so
//!   overwrites within it are absorbed and never sent.

use std::collections::BTreeMap;

/// What a staged write puts in the volume.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source<L> {
    /// Bytes from a log record: (record, byte offset into its payload).
    Data(L, u64),
    /// Zeroes.
    Zero,
}

/// A staged (dirty) write, as the destager sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Staged<L> {
    pub ser: u64,
    pub offset: u64,
    pub len: u64,
    pub source: Source<L>,
}

/// One datastore write of a window: `len` bytes at `offset` from `source`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece<L> {
    pub offset: u64,
    pub len: u64,
    pub source: Source<L>,
}

/// How a volume's windows close.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Closing {
    /// At the first overlap or at `max_writes` writes.
    Batch { max_writes: usize },
    /// Everything staged (the caller decides when the hold time has passed).
    Held,
}

/// How many writes from the head of `staged` (in `ser` order) form the next window.
pub fn window_len<L>(staged: &[Staged<L>], closing: Closing) -> usize {
    match closing {
        Closing::Held => staged.len(),
        Closing::Batch { max_writes } => {
            let max = max_writes.max(1);
            let mut taken: Vec<(u64, u64)> = Vec::new();
            for (i, w) in staged.iter().enumerate() {
                if i == max {
                    return i;
                }
                let overlaps = taken
                    .iter()
                    .any(|(s, e)| w.offset < *e && *s < w.offset + w.len);
                if overlaps {
                    return i.max(1);
                }
                taken.push((w.offset, w.offset + w.len));
            }
            staged.len()
        }
    }
}

/// The datastore writes that bring the volume from the state before `window` to the state
/// after it: the newest version of every byte the window touches, as non-overlapping pieces in
/// offset order, adjacent bytes of one record (or adjacent zeroes) merged. `window` must be in
/// `ser` order.
pub fn coalesce<L: Copy + PartialEq>(window: &[Staged<L>]) -> Vec<Piece<L>> {
    // start -> (end, source): non-overlapping, newest wins.
    let mut m: BTreeMap<u64, (u64, Source<L>)> = BTreeMap::new();
    let advance = |s: Source<L>, by: u64| match s {
        Source::Data(l, at) => Source::Data(l, at + by),
        Source::Zero => Source::Zero,
    };
    for w in window {
        let (start, end) = (w.offset, w.offset + w.len);
        let overlapping: Vec<u64> = m
            .range(..end)
            .filter(|(_, (e, _))| *e > start)
            .map(|(s, _)| *s)
            .collect();
        for s in overlapping {
            let (e, src) = m.remove(&s).expect("present");
            if s < start {
                m.insert(s, (start, src));
            }
            if e > end {
                m.insert(end, (e, advance(src, end - s)));
            }
        }
        if w.len > 0 {
            m.insert(start, (end, w.source));
        }
    }
    let mut out: Vec<Piece<L>> = Vec::with_capacity(m.len());
    for (s, (e, src)) in m {
        if let Some(last) = out.last_mut() {
            let adjacent = last.offset + last.len == s;
            let continues = match (last.source, src) {
                (Source::Zero, Source::Zero) => true,
                (Source::Data(l1, a), Source::Data(l2, b)) => l1 == l2 && a + last.len == b,
                _ => false,
            };
            if adjacent && continues {
                last.len += e - s;
                continue;
            }
        }
        out.push(Piece {
            offset: s,
            len: e - s,
            source: src,
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const SECTORS: u64 = 48;

    fn staged() -> impl Strategy<Value = Vec<Staged<u32>>> {
        proptest::collection::vec((0..SECTORS, 1..12u64, any::<bool>()), 1..30).prop_map(|v| {
            v.into_iter()
                .enumerate()
                .map(|(i, (s, l, zero))| {
                    let l = l.min(SECTORS - s);
                    Staged {
                        ser: i as u64 + 1,
                        offset: s * 512,
                        len: l * 512,
                        source: if zero {
                            Source::Zero
                        } else {
                            Source::Data(i as u32, 0)
                        },
                    }
                })
                .collect()
        })
    }

    /// Applies writes in ser order to a sector model: each sector names (record, byte offset)
    /// or zero or untouched.
    fn apply(model: &mut [Option<Source<u32>>], w: &Staged<u32>) {
        for k in 0..w.len / 512 {
            let sec = (w.offset / 512 + k) as usize;
            model[sec] = Some(match w.source {
                Source::Data(l, at) => Source::Data(l, at + k * 512),
                Source::Zero => Source::Zero,
            });
        }
    }

    proptest! {
        /// Applying a window's pieces in any order gives the same result as applying its
        /// writes one by one in ser order; pieces never overlap.
        #[test]
        fn coalesced_pieces_equal_ser_order_application(ws in staged(), reverse in any::<bool>()) {
            let mut expect = vec![None; SECTORS as usize];
            for w in &ws {
                apply(&mut expect, w);
            }
            let mut pieces = coalesce(&ws);
            for p in pieces.windows(2) {
                prop_assert!(p[0].offset + p[0].len <= p[1].offset, "pieces overlap or are unordered");
            }
            if reverse {
                pieces.reverse();
            }
            let mut got = vec![None; SECTORS as usize];
            for p in &pieces {
                apply(&mut got, &Staged { ser: 0, offset: p.offset, len: p.len, source: p.source });
            }
            prop_assert_eq!(got, expect);
        }

        /// A batch window never holds two overlapping writes and never exceeds the queue depth,
        /// and is never empty when there is something staged.
        #[test]
        fn batch_windows_close_at_overlap_or_depth(ws in staged(), depth in 1usize..8) {
            let n = window_len(&ws, Closing::Batch { max_writes: depth });
            prop_assert!(n >= 1 && n <= depth.min(ws.len()));
            for i in 0..n {
                for j in 0..i {
                    let (a, b) = (&ws[i], &ws[j]);
                    prop_assert!(a.offset >= b.offset + b.len || b.offset >= a.offset + a.len);
                }
            }
            // It closed for a reason: the end, the depth, or an overlap with the next write.
            if n < ws.len() && n < depth {
                let next = &ws[n];
                prop_assert!(ws[..n].iter().any(|w| next.offset < w.offset + w.len && w.offset < next.offset + next.len));
            }
            prop_assert_eq!(window_len(&ws, Closing::Held), ws.len());
        }
    }
}
