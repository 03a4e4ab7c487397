//! A TCP fault proxy for network failures between hosts (DESIGN §10): it forwards
//! connections from its own loopback address to an upstream one until a test cuts it.
//!
//! - [`FaultProxy::cut`]: a partition that resets, as when a switch port goes down: every
//!   connection through the proxy is closed and new ones are refused until [`FaultProxy::heal`].
//! - [`FaultProxy::blackhole`]: a partition that says nothing: connections stay open but no
//!   byte gets through in either direction, nor the end of a connection, so only timeouts can
//!   tell.
//! - [`FaultProxy::freeze`]: the upstream host died without a word while its connections were
//!   idle (a power cut, with nothing sent on them since): each connection open now stays open
//!   on the client's side, and nothing of it passes either way, its end included, until
//!   [`FaultProxy::cut`]. New connections pass: the host is back.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
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
    /// Connections accepted so far, and how many of the first of them [`FaultProxy::freeze`]
    /// froze.
    accepted: Arc<AtomicU64>,
    frozen: Arc<AtomicU64>,
}

/// One connection's view of the proxy's faults.
#[derive(Clone)]
struct Faults {
    state: Arc<AtomicU8>,
    frozen: Arc<AtomicU64>,
    /// This connection's number, in the order accepted.
    index: u64,
}

impl Faults {
    /// Whether nothing may pass now (bytes, or the connection's end).
    fn holding(&self) -> bool {
        let state = self.state.load(Ordering::SeqCst);
        state == BLACKHOLE || (state != CUT && self.index < self.frozen.load(Ordering::SeqCst))
    }

    fn wait(&self) {
        while self.holding() {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl FaultProxy {
    /// Listens on `ip` (port chosen by the OS) and forwards to `upstream`.
    pub fn start(ip: &str, upstream: &str) -> FaultProxy {
        let l = TcpListener::bind(format!("{ip}:0")).expect("bind the fault proxy");
        let addr = l.local_addr().expect("address").to_string();
        let state = Arc::new(AtomicU8::new(OPEN));
        let conns: Arc<Mutex<Vec<TcpStream>>> = Arc::default();
        let (accepted, frozen) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        let (st, cs, up) = (state.clone(), conns.clone(), upstream.to_owned());
        let (acc, fr) = (accepted.clone(), frozen.clone());
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
                let faults = Faults {
                    state: st.clone(),
                    frozen: fr.clone(),
                    index: acc.fetch_add(1, Ordering::SeqCst),
                };
                for (from, to) in [(c.try_clone().unwrap(), u.try_clone().unwrap()), (u, c)] {
                    let faults = faults.clone();
                    std::thread::spawn(move || pump(from, to, &faults));
                }
            }
        });
        FaultProxy {
            addr,
            state,
            conns,
            accepted,
            frozen,
        }
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

    /// Freezes every connection open now (see the module docs); [`FaultProxy::cut`] ends them.
    pub fn freeze(&self) {
        self.frozen
            .store(self.accepted.load(Ordering::SeqCst), Ordering::SeqCst);
    }
}

/// Copies bytes one way until either side closes; holds them back, and the end of the
/// connection too, while blackholed or frozen.
fn pump(mut from: TcpStream, mut to: TcpStream, faults: &Faults) {
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        faults.wait();
        if faults.state.load(Ordering::SeqCst) == CUT || to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    faults.wait();
    let _ = to.shutdown(Shutdown::Both);
    let _ = from.shutdown(Shutdown::Both);
}
