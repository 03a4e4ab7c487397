//! The cache log's on-disk format (pure: bytes in, bytes out). `docs/FORMAT.md` has the same
//! tables for readers who do not read Rust.
//!
//! ```text
//! 0          superblock (4 KiB): magic, version, device UUID, geometry, crc32c
//! 1 MiB      segment 0: segment header (512 B), then records
//! 1 MiB + S  segment 1 …
//! ```
//!
//! # Inside a segment (version 2)
//!
//! ```text
//! 0      segment header, metadata copies, record headers (and inline records) → grows up
//!        … free …
//! S      ← page-aligned payloads grow down from the end
//! ```
//!
//! Every record has a 512-byte header in the *header area* at the front of the segment. A
//! payload whose length is a multiple of 4 KiB ([`PAGE`]) is **paged**: it is written on its
//! own, page-aligned, in the *data area* that grows down from the end of the segment, and its
//! header says where (`data_at`). Any other payload is **inline**, right after its header and
//! padded to 512 bytes, as in version 1.
//!
//! Why: the device is written through the page cache (or is a block device with 4 KiB pages).
//! A write that covers part of a page makes the kernel zero the rest (a hole) or *read it from
//! the device first* (blocks written before: every reused segment). Version 1 put a 4 KiB
//! payload after its 512-byte header, so every record ended in the middle of a page; once
//! the log wrapped, each such write waited for a read (a 4 KiB randwrite bench dropped from
//! about 60,000 to 8,500 writes/s on a cache file that had been written once). In version 2
//! paged payloads are whole pages, and the log never writes part of a header-area page it has
//! not first written whole: a segment starts with a full page (header, metadata copies,
//! zeroes), and an append whose header-area bytes reach into a new page first writes that
//! page as zeroes (see `Log::append`). The space a 4 KiB write takes is unchanged: 512 bytes
//! of header plus 4 KiB of payload; headers share pages, eight to a page.
//!
//! All integers are little-endian.
//!
//! Segments are reused. Each time a segment is (re)started it gets a new, globally increasing
//! `seg_seq`, written into its header and into every record appended to it, so records left
//! over from the segment's previous life are never mistaken for new ones.
//!
//! Concurrent appends reserve space in one order and finish in another, so a crash can leave
//! a hole (an unwritten or torn record) *before* complete ones in the same segment. A scan
//! therefore steps over what does not decode, sector by sector, to the next valid header of
//! the segment's life. Because that means looking at bytes that may be a VM's data (inside a
//! torn record, or a page of the data area), header checksums are keyed with the device's
//! UUID ([`key_of`]): a VM cannot write bytes that pass for a record header.

use uuid::Uuid;

pub const SUPER_MAGIC: &[u8; 8] = b"VESTALOG";
pub const SEGMENT_MAGIC: u32 = u32::from_le_bytes(*b"VSEG");
pub const RECORD_MAGIC: u32 = u32::from_le_bytes(*b"VREC");
/// 2: paged payloads in a data area at the end of each segment (1: every payload inline).
pub const VERSION: u32 = 2;
pub const SUPER_LEN: usize = 4096;
/// The sector: record headers and payloads are multiples of it.
pub const SECTOR: u64 = 512;
pub const HEADER_LEN: usize = SECTOR as usize;
pub const SEGMENT_HEADER_LEN: u64 = SECTOR;
/// The page: paged payloads start and end on page boundaries, and the log writes pages of
/// the header area whole before writing parts of them, so the kernel never reads a page to
/// complete a partial write (module doc). 4 KiB is the page size of x86-64 and the block size
/// of ext4 and XFS; segments are whole pages.
pub const PAGE: u64 = 4096;
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
        if segment_size < 16 * PAGE || !segment_size.is_multiple_of(PAGE) {
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
        // Two checksums: one inside the first sector, over it, and one over the whole block.
        // The superblock is rewritten in place at every open (its epoch), and a power cut
        // may tear that write between sectors: the first sector alone still checks. (The
        // second, which older builds check, then checks too: a CRC over a message followed
        // by its own CRC and zeroes is the same for every message.)
        let s = SECTOR as usize;
        let crc = crc32c::crc32c(&b[..s - 4]);
        b[s - 4..s].copy_from_slice(&crc.to_le_bytes());
        let crc = crc32c::crc32c(&b[..SUPER_LEN - 4]);
        b[SUPER_LEN - 4..].copy_from_slice(&crc.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8]) -> Result<Superblock, String> {
        if b.len() < SUPER_LEN || &b[0..8] != SUPER_MAGIC {
            return Err("no cache log superblock (magic missing)".into());
        }
        let s = SECTOR as usize;
        // Everything the superblock says is in its first sector: either checksum will do (a
        // superblock written before the first existed has only the second).
        let whole = crc32c::crc32c(&b[..SUPER_LEN - 4]) == le32(&b[SUPER_LEN - 4..SUPER_LEN]);
        let first = crc32c::crc32c(&b[..s - 4]) == le32(&b[s - 4..s]);
        if !whole && !first {
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
        let (segment_size, segment_count) = (le64(&b[32..40]), le64(&b[40..48]));
        // The geometry `for_device` makes, and nothing a buggy or foreign build could write
        // that would make the scan allocate or address beyond reason.
        let end = segment_size
            .checked_mul(segment_count)
            .and_then(|n| n.checked_add(SEGMENTS_START));
        if segment_size < 16 * PAGE
            || !segment_size.is_multiple_of(PAGE)
            || segment_size > u64::from(u32::MAX)
            || !(2..=u64::from(u32::MAX)).contains(&segment_count)
            || end.is_none()
        {
            return Err(format!(
                "cache log superblock has an impossible geometry ({segment_count} segments of \
                 {segment_size} bytes)"
            ));
        }
        Ok(Superblock {
            device_id: Uuid::from_bytes(b[16..32].try_into().expect("16 bytes")),
            segment_size,
            segment_count,
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
    /// The volume's datastore holds every write up to and including `ser`. A nonzero `arg` is
    /// the end of a window being destaged: the datastore may also hold parts of the writes up
    /// to it (see `OwnerMeta::window_end`). Older builds ignore it.
    Checkpoint,
    /// The volume's policy changed; `arg` holds the policy code (see `Policy` in `engine`).
    Policy,
    /// A peer's copy of another host's write (`wbp`); like `Data`, for the volume's owner.
    Replica,
    /// A peer's copy of another host's WRITE_ZEROES or TRIM (`wbp`); like `Zero`.
    ReplicaZero,
    /// `len` bytes at `offset` read as zeroes (WRITE_ZEROES, TRIM); no payload. The
    /// datastore may deallocate them.
    Zero,
    /// Like `Zero`, but the datastore must keep the zeroes allocated (WRITE_ZEROES with
    /// NO_HOLE). Kind 5 with bit 0 of the flags byte set: a build before the flag reads it
    /// as `Zero`.
    ZeroAlloc,
    /// A peer's copy of another host's `ZeroAlloc` (kind 7 with the same flag).
    ReplicaZeroAlloc,
    /// Clean data read from the datastore into the cache (a read miss). Never replayed.
    Fill,
}

/// Bit 0 of a record's flags byte: its zeroes stay allocated ([`Kind::ZeroAlloc`]).
const FLAG_ALLOC: u8 = 1;

impl Kind {
    fn code(self) -> u8 {
        match self {
            Kind::Data => 1,
            Kind::Checkpoint => 2,
            Kind::Policy => 3,
            Kind::Replica => 4,
            Kind::Zero | Kind::ZeroAlloc => 5,
            Kind::Fill => 6,
            Kind::ReplicaZero | Kind::ReplicaZeroAlloc => 7,
        }
    }

    /// The flags byte (offset 5), which builds before it ignore.
    fn flags(self) -> u8 {
        if self.allocates() {
            FLAG_ALLOC
        } else {
            0
        }
    }

    fn from_code(c: u8, flags: u8) -> Option<Kind> {
        let alloc = flags & FLAG_ALLOC != 0;
        Some(match c {
            1 => Kind::Data,
            2 => Kind::Checkpoint,
            3 => Kind::Policy,
            4 => Kind::Replica,
            5 if alloc => Kind::ZeroAlloc,
            5 => Kind::Zero,
            6 => Kind::Fill,
            7 if alloc => Kind::ReplicaZeroAlloc,
            7 => Kind::ReplicaZero,
            _ => return None,
        })
    }

    /// Whether the record is a zeroing (of the host's own volume or a peer's copy).
    pub fn is_zero(self) -> bool {
        matches!(
            self,
            Kind::Zero | Kind::ZeroAlloc | Kind::ReplicaZero | Kind::ReplicaZeroAlloc
        )
    }

    /// Whether the record is a zeroing the datastore must keep allocated (NO_HOLE).
    pub fn allocates(self) -> bool {
        matches!(self, Kind::ZeroAlloc | Kind::ReplicaZeroAlloc)
    }

    /// Whether the record carries `len` bytes of payload after its header.
    pub fn has_payload(self) -> bool {
        matches!(self, Kind::Data | Kind::Replica | Kind::Fill)
    }

    /// Whether the record is a write of the volume, numbered by `ser` in its sequence.
    pub fn is_write(self) -> bool {
        matches!(self, Kind::Data | Kind::Replica) || self.is_zero()
    }

    /// Whether the record is a peer's copy of another host's write.
    pub fn is_replica(self) -> bool {
        matches!(
            self,
            Kind::Replica | Kind::ReplicaZero | Kind::ReplicaZeroAlloc
        )
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
    /// How many page checksums the header carries after its fields, one per page of a paged
    /// payload ([`PageCrcs`]), so that part of the payload can be read and verified alone;
    /// 0 for other records, and in records written before there were any.
    pub pages: u32,
    /// Where the payload starts, in bytes from the start of the segment: right after the
    /// header (inline) or a page of the data area (paged); 0 for records without payload.
    pub data_at: u64,
}

/// Where a record's payload goes (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// No payload: the header alone.
    None,
    /// Right after the header, padded to a sector.
    Inline,
    /// Whole pages in the data area.
    Paged,
}

/// Where a payload of `len` bytes goes.
pub fn placement(has_payload: bool, len: u64) -> Placement {
    if !has_payload {
        Placement::None
    } else if len > 0 && len.is_multiple_of(PAGE) {
        Placement::Paged
    } else {
        Placement::Inline
    }
}

/// Header-area bytes and data-area bytes a record takes.
pub fn record_space(has_payload: bool, len: u64) -> (u64, u64) {
    match placement(has_payload, len) {
        Placement::None => (HEADER_LEN as u64, 0),
        Placement::Inline => (HEADER_LEN as u64 + len.div_ceil(SECTOR) * SECTOR, 0),
        Placement::Paged => (HEADER_LEN as u64, len),
    }
}

/// Log bytes a record takes, both areas together (for space accounting).
pub fn log_bytes(has_payload: bool, len: u64) -> u64 {
    let (head, data) = record_space(has_payload, len);
    head + data
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
    pub fn placement(&self) -> Placement {
        placement(self.kind.has_payload(), self.len)
    }

    /// Header-area bytes the record takes: its header, plus its payload if inline.
    pub fn head_len(&self) -> u64 {
        record_space(self.kind.has_payload(), self.len).0
    }

    /// Whether `data_at` is where a record whose header is at `at` (bytes from the segment
    /// start) may keep its payload, in a segment of `segment_size` bytes. Only a header that
    /// passed its keyed checksum is asked, so this guards against a bug, not against a VM.
    pub fn layout_ok(&self, at: u64, segment_size: u64) -> bool {
        let (head, data) = record_space(self.kind.has_payload(), self.len);
        match self.placement() {
            Placement::None => self.data_at == 0 && at + head <= segment_size,
            Placement::Inline => {
                self.data_at == at + HEADER_LEN as u64 && at + head <= segment_size
            }
            Placement::Paged => {
                self.data_at.is_multiple_of(PAGE)
                    && self.data_at >= (at + head).next_multiple_of(PAGE)
                    && self
                        .data_at
                        .checked_add(data)
                        .is_some_and(|end| end <= segment_size)
            }
        }
    }

    pub fn encode(&self, key: u32) -> [u8; HEADER_LEN] {
        self.encode_with(key, &PageCrcs::NONE)
    }

    /// The header with the page checksums `crcs` of its payload, as many as
    /// [`Header::pages`] says.
    pub fn encode_with(&self, key: u32, crcs: &PageCrcs) -> [u8; HEADER_LEN] {
        assert_eq!(crcs.n, self.pages as usize, "the header's page count");
        let mut b = [0u8; HEADER_LEN];
        for (i, c) in crcs.as_slice().iter().enumerate() {
            b[PAGE_CRCS_AT + 4 * i..][..4].copy_from_slice(&c.to_le_bytes());
        }
        b[0..4].copy_from_slice(&RECORD_MAGIC.to_le_bytes());
        b[4] = self.kind.code();
        b[5] = self.kind.flags();
        b[12..16].copy_from_slice(&self.payload_crc.to_le_bytes());
        b[16..32].copy_from_slice(self.volume.as_bytes());
        b[32..40].copy_from_slice(&self.ser.to_le_bytes());
        b[40..48].copy_from_slice(&self.gen.to_le_bytes());
        b[48..56].copy_from_slice(&self.offset.to_le_bytes());
        b[56..64].copy_from_slice(&self.len.to_le_bytes());
        b[64..72].copy_from_slice(&self.seg_seq.to_le_bytes());
        b[72..80].copy_from_slice(&self.arg.to_le_bytes());
        b[80..88].copy_from_slice(&self.data_at.to_le_bytes());
        b[88..92].copy_from_slice(&self.pages.to_le_bytes());
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
        let kind = Kind::from_code(b[4], b[5]).ok_or(BadHeader::Checksum)?;
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
            data_at: le64(&b[80..88]),
            pages: le32(&b[88..92]),
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

/// Where a record header's page checksums start.
pub const PAGE_CRCS_AT: usize = 96;
/// The most page checksums a header holds (416 KiB of payload; writes are cut into parts of
/// at most 256 KiB).
pub const PAGE_CRCS_MAX: usize = (HEADER_LEN - PAGE_CRCS_AT) / 4;

/// The crc32c of each page of a paged payload, which its header carries (from
/// [`PAGE_CRCS_AT`]) so that a read of part of the payload reads and verifies only the pages
/// it needs, not the whole record. Payloads that are not paged, or longer than
/// [`PAGE_CRCS_MAX`] pages, have none.
pub struct PageCrcs {
    n: usize,
    crcs: [u32; PAGE_CRCS_MAX],
}

impl PageCrcs {
    pub const NONE: PageCrcs = PageCrcs {
        n: 0,
        crcs: [0; PAGE_CRCS_MAX],
    };

    /// The page checksums of `payload` where its header carries them, and the checksum of
    /// the whole payload ([`payload_crc`]), computed from them in the same single pass.
    pub fn of(payload: &[u8]) -> (u32, PageCrcs) {
        let len = payload.len() as u64;
        let pages = len / PAGE;
        if placement(true, len) != Placement::Paged || pages > PAGE_CRCS_MAX as u64 {
            return (payload_crc(payload), PageCrcs::NONE);
        }
        let mut c = PageCrcs::NONE;
        let mut whole = 0;
        for (i, page) in payload.chunks(PAGE as usize).enumerate() {
            let crc = crc32c::crc32c(page);
            c.crcs[i] = crc;
            // crc(A ‖ B) = crc(A) shifted over |B| zero bytes, xor crc(B).
            whole = if i == 0 { crc } else { shift_page(whole) ^ crc };
        }
        c.n = pages as usize;
        (whole, c)
    }

    pub fn as_slice(&self) -> &[u32] {
        &self.crcs[..self.n]
    }
}

/// The checksum page `i` of a record's payload must match: from the header's bytes `head`,
/// which must have decoded with `pages` > `i`.
pub fn page_crc(head: &[u8], i: usize) -> u32 {
    le32(&head[PAGE_CRCS_AT + 4 * i..])
}

/// `crc32c_combine(crc, 0, PAGE)`: a crc carried over a page of zero bytes. The operator is
/// linear over GF(2), so it is the xor of its images of the bits set in `crc`, computed
/// once: 32 steps here instead of the general combine's matrix squarings on every call.
fn shift_page(crc: u32) -> u32 {
    static COLUMNS: std::sync::OnceLock<[u32; 32]> = std::sync::OnceLock::new();
    let cols = COLUMNS.get_or_init(|| {
        std::array::from_fn(|bit| crc32c::crc32c_combine(1 << bit, 0, PAGE as usize))
    });
    (0..32)
        .filter(|bit| crc & (1 << bit) != 0)
        .fold(0, |acc, bit| acc ^ cols[bit])
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
            data_at: 0,
            pages: 0,
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
        assert!(
            Superblock::for_device(Uuid::nil(), 1 << 30, 65536 + 512).is_none(),
            "segments are whole pages"
        );
    }

    /// A superblock whose checksum holds but whose geometry no `for_device` makes (a buggy
    /// or foreign build wrote it) is refused, not trusted with the scan's allocations and
    /// offsets.
    #[test]
    fn a_superblock_with_an_impossible_geometry_is_refused() {
        let good = Superblock::for_device(Uuid::new_v4(), 1 << 30, 1 << 20).unwrap();
        for (size, count) in [
            (1000, 1023),
            (1 << 20, 1),
            (1 << 20, u64::from(u32::MAX) + 1),
            (1 << 40, 1 << 30),
            (!(PAGE - 1), 2),
        ] {
            let bad = Superblock {
                segment_size: size,
                segment_count: count,
                ..good
            };
            let e = Superblock::decode(&bad.encode()).unwrap_err();
            assert!(e.contains("impossible geometry"), "{size} x {count}: {e}");
        }
        assert_eq!(Superblock::decode(&good.encode()), Ok(good));
    }

    #[test]
    fn a_superblock_with_the_whole_block_checksum_only_still_decodes() {
        // As superblocks were written before the first sector got its own checksum.
        let s = Superblock::for_device(Uuid::new_v4(), 1 << 30, 1 << 20).unwrap();
        let mut b = s.encode();
        b[508..512].fill(0);
        let crc = crc32c::crc32c(&b[..SUPER_LEN - 4]);
        b[SUPER_LEN - 4..].copy_from_slice(&crc.to_le_bytes());
        assert_eq!(Superblock::decode(&b), Ok(s));
        b[40] ^= 1;
        assert!(Superblock::decode(&b).unwrap_err().contains("checksum"));
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

    /// A zeroing that must stay allocated is kind 5 (or 7) with a flag a build before the
    /// flag ignores: it reads the record as a plain zeroing, which is still the same zeroes.
    #[test]
    fn an_allocated_zeroing_is_a_zeroing_with_a_flag_older_builds_ignore() {
        for (plain, alloc, code) in [
            (Kind::Zero, Kind::ZeroAlloc, 5),
            (Kind::ReplicaZero, Kind::ReplicaZeroAlloc, 7),
        ] {
            let h = header(alloc, 1 << 20);
            let b = h.encode(KEY);
            assert_eq!((b[4], b[5]), (code, 1));
            assert_eq!(Header::decode(&b, 7, KEY), Ok(h));
            let p = header(plain, 1 << 20);
            let b = p.encode(KEY);
            assert_eq!((b[4], b[5]), (code, 0));
            assert_eq!(Header::decode(&b, 7, KEY), Ok(p));
            // What a build before the flag did with the byte: nothing.
            assert_eq!(Kind::from_code(code, 0), Some(plain));
            assert!(alloc.is_zero() && alloc.is_write() && !alloc.has_payload());
            assert_eq!(alloc.is_replica(), plain.is_replica());
            assert!(alloc.allocates() && !plain.allocates());
        }
        // Other kinds carry no flag.
        let d = header(Kind::Data, 4096).encode(KEY);
        assert_eq!(d[5], 0);
    }

    #[test]
    fn whole_pages_are_paged_and_the_rest_inline() {
        assert_eq!(record_space(true, 4096), (512, 4096));
        assert_eq!(record_space(true, 256 << 10), (512, 256 << 10));
        assert_eq!(record_space(true, 1), (1024, 0));
        assert_eq!(record_space(true, 4096 + 512), (512 + 4608, 0));
        assert_eq!(record_space(false, 1 << 30), (512, 0), "zero records");
        assert_eq!(record_space(true, 0), (512, 0));
        assert_eq!(
            log_bytes(true, 4096),
            512 + 4096,
            "a 4 KiB write costs what it did"
        );
    }

    #[test]
    fn payload_places_are_checked_against_the_segment() {
        const S: u64 = 64 << 10;
        let mut paged = header(Kind::Data, 8192);
        paged.data_at = S - 8192;
        assert!(paged.layout_ok(512, S));
        assert!(
            paged.layout_ok(S - 8192 - 512, S),
            "the header in the last sector before its payload's page"
        );
        // A payload in the page of its own header, unaligned, or past the segment end.
        assert!(!paged.layout_ok(S - 8192, S));
        paged.data_at = S - 8192 - 512;
        assert!(!paged.layout_ok(512, S));
        paged.data_at = S - 4096;
        assert!(!paged.layout_ok(512, S));
        let mut inline = header(Kind::Data, 1024);
        inline.data_at = 1024;
        assert!(inline.layout_ok(512, S));
        assert!(!inline.layout_ok(1024, S));
        assert!(!inline.layout_ok(S - 1024, S), "runs past the end");
        let mut zero = header(Kind::Zero, 1 << 30);
        assert!(zero.layout_ok(S - 512, S));
        zero.data_at = 1024;
        assert!(!zero.layout_ok(512, S));
    }

    #[test]
    fn page_checksums_are_carried_for_paged_payloads_that_fit_the_header() {
        let payload: Vec<u8> = (0..(PAGE_CRCS_MAX as u32 + 1) * PAGE as u32)
            .map(|i| (i * 7 % 251) as u8)
            .collect();
        for len in [0, 1, 512, 4096, 4096 + 512, 8192, 256 << 10] {
            let p = &payload[..len];
            let (whole, pages) = PageCrcs::of(p);
            assert_eq!(whole, payload_crc(p), "len {len}");
            let want: Vec<u32> = if placement(true, len as u64) == Placement::Paged {
                p.chunks(PAGE as usize).map(crc32c::crc32c).collect()
            } else {
                Vec::new()
            };
            assert_eq!(pages.as_slice(), want, "len {len}");
        }
        let most = PAGE_CRCS_MAX * PAGE as usize;
        assert_eq!(
            PageCrcs::of(&payload[..most]).1.as_slice().len(),
            PAGE_CRCS_MAX
        );
        let (whole, none) = PageCrcs::of(&payload[..most + PAGE as usize]);
        assert!(
            none.as_slice().is_empty(),
            "more pages than the header holds"
        );
        assert_eq!(whole, payload_crc(&payload[..most + PAGE as usize]));
        // The header carries them under its checksum, and the last ends before it.
        let mut h = header(Kind::Data, most as u64);
        let (_, crcs) = PageCrcs::of(&payload[..most]);
        h.pages = PAGE_CRCS_MAX as u32;
        let b = h.encode_with(KEY, &crcs);
        assert_eq!(Header::decode(&b, 7, KEY), Ok(h));
        for (i, c) in crcs.as_slice().iter().enumerate() {
            assert_eq!(page_crc(&b, i), *c);
        }
        assert_eq!(PAGE_CRCS_AT + 4 * PAGE_CRCS_MAX, HEADER_LEN);
        let mut bad = b;
        bad[PAGE_CRCS_AT + 4 * (PAGE_CRCS_MAX - 1)] ^= 1;
        assert_eq!(Header::decode(&bad, 7, KEY), Err(BadHeader::Checksum));
    }

    proptest! {
        #[test]
        fn the_whole_payload_checksum_from_page_checksums_is_crc32c(
            pages in 1usize..=PAGE_CRCS_MAX,
            seed in any::<u64>(),
        ) {
            let mut x = seed | 1;
            let p: Vec<u8> = (0..pages * PAGE as usize)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x as u8
                })
                .collect();
            let (whole, c) = PageCrcs::of(&p);
            prop_assert_eq!(whole, payload_crc(&p));
            prop_assert_eq!(c.as_slice().len(), pages);
        }

        #[test]
        fn any_single_bit_flip_in_a_header_is_detected(
            bit in 0usize..(HEADER_LEN * 8),
            ser in any::<u64>(),
            len in 0u64..(1 << 25),
        ) {
            let mut h = header(Kind::Data, len);
            h.ser = ser;
            h.data_at = 4096;
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
