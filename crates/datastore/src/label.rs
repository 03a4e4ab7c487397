//! The on-disk label and volume table of a `lun` datastore (pure: bytes in, bytes out).
//!
//! ```text
//! 0 MiB   label (4 KiB): magic, version, LUN UUID, geometry, pod UUID, crc32c
//! 1 MiB   table slot 0 (up to 1 MiB)
//! 2 MiB   table slot 1 (up to 1 MiB)
//! 3 MiB   backup label (4 KiB): read when the label's checksum fails
//! 4 MiB   volume extents, each 1 MiB aligned, raw bytes laid out 1:1
//! ```
//!
//! The table is double-buffered: generation g lives in slot g % 2, so writing generation g+1
//! never touches the only valid copy of g. A torn table write leaves a slot whose crc fails,
//! and the reader falls back to the other slot. All integers are little-endian. Details in
//! `docs/FORMAT.md`.

use uuid::Uuid;

pub const LABEL_MAGIC: &[u8; 8] = b"VESTALUN";
pub const TABLE_MAGIC: &[u8; 8] = b"VLUNTABL";
pub const VERSION: u32 = 1;
pub const LABEL_LEN: usize = 4096;
/// Where the backup label lives: written before the label whenever the label changes, so a
/// torn label write leaves one of the two whole.
pub const LABEL_BACKUP_OFFSET: u64 = 3 << 20;
pub const TABLE_SLOT_OFFSETS: [u64; 2] = [1 << 20, 2 << 20];
pub const TABLE_SLOT_LEN: usize = 1 << 20;
pub const DATA_START: u64 = 4 << 20;
/// Extents start and end on this boundary, so volumes stay aligned for any device.
pub const EXTENT_ALIGN: u64 = 1 << 20;
pub const ENTRY_LEN: usize = 128;
pub const TABLE_HEADER_LEN: usize = 32;
pub const NAME_MAX: usize = 64;
/// Most volumes one LUN can hold: what fits in a table slot.
pub const ENTRIES_MAX: usize = (TABLE_SLOT_LEN - TABLE_HEADER_LEN) / ENTRY_LEN;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Label {
    pub lun_id: Uuid,
    /// Device size when formatted; a device that has since shrunk is refused.
    pub device_size: u64,
    /// The pod that uses the LUN (`Coordinator::pod_id`); none on a LUN formatted before
    /// labels carried it. Stored as 16 zero bytes when none.
    pub pod: Option<Uuid>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub volume_id: Uuid,
    pub name: String,
    pub offset: u64,
    pub len: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Table {
    pub generation: u64,
    pub entries: Vec<Entry>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LabelError {
    #[error("no Vesta label (magic missing)")]
    NoMagic,
    #[error("Vesta label checksum mismatch")]
    BadChecksum,
    #[error("Vesta label version {0} is not supported (this build reads version {VERSION})")]
    Version(u32),
}

fn le32(b: &[u8]) -> u32 {
    u32::from_le_bytes(b[..4].try_into().expect("4 bytes"))
}

fn le64(b: &[u8]) -> u64 {
    u64::from_le_bytes(b[..8].try_into().expect("8 bytes"))
}

impl Label {
    pub fn encode(&self) -> Vec<u8> {
        let mut b = vec![0u8; LABEL_LEN];
        b[0..8].copy_from_slice(LABEL_MAGIC);
        b[8..12].copy_from_slice(&VERSION.to_le_bytes());
        b[12..16].copy_from_slice(&(LABEL_LEN as u32).to_le_bytes());
        b[16..32].copy_from_slice(self.lun_id.as_bytes());
        b[32..40].copy_from_slice(&self.device_size.to_le_bytes());
        b[40..48].copy_from_slice(&TABLE_SLOT_OFFSETS[0].to_le_bytes());
        b[48..56].copy_from_slice(&TABLE_SLOT_OFFSETS[1].to_le_bytes());
        b[56..60].copy_from_slice(&(TABLE_SLOT_LEN as u32).to_le_bytes());
        b[64..72].copy_from_slice(&DATA_START.to_le_bytes());
        b[72..88].copy_from_slice(self.pod.unwrap_or_default().as_bytes());
        let crc = crc32c::crc32c(&b[..LABEL_LEN - 4]);
        b[LABEL_LEN - 4..].copy_from_slice(&crc.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8]) -> Result<Label, LabelError> {
        if b.len() < LABEL_LEN || &b[0..8] != LABEL_MAGIC {
            return Err(LabelError::NoMagic);
        }
        // The version first: a newer label may checksum other bytes, and must read as newer,
        // never as damaged (which `--force` may format).
        let v = le32(&b[8..12]);
        if v != VERSION {
            return Err(LabelError::Version(v));
        }
        if crc32c::crc32c(&b[..LABEL_LEN - 4]) != le32(&b[LABEL_LEN - 4..]) {
            return Err(LabelError::BadChecksum);
        }
        Ok(Label {
            lun_id: Uuid::from_bytes(b[16..32].try_into().expect("16 bytes")),
            device_size: le64(&b[32..40]),
            pod: Some(Uuid::from_bytes(b[72..88].try_into().expect("16 bytes")))
                .filter(|p| !p.is_nil()),
        })
    }
}

impl Table {
    /// Encodes the table; panics if it holds more than [`ENTRIES_MAX`] entries or a name longer
    /// than [`NAME_MAX`] (callers check both before they get here).
    pub fn encode(&self) -> Vec<u8> {
        assert!(self.entries.len() <= ENTRIES_MAX, "volume table overflow");
        let len = TABLE_HEADER_LEN + self.entries.len() * ENTRY_LEN;
        let mut b = vec![0u8; len];
        b[0..8].copy_from_slice(TABLE_MAGIC);
        b[8..16].copy_from_slice(&self.generation.to_le_bytes());
        b[16..20].copy_from_slice(&(self.entries.len() as u32).to_le_bytes());
        b[20..24].copy_from_slice(&(ENTRY_LEN as u32).to_le_bytes());
        for (i, e) in self.entries.iter().enumerate() {
            assert!(
                e.name.len() <= NAME_MAX,
                "volume name too long for the table"
            );
            let o = TABLE_HEADER_LEN + i * ENTRY_LEN;
            b[o..o + 16].copy_from_slice(e.volume_id.as_bytes());
            b[o + 16..o + 24].copy_from_slice(&e.offset.to_le_bytes());
            b[o + 24..o + 32].copy_from_slice(&e.len.to_le_bytes());
            b[o + 32] = e.name.len() as u8;
            b[o + 33..o + 33 + e.name.len()].copy_from_slice(e.name.as_bytes());
        }
        let crc = table_crc(&b);
        b[24..28].copy_from_slice(&crc.to_le_bytes());
        b
    }

    /// Decodes a slot; `None` if it is not a valid, complete table.
    pub fn decode(b: &[u8]) -> Option<Table> {
        if b.len() < TABLE_HEADER_LEN || &b[0..8] != TABLE_MAGIC {
            return None;
        }
        let count = le32(&b[16..20]) as usize;
        if count > ENTRIES_MAX || le32(&b[20..24]) as usize != ENTRY_LEN {
            return None;
        }
        let len = TABLE_HEADER_LEN + count * ENTRY_LEN;
        if b.len() < len || table_crc(&b[..len]) != le32(&b[24..28]) {
            return None;
        }
        let mut entries = Vec::with_capacity(count);
        for i in 0..count {
            let o = TABLE_HEADER_LEN + i * ENTRY_LEN;
            let name_len = b[o + 32] as usize;
            if name_len > NAME_MAX {
                return None;
            }
            entries.push(Entry {
                volume_id: Uuid::from_bytes(b[o..o + 16].try_into().ok()?),
                offset: le64(&b[o + 16..]),
                len: le64(&b[o + 24..]),
                name: String::from_utf8(b[o + 33..o + 33 + name_len].to_vec()).ok()?,
            });
        }
        Some(Table {
            generation: le64(&b[8..16]),
            entries,
        })
    }

    /// Checks that every extent is aligned, inside `device_size`, and overlaps no other. A
    /// table that passes its checksum but fails this was written wrong, and is never used.
    pub fn check(&self, device_size: u64) -> Result<(), String> {
        let mut spans: Vec<(u64, u64, &str)> = Vec::with_capacity(self.entries.len());
        for e in &self.entries {
            let end = e
                .len
                .checked_next_multiple_of(EXTENT_ALIGN)
                .and_then(|l| e.offset.checked_add(l));
            match end {
                Some(end)
                    if e.offset >= DATA_START
                        && e.offset % EXTENT_ALIGN == 0
                        && end <= device_size
                        && e.len > 0 =>
                {
                    spans.push((e.offset, end, &e.name))
                }
                _ => {
                    return Err(format!(
                        "volume {:?} has an impossible extent {}+{} on a {device_size}-byte device",
                        e.name, e.offset, e.len
                    ))
                }
            }
        }
        spans.sort_unstable();
        for w in spans.windows(2) {
            if w[0].1 > w[1].0 {
                return Err(format!("volumes {:?} and {:?} overlap", w[0].2, w[1].2));
            }
        }
        Ok(())
    }

    /// The slot generation `g` is written to.
    pub fn slot_of(generation: u64) -> usize {
        (generation % 2) as usize
    }

    /// The newest valid table among the two slots.
    pub fn newest(slots: [Option<Table>; 2]) -> Option<Table> {
        let [a, b] = slots;
        match (a, b) {
            (Some(a), Some(b)) => Some(if a.generation >= b.generation { a } else { b }),
            (a, b) => a.or(b),
        }
    }

    /// First-fit allocation of `len` bytes (rounded up to [`EXTENT_ALIGN`]) on a device of
    /// `device_size` bytes. Returns the offset, or `None` if no gap is large enough.
    pub fn allocate(&self, device_size: u64, len: u64) -> Option<u64> {
        let need = len.checked_next_multiple_of(EXTENT_ALIGN)?;
        let mut used: Vec<(u64, u64)> = self
            .entries
            .iter()
            .map(|e| (e.offset, e.offset + e.len.next_multiple_of(EXTENT_ALIGN)))
            .collect();
        used.sort_unstable();
        let mut at = DATA_START;
        for (start, end) in used {
            if start >= at && start - at >= need {
                return Some(at);
            }
            at = at.max(end);
        }
        let end = device_size / EXTENT_ALIGN * EXTENT_ALIGN;
        (end >= at && end - at >= need).then_some(at)
    }

    /// Bytes not held by any extent, and the largest single gap.
    pub fn free(&self, device_size: u64) -> (u64, u64) {
        let mut used: Vec<(u64, u64)> = self
            .entries
            .iter()
            .map(|e| (e.offset, e.offset + e.len.next_multiple_of(EXTENT_ALIGN)))
            .collect();
        used.sort_unstable();
        let (mut total, mut largest, mut at) = (0u64, 0u64, DATA_START);
        let end = device_size / EXTENT_ALIGN * EXTENT_ALIGN;
        for (start, stop) in used.into_iter().chain([(end, end)]) {
            if start > at {
                total += start - at;
                largest = largest.max(start - at);
            }
            at = at.max(stop);
        }
        (total, largest)
    }
}

fn table_crc(b: &[u8]) -> u32 {
    let mut h = crc32c::crc32c(&b[..24]);
    h = crc32c::crc32c_append(h, &[0u8; 4]);
    crc32c::crc32c_append(h, &b[28..])
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn entry(n: u8, offset: u64, len: u64) -> Entry {
        Entry {
            volume_id: Uuid::from_bytes([n; 16]),
            name: format!("vol-{n}"),
            offset,
            len,
        }
    }

    #[test]
    fn label_round_trips_and_detects_damage() {
        let l = Label {
            lun_id: Uuid::new_v4(),
            device_size: 1 << 34,
            pod: Some(Uuid::new_v4()),
        };
        let mut b = l.encode();
        assert_eq!(Label::decode(&b), Ok(l.clone()));
        // A label from before pods: zeroes where the pod goes.
        let old = Label { pod: None, ..l };
        assert_eq!(&old.encode()[72..88], &[0u8; 16]);
        assert_eq!(Label::decode(&old.encode()), Ok(old));
        b[100] ^= 1;
        assert_eq!(Label::decode(&b), Err(LabelError::BadChecksum));
        // A newer version reads as newer, whatever its checksum: never as damaged.
        b[8..12].copy_from_slice(&(VERSION + 1).to_le_bytes());
        assert_eq!(Label::decode(&b), Err(LabelError::Version(VERSION + 1)));
        assert_eq!(Label::decode(&[0u8; LABEL_LEN]), Err(LabelError::NoMagic));
    }

    #[test]
    fn a_torn_table_write_falls_back_to_the_other_slot() {
        let t1 = Table {
            generation: 1,
            entries: vec![entry(1, DATA_START, 1 << 20)],
        };
        let mut t2 = t1.clone();
        t2.generation = 2;
        t2.entries.push(entry(2, DATA_START + (1 << 20), 1 << 20));
        let good = t1.encode();
        let mut torn = t2.encode();
        let half = torn.len() / 2;
        torn[half..].fill(0);
        let slots = [Table::decode(&torn), Table::decode(&good)];
        assert!(slots[0].is_none());
        assert_eq!(Table::newest(slots), Some(t1));
        let slots = [Table::decode(&t2.encode()), Table::decode(&good)];
        assert_eq!(Table::newest(slots).unwrap().generation, 2);
    }

    #[test]
    fn impossible_tables_are_caught() {
        let size = DATA_START + (10 << 20);
        let ok = Table {
            generation: 1,
            entries: vec![
                entry(1, DATA_START, 1 << 20),
                entry(2, DATA_START + (1 << 20), 5),
            ],
        };
        assert_eq!(ok.check(size), Ok(()));
        for bad in [
            vec![entry(1, 0, 1 << 20)],              // over the label
            vec![entry(1, DATA_START + 1, 512)],     // misaligned
            vec![entry(1, DATA_START, 11 << 20)],    // past the end
            vec![entry(1, u64::MAX - 511, 1 << 20)], // overflow
            vec![
                entry(1, DATA_START, 2 << 20),
                entry(2, DATA_START + (1 << 20), 512),
            ], // overlap
            vec![entry(1, DATA_START, 0)],           // empty
        ] {
            let t = Table {
                generation: 1,
                entries: bad,
            };
            assert!(t.check(size).is_err(), "{t:?}");
        }
    }

    #[test]
    fn allocation_is_first_fit_and_aligned() {
        let size = DATA_START + (10 << 20);
        let mut t = Table::default();
        assert_eq!(t.allocate(size, 1), Some(DATA_START));
        t.entries.push(entry(1, DATA_START, 3 << 20));
        t.entries.push(entry(2, DATA_START + (5 << 20), 1 << 20));
        // gap of 2 MiB between them
        assert_eq!(t.allocate(size, 2 << 20), Some(DATA_START + (3 << 20)));
        assert_eq!(
            t.allocate(size, (3 << 20) + 1),
            Some(DATA_START + (6 << 20))
        );
        assert_eq!(t.allocate(size, 5 << 20), None);
        assert_eq!(t.free(size), (6 << 20, 4 << 20));
    }

    proptest! {
        #[test]
        fn allocations_never_overlap_and_stay_on_the_device(
            sizes in proptest::collection::vec(1u64..(8 << 20), 1..40),
            frees in proptest::collection::vec(any::<prop::sample::Index>(), 0..20),
        ) {
            let device = DATA_START + (64 << 20);
            let mut t = Table::default();
            let mut n = 0u8;
            for (i, s) in sizes.iter().enumerate() {
                if let Some(ix) = frees.get(i) {
                    if !t.entries.is_empty() {
                        let k = ix.index(t.entries.len());
                        t.entries.remove(k);
                    }
                }
                let (free, largest) = t.free(device);
                match t.allocate(device, *s) {
                    Some(off) => {
                        n = n.wrapping_add(1);
                        prop_assert!(off % EXTENT_ALIGN == 0 && off >= DATA_START);
                        prop_assert!(off + s <= device);
                        for e in &t.entries {
                            let e_end = e.offset + e.len.next_multiple_of(EXTENT_ALIGN);
                            prop_assert!(off + s <= e.offset || off >= e_end);
                        }
                        t.entries.push(entry(n, off, *s));
                    }
                    None => prop_assert!(largest < s.next_multiple_of(EXTENT_ALIGN), "free {free} largest {largest}"),
                }
            }
            prop_assert_eq!(t.check(device), Ok(()));
            let enc = t.encode();
            prop_assert_eq!(Table::decode(&enc), Some(t));
        }
    }
}
