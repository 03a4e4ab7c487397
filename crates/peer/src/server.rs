//! The receiving side: a peer takes other hosts' writes into its cache log.
//!
//! Each connection gets one thread that reads frames, hands them to the [`Sink`] in order and
//! writes the replies; replies are flushed to the socket whenever no further request is
//! already buffered, so a pipelined sender gets them in batches. Requests of one connection
//! are applied in the order they were sent, which is the order of their acknowledgements.

use std::io::{BufReader, BufWriter, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;

use bytes::Bytes;
use tracing::{info, warn};
use uuid::Uuid;

use crate::wire::{self, Msg, Status, WriteMsg, HEADER_LEN};

/// Why a peer did not take a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// It could not (cache device failed, out of space…).
    Failed(String),
    /// It knows a newer generation of the volume: the sender is no longer its owner.
    Stale(String),
}

/// What a peer does with what it receives (the daemon puts it in the host's cache log).
/// Calls may block (they append to and sync the log).
pub trait Sink: Send + Sync + 'static {
    /// This host's name, sent back in answer to a `Hello`.
    fn host(&self) -> String;
    fn open(&self, from: &str, volume: Uuid, gen: u64, checkpoint: u64) -> Result<(), Refusal>;
    fn write(&self, from: &str, w: WriteMsg) -> Result<(), Refusal>;
    /// Makes every write taken so far durable.
    fn flush(&self) -> Result<(), Refusal>;
    fn checkpoint(&self, volume: Uuid, gen: u64, ser: u64) -> Result<(), Refusal>;
    fn drop_replicas(&self, volume: Uuid, gen: u64) -> Result<(), Refusal>;
}

/// Accepts peer connections on `listener` until the process ends.
pub fn serve(listener: TcpListener, sink: Arc<dyn Sink>) -> std::io::Result<()> {
    std::thread::Builder::new()
        .name("peer-accept".into())
        .spawn(move || {
            for conn in listener.incoming() {
                match conn {
                    Ok(s) => {
                        let sink = sink.clone();
                        let _ =
                            std::thread::Builder::new()
                                .name("peer-conn".into())
                                .spawn(move || {
                                    let who = s
                                        .peer_addr()
                                        .map(|a| a.to_string())
                                        .unwrap_or_else(|_| "?".into());
                                    if let Err(e) = connection(s, sink) {
                                        warn!("peer connection from {who} closed: {e}");
                                    }
                                });
                    }
                    Err(e) => {
                        warn!("peer listener: accept failed: {e}");
                        std::thread::sleep(std::time::Duration::from_millis(100));
                    }
                }
            }
        })?;
    Ok(())
}

fn read_frame(r: &mut impl Read) -> std::io::Result<Option<(wire::Head, Bytes)>> {
    let mut head = [0u8; HEADER_LEN];
    match r.read_exact(&mut head) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let h = wire::decode_head(&head).map_err(std::io::Error::other)?;
    let mut body = vec![0u8; h.body_len as usize];
    r.read_exact(&mut body)?;
    Ok(Some((h, Bytes::from(body))))
}

fn reply_of(result: Result<String, Refusal>) -> Msg {
    match result {
        Ok(msg) => Msg::Reply {
            status: Status::Ok,
            msg,
        },
        Err(Refusal::Failed(msg)) => Msg::Reply {
            status: Status::Failed,
            msg,
        },
        Err(Refusal::Stale(msg)) => Msg::Reply {
            status: Status::Stale,
            msg,
        },
    }
}

type Writer = Arc<std::sync::Mutex<BufWriter<TcpStream>>>;

/// FLUSHes are synced on their own thread, so the writes behind one keep going into the log
/// while the device syncs; flushes waiting together share one sync. A flush's reply may
/// overtake the replies of writes sent after it (replies are matched by request number).
fn syncer(sink: Arc<dyn Sink>, w: Writer) -> std::sync::mpsc::Sender<u64> {
    let (tx, rx) = std::sync::mpsc::channel::<u64>();
    let _ = std::thread::Builder::new()
        .name("peer-sync".into())
        .spawn(move || {
            while let Ok(first) = rx.recv() {
                let mut seqs = vec![first];
                seqs.extend(rx.try_iter());
                // Everything the connection applied before queueing these is in the log.
                let reply = reply_of(sink.flush().map(|_| String::new()));
                let mut w = w.lock().unwrap_or_else(|e| e.into_inner());
                let sent = seqs
                    .iter()
                    .try_for_each(|seq| w.write_all(&wire::encode(*seq, &reply)))
                    .and_then(|_| w.flush());
                if sent.is_err() {
                    return; // the connection is gone; its thread notices too
                }
            }
        });
    tx
}

fn connection(s: TcpStream, sink: Arc<dyn Sink>) -> std::io::Result<()> {
    s.set_nodelay(true)?;
    // Small: headers and small bodies are buffered, a write's data is read straight into
    // its own buffer.
    let mut r = BufReader::with_capacity(16 << 10, s.try_clone()?);
    let w: Writer = Arc::new(std::sync::Mutex::new(BufWriter::with_capacity(64 << 10, s)));
    let flushes = syncer(sink.clone(), w.clone());
    let mut from: Option<String> = None;
    loop {
        let Some((h, body)) = read_frame(&mut r)? else {
            if let Some(f) = &from {
                info!("peer {f} disconnected");
            }
            return Ok(());
        };
        let msg = match wire::decode_body(&h, body) {
            Ok(m) => m,
            Err(e) => {
                // The frame is damaged: answer it if possible and close, since nothing after
                // it can be trusted.
                let reply = Msg::Reply {
                    status: Status::Failed,
                    msg: format!("damaged frame: {e}"),
                };
                let mut w = w.lock().unwrap_or_else(|e| e.into_inner());
                w.write_all(&wire::encode(h.seq, &reply))?;
                w.flush()?;
                return Err(std::io::Error::other(e));
            }
        };
        let result = match (&from, msg) {
            (None, Msg::Hello { host }) => {
                info!("peer {host} connected");
                from = Some(host);
                Ok(sink.host())
            }
            (None, other) => {
                return Err(std::io::Error::other(format!(
                    "expected Hello first, got {other:?}"
                )))
            }
            (
                Some(f),
                Msg::Open {
                    volume,
                    gen,
                    checkpoint,
                },
            ) => sink.open(f, volume, gen, checkpoint).map(|_| String::new()),
            (Some(f), Msg::Write(m)) => {
                let volume = m.volume;
                match sink.write(f, m) {
                    Ok(()) => Ok(String::new()),
                    Err(e) => {
                        // The owner counts nothing after a refused write and breaks the link:
                        // the writes queued behind this one are not applied (each could wait
                        // for room again), the connection ends here.
                        let (Refusal::Failed(why) | Refusal::Stale(why)) = &e;
                        warn!("refused a write of volume {volume} from peer {f}: {why}");
                        let mut w = w.lock().unwrap_or_else(|e| e.into_inner());
                        w.write_all(&wire::encode(h.seq, &reply_of(Err(e))))?;
                        w.flush()?;
                        return Ok(());
                    }
                }
            }
            (Some(_), Msg::Flush) => {
                flushes
                    .send(h.seq)
                    .map_err(|_| std::io::Error::other("flush thread gone"))?;
                continue;
            }
            (Some(_), Msg::Checkpoint { volume, gen, ser }) => {
                sink.checkpoint(volume, gen, ser).map(|_| String::new())
            }
            (Some(_), Msg::Drop { volume, gen }) => {
                sink.drop_replicas(volume, gen).map(|_| String::new())
            }
            (Some(_), other) => {
                return Err(std::io::Error::other(format!("unexpected frame {other:?}")))
            }
        };
        let reply = reply_of(result);
        let mut w = w.lock().unwrap_or_else(|e| e.into_inner());
        w.write_all(&wire::encode(h.seq, &reply))?;
        if r.buffer().is_empty() {
            w.flush()?;
        }
    }
}
