//! A TCP fault proxy for network failures between hosts (DESIGN §10): it forwards
//! connections from its own loopback address to an upstream one until a test cuts it.
//!
//! - [`FaultProxy::cut`]: a partition that resets, as when a switch port goes down: every
//!   connection through the proxy is closed and new ones are refused until [`FaultProxy::heal`].
//! - [`FaultProxy::blackhole`]: a partition that says nothing: connections stay open but no
//!   byte gets through in either direction, so only timeouts can tell.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const OPEN: u8 = 0;
const CUT: u8 = 1;
const BLACKHOLE: u8 = 2;

pub struct FaultProxy {
    /// Where clients connect (`ip:port`).
    pub addr: String,
    state: Arc<AtomicU8>,
    conns: Arc<Mutex<Vec<TcpStream>>>,
}

impl FaultProxy {
    /// Listens on `ip` (port chosen by the OS) and forwards to `upstream`.
    pub fn start(ip: &str, upstream: &str) -> FaultProxy {
        let l = TcpListener::bind(format!("{ip}:0")).expect("bind the fault proxy");
        let addr = l.local_addr().expect("address").to_string();
        let state = Arc::new(AtomicU8::new(OPEN));
        let conns: Arc<Mutex<Vec<TcpStream>>> = Arc::default();
        let (st, cs, up) = (state.clone(), conns.clone(), upstream.to_owned());
        std::thread::spawn(move || {
            for c in l.incoming() {
                let Ok(c) = c else { continue };
                if st.load(Ordering::SeqCst) == CUT {
                    let _ = c.shutdown(Shutdown::Both);
                    continue;
                }
                let Ok(u) = TcpStream::connect(&up) else {
                    continue;
                };
                let _ = c.set_nodelay(true);
                let _ = u.set_nodelay(true);
                {
                    let mut v = cs.lock().unwrap();
                    v.push(c.try_clone().unwrap());
                    v.push(u.try_clone().unwrap());
                }
                for (from, to) in [(c.try_clone().unwrap(), u.try_clone().unwrap()), (u, c)] {
                    let st = st.clone();
                    std::thread::spawn(move || pump(from, to, &st));
                }
            }
        });
        FaultProxy { addr, state, conns }
    }

    pub fn cut(&self) {
        self.state.store(CUT, Ordering::SeqCst);
        for c in self.conns.lock().unwrap().drain(..) {
            let _ = c.shutdown(Shutdown::Both);
        }
    }

    pub fn blackhole(&self) {
        self.state.store(BLACKHOLE, Ordering::SeqCst);
    }

    pub fn heal(&self) {
        self.state.store(OPEN, Ordering::SeqCst);
    }
}

/// Copies bytes one way until either side closes; holds them back while blackholed.
fn pump(mut from: TcpStream, mut to: TcpStream, state: &AtomicU8) {
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        while state.load(Ordering::SeqCst) == BLACKHOLE {
            std::thread::sleep(Duration::from_millis(20));
        }
        if state.load(Ordering::SeqCst) == CUT || to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = to.shutdown(Shutdown::Both);
    let _ = from.shutdown(Shutdown::Both);
}
