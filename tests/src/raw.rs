//! A hand-driven NBD connection, for the requests real clients never send (bad magic,
//! oversized payloads, a disconnect mid-request). Deliberately independent of the `nbd`
//! crate: it checks the server against the spec, not against itself.

use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
pub const REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;

pub const OPT_ABORT: u32 = 2;
pub const OPT_LIST: u32 = 3;
pub const OPT_INFO: u32 = 6;
pub const OPT_GO: u32 = 7;
pub const REP_ACK: u32 = 1;
pub const REP_SERVER: u32 = 2;
pub const REP_INFO: u32 = 3;
pub const REP_ERR_UNSUP: u32 = (1 << 31) + 1;
pub const REP_ERR_INVALID: u32 = (1 << 31) + 3;
pub const REP_ERR_UNKNOWN: u32 = (1 << 31) + 6;

pub const CMD_READ: u16 = 0;
pub const CMD_WRITE: u16 = 1;
pub const CMD_DISC: u16 = 2;
pub const CMD_FLUSH: u16 = 3;

pub const EINVAL: u32 = 22;
pub const ENOSPC: u32 = 28;

pub struct Raw {
    pub s: UnixStream,
}

impl Raw {
    pub fn connect(sock: &Path) -> Raw {
        let s = UnixStream::connect(sock).expect("connect to vestad's unix socket");
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        Raw { s }
    }

    /// Reads the greeting and answers with fixed-newstyle + no-zeroes client flags.
    pub fn hello(&mut self) {
        let magic = self.u64();
        let opt = self.u64();
        let flags = self.u16();
        assert_eq!(magic, NBDMAGIC, "greeting magic");
        assert_eq!(opt, IHAVEOPT, "newstyle magic");
        assert_eq!(flags & 3, 3, "fixed newstyle and no-zeroes offered");
        self.s.write_all(&3u32.to_be_bytes()).unwrap();
    }

    pub fn option(&mut self, opt: u32, data: &[u8]) {
        let mut b = Vec::new();
        b.extend_from_slice(&IHAVEOPT.to_be_bytes());
        b.extend_from_slice(&opt.to_be_bytes());
        b.extend_from_slice(&(data.len() as u32).to_be_bytes());
        b.extend_from_slice(data);
        self.s.write_all(&b).unwrap();
    }

    /// Reads one option reply: (option, reply type, data).
    pub fn opt_reply(&mut self) -> (u32, u32, Vec<u8>) {
        let magic = self.u64();
        assert_eq!(magic, REPLY_MAGIC, "option reply magic");
        let opt = self.u32();
        let kind = self.u32();
        let len = self.u32() as usize;
        let mut d = vec![0; len];
        self.s.read_exact(&mut d).unwrap();
        (opt, kind, d)
    }

    pub fn go_payload(name: &str) -> Vec<u8> {
        let mut d = Vec::new();
        d.extend_from_slice(&(name.len() as u32).to_be_bytes());
        d.extend_from_slice(name.as_bytes());
        d.extend_from_slice(&1u16.to_be_bytes());
        d.extend_from_slice(&3u16.to_be_bytes()); // NBD_INFO_BLOCK_SIZE
        d
    }

    /// Connects and negotiates `name` with NBD_OPT_GO; returns the connection and export size.
    pub fn go(sock: &Path, name: &str) -> (Raw, u64) {
        let mut r = Raw::connect(sock);
        r.hello();
        r.option(OPT_GO, &Raw::go_payload(name));
        let mut size = None;
        loop {
            let (_, kind, d) = r.opt_reply();
            match kind {
                REP_INFO if u16::from_be_bytes([d[0], d[1]]) == 0 => {
                    size = Some(u64::from_be_bytes(d[2..10].try_into().unwrap()))
                }
                REP_INFO => {}
                REP_ACK => break,
                other => panic!(
                    "GO {name:?} answered {other:#x}: {}",
                    String::from_utf8_lossy(&d)
                ),
            }
        }
        (r, size.expect("NBD_INFO_EXPORT sent"))
    }

    pub fn request(&mut self, flags: u16, kind: u16, cookie: u64, offset: u64, len: u32) {
        self.s
            .write_all(&Raw::header(flags, kind, cookie, offset, len))
            .unwrap();
    }

    pub fn header(flags: u16, kind: u16, cookie: u64, offset: u64, len: u32) -> Vec<u8> {
        let mut b = Vec::with_capacity(28);
        b.extend_from_slice(&REQUEST_MAGIC.to_be_bytes());
        b.extend_from_slice(&flags.to_be_bytes());
        b.extend_from_slice(&kind.to_be_bytes());
        b.extend_from_slice(&cookie.to_be_bytes());
        b.extend_from_slice(&offset.to_be_bytes());
        b.extend_from_slice(&len.to_be_bytes());
        b
    }

    /// Reads a simple reply header: (errno, cookie).
    pub fn reply(&mut self) -> io::Result<(u32, u64)> {
        let mut h = [0u8; 16];
        self.s.read_exact(&mut h)?;
        let magic = u32::from_be_bytes(h[0..4].try_into().unwrap());
        assert_eq!(magic, SIMPLE_REPLY_MAGIC, "simple reply magic");
        Ok((
            u32::from_be_bytes(h[4..8].try_into().unwrap()),
            u64::from_be_bytes(h[8..16].try_into().unwrap()),
        ))
    }

    pub fn read_n(&mut self, n: usize) -> Vec<u8> {
        let mut d = vec![0; n];
        self.s.read_exact(&mut d).unwrap();
        d
    }

    /// True if the server closed the connection (EOF or reset) within the read timeout.
    pub fn closed(&mut self) -> bool {
        let mut b = [0u8; 1];
        match self.s.read(&mut b) {
            Ok(0) => true,
            Ok(_) => false,
            Err(e) => matches!(
                e.kind(),
                io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe
            ),
        }
    }

    fn u16(&mut self) -> u16 {
        let mut b = [0u8; 2];
        self.s.read_exact(&mut b).unwrap();
        u16::from_be_bytes(b)
    }

    fn u32(&mut self) -> u32 {
        let mut b = [0u8; 4];
        self.s.read_exact(&mut b).unwrap();
        u32::from_be_bytes(b)
    }

    fn u64(&mut self) -> u64 {
        let mut b = [0u8; 8];
        self.s.read_exact(&mut b).unwrap();
        u64::from_be_bytes(b)
    }
}
