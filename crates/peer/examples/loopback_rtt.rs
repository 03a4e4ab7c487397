//! The floor under a wbp write's added latency on this machine: the round trip of one
//! replication-sized message over TCP, with nothing else in it. One thread sends a 4 KiB
//! payload with a 40-byte header (a replica record's size on the wire) and waits for a
//! 16-byte acknowledgement; another thread, on the address given, reads each message and
//! answers it. Both use `TCP_NODELAY`; a peer's round trip can only be slower.
//!
//!   cargo run --release -p peer --example loopback_rtt -- [ADDR] [ROUNDS] [MODE]
//!
//! ADDR defaults to 127.0.0.3 (a peer's address in `bench/wbp.sh`), ROUNDS to 20000. MODE:
//! - `block` (the default): blocking sockets, as vestad's threads wait;
//! - `spin`: both sides poll non-blocking sockets instead of sleeping in the kernel, so no
//!   thread is woken for a message (what the wake-ups cost);
//! - `busy`: blocking sockets, and a third thread spinning meanwhile, so the machine's vCPUs
//!   are never idle (what waking an idle vCPU costs, on a virtual machine).
//!
//! Prints the mean and median round trip in microseconds.

use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

const MESSAGE: usize = 40 + 4096;
const ACK: usize = 16;

/// Reads `buf` whole from a socket that is non-blocking in `spin` mode, polling.
fn read_all(s: &mut TcpStream, buf: &mut [u8], spin: bool) -> std::io::Result<()> {
    if !spin {
        return s.read_exact(buf);
    }
    let mut got = 0;
    while got < buf.len() {
        match s.read(&mut buf[got..]) {
            Ok(0) => return Err(ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == ErrorKind::WouldBlock => std::hint::spin_loop(),
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Writes `buf` whole, polling if the socket is non-blocking.
fn write_all(s: &mut TcpStream, mut buf: &[u8]) -> std::io::Result<()> {
    while !buf.is_empty() {
        match s.write(buf) {
            Ok(n) => buf = &buf[n..],
            Err(e) if e.kind() == ErrorKind::WouldBlock => std::hint::spin_loop(),
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn main() -> std::io::Result<()> {
    let mut args = std::env::args().skip(1);
    let addr = args.next().unwrap_or_else(|| "127.0.0.3".into());
    let rounds: usize = match args.next() {
        Some(n) => n
            .parse()
            .map_err(|e| std::io::Error::other(format!("ROUNDS: {e}")))?,
        None => 20_000,
    };
    let mode = args.next().unwrap_or_else(|| "block".into());
    let spin = match mode.as_str() {
        "block" | "busy" => false,
        "spin" => true,
        other => {
            return Err(std::io::Error::other(format!(
                "MODE {other:?}: use block, spin or busy"
            )))
        }
    };
    let stop = Arc::new(AtomicBool::new(false));
    let busy = (mode == "busy").then(|| {
        let stop = stop.clone();
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                std::hint::spin_loop();
            }
        })
    });
    let listener = TcpListener::bind((addr.as_str(), 0))?;
    let at = listener.local_addr()?;
    let server = std::thread::spawn(move || -> std::io::Result<()> {
        let (mut s, _) = listener.accept()?;
        s.set_nodelay(true)?;
        s.set_nonblocking(spin)?;
        let mut msg = vec![0u8; MESSAGE];
        loop {
            match read_all(&mut s, &mut msg, spin) {
                Ok(()) => write_all(&mut s, &msg[..ACK])?,
                Err(e) if e.kind() == ErrorKind::UnexpectedEof => return Ok(()),
                Err(e) => return Err(e),
            }
        }
    });
    let mut c = TcpStream::connect(at)?;
    c.set_nodelay(true)?;
    c.set_nonblocking(spin)?;
    let msg = vec![0x5au8; MESSAGE];
    let mut ack = [0u8; ACK];
    let warmup = rounds / 10;
    let mut took = Vec::with_capacity(rounds);
    for i in 0..warmup + rounds {
        let t = Instant::now();
        write_all(&mut c, &msg)?;
        read_all(&mut c, &mut ack, spin)?;
        if i >= warmup {
            took.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    drop(c);
    server.join().expect("server thread")?;
    stop.store(true, Ordering::Relaxed);
    if let Some(b) = busy {
        b.join().expect("busy thread");
    }
    took.sort_by(f64::total_cmp);
    let mean = took.iter().sum::<f64>() / took.len() as f64;
    println!(
        "{:.1} {:.1}  (mean and median round trip in us, {rounds} rounds on {at}, {mode})",
        mean,
        took[took.len() / 2]
    );
    Ok(())
}
