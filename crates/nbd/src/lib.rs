//! The NBD protocol, and nothing else.
//!
//! - [`proto`]: wire constants and fixed-size message codecs (pure).
//! - [`server`]: fixed newstyle negotiation and a pipelined transmission phase over any
//!   [`server::ExportSet`]; it knows nothing about volumes, caches or datastores.
//! - [`client`]: a pipelined client with a connection pool, used by `lun` datastores that are
//!   NBD exports (nbdkit, qemu-nbd).
//! - [`uri`]: the `nbd://` and `nbd+unix://` URI forms clients and datastores are given.

pub mod client;
pub mod proto;
pub mod server;
pub mod stop;
pub mod uri;

pub use proto::Errno;
pub use stop::{Stop, StopHandle};
