//! The floor under a wbp write's added latency on this machine: the round trip of one
//! replication-sized message over TCP, with nothing else in it. One thread sends a 4 KiB
//! payload with a 40-byte header (a replica record's size on the wire) and waits for a
//! 16-byte acknowledgement; another thread, on the address given, reads each message and
//! answers it. Both use blocking sockets with `TCP_NODELAY`, as close to free as a round trip
//! gets; a peer's round trip can only be slower.
//!
//!   cargo run --release -p peer --example loopback_rtt -- [ADDR] [ROUNDS]
//!
//! ADDR defaults to 127.0.0.3 (a peer's address in `bench/wbp.sh`), ROUNDS to 20000. Prints
//! the mean and median round trip in microseconds.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Instant;

const MESSAGE: usize = 40 + 4096;
const ACK: usize = 16;

fn main() -> std::io::Result<()> {
    let mut args = std::env::args().skip(1);
    let addr = args.next().unwrap_or_else(|| "127.0.0.3".into());
    let rounds: usize = match args.next() {
        Some(n) => n
            .parse()
            .map_err(|e| std::io::Error::other(format!("ROUNDS: {e}")))?,
        None => 20_000,
    };
    let listener = TcpListener::bind((addr.as_str(), 0))?;
    let at = listener.local_addr()?;
    let server = std::thread::spawn(move || -> std::io::Result<()> {
        let (mut s, _) = listener.accept()?;
        s.set_nodelay(true)?;
        let mut msg = vec![0u8; MESSAGE];
        loop {
            match s.read_exact(&mut msg) {
                Ok(()) => s.write_all(&msg[..ACK])?,
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
                Err(e) => return Err(e),
            }
        }
    });
    let mut c = TcpStream::connect(at)?;
    c.set_nodelay(true)?;
    let msg = vec![0x5au8; MESSAGE];
    let mut ack = [0u8; ACK];
    let warmup = rounds / 10;
    let mut took = Vec::with_capacity(rounds);
    for i in 0..warmup + rounds {
        let t = Instant::now();
        c.write_all(&msg)?;
        c.read_exact(&mut ack)?;
        if i >= warmup {
            took.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    drop(c);
    server.join().expect("server thread")?;
    took.sort_by(f64::total_cmp);
    let mean = took.iter().sum::<f64>() / took.len() as f64;
    println!(
        "{:.1} {:.1}  (mean and median round trip in us, {rounds} rounds on {at})",
        mean,
        took[took.len() / 2]
    );
    Ok(())
}
