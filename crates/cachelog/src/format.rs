//! The cache log's on-disk format (pure: bytes in, bytes out). `docs/FORMAT.md` has the same
//! tables for readers who do not read Rust.
//!
//! ```text
//! 0          superblock (4 KiB): magic, version, device UUID, geometry, crc32c
//! 1 MiB      segment 0: segment header (512 B), then records
//! 1 MiB + S  segment 1 …
//! ```
//!
//! Every record starts on a 512-byte boundary with a 512-byte header, followed by its payload
//! padded to 512 bytes. All integers are little-endian.
//!
//! Segments are reused. Each time a segment is (re)started it gets a new, globally increasing
//! `seg_seq`, written into its header and into every record appended to it, so records left
//! over from the segment's previous life are never mistaken for new ones.
//!
//! Concurrent appends reserve space in one order and finish in another, so a crash can leave
//! a hole (an unwritten or torn record) *before* complete ones in the same segment. A scan
//! therefore steps over what does not decode, sector by sector, to the next valid header of
//! the segment's life. Because that means looking at bytes that may be a VM's data (inside a
//! torn record), header checksums are keyed with the device's UUID ([`key_of`]): a VM cannot
//! write bytes that pass for a record header.

use uuid::Uuid;

pub const SUPER_MAGIC: &[u8; 8] = b"VESTALOG";
pub const SEGMENT_MAGIC: u32 = u32::from_le_bytes(*b"VSEG");
pub const RECORD_MAGIC: u32 = u32::from_le_bytes(*b"VREC");
pub const VERSION: u32 = 1;
pub const SUPER_LEN: usize = 4096;
/// The sector: record headers and payloads are multiples of it.
pub const SECTOR: u64 = 512;
pub const HEADER_LEN: usize = SECTOR as usize;
pub const SEGMENT_HEADER_LEN: u64 = SECTOR;
/// Where the first segment starts; the superblock lives below.
pub const SEGMENTS_START: u64 = 1 << 20;

fn le32(b: &[u8]) -> u32 {
    u32::from_le_bytes(b[..4].try_into().expect("4 bytes"))
}

fn le64(b: &[u8]) -> u64 {
    u64::from_le_bytes(b[..8].try_into().expect("8 bytes"))
}

/// The device-wide superblock, written once when the device is formatted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Superblock {
    pub device_id: Uuid,
    pub segment_size: u64,
    pub segment_count: u64,
    /// Bumped (and synced) every time the log is opened; the high half of every `seg_seq`
    /// handed out in that run, so segment lives never repeat across restarts even when a
    /// power loss erased every trace of the last ones.
    pub epoch: u64,
}

impl Superblock {
    /// Geometry for a device of `device_size` bytes and segments of `segment_size` bytes.
    pub fn for_device(device_id: Uuid, device_size: u64, segment_size: u64) -> Option<Superblock> {
        if segment_size < 64 * SECTOR || !segment_size.is_multiple_of(SECTOR) {
            return None;
        }
        let segment_count = device_size.checked_sub(SEGMENTS_START)? / segment_size;
        (segment_count >= 2).then_some(Superblock {
            device_id,
            segment_size,
            segment_count,
            epoch: 1,
        })
    }

    pub fn segment_offset(&self, segment: u32) -> u64 {
        SEGMENTS_START + u64::from(segment) * self.segment_size
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut b = vec![0u8; SUPER_LEN];
        b[0..8].copy_from_slice(SUPER_MAGIC);
        b[8..12].copy_from_slice(&VERSION.to_le_bytes());
        b[16..32].copy_from_slice(self.device_id.as_bytes());
        b[32..40].copy_from_slice(&self.segment_size.to_le_bytes());
        b[40..48].copy_from_slice(&self.segment_count.to_le_bytes());
        b[48..56].copy_from_slice(&SEGMENTS_START.to_le_bytes());
        b[56..64].copy_from_slice(&self.epoch.to_le_bytes());
        let crc = crc32c::crc32c(&b[..SUPER_LEN - 4]);
        b[SUPER_LEN - 4..].copy_from_slice(&crc.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8]) -> Result<Superblock, String> {
        if b.len() < SUPER_LEN || &b[0..8] != SUPER_MAGIC {
            return Err("no cache log superblock (magic missing)".into());
        }
        if crc32c::crc32c(&b[..SUPER_LEN - 4]) != le32(&b[SUPER_LEN - 4..]) {
            return Err("cache log superblock checksum mismatch".into());
        }
        let v = le32(&b[8..12]);
        if v != VERSION {
            return Err(format!(
                "cache log version {v} is not supported (this build reads {VERSION})"
            ));
        }
        if le64(&b[48..56]) != SEGMENTS_START {
            return Err("cache log superblock has an unexpected layout".into());
        }
        Ok(Superblock {
            device_id: Uuid::from_bytes(b[16..32].try_into().expect("16 bytes")),
            segment_size: le64(&b[32..40]),
            segment_count: le64(&b[40..48]),
            epoch: le64(&b[56..64]),
        })
    }
}

/// The header at the start of a segment: which life of the segment this is, and whose.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentHeader {
    pub seg_seq: u64,
    /// The volume whose records this segment holds (each volume appends to its own segments).
    pub owner: Uuid,
}

impl SegmentHeader {
    pub fn encode(&self) -> Vec<u8> {
        let mut b = vec![0u8; SEGMENT_HEADER_LEN as usize];
        b[0..4].copy_from_slice(&SEGMENT_MAGIC.to_le_bytes());
        b[8..16].copy_from_slice(&self.seg_seq.to_le_bytes());
        b[16..32].copy_from_slice(self.owner.as_bytes());
        let crc = crc32c::crc32c(&b[..SEGMENT_HEADER_LEN as usize - 4]);
        let n = b.len();
        b[n - 4..].copy_from_slice(&crc.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8]) -> Option<SegmentHeader> {
        let n = SEGMENT_HEADER_LEN as usize;
        if b.len() < n || le32(&b[0..4]) != SEGMENT_MAGIC {
            return None;
        }
        if crc32c::crc32c(&b[..n - 4]) != le32(&b[n - 4..n]) {
            return None;
        }
        Some(SegmentHeader {
            seg_seq: le64(&b[8..16]),
            owner: Uuid::from_bytes(b[16..32].try_into().ok()?),
        })
    }
}

/// What a record says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A volume write: the payload is the data written at `offset`. Dirty until a checkpoint
    /// at or above its `ser` (in `wt`, written clean: the datastore already has it).
    Data,
    /// The volume's datastore holds every write up to and including `ser`.
    Checkpoint,
    /// The volume's policy changed; `arg` holds the policy code (see `Policy` in `engine`).
    Policy,
    /// A peer's copy of another host's write (`wbp`); like `Data`, for the volume's owner.
    Replica,
    /// `len` bytes at `offset` read as zeroes (WRITE_ZEROES, TRIM); no payload.
    Zero,
    /// Clean data read from the datastore into the cache (a read miss). Never replayed.
    Fill,
}

impl Kind {
    fn code(self) -> u8 {
        match self {
            Kind::Data => 1,
            Kind::Checkpoint => 2,
            Kind::Policy => 3,
            Kind::Replica => 4,
            Kind::Zero => 5,
            Kind::Fill => 6,
        }
    }

    fn from_code(c: u8) -> Option<Kind> {
        Some(match c {
            1 => Kind::Data,
            2 => Kind::Checkpoint,
            3 => Kind::Policy,
            4 => Kind::Replica,
            5 => Kind::Zero,
            6 => Kind::Fill,
            _ => return None,
        })
    }

    /// Whether the record carries `len` bytes of payload after its header.
    pub fn has_payload(self) -> bool {
        matches!(self, Kind::Data | Kind::Replica | Kind::Fill)
    }

    /// Whether the record is a write of the volume, numbered by `ser` in its sequence.
    pub fn is_write(self) -> bool {
        matches!(self, Kind::Data | Kind::Replica | Kind::Zero)
    }
}

/// A record header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub kind: Kind,
    pub seg_seq: u64,
    pub volume: Uuid,
    pub ser: u64,
    pub gen: u64,
    pub offset: u64,
    pub len: u64,
    /// Kind-specific: the policy code of a `Policy` record.
    pub arg: u64,
    /// crc32c of the payload (0 when there is none).
    pub payload_crc: u32,
}

/// Why a header did not decode: the scan of its segment stops there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BadHeader {
    /// Not a record at all (zeroes, garbage, or the rest of a torn write).
    NoRecord,
    /// A record header whose checksum fails: damaged.
    Checksum,
    /// A valid record from an earlier life of the segment.
    Stale,
}

impl Header {
    /// Bytes the record occupies in the log: header plus payload padded to a sector.
    pub fn record_len(&self) -> u64 {
        let payload = if self.kind.has_payload() {
            self.len.div_ceil(SECTOR) * SECTOR
        } else {
            0
        };
        HEADER_LEN as u64 + payload
    }

    pub fn encode(&self, key: u32) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&RECORD_MAGIC.to_le_bytes());
        b[4] = self.kind.code();
        b[12..16].copy_from_slice(&self.payload_crc.to_le_bytes());
        b[16..32].copy_from_slice(self.volume.as_bytes());
        b[32..40].copy_from_slice(&self.ser.to_le_bytes());
        b[40..48].copy_from_slice(&self.gen.to_le_bytes());
        b[48..56].copy_from_slice(&self.offset.to_le_bytes());
        b[56..64].copy_from_slice(&self.len.to_le_bytes());
        b[64..72].copy_from_slice(&self.seg_seq.to_le_bytes());
        b[72..80].copy_from_slice(&self.arg.to_le_bytes());
        let crc = crc32c::crc32c_append(key, &b);
        b[8..12].copy_from_slice(&crc.to_le_bytes());
        b
    }

    /// Decodes a header expected in the segment life `seg_seq` of the device with `key`.
    pub fn decode(b: &[u8], seg_seq: u64, key: u32) -> Result<Header, BadHeader> {
        if b.len() < HEADER_LEN || le32(&b[0..4]) != RECORD_MAGIC {
            return Err(BadHeader::NoRecord);
        }
        let mut copy = [0u8; HEADER_LEN];
        copy.copy_from_slice(&b[..HEADER_LEN]);
        copy[8..12].fill(0);
        if crc32c::crc32c_append(key, &copy) != le32(&b[8..12]) {
            return Err(BadHeader::Checksum);
        }
        let kind = Kind::from_code(b[4]).ok_or(BadHeader::Checksum)?;
        let h = Header {
            kind,
            payload_crc: le32(&b[12..16]),
            volume: Uuid::from_bytes(b[16..32].try_into().expect("16 bytes")),
            ser: le64(&b[32..40]),
            gen: le64(&b[40..48]),
            offset: le64(&b[48..56]),
            len: le64(&b[56..64]),
            seg_seq: le64(&b[64..72]),
            arg: le64(&b[72..80]),
        };
        if h.seg_seq != seg_seq {
            return Err(BadHeader::Stale);
        }
        Ok(h)
    }
}

/// The key that header checksums are seeded with: derived from the device UUID, which no VM
/// ever sees.
pub fn key_of(device_id: &Uuid) -> u32 {
    crc32c::crc32c(device_id.as_bytes())
}

/// The checksum a payload must match.
pub fn payload_crc(payload: &[u8]) -> u32 {
    crc32c::crc32c(payload)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const KEY: u32 = 0x1234_5678;

    fn header(kind: Kind, len: u64) -> Header {
        Header {
            kind,
            seg_seq: 7,
            volume: Uuid::from_bytes([3; 16]),
            ser: 42,
            gen: 2,
            offset: 8192,
            len,
            arg: 0,
            payload_crc: 0xdead_beef,
        }
    }

    #[test]
    fn superblock_round_trips_and_rejects_damage() {
        let s = Superblock::for_device(Uuid::new_v4(), 1 << 30, 1 << 20).unwrap();
        assert_eq!(s.segment_count, 1023);
        let mut b = s.encode();
        assert_eq!(Superblock::decode(&b), Ok(s));
        b[33] ^= 1;
        assert!(Superblock::decode(&b).unwrap_err().contains("checksum"));
        assert!(Superblock::for_device(Uuid::nil(), 2 << 20, 1 << 20).is_none());
        assert!(Superblock::for_device(Uuid::nil(), 1 << 30, 1000).is_none());
    }

    #[test]
    fn a_stale_record_is_told_apart_from_damage() {
        let h = header(Kind::Data, 4096);
        let b = h.encode(KEY);
        assert_eq!(Header::decode(&b, 7, KEY), Ok(h));
        assert_eq!(Header::decode(&b, 8, KEY), Err(BadHeader::Stale));
        assert_eq!(
            Header::decode(&b, 7, KEY + 1),
            Err(BadHeader::Checksum),
            "another device's key"
        );
        let mut bad = b;
        bad[40] ^= 0x10;
        assert_eq!(Header::decode(&bad, 7, KEY), Err(BadHeader::Checksum));
        assert_eq!(
            Header::decode(&[0u8; 512], 7, KEY),
            Err(BadHeader::NoRecord)
        );
    }

    #[test]
    fn record_lengths_are_sector_multiples() {
        assert_eq!(header(Kind::Data, 4096).record_len(), 512 + 4096);
        assert_eq!(header(Kind::Data, 1).record_len(), 1024);
        assert_eq!(header(Kind::Zero, 1 << 30).record_len(), 512);
        assert_eq!(header(Kind::Checkpoint, 0).record_len(), 512);
    }

    proptest! {
        #[test]
        fn any_single_bit_flip_in_a_header_is_detected(
            bit in 0usize..(HEADER_LEN * 8),
            ser in any::<u64>(),
            len in 0u64..(1 << 25),
        ) {
            let mut h = header(Kind::Data, len);
            h.ser = ser;
            let mut b = h.encode(KEY);
            b[bit / 8] ^= 1 << (bit % 8);
            prop_assert!(Header::decode(&b, 7, KEY).is_err());
        }

        #[test]
        fn segment_headers_round_trip(seq in any::<u64>(), owner in any::<[u8; 16]>()) {
            let s = SegmentHeader { seg_seq: seq, owner: Uuid::from_bytes(owner) };
            prop_assert_eq!(SegmentHeader::decode(&s.encode()), Some(s));
        }
    }
}
