//! NBD URIs as standardised by the NBD project's `doc/uri.md`, in the two forms Vesta uses:
//! `nbd://HOST[:PORT]/EXPORT` and `nbd+unix:///EXPORT?socket=PATH`.
//!
//! As in RFC 3986, the export name and the socket path are percent-encoded, a query follows
//! `?` (query parameters other than `socket` are ignored), and a `#fragment` is ignored. A
//! URI Vesta prints encodes every byte of the export and the path but the unreserved ones and
//! `/`, so one whose socket lives under a directory named with a space, `&` or `#` still
//! reaches the socket from QEMU or libnbd (which refuse a space, and would cut the path at
//! `&` or `#`), and parses back to the same address here.

use std::fmt;
use std::os::unix::ffi::OsStringExt as _;
use std::path::PathBuf;

pub const DEFAULT_PORT: u16 = 10809;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Address {
    Tcp { host: String, port: u16 },
    Unix(PathBuf),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NbdUri {
    pub address: Address,
    pub export: String,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("bad NBD URI {uri:?}: {reason} (examples: nbd://127.0.0.1:10809/disk, nbd+unix:///disk?socket=/run/nbd.sock)")]
pub struct UriError {
    pub uri: String,
    pub reason: &'static str,
}

impl NbdUri {
    pub fn parse(s: &str) -> Result<NbdUri, UriError> {
        let err = |reason| UriError {
            uri: s.to_owned(),
            reason,
        };
        // A fragment is not part of what is addressed.
        let whole = s.split_once('#').map_or(s, |(before, _)| before);
        if let Some(rest) = whole.strip_prefix("nbd+unix://") {
            let (path_part, query) = rest.split_once('?').ok_or(err("missing ?socket=PATH"))?;
            let export = path_part.strip_prefix('/').ok_or(err(
                "nbd+unix URIs have no host: use nbd+unix:///EXPORT?socket=PATH",
            ))?;
            let socket = query
                .split('&')
                .find_map(|kv| kv.strip_prefix("socket="))
                .ok_or(err("missing socket= parameter"))?;
            if socket.is_empty() {
                return Err(err("empty socket path"));
            }
            return Ok(NbdUri {
                address: Address::Unix(PathBuf::from(std::ffi::OsString::from_vec(
                    percent_decode_bytes(socket),
                ))),
                export: percent_decode(export),
            });
        }
        if let Some(rest) = whole.strip_prefix("nbd://") {
            let rest = rest.split_once('?').map_or(rest, |(before, _)| before);
            let (authority, export) = match rest.split_once('/') {
                Some((a, e)) => (a, e),
                None => (rest, ""),
            };
            if authority.is_empty() {
                return Err(err("missing host"));
            }
            let (host, port) = if let Some(h) = authority.strip_prefix('[') {
                let (h, p) = h.split_once(']').ok_or(err("unterminated [ipv6] host"))?;
                (h, p.strip_prefix(':'))
            } else {
                match authority.rsplit_once(':') {
                    Some((h, p)) => (h, Some(p)),
                    None => (authority, None),
                }
            };
            if host.is_empty() {
                return Err(err("missing host"));
            }
            let port = match port {
                Some(p) => p.parse().map_err(|_| err("port is not a number"))?,
                None => DEFAULT_PORT,
            };
            return Ok(NbdUri {
                address: Address::Tcp {
                    host: host.to_owned(),
                    port,
                },
                export: percent_decode(export),
            });
        }
        Err(err("scheme must be nbd:// or nbd+unix://"))
    }
}

impl fmt::Display for NbdUri {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.address {
            Address::Tcp { host, port } => {
                let export = percent_encode(self.export.as_bytes());
                if host.contains(':') {
                    write!(f, "nbd://[{host}]:{port}/{export}")
                } else {
                    write!(f, "nbd://{host}:{port}/{export}")
                }
            }
            Address::Unix(p) => {
                use std::os::unix::ffi::OsStrExt as _;
                write!(
                    f,
                    "nbd+unix:///{}?socket={}",
                    percent_encode(self.export.as_bytes()),
                    percent_encode(p.as_os_str().as_bytes())
                )
            }
        }
    }
}

/// `b` with every byte percent-encoded but the unreserved ones of RFC 3986 and `/`.
fn percent_encode(b: &[u8]) -> String {
    let mut out = String::with_capacity(b.len());
    for &c in b {
        if c.is_ascii_alphanumeric() || matches!(c, b'-' | b'.' | b'_' | b'~' | b'/') {
            out.push(c as char);
        } else {
            out.push_str(&format!("%{c:02X}"));
        }
    }
    out
}

fn percent_decode(s: &str) -> String {
    String::from_utf8_lossy(&percent_decode_bytes(s)).into_owned()
}

/// `s` with each `%XX` turned back into its byte (a path need not be UTF-8).
fn percent_decode_bytes(s: &str) -> Vec<u8> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            let hex = |c: u8| (c as char).to_digit(16);
            if let (Some(h), Some(l)) = (hex(b[i + 1]), hex(b[i + 2])) {
                out.push((h * 16 + l) as u8);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_tcp_and_unix_forms() {
        let u = NbdUri::parse("nbd://127.0.0.1:10810/disk").unwrap();
        assert_eq!(
            u.address,
            Address::Tcp {
                host: "127.0.0.1".into(),
                port: 10810
            }
        );
        assert_eq!(u.export, "disk");
        assert_eq!(u.to_string(), "nbd://127.0.0.1:10810/disk");

        let u = NbdUri::parse("nbd://localhost").unwrap();
        assert_eq!(u.export, "");
        assert_eq!(
            u.address,
            Address::Tcp {
                host: "localhost".into(),
                port: DEFAULT_PORT
            }
        );

        let u = NbdUri::parse("nbd+unix:///vol%201?socket=/tmp/x.sock").unwrap();
        assert_eq!(u.address, Address::Unix("/tmp/x.sock".into()));
        assert_eq!(u.export, "vol 1");

        let u = NbdUri::parse("nbd://[::1]:99/e").unwrap();
        assert_eq!(
            u.address,
            Address::Tcp {
                host: "::1".into(),
                port: 99
            }
        );
    }

    /// What a URI printed from an address holds reaches the same address again, here and in
    /// other clients: a space, `&`, `#`, `?`, `%` or `+` in a socket path or export name is
    /// percent-encoded (QEMU refused such a URI, and libnbd cut the path at `&` or `#`).
    #[test]
    fn a_printed_uri_parses_back_to_its_address() {
        for (path, export) in [
            ("/var/lib/vesta data/nbd.sock", "vol"),
            ("/srv/a&b/#1/x?y=z/nbd.sock", "v"),
            ("/tmp/100%/n+b.sock", "a b/c?d#e"),
            ("/run/vesta/nbd.sock", ""),
        ] {
            let u = NbdUri {
                address: Address::Unix(path.into()),
                export: export.into(),
            };
            let printed = u.to_string();
            assert!(
                !printed.contains(' ') && printed.matches('?').count() == 1,
                "{printed}"
            );
            assert!(
                !printed.contains('#') && !printed.contains('&'),
                "{printed}"
            );
            assert_eq!(NbdUri::parse(&printed).unwrap(), u, "{printed}");
        }
        let u = NbdUri {
            address: Address::Tcp {
                host: "::1".into(),
                port: 10809,
            },
            export: "a b#c?d".into(),
        };
        assert_eq!(u.to_string(), "nbd://[::1]:10809/a%20b%23c%3Fd");
        assert_eq!(NbdUri::parse(&u.to_string()).unwrap(), u);
        // A socket path need not be UTF-8.
        let u = NbdUri {
            address: Address::Unix(std::ffi::OsString::from_vec(b"/run/\xffv/s".to_vec()).into()),
            export: "v".into(),
        };
        assert_eq!(u.to_string(), "nbd+unix:///v?socket=/run/%FFv/s");
        assert_eq!(NbdUri::parse(&u.to_string()).unwrap(), u);
        // Unencoded paths as people type them still parse.
        let u = NbdUri::parse("nbd+unix:///v?socket=/run/my vesta/nbd.sock").unwrap();
        assert_eq!(u.address, Address::Unix("/run/my vesta/nbd.sock".into()));
    }

    /// A query after a TCP export and a fragment after either form are not part of the
    /// export's name or the socket's path.
    #[test]
    fn a_query_or_fragment_is_not_part_of_the_name_or_path() {
        let u = NbdUri::parse("nbd://h:1/disk?tls=off#frag").unwrap();
        assert_eq!(u.export, "disk");
        let u = NbdUri::parse("nbd://h/?x=1").unwrap();
        assert_eq!(u.export, "");
        let u = NbdUri::parse("nbd+unix:///disk?socket=/s.sock#frag").unwrap();
        assert_eq!(u.address, Address::Unix("/s.sock".into()));
        assert_eq!(u.export, "disk");
        let u = NbdUri::parse("nbd+unix:///disk?x=1&socket=/a%23b.sock").unwrap();
        assert_eq!(u.address, Address::Unix("/a#b.sock".into()));
    }

    #[test]
    fn rejects_bad_forms_with_a_reason() {
        for bad in [
            "http://x/y",
            "nbd+unix:///x",
            "nbd+unix://host/x?socket=/s",
            "nbd://:10/x",
            "nbd://h:notaport/x",
            "nbd+unix:///x?socket=",
        ] {
            assert!(NbdUri::parse(bad).is_err(), "{bad} should be rejected");
        }
    }
}
