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
//! - **batch** (FVP §5): at the first write that overlaps an earlier write of the window, or
//!   when it would need more datastore IOs than the datastore's queue depth — little is held
//!   back, destaging starts at once. Adjacent writes go to the datastore as one IO ([`runs`]),
//!   so a sequential stream fills a window with far more than queue-depth writes;
//! - **held** (SLIM's interval): everything staged when the window's hold time has passed, so
//!   overwrites within it are absorbed and never sent.

use std::collections::BTreeMap;
use std::ops::Range;

/// Largest datastore IO the destager assembles from adjacent pieces: large enough that a
/// sequential stream costs few round trips, small enough that one IO never holds a slot long.
pub const RUN_BYTES_MAX: u64 = 1 << 20;

/// What a staged write puts in the volume.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source<L> {
    /// Bytes from a log record: (record, byte offset into its payload).
    Data(L, u64),
    /// Zeroes; `alloc`: the datastore must keep them allocated (WRITE_ZEROES with NO_HOLE),
    /// else it may deallocate them.
    Zero { alloc: bool },
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
    /// At the first overlap, or before the window would need more than `max_ios` datastore
    /// IOs (adjacent writes counting as one, [`RUN_BYTES_MAX`] at a time).
    Batch { max_ios: usize },
    /// Everything staged (the caller decides when the hold time has passed).
    Held,
}

/// How many writes from the head of `staged` (in `ser` order) form the next window.
pub fn window_len<L>(staged: &[Staged<L>], closing: Closing) -> usize {
    match closing {
        Closing::Held => staged.len(),
        Closing::Batch { max_ios } => {
            let max = max_ios.max(1);
            // The window's bytes as maximal runs of adjacent writes: start -> end.
            let mut taken: BTreeMap<u64, u64> = BTreeMap::new();
            let mut ios = 0usize;
            for (i, w) in staged.iter().enumerate() {
                let (start, end) = (w.offset, w.offset + w.len);
                let overlaps = taken
                    .range(..end)
                    .next_back()
                    .is_some_and(|(_, e)| *e > start);
                if overlaps && w.len > 0 {
                    return i.max(1);
                }
                // Merge with the runs it touches (ends at `start`, starts at `end`).
                let mut lo = start;
                let mut hi = end;
                let mut delta = 0isize;
                if let Some((&s, &e)) = taken.range(..=start).next_back() {
                    if e == start {
                        taken.remove(&s);
                        delta -= ios_of(e - s) as isize;
                        lo = s;
                    }
                }
                if let Some(e) = taken.remove(&end) {
                    delta -= ios_of(e - end) as isize;
                    hi = e;
                }
                delta += ios_of(hi - lo) as isize;
                let after = (ios as isize + delta) as usize;
                if after > max && i > 0 {
                    return i;
                }
                taken.insert(lo, hi);
                ios = after;
            }
            staged.len()
        }
    }
}

/// Datastore IOs for `len` adjacent bytes.
fn ios_of(len: u64) -> usize {
    len.div_ceil(RUN_BYTES_MAX).max(1) as usize
}

/// Groups coalesced pieces (in offset order, as [`coalesce`] returns them) into datastore IOs:
/// consecutive adjacent data pieces up to [`RUN_BYTES_MAX`] bytes each; zero pieces alone.
pub fn runs<L>(pieces: &[Piece<L>]) -> Vec<Range<usize>> {
    let mut out: Vec<Range<usize>> = Vec::new();
    let mut bytes = 0u64;
    for (i, p) in pieces.iter().enumerate() {
        let joins = out.last().is_some_and(|r| {
            let last = &pieces[r.end - 1];
            r.end == i
                && last.offset + last.len == p.offset
                && !matches!(last.source, Source::Zero { .. })
                && !matches!(p.source, Source::Zero { .. })
                && bytes + p.len <= RUN_BYTES_MAX
        });
        if joins {
            out.last_mut().expect("a run").end = i + 1;
            bytes += p.len;
        } else {
            out.push(i..i + 1);
            bytes = p.len;
        }
    }
    out
}

/// The datastore writes that bring the volume from the state before `window` to the state
/// after it: the newest version of every byte the window touches, as non-overlapping pieces in
/// offset order, adjacent bytes of one record (or adjacent zeroes of one kind) merged.
/// `window` must be in `ser` order.
pub fn coalesce<L: Copy + PartialEq>(window: &[Staged<L>]) -> Vec<Piece<L>> {
    // start -> (end, source): non-overlapping, newest wins.
    let mut m: BTreeMap<u64, (u64, Source<L>)> = BTreeMap::new();
    let advance = |s: Source<L>, by: u64| match s {
        Source::Data(l, at) => Source::Data(l, at + by),
        z @ Source::Zero { .. } => z,
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
                (Source::Zero { alloc: a }, Source::Zero { alloc: b }) => a == b,
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
        // What each write is: data, zeroes, or zeroes kept allocated.
        proptest::collection::vec((0..SECTORS, 1..12u64, 0..3u8), 1..30).prop_map(|v| {
            v.into_iter()
                .enumerate()
                .map(|(i, (s, l, what))| {
                    let l = l.min(SECTORS - s);
                    Staged {
                        ser: i as u64 + 1,
                        offset: s * 512,
                        len: l * 512,
                        source: match what {
                            0 => Source::Data(i as u32, 0),
                            z => Source::Zero { alloc: z == 2 },
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
                z @ Source::Zero { .. } => z,
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

        /// A batch window never holds two overlapping writes, never needs more datastore IOs
        /// than the queue depth (unless one write alone does), and is never empty when there
        /// is something staged. It closes for a reason: the end, an overlap, or the depth.
        #[test]
        fn batch_windows_close_at_overlap_or_depth(ws in staged(), depth in 1usize..8) {
            let n = window_len(&ws, Closing::Batch { max_ios: depth });
            prop_assert!(n >= 1 && n <= ws.len());
            for i in 0..n {
                for j in 0..i {
                    let (a, b) = (&ws[i], &ws[j]);
                    prop_assert!(a.offset >= b.offset + b.len || b.offset >= a.offset + a.len);
                }
            }
            // Non-overlapping writes: the IOs are the runs of the coalesced pieces (zero and
            // data pieces counted alike, as the window does).
            let ios = |k: usize| {
                let mut iv: Vec<(u64, u64)> = ws[..k].iter().map(|w| (w.offset, w.offset + w.len)).collect();
                iv.sort();
                let mut merged: Vec<(u64, u64)> = Vec::new();
                for (s, e) in iv {
                    match merged.last_mut() {
                        Some(m) if m.1 == s => m.1 = e,
                        _ => merged.push((s, e)),
                    }
                }
                merged.iter().map(|(s, e)| ios_of(e - s)).sum::<usize>()
            };
            prop_assert!(n == 1 || ios(n) <= depth, "{} IOs in a window of depth {}", ios(n), depth);
            if n < ws.len() {
                let next = &ws[n];
                let overlap = ws[..n].iter().any(|w| next.offset < w.offset + w.len && w.offset < next.offset + next.len);
                prop_assert!(overlap || ios(n + 1) > depth, "closed early at {} of {}", n, ws.len());
            }
            prop_assert_eq!(window_len(&ws, Closing::Held), ws.len());
        }

        /// Runs partition the pieces in order; each is adjacent bytes of data pieces within
        /// RUN_BYTES_MAX (or a single piece), and zero pieces stand alone.
        #[test]
        fn runs_group_adjacent_data_pieces(ws in staged()) {
            let pieces = coalesce(&ws);
            let rs = runs(&pieces);
            let mut next = 0;
            for r in &rs {
                prop_assert_eq!(r.start, next);
                prop_assert!(r.end > r.start);
                next = r.end;
                let run = &pieces[r.clone()];
                if run.len() > 1 {
                    let zero = run.iter().any(|p| matches!(p.source, Source::Zero { .. }));
                    prop_assert!(!zero, "a zero piece in a run of several");
                    prop_assert!(run.iter().map(|p| p.len).sum::<u64>() <= RUN_BYTES_MAX);
                }
                for w in run.windows(2) {
                    prop_assert_eq!(w[0].offset + w[0].len, w[1].offset);
                }
            }
            prop_assert_eq!(next, pieces.len());
            // Maximal: a run ends only where the next piece cannot join it.
            for w in rs.windows(2) {
                let (a, b) = (&pieces[w[0].end - 1], &pieces[w[1].start]);
                let bytes: u64 = pieces[w[0].clone()].iter().map(|p| p.len).sum();
                let zero = matches!(a.source, Source::Zero { .. })
                    || matches!(b.source, Source::Zero { .. });
                prop_assert!(a.offset + a.len != b.offset || zero || bytes + b.len > RUN_BYTES_MAX,
                    "a run ended where the next piece could join it");
            }
        }
    }
}
