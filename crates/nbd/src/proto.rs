//! Wire constants and fixed-size message codecs of the NBD protocol.
//!
//! The reference is the NetworkBlockDevice project's `doc/proto.md`. Only what Vesta speaks is
//! here: fixed newstyle negotiation, `NBD_OPT_INFO`/`NBD_OPT_GO` with block sizes, and simple
//! replies. Structured replies, metadata contexts and extended headers are declined with
//! `NBD_REP_ERR_UNSUP`, which every client handles by falling back to simple replies.
//!
//! Everything here is pure: parsing from byte slices and encoding into `BytesMut`.

use bytes::{BufMut, BytesMut};

/// `NBDMAGIC`, first eight bytes the server sends.
pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
/// `IHAVEOPT`: the newstyle magic, also prefixing every option the client sends.
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
/// Magic of an option reply.
pub const OPT_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
/// Magic of a transmission request.
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
/// Magic of a simple reply.
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;

// Handshake flags (server) and client flags.
pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
pub const FLAG_NO_ZEROES: u16 = 1 << 1;
pub const FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
pub const FLAG_C_NO_ZEROES: u32 = 1 << 1;

// Transmission flags.
pub const FLAG_HAS_FLAGS: u16 = 1 << 0;
pub const FLAG_READ_ONLY: u16 = 1 << 1;
pub const FLAG_SEND_FLUSH: u16 = 1 << 2;
pub const FLAG_SEND_FUA: u16 = 1 << 3;
pub const FLAG_ROTATIONAL: u16 = 1 << 4;
pub const FLAG_SEND_TRIM: u16 = 1 << 5;
pub const FLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;
pub const FLAG_CAN_MULTI_CONN: u16 = 1 << 8;

// Options.
pub const OPT_EXPORT_NAME: u32 = 1;
pub const OPT_ABORT: u32 = 2;
pub const OPT_LIST: u32 = 3;
pub const OPT_STARTTLS: u32 = 5;
pub const OPT_INFO: u32 = 6;
pub const OPT_GO: u32 = 7;
pub const OPT_STRUCTURED_REPLY: u32 = 8;

// Option reply types.
pub const REP_ACK: u32 = 1;
pub const REP_SERVER: u32 = 2;
pub const REP_INFO: u32 = 3;
pub const REP_ERR_UNSUP: u32 = (1 << 31) + 1;
pub const REP_ERR_POLICY: u32 = (1 << 31) + 2;
pub const REP_ERR_INVALID: u32 = (1 << 31) + 3;
pub const REP_ERR_UNKNOWN: u32 = (1 << 31) + 6;
pub const REP_ERR_SHUTDOWN: u32 = (1 << 31) + 7;

// Info types carried in `REP_INFO`.
pub const INFO_EXPORT: u16 = 0;
pub const INFO_NAME: u16 = 1;
pub const INFO_DESCRIPTION: u16 = 2;
pub const INFO_BLOCK_SIZE: u16 = 3;

// Commands.
pub const CMD_READ: u16 = 0;
pub const CMD_WRITE: u16 = 1;
pub const CMD_DISC: u16 = 2;
pub const CMD_FLUSH: u16 = 3;
pub const CMD_TRIM: u16 = 4;
pub const CMD_WRITE_ZEROES: u16 = 6;

// Command flags.
pub const CMD_FLAG_FUA: u16 = 1 << 0;
pub const CMD_FLAG_NO_HOLE: u16 = 1 << 1;

/// Smallest IO Vesta accepts: the sector. Every offset and length must be a multiple of it.
pub const BLOCK_SIZE_MIN: u32 = 512;
/// The page size, which avoids read-modify-write in the cache log.
pub const BLOCK_SIZE_PREFERRED: u32 = 4096;
/// The largest READ or WRITE payload; the limit the spec asks interoperable clients to keep.
pub const BLOCK_SIZE_MAX: u32 = 32 << 20;

/// Length of a request header on the wire.
pub const REQUEST_LEN: usize = 28;
/// Length of a simple reply header on the wire.
pub const SIMPLE_REPLY_LEN: usize = 16;
/// Longest export name the spec allows.
pub const NAME_MAX: usize = 4096;

/// An error number carried in a reply. Only the values the spec defines are ever sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Errno(pub u32);

impl Errno {
    pub const EPERM: Errno = Errno(1);
    pub const EIO: Errno = Errno(5);
    pub const ENOMEM: Errno = Errno(12);
    pub const EINVAL: Errno = Errno(22);
    pub const ENOSPC: Errno = Errno(28);
    pub const EOVERFLOW: Errno = Errno(75);
    pub const ENOTSUP: Errno = Errno(95);
    pub const ESHUTDOWN: Errno = Errno(108);

    pub fn name(self) -> &'static str {
        match self.0 {
            0 => "OK",
            1 => "EPERM",
            5 => "EIO",
            12 => "ENOMEM",
            22 => "EINVAL",
            28 => "ENOSPC",
            75 => "EOVERFLOW",
            95 => "ENOTSUP",
            108 => "ESHUTDOWN",
            _ => "E?",
        }
    }
}

impl std::fmt::Display for Errno {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.name(), self.0)
    }
}

/// A transmission-phase request header, decoded but not yet validated against an export.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    pub flags: u16,
    pub kind: u16,
    pub cookie: u64,
    pub offset: u64,
    pub len: u32,
}

impl Request {
    /// Decodes a header; `None` if the magic is wrong (the stream is then unusable).
    pub fn decode(b: &[u8; REQUEST_LEN]) -> Option<Request> {
        if be32(&b[0..4]) != REQUEST_MAGIC {
            return None;
        }
        Some(Request {
            flags: be16(&b[4..6]),
            kind: be16(&b[6..8]),
            cookie: be64(&b[8..16]),
            offset: be64(&b[16..24]),
            len: be32(&b[24..28]),
        })
    }

    pub fn encode(&self, out: &mut BytesMut) {
        out.put_u32(REQUEST_MAGIC);
        out.put_u16(self.flags);
        out.put_u16(self.kind);
        out.put_u64(self.cookie);
        out.put_u64(self.offset);
        out.put_u32(self.len);
    }
}

/// Name of a command for log lines.
pub fn command_name(kind: u16) -> &'static str {
    match kind {
        CMD_READ => "READ",
        CMD_WRITE => "WRITE",
        CMD_DISC => "DISC",
        CMD_FLUSH => "FLUSH",
        CMD_TRIM => "TRIM",
        CMD_WRITE_ZEROES => "WRITE_ZEROES",
        _ => "UNKNOWN",
    }
}

/// Encodes the 16-byte header of a simple reply.
pub fn encode_simple_reply(out: &mut BytesMut, errno: Errno, cookie: u64) {
    out.put_u32(SIMPLE_REPLY_MAGIC);
    out.put_u32(errno.0);
    out.put_u64(cookie);
}

/// Decodes a simple reply header into (errno, cookie); `None` on a wrong magic.
pub fn decode_simple_reply(b: &[u8; SIMPLE_REPLY_LEN]) -> Option<(Errno, u64)> {
    if be32(&b[0..4]) != SIMPLE_REPLY_MAGIC {
        return None;
    }
    Some((Errno(be32(&b[4..8])), be64(&b[8..16])))
}

/// Encodes an option reply: header and payload.
pub fn encode_option_reply(out: &mut BytesMut, option: u32, reply: u32, data: &[u8]) {
    out.put_u64(OPT_REPLY_MAGIC);
    out.put_u32(option);
    out.put_u32(reply);
    out.put_u32(data.len() as u32);
    out.put_slice(data);
}

/// The payload of `NBD_OPT_INFO` / `NBD_OPT_GO`: an export name and the info types asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InfoRequest {
    pub name: String,
    pub requests: Vec<u16>,
}

impl InfoRequest {
    /// Parses the option data; `None` if lengths are inconsistent or the name is not UTF-8.
    pub fn decode(data: &[u8]) -> Option<InfoRequest> {
        if data.len() < 4 {
            return None;
        }
        let name_len = be32(&data[0..4]) as usize;
        if name_len > NAME_MAX || data.len() < 4 + name_len + 2 {
            return None;
        }
        let name = std::str::from_utf8(&data[4..4 + name_len]).ok()?.to_owned();
        let rest = &data[4 + name_len..];
        let count = be16(&rest[0..2]) as usize;
        if rest.len() != 2 + 2 * count {
            return None;
        }
        let requests = (0..count)
            .map(|i| be16(&rest[2 + 2 * i..4 + 2 * i]))
            .collect();
        Some(InfoRequest { name, requests })
    }

    pub fn encode(&self, out: &mut BytesMut) {
        out.put_u32(self.name.len() as u32);
        out.put_slice(self.name.as_bytes());
        out.put_u16(self.requests.len() as u16);
        for r in &self.requests {
            out.put_u16(*r);
        }
    }
}

/// `NBD_INFO_EXPORT` payload.
pub fn info_export(size: u64, flags: u16) -> Vec<u8> {
    let mut v = Vec::with_capacity(12);
    v.extend_from_slice(&INFO_EXPORT.to_be_bytes());
    v.extend_from_slice(&size.to_be_bytes());
    v.extend_from_slice(&flags.to_be_bytes());
    v
}

/// `NBD_INFO_BLOCK_SIZE` payload with Vesta's constraints.
pub fn info_block_size(min: u32, preferred: u32, max: u32) -> Vec<u8> {
    let mut v = Vec::with_capacity(14);
    v.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
    v.extend_from_slice(&min.to_be_bytes());
    v.extend_from_slice(&preferred.to_be_bytes());
    v.extend_from_slice(&max.to_be_bytes());
    v
}

/// An `NBD_INFO_NAME` or `NBD_INFO_DESCRIPTION` payload.
pub fn info_string(kind: u16, s: &str) -> Vec<u8> {
    let mut v = Vec::with_capacity(2 + s.len());
    v.extend_from_slice(&kind.to_be_bytes());
    v.extend_from_slice(s.as_bytes());
    v
}

pub fn be16(b: &[u8]) -> u16 {
    u16::from_be_bytes([b[0], b[1]])
}

pub fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}

pub fn be64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_be_bytes(a)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_round_trips() {
        let r = Request {
            flags: CMD_FLAG_FUA,
            kind: CMD_WRITE,
            cookie: 0xdead_beef_0000_0001,
            offset: 1 << 40,
            len: 4096,
        };
        let mut b = BytesMut::new();
        r.encode(&mut b);
        let arr: [u8; REQUEST_LEN] = b[..].try_into().unwrap();
        assert_eq!(Request::decode(&arr), Some(r));
    }

    #[test]
    fn request_with_bad_magic_is_rejected() {
        let mut arr = [0u8; REQUEST_LEN];
        arr[0..4].copy_from_slice(&0x2560_9514u32.to_be_bytes());
        assert_eq!(Request::decode(&arr), None);
    }

    #[test]
    fn info_request_round_trips_and_rejects_inconsistent_lengths() {
        let r = InfoRequest {
            name: "vol-1".into(),
            requests: vec![INFO_BLOCK_SIZE, INFO_NAME],
        };
        let mut b = BytesMut::new();
        r.encode(&mut b);
        assert_eq!(InfoRequest::decode(&b), Some(r.clone()));
        // One byte short: the count says two requests but only one and a half are present.
        assert_eq!(InfoRequest::decode(&b[..b.len() - 1]), None);
        // Name length larger than the data.
        let mut bad = b.to_vec();
        bad[0..4].copy_from_slice(&1000u32.to_be_bytes());
        assert_eq!(InfoRequest::decode(&bad), None);
        // Trailing garbage.
        let mut long = b.to_vec();
        long.push(0);
        assert_eq!(InfoRequest::decode(&long), None);
        assert_eq!(InfoRequest::decode(&[]), None);
    }

    #[test]
    fn simple_reply_round_trips() {
        let mut b = BytesMut::new();
        encode_simple_reply(&mut b, Errno::ENOSPC, 7);
        let arr: [u8; SIMPLE_REPLY_LEN] = b[..].try_into().unwrap();
        assert_eq!(decode_simple_reply(&arr), Some((Errno::ENOSPC, 7)));
    }
}
