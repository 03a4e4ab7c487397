//! The peer protocol's frames (pure: no IO).
//!
//! Every frame is a 32-byte header and a body:
//!
//! | offset | size | field |
//! |---:|---:|---|
//! | 0 | 4 | magic `VSPR` |
//! | 4 | 1 | protocol version ([`VERSION`]) |
//! | 5 | 1 | frame kind ([`Kind`]) |
//! | 6 | 2 | flags (bit 0: a write of zeroes, no payload; bit 1: zeroes kept allocated) |
//! | 8 | 8 | request number; a reply carries its request's |
//! | 16 | 4 | body length |
//! | 20 | 4 | crc32c of the body |
//! | 24 | 4 | crc32c of bytes 0..24 |
//! | 28 | 4 | reserved, zero |
//!
//! All integers are little endian. Bodies:
//!
//! - `Hello`: nonce (16), proof (32; zero from the connecting side), then the sender's host
//!   name (UTF-8). The peer answers the owner's `Hello` with its own (see [`crate::auth`]).
//! - `Proof`: the connecting side's proof (32). Answered with a `Reply`.
//! - `Open`: volume UUID (16), gen (8), checkpoint (8). The owner starts replicating the
//!   volume's generation `gen` to this peer; every write above `checkpoint` will follow.
//! - `Write`: volume (16), gen (8), ser (8), offset (8), length (8), then the data (absent for
//!   zeroes).
//! - `Flush`: empty. Answered once every write before it is on the peer's stable media.
//! - `Checkpoint`: volume (16), gen (8), ser (8), then, only if nonzero, a window end (8). The
//!   datastore holds the volume's writes up to `ser`; the peer may drop its copies of them. A
//!   window end says the owner is about to send a window up to it: the datastore may hold
//!   parts of the writes up to it, and a replay must reach it before its first checkpoint. The
//!   peer answers such a checkpoint once it is durable. (Added without a new version: a peer
//!   of an earlier build reads the first 32 bytes and answers as for a plain checkpoint.)
//! - `Drop`: volume (16), gen (8). The peer drops every copy of the volume of a gen ≤ this.
//! - `Held`: volume (16), gen (8), from (8). Asked by a host about to replay the volume, or
//!   by its owner waiting on a hand-off no peer has taken up: the peer makes its replicas durable and answers with the highest `ser`
//!   it holds contiguously above `from` in that generation, as decimal text in an `Ok` reply
//!   (`from` itself if it holds none). Added after version 2 first shipped, without a new
//!   version: a peer of an earlier build closes the connection on it, and the asking host
//!   treats it as unreachable. A peer that holds nothing of the volume at all answers
//!   `Absent` (added the same way: a host of an earlier build fails the link on the
//!   unknown status, and treats the peer as unreachable).
//! - `Reply`: status (1: [`Status`]), then a UTF-8 message.
//!
//! Until the handshake is done, a frame must be the handshake's next one and carry a body of
//! at most [`HANDSHAKE_BODY_MAX`] bytes.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use uuid::Uuid;

use crate::auth::{Nonce, Proof, NONCE_LEN, PROOF_LEN};

pub const MAGIC: [u8; 4] = *b"VSPR";
/// The protocol version this build speaks. A host that speaks another closes the connection
/// at the first frame; the other side logs both versions if it can read them.
/// Version 2: authenticated handshake. Version 3: the answer to `Held` carries the newest
/// checkpoint the peer was sent (`upto checkpoint`), which a version-2 host could not read:
/// it would take the peer for one that cannot say what it holds.
pub const VERSION: u8 = 3;
pub const HEADER_LEN: usize = 32;
/// Largest body: a 32 MiB write (the largest NBD request Vesta takes) and its fields.
pub const BODY_MAX: u32 = (32 << 20) + 64;
/// Largest body before the handshake is done: nothing big is read from a stranger.
pub const HANDSHAKE_BODY_MAX: u32 = 1024;
/// The `Ok` answer's message to a `Checkpoint` with a window end, from a peer that holds it
/// durably. A peer of an earlier build answers with an empty one: it took only the checkpoint.
pub const WINDOW_END_HELD: &str = "window end held";
const FLAG_ZERO: u16 = 1;
const FLAG_ALLOC: u16 = 2;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Hello,
    Open,
    Write,
    Flush,
    Checkpoint,
    Drop,
    Reply,
    Proof,
    Held,
}

impl Kind {
    fn code(self) -> u8 {
        match self {
            Kind::Hello => 1,
            Kind::Open => 2,
            Kind::Write => 3,
            Kind::Flush => 4,
            Kind::Checkpoint => 5,
            Kind::Drop => 6,
            Kind::Reply => 7,
            Kind::Proof => 8,
            Kind::Held => 9,
        }
    }

    fn from_code(c: u8) -> Option<Kind> {
        Some(match c {
            1 => Kind::Hello,
            2 => Kind::Open,
            3 => Kind::Write,
            4 => Kind::Flush,
            5 => Kind::Checkpoint,
            6 => Kind::Drop,
            7 => Kind::Reply,
            8 => Kind::Proof,
            9 => Kind::Held,
            _ => return None,
        })
    }
}

/// How a request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    Ok,
    /// The peer could not do it (its cache device failed, it is out of space…).
    Failed,
    /// The peer knows a newer generation of the volume: the sender is a stale owner.
    Stale,
    /// The peer holds nothing of the volume asked about (an answer to `Held` only).
    Absent,
}

impl Status {
    fn code(self) -> u8 {
        match self {
            Status::Ok => 0,
            Status::Failed => 1,
            Status::Stale => 2,
            Status::Absent => 3,
        }
    }

    fn from_code(c: u8) -> Option<Status> {
        Some(match c {
            0 => Status::Ok,
            1 => Status::Failed,
            2 => Status::Stale,
            3 => Status::Absent,
            _ => return None,
        })
    }
}

/// One write as replicated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WriteMsg {
    pub volume: Uuid,
    pub gen: u64,
    pub ser: u64,
    pub offset: u64,
    pub len: u64,
    /// The data; `None` for WRITE_ZEROES and TRIM.
    pub data: Option<Bytes>,
    /// A zeroing the datastore must keep allocated (WRITE_ZEROES with NO_HOLE): flag bit 1,
    /// which peers of builds before it ignore (they keep a plain zeroing, the same zeroes).
    pub alloc: bool,
}

/// A decoded frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Msg {
    Hello {
        host: String,
        nonce: Nonce,
        proof: Proof,
    },
    Proof(Proof),
    Open {
        volume: Uuid,
        gen: u64,
        checkpoint: u64,
    },
    Write(WriteMsg),
    Flush,
    Checkpoint {
        volume: Uuid,
        gen: u64,
        ser: u64,
        window_end: u64,
    },
    Drop {
        volume: Uuid,
        gen: u64,
    },
    Held {
        volume: Uuid,
        gen: u64,
        from: u64,
    },
    Reply {
        status: Status,
        msg: String,
    },
}

/// A frame that cannot be taken: the connection is closed (after a reply if one can be
/// addressed), since framing can no longer be trusted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("bad magic (not a Vesta peer connection)")]
    Magic,
    #[error("peer speaks protocol version {0}, this build speaks {VERSION}")]
    Version(u8),
    #[error("frame header checksum mismatch")]
    HeaderChecksum,
    #[error("frame body checksum mismatch")]
    BodyChecksum,
    #[error("frame body of {0} bytes is over the limit")]
    TooLong(u32),
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    #[error("malformed {0:?} body")]
    Malformed(Kind),
}

/// A decoded header: what to read next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Head {
    pub kind: Kind,
    pub flags: u16,
    pub seq: u64,
    pub body_len: u32,
    pub body_crc: u32,
}

/// A frame's body, encoded once and sendable on any number of links (only the header, with
/// its request number, differs). A write's data is not copied: it is the second part.
#[derive(Debug, Clone)]
pub struct Body {
    kind: Kind,
    flags: u16,
    /// The fields, then (for a write) the data.
    pub parts: [Bytes; 2],
    crc: u32,
}

impl Body {
    pub fn new(msg: &Msg) -> Body {
        let mut b = BytesMut::new();
        let mut flags = 0u16;
        let mut data = Bytes::new();
        let kind = match msg {
            Msg::Hello { host, nonce, proof } => {
                b.put_slice(nonce);
                b.put_slice(proof);
                b.put_slice(host.as_bytes());
                Kind::Hello
            }
            Msg::Proof(proof) => {
                b.put_slice(proof);
                Kind::Proof
            }
            Msg::Open {
                volume,
                gen,
                checkpoint,
            } => {
                b.put_slice(volume.as_bytes());
                b.put_u64_le(*gen);
                b.put_u64_le(*checkpoint);
                Kind::Open
            }
            Msg::Write(w) => {
                b.put_slice(w.volume.as_bytes());
                b.put_u64_le(w.gen);
                b.put_u64_le(w.ser);
                b.put_u64_le(w.offset);
                b.put_u64_le(w.len);
                match &w.data {
                    Some(d) => data = d.clone(),
                    None if w.alloc => flags |= FLAG_ZERO | FLAG_ALLOC,
                    None => flags |= FLAG_ZERO,
                }
                Kind::Write
            }
            Msg::Flush => Kind::Flush,
            Msg::Checkpoint {
                volume,
                gen,
                ser,
                window_end,
            } => {
                b.put_slice(volume.as_bytes());
                b.put_u64_le(*gen);
                b.put_u64_le(*ser);
                if *window_end != 0 {
                    b.put_u64_le(*window_end);
                }
                Kind::Checkpoint
            }
            Msg::Drop { volume, gen } => {
                b.put_slice(volume.as_bytes());
                b.put_u64_le(*gen);
                Kind::Drop
            }
            Msg::Held { volume, gen, from } => {
                b.put_slice(volume.as_bytes());
                b.put_u64_le(*gen);
                b.put_u64_le(*from);
                Kind::Held
            }
            Msg::Reply { status, msg } => {
                b.put_u8(status.code());
                b.put_slice(msg.as_bytes());
                Kind::Reply
            }
        };
        let crc = crc32c::crc32c_append(crc32c::crc32c(&b), &data);
        Body {
            kind,
            flags,
            parts: [b.freeze(), data],
            crc,
        }
    }

    pub fn len(&self) -> usize {
        self.parts[0].len() + self.parts[1].len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn kind(&self) -> Kind {
        self.kind
    }

    /// The frame header for sending this body as request `seq`.
    pub fn header(&self, seq: u64) -> [u8; HEADER_LEN] {
        let mut out = [0u8; HEADER_LEN];
        let mut w = &mut out[..];
        w.put_slice(&MAGIC);
        w.put_u8(VERSION);
        w.put_u8(self.kind.code());
        w.put_u16_le(self.flags);
        w.put_u64_le(seq);
        w.put_u32_le(self.len() as u32);
        w.put_u32_le(self.crc);
        let head_crc = crc32c::crc32c(&out[..24]);
        out[24..28].copy_from_slice(&head_crc.to_le_bytes());
        out
    }
}

/// Encodes a frame: header and body in one buffer.
pub fn encode(seq: u64, msg: &Msg) -> Bytes {
    let body = Body::new(msg);
    let mut out = BytesMut::with_capacity(HEADER_LEN + body.len());
    out.put_slice(&body.header(seq));
    out.put_slice(&body.parts[0]);
    out.put_slice(&body.parts[1]);
    out.freeze()
}

/// Decodes a frame header.
pub fn decode_head(b: &[u8; HEADER_LEN]) -> Result<Head, WireError> {
    if b[..4] != MAGIC {
        return Err(WireError::Magic);
    }
    let mut h = &b[4..];
    let version = h.get_u8();
    let kind = h.get_u8();
    let flags = h.get_u16_le();
    let seq = h.get_u64_le();
    let body_len = h.get_u32_le();
    let body_crc = h.get_u32_le();
    let head_crc = h.get_u32_le();
    if crc32c::crc32c(&b[..24]) != head_crc {
        return Err(WireError::HeaderChecksum);
    }
    if version != VERSION {
        return Err(WireError::Version(version));
    }
    let kind = Kind::from_code(kind).ok_or(WireError::UnknownKind(kind))?;
    if body_len > BODY_MAX {
        return Err(WireError::TooLong(body_len));
    }
    Ok(Head {
        kind,
        flags,
        seq,
        body_len,
        body_crc,
    })
}

fn uuid(b: &mut Bytes) -> Uuid {
    let mut id = [0u8; 16];
    b.copy_to_slice(&mut id);
    Uuid::from_bytes(id)
}

/// Decodes a body whose header was `h`; checks the body's checksum.
pub fn decode_body(h: &Head, mut b: Bytes) -> Result<Msg, WireError> {
    if crc32c::crc32c(&b) != h.body_crc {
        return Err(WireError::BodyChecksum);
    }
    let bad = || WireError::Malformed(h.kind);
    let need = |b: &Bytes, n: usize| if b.len() >= n { Ok(()) } else { Err(bad()) };
    let text = |b: Bytes| String::from_utf8(b.to_vec()).map_err(|_| bad());
    Ok(match h.kind {
        Kind::Hello => {
            need(&b, NONCE_LEN + PROOF_LEN)?;
            let mut nonce = [0u8; NONCE_LEN];
            let mut proof = [0u8; PROOF_LEN];
            b.copy_to_slice(&mut nonce);
            b.copy_to_slice(&mut proof);
            Msg::Hello {
                host: text(b)?,
                nonce,
                proof,
            }
        }
        Kind::Proof => {
            if b.len() != PROOF_LEN {
                return Err(bad());
            }
            let mut proof = [0u8; PROOF_LEN];
            b.copy_to_slice(&mut proof);
            Msg::Proof(proof)
        }
        Kind::Open => {
            need(&b, 32)?;
            Msg::Open {
                volume: uuid(&mut b),
                gen: b.get_u64_le(),
                checkpoint: b.get_u64_le(),
            }
        }
        Kind::Write => {
            need(&b, 48)?;
            let volume = uuid(&mut b);
            let (gen, ser, offset, len) = (
                b.get_u64_le(),
                b.get_u64_le(),
                b.get_u64_le(),
                b.get_u64_le(),
            );
            let data = if h.flags & FLAG_ZERO != 0 {
                if !b.is_empty() {
                    return Err(bad());
                }
                None
            } else {
                if b.len() as u64 != len {
                    return Err(bad());
                }
                Some(b)
            };
            Msg::Write(WriteMsg {
                volume,
                gen,
                ser,
                offset,
                len,
                alloc: data.is_none() && h.flags & FLAG_ALLOC != 0,
                data,
            })
        }
        Kind::Flush => Msg::Flush,
        Kind::Checkpoint => {
            need(&b, 32)?;
            Msg::Checkpoint {
                volume: uuid(&mut b),
                gen: b.get_u64_le(),
                ser: b.get_u64_le(),
                window_end: if b.len() >= 8 { b.get_u64_le() } else { 0 },
            }
        }
        Kind::Drop => {
            need(&b, 24)?;
            Msg::Drop {
                volume: uuid(&mut b),
                gen: b.get_u64_le(),
            }
        }
        Kind::Held => {
            need(&b, 32)?;
            Msg::Held {
                volume: uuid(&mut b),
                gen: b.get_u64_le(),
                from: b.get_u64_le(),
            }
        }
        Kind::Reply => {
            need(&b, 1)?;
            let status = Status::from_code(b.get_u8()).ok_or_else(bad)?;
            Msg::Reply {
                status,
                msg: text(b)?,
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn roundtrip(seq: u64, m: &Msg) -> Result<(u64, Msg), WireError> {
        let f = encode(seq, m);
        let head: [u8; HEADER_LEN] = f[..HEADER_LEN].try_into().unwrap();
        let h = decode_head(&head)?;
        assert_eq!(h.body_len as usize, f.len() - HEADER_LEN);
        Ok((h.seq, decode_body(&h, f.slice(HEADER_LEN..))?))
    }

    fn msg() -> impl Strategy<Value = Msg> {
        let id = any::<u128>().prop_map(Uuid::from_u128);
        prop_oneof![
            ("[a-z0-9.-]{0,20}", any::<[u8; 16]>(), any::<[u8; 32]>())
                .prop_map(|(host, nonce, proof)| Msg::Hello { host, nonce, proof }),
            any::<[u8; 32]>().prop_map(Msg::Proof),
            (id.clone(), any::<u64>(), any::<u64>()).prop_map(|(volume, gen, checkpoint)| {
                Msg::Open {
                    volume,
                    gen,
                    checkpoint,
                }
            }),
            (
                id.clone(),
                any::<u64>(),
                any::<u64>(),
                any::<u64>(),
                proptest::collection::vec(any::<u8>(), 0..2048),
                any::<bool>(),
            )
                .prop_map(|(volume, gen, ser, offset, data, zero)| {
                    Msg::Write(WriteMsg {
                        volume,
                        gen,
                        ser,
                        offset,
                        len: if zero {
                            offset % 9999
                        } else {
                            data.len() as u64
                        },
                        alloc: zero && ser % 2 == 0,
                        data: (!zero).then(|| Bytes::from(data)),
                    })
                }),
            Just(Msg::Flush),
            (
                id.clone(),
                any::<u64>(),
                any::<u64>(),
                prop_oneof![Just(0u64), any::<u64>()]
            )
                .prop_map(|(volume, gen, ser, window_end)| Msg::Checkpoint {
                    volume,
                    gen,
                    ser,
                    window_end
                }),
            (id.clone(), any::<u64>()).prop_map(|(volume, gen)| Msg::Drop { volume, gen }),
            (id, any::<u64>(), any::<u64>()).prop_map(|(volume, gen, from)| Msg::Held {
                volume,
                gen,
                from
            }),
            (0u8..4, "[ -~]{0,40}").prop_map(|(s, msg)| Msg::Reply {
                status: Status::from_code(s).unwrap(),
                msg
            }),
        ]
    }

    proptest! {
        #[test]
        fn every_frame_roundtrips(seq in any::<u64>(), m in msg()) {
            prop_assert_eq!(roundtrip(seq, &m), Ok((seq, m)));
        }

        /// Any single flipped bit is caught: by a checksum, the magic, or a field check. A
        /// frame that decodes after a flip would be a write to the wrong place.
        #[test]
        fn a_flipped_bit_never_decodes(seq in any::<u64>(), m in msg(), at in any::<usize>(), bit in 0u8..8) {
            let mut f = encode(seq, &m).to_vec();
            let at = at % f.len();
            if (28..32).contains(&at) {
                return Ok(()); // reserved bytes
            }
            f[at] ^= 1 << bit;
            let head: [u8; HEADER_LEN] = f[..HEADER_LEN].try_into().unwrap();
            let r = decode_head(&head).and_then(|h| {
                if h.body_len as usize != f.len() - HEADER_LEN {
                    return Err(WireError::Malformed(h.kind));
                }
                decode_body(&h, Bytes::from(f[HEADER_LEN..].to_vec()))
            });
            prop_assert!(r.is_err(), "decoded after a flip at byte {}: {:?}", at, r);
        }
    }

    /// A plain checkpoint keeps the body earlier builds wrote; one with a window end adds 8
    /// bytes after it, which an earlier build (it reads 32) leaves unread.
    #[test]
    fn a_window_end_extends_the_checkpoint_body_and_leaves_the_rest_as_it_was() {
        let volume = Uuid::new_v4();
        let plain = encode(
            7,
            &Msg::Checkpoint {
                volume,
                gen: 3,
                ser: 10,
                window_end: 0,
            },
        );
        let ended = encode(
            7,
            &Msg::Checkpoint {
                volume,
                gen: 3,
                ser: 10,
                window_end: 42,
            },
        );
        assert_eq!(plain.len(), HEADER_LEN + 32);
        assert_eq!(ended.len(), HEADER_LEN + 40);
        assert_eq!(ended[HEADER_LEN..HEADER_LEN + 32], plain[HEADER_LEN..]);
        assert_eq!(ended[HEADER_LEN + 32..], 42u64.to_le_bytes());
    }

    #[test]
    fn another_version_is_named() {
        let mut f = encode(1, &Msg::Flush).to_vec();
        f[4] = 9;
        let crc = crc32c::crc32c(&f[..24]);
        f[24..28].copy_from_slice(&crc.to_le_bytes());
        let head: [u8; HEADER_LEN] = f[..HEADER_LEN].try_into().unwrap();
        let e = decode_head(&head).unwrap_err();
        assert_eq!(e, WireError::Version(9));
        let speaks = format!("speaks {VERSION}");
        assert!(e.to_string().contains("version 9") && e.to_string().contains(&speaks));
    }

    #[test]
    fn oversized_and_short_bodies_are_refused() {
        let mut f = encode(1, &Msg::Flush).to_vec();
        f[16..20].copy_from_slice(&(BODY_MAX + 1).to_le_bytes());
        let crc = crc32c::crc32c(&f[..24]);
        f[24..28].copy_from_slice(&crc.to_le_bytes());
        let head: [u8; HEADER_LEN] = f[..HEADER_LEN].try_into().unwrap();
        assert_eq!(decode_head(&head), Err(WireError::TooLong(BODY_MAX + 1)));

        let h = Head {
            kind: Kind::Open,
            flags: 0,
            seq: 0,
            body_len: 3,
            body_crc: crc32c::crc32c(b"abc"),
        };
        assert_eq!(
            decode_body(&h, Bytes::from_static(b"abc")),
            Err(WireError::Malformed(Kind::Open))
        );
    }
}
