//! Bootstrap: how ranks find each other before they share any GPU memory.
//!
//! A per-rank communicator needs a small exchange of bytes among its ranks (device numbers, memory
//! handles, workspace addresses) before its first kernel: a [`Bootstrap`], an all-gather of bytes and
//! a barrier. oxccl brings two, and you can bring your own:
//!
//! - [`TcpBootstrap`]: ranks in any processes on any hosts meet at a *root*, a small TCP server that
//!   [`Id::new`] starts in one process (typically rank 0's). The [`Id`] names the root; hand it to the
//!   other processes as a string, a file, bytes or through serde, like NCCL's unique id. Under
//!   torchrun, [`TcpBootstrap::from_env`] needs no hand-over: every rank derives the same Id from the
//!   environment ([`LaunchEnv`]).
//! - [`LocalBootstrap`]: ranks that are threads of one process; no sockets.
//! - Your own: implement [`Bootstrap`] over torch's store, MPI or an NCCL communicator.
//!
//! ```
//! use oxccl::bootstrap::{Bootstrap, BootstrapError, Id, TcpBootstrap};
//! use std::net::Ipv4Addr;
//! use std::time::Duration;
//!
//! # fn main() -> Result<(), BootstrapError> {
//! // One process starts the root and hands the Id to the others (here: threads of this one).
//! let id = Id::new_on((Ipv4Addr::LOCALHOST, 0).into())?;
//! let ranks: Vec<_> = (0..4usize)
//!     .map(|rank| {
//!         std::thread::spawn(move || {
//!             let boot = TcpBootstrap::new(&id, rank, 4, Duration::from_secs(10))?;
//!             boot.all_gather(&[rank as u8])
//!         })
//!     })
//!     .collect();
//! for r in ranks {
//!     assert_eq!(r.join().expect("rank thread")?, vec![vec![0], vec![1], vec![2], vec![3]]);
//! }
//! # Ok(()) }
//! ```
//!
//! # Failures
//!
//! Nothing waits forever and every failure is a [`BootstrapError`] naming what went wrong: an Id of
//! another run ([`StaleId`](BootstrapError::StaleId)), ranks that disagree on the world size or claim
//! one rank twice, ranks that never arrive ([`Missing`](BootstrapError::Missing) names them), a rank
//! whose process died or that dropped its bootstrap mid-way ([`PeerLeft`](BootstrapError::PeerLeft)
//! names it), a rank that gave up ([`PeerAborted`](BootstrapError::PeerAborted) says why). A call
//! that fails leaves the group: the bootstrap is closed, later calls return
//! [`Broken`](BootstrapError::Broken), and the other ranks learn at once who left rather than wait
//! for their own timeouts.
//!
//! # Protocol (TCP)
//!
//! Frames are a kind byte, a little-endian `u64` payload length, and the payload.
//!
//! 1. Each rank connects to the root (retrying refused connections until its timeout: the root may
//!    start a little later) and sends a hello: magic, protocol version, the Id's nonce, its rank, the
//!    world size and its timeout.
//! 2. The root refuses a hello with another nonce, a rank outside the world, a world size other than
//!    the first arrival's, or a rank a live connection already holds (refusals are JSON payloads of a
//!    closed set of reasons), and welcomes every rank once `world` distinct ranks have arrived. If
//!    they have not within the first arrival's timeout, the arrived ranks are told who is missing.
//! 3. A round: each rank sends its bytes (at most [`MAX_MESSAGE_BYTES`]); once all have, the root
//!    answers each with a table of lengths and everyone's bytes.
//! 4. A connection that closes or sends garbage, or a rank that reports an error, ends the group: the
//!    root tells every remaining rank who left and stops. Refused connections do not disturb the
//!    group. A rank that gives up (times out) after sending its bytes for a round may still have
//!    completed that round for the others, with those bytes: they learn it left at their next call.

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::collections::HashMap;
use std::fmt;
use std::fs;
use std::hash::{BuildHasher, Hasher, RandomState};
use std::io::{self, ErrorKind, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, SocketAddrV6, TcpListener, TcpStream, ToSocketAddrs};
use std::path::Path;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// The most bytes one rank may contribute to one TCP [`Bootstrap::all_gather`] (1 GiB). A larger
/// contribution is refused as [`BootstrapError::TooLarge`] before anything is sent; a length over it
/// read from the wire is a [`BootstrapError::Protocol`] error, refused before anything is allocated.
pub const MAX_MESSAGE_BYTES: usize = 1 << 30;

/// The most ranks a TCP bootstrap group has (65536): it bounds what the root allocates for a hello.
pub const MAX_WORLD: usize = 1 << 16;

/// The length of [`Id::to_bytes`].
pub const ID_BYTES: usize = 40;

/// How an [`Id`] prints: this prefix and its bytes as 80 hex digits.
pub const ID_PREFIX: &str = "oxccl-id-v1:";

/// The environment variable [`Id::new`] reads for where the root listens (`host` or `host:port`).
pub const ADDR_VAR: &str = "OXCCL_BOOTSTRAP_ADDR";

/// The environment variable [`LaunchEnv`] reads for the root's port (overrides the torchrun default).
pub const PORT_VAR: &str = "OXCCL_BOOTSTRAP_PORT";

/// The first byte of [`Id::to_bytes`]: the layout's version.
const ID_VERSION: u8 = 1;
/// The wire protocol's version, sent in every hello and welcome.
const PROTOCOL_VERSION: u32 = 1;
/// Opens every hello and welcome: a stray connection (an HTTP probe, another service on the port)
/// is told apart from a rank at its first bytes.
const MAGIC: [u8; 8] = *b"OXCCL-BS";
/// A connection to the root must send its hello within this long; then the root drops it, so a
/// silent stray connection holds no thread for long. Ranks send theirs at once.
const ROOT_HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// A rank waits for the welcome this much longer than its timeout: the root counts the timeout
/// from the first arrival, so its report of who is missing must be able to come first.
const WELCOME_GRACE: Duration = Duration::from_secs(1);
/// Socket timeouts cannot be zero: a shorter timeout is taken as this.
const MIN_TIMEOUT: Duration = Duration::from_millis(1);
/// The longest refusal or abort reason read from the wire.
const MAX_TEXT: u64 = 64 * 1024;
/// Frames up to this size are written with one call (one packet with `TCP_NODELAY`).
const COALESCE: usize = 64 * 1024;

// Frame kinds. Rank to root:
const HELLO: u8 = 0x01;
const GATHER: u8 = 0x02;
const ABORT: u8 = 0x03;
// Root to rank:
const WELCOME: u8 = 0x81;
const RESULT: u8 = 0x82;
const REFUSAL: u8 = 0x83;

const HEADER_LEN: usize = 9;
const HELLO_LEN: usize = 8 + 4 + 16 + 8 + 8 + 8 + 4;
/// Hello flag: the rank runs in the root's own process.
const IN_ROOT_PROCESS: u32 = 1;
const WELCOME_LEN: usize = 8 + 4 + 16;

/// An all-gather of bytes among the ranks and a barrier: what a communicator needs from whoever
/// starts the ranks. Implement it to carry oxccl's setup over torch's store, MPI or an NCCL
/// communicator; [`TcpBootstrap`] and [`LocalBootstrap`] come with oxccl.
///
/// Calls are collective: every rank makes the same calls in the same order (an
/// [`all_gather`](Bootstrap::all_gather) on one rank meeting a [`barrier`](Bootstrap::barrier) on
/// another is simply a round). A call that fails leaves the group; the other ranks' calls then fail
/// too, naming the rank that left, instead of waiting.
pub trait Bootstrap: Send + Sync {
    /// This rank, `0..world()`.
    fn rank(&self) -> usize;

    /// The number of ranks.
    fn world(&self) -> usize;

    /// Every rank's `mine`, indexed by rank (this rank's own included). Collective: every rank calls
    /// it, in the same order; the lengths may differ between ranks.
    fn all_gather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>, BootstrapError>;

    /// Returns once every rank has called it. Default: an [`all_gather`](Bootstrap::all_gather) of
    /// nothing.
    fn barrier(&self) -> Result<(), BootstrapError> {
        self.all_gather(&[]).map(drop)
    }
}

impl<B: Bootstrap + ?Sized> Bootstrap for &B {
    fn rank(&self) -> usize {
        (**self).rank()
    }
    fn world(&self) -> usize {
        (**self).world()
    }
    fn all_gather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>, BootstrapError> {
        (**self).all_gather(mine)
    }
    fn barrier(&self) -> Result<(), BootstrapError> {
        (**self).barrier()
    }
}

impl<B: Bootstrap + ?Sized> Bootstrap for Box<B> {
    fn rank(&self) -> usize {
        (**self).rank()
    }
    fn world(&self) -> usize {
        (**self).world()
    }
    fn all_gather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>, BootstrapError> {
        (**self).all_gather(mine)
    }
    fn barrier(&self) -> Result<(), BootstrapError> {
        (**self).barrier()
    }
}

impl<B: Bootstrap + ?Sized> Bootstrap for Arc<B> {
    fn rank(&self) -> usize {
        (**self).rank()
    }
    fn world(&self) -> usize {
        (**self).world()
    }
    fn all_gather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>, BootstrapError> {
        (**self).all_gather(mine)
    }
    fn barrier(&self) -> Result<(), BootstrapError> {
        (**self).barrier()
    }
}

/// What went wrong while ranks found each other or exchanged bytes.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BootstrapError {
    /// A socket or file operation failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done ("connecting to the root at 10.0.0.1:29500", "reading the Id file ...").
        what: String,
        /// The operating system's error.
        source: io::Error,
    },
    /// The root could not listen on an address (typically: another process holds the port).
    #[error("the bootstrap root cannot listen on {addr}: {source}{}", bind_hint(.source))]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The operating system's error (`AddrInUse`, `AddrNotAvailable`, ...).
        source: io::Error,
    },
    /// A bounded wait gave up.
    #[error("timed out after {waited:?} {what}")]
    Timeout {
        /// What was awaited.
        what: String,
        /// How long it was awaited.
        waited: Duration,
    },
    /// The root at the Id's address serves another run (its nonce differs): the Id is stale.
    #[error(
        "the bootstrap root at {root} serves another run (the Id's nonce differs): the Id is stale, \
         pass this run's"
    )]
    StaleId {
        /// The root's address.
        root: SocketAddr,
    },
    /// A rank at or above the world size.
    #[error("rank {rank} is out of range for a world of {world} rank(s)")]
    RankOutOfRange {
        /// The rank.
        rank: usize,
        /// The world size.
        world: usize,
    },
    /// A world size of zero or over [`MAX_WORLD`].
    #[error("a world of {world} rank(s): a bootstrap group has 1 to {max}")]
    World {
        /// The world size given.
        world: usize,
        /// The most ranks a group has.
        max: usize,
    },
    /// A rank joined with another world size than the first rank to arrive.
    #[error("rank {rank} joined with a world of {got} rank(s), but the first rank to arrive said {expected}")]
    WorldMismatch {
        /// The rank that joined.
        rank: usize,
        /// The first arrival's world size.
        expected: usize,
        /// This rank's world size.
        got: usize,
    },
    /// A live connection already holds this rank: two processes were given the same rank.
    #[error("rank {rank} is already held by another live connection (two processes were given rank {rank})")]
    RankTaken {
        /// The rank.
        rank: usize,
    },
    /// These ranks never joined within the timeout (the first arrival's, counted from its arrival).
    #[error("{} of {world} never joined within {waited:?}", ranks_text(.ranks))]
    Missing {
        /// The ranks that never came, ascending.
        ranks: Vec<usize>,
        /// The world size.
        world: usize,
        /// How long the root waited.
        waited: Duration,
    },
    /// A rank left the group (its process ended, or it dropped its bootstrap or closed its
    /// connection) before every rank was done: no further round can complete.
    #[error(
        "rank {rank} left the group (its process ended or it dropped its bootstrap) before the other \
         ranks were done"
    )]
    PeerLeft {
        /// The rank that left.
        rank: usize,
    },
    /// A rank gave up (its call failed: a timeout, a message over the limit, ...) and left the group.
    #[error("rank {rank} gave up and left the group: {why}")]
    PeerAborted {
        /// The rank that gave up.
        rank: usize,
        /// Its error.
        why: String,
    },
    /// The root closed the connection without a reason: its process ended (it runs in one of the
    /// ranks' processes, typically rank 0's).
    #[error(
        "the bootstrap root at {root} closed the connection without a reason (the process that ran it \
         ended)"
    )]
    RootClosed {
        /// The root's address.
        root: SocketAddr,
    },
    /// This bootstrap failed earlier and left the group; it cannot be used again.
    #[error("this bootstrap failed earlier and left its group, it cannot be used again: {why}")]
    Broken {
        /// The earlier error.
        why: String,
    },
    /// An environment variable is missing or malformed.
    #[error("environment variable {var}: {why}")]
    Env {
        /// The variable.
        var: &'static str,
        /// What is wrong with it.
        why: String,
    },
    /// A string, a byte string or a file that is not an [`Id`].
    #[error("not an oxccl bootstrap Id: {why}")]
    BadId {
        /// What is wrong with it.
        why: String,
    },
    /// A contribution over [`MAX_MESSAGE_BYTES`].
    #[error(
        "{len} bytes is over the bootstrap's limit of {max} bytes per rank and call (send large data \
         through the communicator, not the bootstrap)"
    )]
    TooLarge {
        /// Its length in bytes.
        len: usize,
        /// The limit in bytes.
        max: usize,
    },
    /// Memory for bytes received could not be allocated.
    #[error("could not allocate {bytes} bytes for {what}")]
    NoMemory {
        /// What the bytes were.
        what: String,
        /// How many bytes.
        bytes: usize,
    },
    /// A peer sent something that is not the bootstrap protocol.
    #[error("bootstrap protocol error: {why}")]
    Protocol {
        /// What was wrong.
        why: String,
    },
}

/// The hint a bind error adds where the port is taken.
fn bind_hint(source: &io::Error) -> String {
    match source.kind() {
        ErrorKind::AddrInUse => {
            format!(" (another process holds the port: set {PORT_VAR} or {ADDR_VAR} to a free one)")
        }
        _ => String::new(),
    }
}

/// "rank 3" or "ranks 1, 4".
fn ranks_text(ranks: &[usize]) -> String {
    let list: Vec<String> = ranks.iter().map(|r| r.to_string()).collect();
    let noun = if ranks.len() == 1 { "rank" } else { "ranks" };
    format!("{noun} {}", list.join(", "))
}

// ------------------------------------------------------------------------------------------------
// Id
// ------------------------------------------------------------------------------------------------

/// Names one run's bootstrap root: its socket address and a random 128-bit nonce. Made by one
/// process ([`Id::new`]) and passed to the others, like NCCL's unique id: as a string
/// (`oxccl-id-v1:` and 80 hex digits, [`Display`](fmt::Display) / [`FromStr`]), as
/// [`ID_BYTES`] bytes ([`Id::to_bytes`] / [`Id::from_bytes`]), through serde (as the string) or a
/// file ([`Id::write_file`] / [`Id::read_file`]).
///
/// The nonce tells runs apart: a rank holding an Id of an earlier run whose port a new root reuses is
/// refused ([`BootstrapError::StaleId`]) rather than joined to the wrong group. It is not a secret
/// that keeps attackers out: the bootstrap trusts its network, as NCCL's does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Id {
    addr: SocketAddr,
    nonce: u128,
}

impl Id {
    /// Starts a root and returns the Id naming it. The root listens on [`ADDR_VAR`]
    /// (`OXCCL_BOOTSTRAP_ADDR`, `host` or `host:port`) if set, else on every interface at a free
    /// port, advertising the first non-loopback IPv4 address the host's name resolves to, else
    /// 127.0.0.1 (enough for one host; across hosts whose name resolves to a loopback address, set
    /// `OXCCL_BOOTSTRAP_ADDR`).
    ///
    /// The root is a background thread (with one more per connection) that serves one group: it ends
    /// once the group has ended (every rank gone, or an error). Until the first rank arrives it waits
    /// without a limit (blocked, using no CPU); from then on within the first rank's timeout.
    ///
    /// The root lives in this process: if the process ends, the other ranks' next call fails
    /// ([`BootstrapError::RootClosed`]). A rank of this process may end it once its own last call has
    /// returned: the root answers this process's ranks last, so the others' answers are on their way.
    pub fn new() -> Result<Id, BootstrapError> {
        match std::env::var_os(ADDR_VAR) {
            Some(v) if !v.is_empty() => {
                let text = v.to_string_lossy();
                let addr = parse_host_port(&text).map_err(|why| BootstrapError::Env { var: ADDR_VAR, why })?;
                Id::new_on(addr)
            }
            _ => Id::new_on(SocketAddr::new(Ipv4Addr::UNSPECIFIED.into(), 0)),
        }
    }

    /// Starts a root listening exactly on `addr` (port 0: a free port) and returns the Id naming it.
    /// An unspecified address (`0.0.0.0`, `::`) listens on every interface and advertises the host's
    /// address as [`Id::new`] does. See [`Id::new`] for the root's lifetime.
    pub fn new_on(addr: SocketAddr) -> Result<Id, BootstrapError> {
        let listener = TcpListener::bind(addr).map_err(|source| BootstrapError::Bind { addr, source })?;
        let bound = listener
            .local_addr()
            .map_err(|source| BootstrapError::Io { what: format!("reading the address bound at {addr}"), source })?;
        let nonce = random_nonce();
        start_root(listener, nonce)?;
        Ok(Id { addr: advertised(bound), nonce })
    }

    /// The Id of a root at `addr` with this nonce; starts nothing. For ranks that agree on both
    /// without an exchange (as [`LaunchEnv::id`] does), and for tests.
    pub fn from_parts(addr: SocketAddr, nonce: u128) -> Id {
        Id { addr, nonce }
    }

    /// The root's address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The run's nonce.
    pub fn nonce(&self) -> u128 {
        self.nonce
    }

    /// The Id as [`ID_BYTES`] bytes: a layout version (1), the address family (4 or 6), the IP
    /// address (16 bytes, IPv4 in the first 4, the rest zero), the port (big-endian), the IPv6 scope
    /// id (big-endian, zero for IPv4) and the nonce (big-endian).
    pub fn to_bytes(&self) -> [u8; ID_BYTES] {
        let mut b = [0u8; ID_BYTES];
        b[0] = ID_VERSION;
        match self.addr {
            SocketAddr::V4(a) => {
                b[1] = 4;
                b[2..6].copy_from_slice(&a.ip().octets());
            }
            SocketAddr::V6(a) => {
                b[1] = 6;
                b[2..18].copy_from_slice(&a.ip().octets());
                b[20..24].copy_from_slice(&a.scope_id().to_be_bytes());
            }
        }
        b[18..20].copy_from_slice(&self.addr.port().to_be_bytes());
        b[24..40].copy_from_slice(&self.nonce.to_be_bytes());
        b
    }

    /// The Id from [`Id::to_bytes`]'s layout; anything else is [`BootstrapError::BadId`].
    pub fn from_bytes(bytes: &[u8]) -> Result<Id, BootstrapError> {
        let bad = |why: String| Err(BootstrapError::BadId { why });
        let Ok(b) = <&[u8; ID_BYTES]>::try_from(bytes) else {
            return bad(format!("{} bytes, an Id has {ID_BYTES}", bytes.len()));
        };
        if b[0] != ID_VERSION {
            return bad(format!("layout version {}, this oxccl reads version {ID_VERSION}", b[0]));
        }
        let port = u16::from_be_bytes([b[18], b[19]]);
        if port == 0 {
            return bad("port 0 (no root listens there)".into());
        }
        let mut ip = [0u8; 16];
        ip.copy_from_slice(&b[2..18]);
        let mut scope = [0u8; 4];
        scope.copy_from_slice(&b[20..24]);
        let addr = match b[1] {
            4 => {
                if ip[4..].iter().any(|&x| x != 0) || scope != [0; 4] {
                    return bad("an IPv4 Id with non-zero padding".into());
                }
                SocketAddr::new(Ipv4Addr::new(ip[0], ip[1], ip[2], ip[3]).into(), port)
            }
            6 => SocketAddr::V6(SocketAddrV6::new(Ipv6Addr::from(ip), port, 0, u32::from_be_bytes(scope))),
            family => return bad(format!("address family {family}, expected 4 or 6")),
        };
        let mut nonce = [0u8; 16];
        nonce.copy_from_slice(&b[24..40]);
        Ok(Id { addr, nonce: u128::from_be_bytes(nonce) })
    }

    /// Writes the Id's string and a newline to `path`. The file is written beside `path` and renamed
    /// into place, so a process polling for it ([`Id::wait_for_file`]) never reads half an Id.
    pub fn write_file(&self, path: impl AsRef<Path>) -> Result<(), BootstrapError> {
        let path = path.as_ref();
        let io_err = |what: String| move |source| BootstrapError::Io { what, source };
        let Some(name) = path.file_name() else {
            let source = io::Error::new(ErrorKind::InvalidInput, "the path names no file");
            return Err(io_err(format!("writing the Id to {}", path.display()))(source));
        };
        let tmp = path.with_file_name(format!(".{}.{}.tmp", name.to_string_lossy(), std::process::id()));
        fs::write(&tmp, format!("{self}\n")).map_err(io_err(format!("writing the Id to {}", tmp.display())))?;
        fs::rename(&tmp, path).map_err(|source| {
            let _ = fs::remove_file(&tmp);
            BootstrapError::Io { what: format!("renaming {} to {}", tmp.display(), path.display()), source }
        })
    }

    /// Reads an Id written by [`Id::write_file`] (surrounding whitespace, such as a trailing newline,
    /// is ignored).
    pub fn read_file(path: impl AsRef<Path>) -> Result<Id, BootstrapError> {
        let path = path.as_ref();
        let text = fs::read_to_string(path)
            .map_err(|source| BootstrapError::Io { what: format!("reading the Id file {}", path.display()), source })?;
        text.trim().parse()
    }

    /// Reads the Id file at `path` once it exists, polling until `timeout` (for ranks started before
    /// the process that writes it).
    pub fn wait_for_file(path: impl AsRef<Path>, timeout: Duration) -> Result<Id, BootstrapError> {
        let path = path.as_ref();
        let start = Instant::now();
        loop {
            match Id::read_file(path) {
                Err(BootstrapError::Io { source, .. }) if source.kind() == ErrorKind::NotFound => {}
                done => return done,
            }
            if start.elapsed() >= timeout {
                return Err(BootstrapError::Timeout {
                    what: format!("waiting for the Id file {} to appear", path.display()),
                    waited: timeout,
                });
            }
            thread::sleep(Duration::from_millis(10).min(timeout));
        }
    }
}

impl fmt::Display for Id {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(ID_PREFIX)?;
        self.to_bytes().iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

impl FromStr for Id {
    type Err = BootstrapError;

    /// Parses [`Id`]'s `Display` form (hex digits in either case); anything else is
    /// [`BootstrapError::BadId`].
    fn from_str(s: &str) -> Result<Id, BootstrapError> {
        let bad = |why: String| Err(BootstrapError::BadId { why });
        let Some(hex) = s.strip_prefix(ID_PREFIX) else {
            let shown: String = s.chars().take(24).collect();
            let more = if s.chars().count() > 24 { "..." } else { "" };
            return bad(format!("expected \"{ID_PREFIX}\" and {} hex digits, got {shown:?}{more}", 2 * ID_BYTES));
        };
        let digits = hex.as_bytes();
        if digits.len() != 2 * ID_BYTES {
            return bad(format!(
                "{} characters after \"{ID_PREFIX}\", expected {} hex digits",
                digits.len(),
                2 * ID_BYTES
            ));
        }
        let mut bytes = [0u8; ID_BYTES];
        for (i, pair) in digits.chunks_exact(2).enumerate() {
            let digit = |k: usize| {
                (pair[k] as char).to_digit(16).ok_or_else(|| BootstrapError::BadId {
                    why: format!("byte {} after \"{ID_PREFIX}\" is not a hex digit", 2 * i + k),
                })
            };
            bytes[i] = (digit(0)? * 16 + digit(1)?) as u8;
        }
        Id::from_bytes(&bytes)
    }
}

/// As the `Display` string.
impl Serialize for Id {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

/// From the `Display` string.
impl<'de> Deserialize<'de> for Id {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Id, D::Error> {
        String::deserialize(deserializer)?.parse().map_err(serde::de::Error::custom)
    }
}

/// 128 random bits from `/dev/urandom`; where there is none, std's per-process random hash keys
/// mixed with the time and the process id.
fn random_nonce() -> u128 {
    let mut b = [0u8; 16];
    if fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut b)).is_ok() {
        return u128::from_le_bytes(b);
    }
    let now = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let half = |salt: u64| {
        let mut h = RandomState::new().build_hasher();
        h.write_u128(now);
        h.write_u32(std::process::id());
        h.write_u64(salt);
        h.finish()
    };
    (u128::from(half(0)) << 64) | u128::from(half(1))
}

/// FNV-1a, 128 bits: a hash every process computes alike (std's hashers promise no stability across
/// builds), for nonces ranks derive without talking.
fn fnv1a_128(parts: &[&[u8]]) -> u128 {
    const OFFSET: u128 = 0x6c62_272e_07bb_0142_62b8_2175_6295_c58d;
    const PRIME: u128 = 0x0000_0000_0100_0000_0000_0000_0000_013b;
    let mut h = OFFSET;
    for part in parts {
        for &byte in *part {
            h ^= u128::from(byte);
            h = h.wrapping_mul(PRIME);
        }
        // A separator, so ("ab", "c") and ("a", "bc") differ.
        h ^= 0xff;
        h = h.wrapping_mul(PRIME);
    }
    h
}

/// The address to advertise for a listener bound at `bound`: itself, or for an unspecified address
/// the host's (see [`Id::new`]).
fn advertised(bound: SocketAddr) -> SocketAddr {
    if !bound.ip().is_unspecified() {
        return bound;
    }
    let ip = host_ip(bound.is_ipv4()).unwrap_or(if bound.is_ipv4() {
        IpAddr::V4(Ipv4Addr::LOCALHOST)
    } else {
        IpAddr::V6(Ipv6Addr::LOCALHOST)
    });
    SocketAddr::new(ip, bound.port())
}

/// The first non-loopback address of the family the host's name resolves to.
fn host_ip(v4: bool) -> Option<IpAddr> {
    // std has no gethostname: the kernel's copy (Linux), the file, or the shell's variable.
    let name = fs::read_to_string("/proc/sys/kernel/hostname")
        .or_else(|_| fs::read_to_string("/etc/hostname"))
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())?;
    let name = name.trim();
    if name.is_empty() {
        return None;
    }
    (name, 0)
        .to_socket_addrs()
        .ok()?
        .map(|a| a.ip())
        .find(|ip| ip.is_ipv4() == v4 && !ip.is_loopback() && !ip.is_unspecified())
}

/// `host` (a name or an IP address, IPv6 optionally in brackets) at `port`: an IPv4 address where
/// the name has one (so that every rank picks the same family), else the first.
fn resolve(host: &str, port: u16) -> Result<SocketAddr, String> {
    let host = host.trim();
    let bare = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host);
    if let Ok(ip) = bare.parse::<IpAddr>() {
        return Ok(SocketAddr::new(ip, port));
    }
    if bare.is_empty() {
        return Err("an empty host name".into());
    }
    let addrs: Vec<SocketAddr> =
        (bare, port).to_socket_addrs().map_err(|e| format!("{bare:?} does not resolve: {e}"))?.collect();
    addrs
        .iter()
        .find(|a| a.is_ipv4())
        .or(addrs.first())
        .copied()
        .ok_or_else(|| format!("{bare:?} resolves to no address"))
}

/// `host`, `host:port`, `ip`, `ip:port`, `[ipv6]` or `[ipv6]:port` (no port: 0, any).
fn parse_host_port(text: &str) -> Result<SocketAddr, String> {
    let text = text.trim();
    if let Ok(addr) = text.parse::<SocketAddr>() {
        return Ok(addr);
    }
    // A bare IPv6 address has several colons: only a single one separates a port.
    if let Some((host, port)) = text.rsplit_once(':')
        && !host.contains(':')
    {
        let port =
            port.parse::<u16>().map_err(|_| format!("port {port:?} in {text:?} is not a number from 0 to 65535"))?;
        return resolve(host, port);
    }
    resolve(text, 0)
}

// ------------------------------------------------------------------------------------------------
// Wire format
// ------------------------------------------------------------------------------------------------

/// A rank's first frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Hello {
    version: u32,
    nonce: u128,
    rank: u64,
    world: u64,
    timeout_ms: u64,
    flags: u32,
}

impl Hello {
    fn encode(&self) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        b[..8].copy_from_slice(&MAGIC);
        b[8..12].copy_from_slice(&self.version.to_le_bytes());
        b[12..28].copy_from_slice(&self.nonce.to_le_bytes());
        b[28..36].copy_from_slice(&self.rank.to_le_bytes());
        b[36..44].copy_from_slice(&self.world.to_le_bytes());
        b[44..52].copy_from_slice(&self.timeout_ms.to_le_bytes());
        b[52..56].copy_from_slice(&self.flags.to_le_bytes());
        b
    }

    /// `None` unless the bytes start with the magic.
    fn decode(b: &[u8; HELLO_LEN]) -> Option<Hello> {
        if b[..8] != MAGIC {
            return None;
        }
        let u64_at = |at: usize| {
            let mut x = [0u8; 8];
            x.copy_from_slice(&b[at..at + 8]);
            u64::from_le_bytes(x)
        };
        let u32_at = |at: usize| {
            let mut x = [0u8; 4];
            x.copy_from_slice(&b[at..at + 4]);
            u32::from_le_bytes(x)
        };
        let mut nonce = [0u8; 16];
        nonce.copy_from_slice(&b[12..28]);
        Some(Hello {
            version: u32_at(8),
            nonce: u128::from_le_bytes(nonce),
            rank: u64_at(28),
            world: u64_at(36),
            timeout_ms: u64_at(44),
            flags: u32_at(52),
        })
    }
}

fn welcome_bytes(nonce: u128) -> [u8; WELCOME_LEN] {
    let mut b = [0u8; WELCOME_LEN];
    b[..8].copy_from_slice(&MAGIC);
    b[8..12].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    b[12..28].copy_from_slice(&nonce.to_le_bytes());
    b
}

/// What the root tells a rank instead of a welcome or a round's result: a closed set, sent as JSON.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
enum Refusal {
    StaleId,
    RankOutOfRange { rank: usize, world: usize },
    World { world: usize },
    WorldMismatch { rank: usize, expected: usize, got: usize },
    RankTaken { rank: usize },
    Missing { ranks: Vec<usize>, world: usize, waited_ms: u64 },
    PeerLeft { rank: usize },
    PeerAborted { rank: usize, why: String },
    Protocol { why: String },
}

impl Refusal {
    fn into_error(self, root: SocketAddr) -> BootstrapError {
        match self {
            Refusal::StaleId => BootstrapError::StaleId { root },
            Refusal::RankOutOfRange { rank, world } => BootstrapError::RankOutOfRange { rank, world },
            Refusal::World { world } => BootstrapError::World { world, max: MAX_WORLD },
            Refusal::WorldMismatch { rank, expected, got } => BootstrapError::WorldMismatch { rank, expected, got },
            Refusal::RankTaken { rank } => BootstrapError::RankTaken { rank },
            Refusal::Missing { ranks, world, waited_ms } => {
                BootstrapError::Missing { ranks, world, waited: Duration::from_millis(waited_ms) }
            }
            Refusal::PeerLeft { rank } => BootstrapError::PeerLeft { rank },
            Refusal::PeerAborted { rank, why } => BootstrapError::PeerAborted { rank, why },
            Refusal::Protocol { why } => {
                BootstrapError::Protocol { why: format!("the root at {root} refused this rank: {why}") }
            }
        }
    }
}

/// Writes one frame; a small one with a single call.
fn write_frame(w: &mut impl Write, kind: u8, parts: &[&[u8]]) -> io::Result<()> {
    let len: usize = parts.iter().map(|p| p.len()).sum();
    let small = len <= COALESCE;
    let mut head = Vec::with_capacity(HEADER_LEN + if small { len } else { 0 });
    head.push(kind);
    head.extend_from_slice(&(len as u64).to_le_bytes());
    if small {
        parts.iter().for_each(|p| head.extend_from_slice(p));
        return w.write_all(&head);
    }
    w.write_all(&head)?;
    parts.iter().try_for_each(|p| w.write_all(p))
}

/// Reads a frame header: the kind and the payload's length.
fn read_header(r: &mut impl Read) -> io::Result<(u8, u64)> {
    let mut h = [0u8; HEADER_LEN];
    r.read_exact(&mut h)?;
    let [kind, len @ ..] = h;
    Ok((kind, u64::from_le_bytes(len)))
}

/// A zeroed buffer of `len` bytes, or an error instead of an allocation abort.
fn buffer(len: usize, what: impl FnOnce() -> String) -> Result<Vec<u8>, BootstrapError> {
    let mut v = Vec::new();
    v.try_reserve_exact(len).map_err(|_| BootstrapError::NoMemory { what: what(), bytes: len })?;
    v.resize(len, 0);
    Ok(v)
}

/// A rank's I/O error in words: a timeout, the root gone, or the OS error.
fn wire_error(e: io::Error, root: SocketAddr, waited: Duration, what: impl FnOnce() -> String) -> BootstrapError {
    match e.kind() {
        ErrorKind::WouldBlock | ErrorKind::TimedOut => BootstrapError::Timeout { what: what(), waited },
        ErrorKind::UnexpectedEof
        | ErrorKind::ConnectionReset
        | ErrorKind::ConnectionAborted
        | ErrorKind::BrokenPipe => BootstrapError::RootClosed { root },
        _ => BootstrapError::Io { what: what(), source: e },
    }
}

/// Reads a refusal's payload of `len` bytes.
fn read_refusal(r: &mut impl Read, len: u64, root: SocketAddr, waited: Duration) -> BootstrapError {
    if len > MAX_TEXT {
        return BootstrapError::Protocol { why: format!("the root at {root} sent a refusal of {len} bytes") };
    }
    let mut text = vec![0u8; len as usize];
    if let Err(e) = r.read_exact(&mut text) {
        return wire_error(e, root, waited, || format!("reading a refusal from the root at {root}"));
    }
    match serde_json::from_slice::<Refusal>(&text) {
        Ok(refusal) => refusal.into_error(root),
        Err(e) => BootstrapError::Protocol { why: format!("the root at {root} sent an unreadable refusal: {e}") },
    }
}

/// Connects to `root`, retrying refused connections (the root may not be listening yet) until
/// `timeout` has passed.
fn connect(root: SocketAddr, timeout: Duration) -> Result<TcpStream, BootstrapError> {
    let start = Instant::now();
    let mut pause = Duration::from_millis(5);
    let mut last = None;
    loop {
        let left = timeout.saturating_sub(start.elapsed());
        if left.is_zero() {
            let why = last.map_or(String::new(), |e: io::Error| format!(" (last attempt: {e})"));
            return Err(BootstrapError::Timeout {
                what: format!(
                    "connecting to the bootstrap root at {root}{why}: is it started, and is the Id this run's?"
                ),
                waited: timeout,
            });
        }
        match TcpStream::connect_timeout(&root, left) {
            Ok(stream) => return Ok(stream),
            Err(e)
                if matches!(
                    e.kind(),
                    ErrorKind::ConnectionRefused | ErrorKind::ConnectionReset | ErrorKind::ConnectionAborted
                ) =>
            {
                thread::sleep(pause.min(left));
                pause = (pause * 2).min(Duration::from_millis(100));
                last = Some(e);
            }
            Err(e) if matches!(e.kind(), ErrorKind::TimedOut | ErrorKind::WouldBlock | ErrorKind::Interrupted) => {
                last = Some(e);
            }
            Err(source) => {
                return Err(BootstrapError::Io { what: format!("connecting to the bootstrap root at {root}"), source });
            }
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // The state stays consistent across a panic in another holder (a panicking test thread).
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

fn check_world(rank: usize, world: usize) -> Result<(), BootstrapError> {
    if world == 0 || world > MAX_WORLD {
        return Err(BootstrapError::World { world, max: MAX_WORLD });
    }
    if rank >= world {
        return Err(BootstrapError::RankOutOfRange { rank, world });
    }
    Ok(())
}

// ------------------------------------------------------------------------------------------------
// The root
// ------------------------------------------------------------------------------------------------

/// The nonces of the roots running in this process. A rank joining one of them says so in its hello,
/// and the root writes to such ranks last: once that rank has its answer every other rank's is in
/// the kernel's hands, so the process may end (taking the root with it) without cutting the others
/// off mid-round.
static ROOTS_HERE: Mutex<Vec<u128>> = Mutex::new(Vec::new());

/// What the connection threads tell the root's coordinator. `u64`s number connections.
enum Event {
    Accepted(u64, TcpStream),
    Hello(u64, Hello),
    Gather(u64, Vec<u8>),
    Abort(u64, String),
    /// The connection ended: `None` when it closed, `Some(why)` when it sent what the root refuses.
    Closed(u64, Option<String>),
}

/// Starts the root's threads: one accepting connections, one reading each connection, and the
/// coordinator, which alone decides and writes (so the group's state needs no lock).
fn start_root(listener: TcpListener, nonce: u128) -> Result<(), BootstrapError> {
    let bound = listener
        .local_addr()
        .map_err(|source| BootstrapError::Io { what: "reading the root's bound address".into(), source })?;
    // The coordinator wakes the accepting thread, blocked in accept, by connecting once it is done.
    let wake = match bound.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => SocketAddr::new(Ipv4Addr::LOCALHOST.into(), bound.port()),
        IpAddr::V6(ip) if ip.is_unspecified() => SocketAddr::new(Ipv6Addr::LOCALHOST.into(), bound.port()),
        _ => bound,
    };
    let (events, inbox) = mpsc::channel();
    let done = Arc::new(AtomicBool::new(false));
    let spawn_err = |source| BootstrapError::Io { what: "starting the bootstrap root's threads".into(), source };
    let coordinator_done = done.clone();
    lock(&ROOTS_HERE).push(nonce);
    let forget = move || lock(&ROOTS_HERE).retain(|&n| n != nonce);
    thread::Builder::new()
        .name("oxccl-bootstrap-root".into())
        .spawn(move || {
            Root::new(nonce).serve(&inbox);
            forget();
            coordinator_done.store(true, Ordering::SeqCst);
            let _ = TcpStream::connect_timeout(&wake, Duration::from_secs(1));
        })
        .map_err(|e| {
            forget();
            spawn_err(e)
        })?;
    // If this spawn fails the coordinator sees its channel closed and ends.
    thread::Builder::new()
        .name("oxccl-bootstrap-accept".into())
        .spawn(move || accept_loop(&listener, &events, &done))
        .map_err(spawn_err)?;
    Ok(())
}

fn accept_loop(listener: &TcpListener, events: &mpsc::Sender<Event>, done: &AtomicBool) {
    let mut next = 0u64;
    loop {
        let accepted = listener.accept();
        if done.load(Ordering::SeqCst) {
            return;
        }
        let Ok((stream, _)) = accepted else {
            // Out of file descriptors or a connection reset before it was accepted: pause, don't spin.
            thread::sleep(Duration::from_millis(10));
            continue;
        };
        let id = next;
        next += 1;
        let _ = stream.set_nodelay(true);
        let Ok(ours) = stream.try_clone() else { continue };
        if events.send(Event::Accepted(id, ours)).is_err() {
            return;
        }
        let tx = events.clone();
        let spawned =
            thread::Builder::new().name("oxccl-bootstrap-conn".into()).spawn(move || read_connection(id, stream, &tx));
        if spawned.is_err() {
            let _ = events.send(Event::Closed(id, Some("the root could not start a thread to read it".into())));
        }
    }
}

/// Reads one connection's frames and hands them to the coordinator, until the connection ends.
fn read_connection(id: u64, mut stream: TcpStream, events: &mpsc::Sender<Event>) {
    let _ = stream.set_read_timeout(Some(ROOT_HELLO_TIMEOUT));
    let hello = read_hello(&mut stream);
    let accepted = match hello {
        Ok(hello) => events.send(Event::Hello(id, hello)).is_ok(),
        Err(why) => {
            let _ = events.send(Event::Closed(id, why));
            // Drain a stray connection for a bounded time, then drop it.
            drain(&mut stream);
            return;
        }
    };
    // A rank may compute for hours between rounds: no read timeout from here on. The thread ends
    // when the rank closes the connection (which a rank does on any error, and on drop).
    let _ = stream.set_read_timeout(None);
    if accepted {
        loop {
            let event = match read_from_rank(&mut stream) {
                Ok(FromRank::Gather(bytes)) => Event::Gather(id, bytes),
                Ok(FromRank::Abort(why)) => Event::Abort(id, why),
                Ok(FromRank::Closed) => {
                    let _ = events.send(Event::Closed(id, None));
                    return;
                }
                Err(why) => {
                    let _ = events.send(Event::Closed(id, Some(why)));
                    drain(&mut stream);
                    return;
                }
            };
            if events.send(event).is_err() {
                break;
            }
        }
    }
    // The coordinator is gone (the group ended): read and drop what the rank still sends until it
    // closes, so closing here never resets a connection whose refusal the rank has not read yet.
    let mut scratch = [0u8; 4096];
    while matches!(stream.read(&mut scratch), Ok(n) if n > 0) {}
}

/// Reads what a stray connection still sends for up to [`ROOT_HELLO_TIMEOUT`].
fn drain(stream: &mut TcpStream) {
    let _ = stream.set_read_timeout(Some(ROOT_HELLO_TIMEOUT));
    let start = Instant::now();
    let mut scratch = [0u8; 4096];
    while start.elapsed() < ROOT_HELLO_TIMEOUT && matches!(stream.read(&mut scratch), Ok(n) if n > 0) {}
}

/// The hello, or why the connection is refused (`None`: it closed without a word, as the root's own
/// wake-up connection and port probes do).
fn read_hello(stream: &mut TcpStream) -> Result<Hello, Option<String>> {
    let header = read_header(stream).map_err(|e| match e.kind() {
        ErrorKind::WouldBlock | ErrorKind::TimedOut => {
            Some(format!("it sent no hello within {ROOT_HELLO_TIMEOUT:?} of connecting"))
        }
        _ => None,
    })?;
    let (kind, len) = header;
    if kind != HELLO || len != HELLO_LEN as u64 {
        return Err(Some(format!(
            "it is not an oxccl bootstrap rank (first frame: kind {kind:#04x}, {len} bytes; a hello is kind \
             {HELLO:#04x}, {HELLO_LEN} bytes)"
        )));
    }
    let mut payload = [0u8; HELLO_LEN];
    stream.read_exact(&mut payload).map_err(|_| None)?;
    Hello::decode(&payload).ok_or_else(|| Some("its hello does not start with the oxccl bootstrap magic".into()))
}

/// What a member sent after its hello.
enum FromRank {
    /// Its bytes for the round.
    Gather(Vec<u8>),
    /// It gave up, for this reason.
    Abort(String),
    /// The connection closed (or failed).
    Closed,
}

/// The next frame from a member, or why it is garbage.
fn read_from_rank(stream: &mut TcpStream) -> Result<FromRank, String> {
    let Ok((kind, len)) = read_header(stream) else { return Ok(FromRank::Closed) };
    let max = match kind {
        GATHER => MAX_MESSAGE_BYTES as u64,
        ABORT => MAX_TEXT,
        HELLO => return Err("it sent a second hello".into()),
        other => return Err(format!("it sent a frame of unknown kind {other:#04x}")),
    };
    if len > max {
        return Err(format!("it sent a frame of {len} bytes, over the limit of {max}"));
    }
    let mut bytes = buffer(len as usize, || "a rank's contribution".into()).map_err(|e| format!("the root {e}"))?;
    if stream.read_exact(&mut bytes).is_err() {
        return Ok(FromRank::Closed);
    }
    Ok(match kind {
        GATHER => FromRank::Gather(bytes),
        _ => FromRank::Abort(String::from_utf8_lossy(&bytes).into_owned()),
    })
}

/// A connection the coordinator knows: its write half, and its rank once its hello is accepted.
struct Peer {
    stream: TcpStream,
    rank: Option<usize>,
    /// The rank runs in the root's process: written to last.
    here: bool,
}

/// The coordinator's state: one group, from the first hello to its end.
struct Root {
    nonce: u128,
    peers: HashMap<u64, Peer>,
    /// Fixed by the first accepted hello, as are `timeout` and `deadline`.
    world: Option<usize>,
    timeout: Duration,
    /// When the arrived ranks are told who is missing (`None` before the first hello and once the
    /// group is complete).
    deadline: Option<Instant>,
    /// Each rank's connection.
    slots: Vec<Option<u64>>,
    /// Every rank has arrived and been welcomed.
    running: bool,
    /// This round's contributions, and how many have come.
    round: Vec<Option<Vec<u8>>>,
    arrived: usize,
}

/// What the coordinator does after an event.
enum Step {
    Go,
    /// End the group, telling every remaining member this.
    End(Refusal),
}

impl Root {
    fn new(nonce: u128) -> Root {
        Root {
            nonce,
            peers: HashMap::new(),
            world: None,
            timeout: ROOT_HELLO_TIMEOUT,
            deadline: None,
            slots: Vec::new(),
            running: false,
            round: Vec::new(),
            arrived: 0,
        }
    }

    fn serve(mut self, inbox: &mpsc::Receiver<Event>) {
        let end = loop {
            let event = match self.deadline {
                Some(deadline) => match inbox.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                    Ok(event) => event,
                    Err(mpsc::RecvTimeoutError::Timeout) => break Some(self.missing()),
                    Err(mpsc::RecvTimeoutError::Disconnected) => break None,
                },
                None => match inbox.recv() {
                    Ok(event) => event,
                    Err(_) => break None,
                },
            };
            if let Step::End(refusal) = self.handle(event) {
                break Some(refusal);
            }
        };
        // Tell every member why the group ended, then half-close every connection: each reader
        // thread drains until its rank closes, so no refusal is lost to a reset.
        for peer in self.peers.values_mut() {
            if let (Some(refusal), Some(_)) = (&end, peer.rank) {
                send_refusal(&mut peer.stream, refusal);
            }
            let _ = peer.stream.shutdown(Shutdown::Write);
        }
    }

    fn missing(&self) -> Refusal {
        let ranks = self.slots.iter().enumerate().filter(|(_, s)| s.is_none()).map(|(r, _)| r).collect();
        Refusal::Missing { ranks, world: self.world.unwrap_or(0), waited_ms: millis(self.timeout) }
    }

    fn handle(&mut self, event: Event) -> Step {
        match event {
            Event::Accepted(id, stream) => {
                // Until its hello sets the group's timeout, a write to a stray connection that reads
                // nothing must not hold the coordinator.
                let _ = stream.set_write_timeout(Some(ROOT_HELLO_TIMEOUT));
                self.peers.insert(id, Peer { stream, rank: None, here: false });
                Step::Go
            }
            Event::Hello(id, hello) => self.hello(id, hello),
            Event::Gather(id, bytes) => self.gather(id, bytes),
            Event::Abort(id, why) => self.leave(id, Some(why), None),
            Event::Closed(id, why) => self.leave(id, None, why),
        }
    }

    fn check(&self, h: &Hello) -> Option<Refusal> {
        if h.version != PROTOCOL_VERSION {
            let why = format!("protocol version {}, this root speaks version {PROTOCOL_VERSION}", h.version);
            return Some(Refusal::Protocol { why });
        }
        if h.nonce != self.nonce {
            return Some(Refusal::StaleId);
        }
        let as_usize = |x: u64| usize::try_from(x).unwrap_or(usize::MAX);
        if h.world == 0 || h.world > MAX_WORLD as u64 {
            return Some(Refusal::World { world: as_usize(h.world) });
        }
        if h.rank >= h.world {
            return Some(Refusal::RankOutOfRange { rank: as_usize(h.rank), world: as_usize(h.world) });
        }
        let (rank, world) = (h.rank as usize, h.world as usize);
        match self.world {
            Some(expected) if expected != world => Some(Refusal::WorldMismatch { rank, expected, got: world }),
            Some(_) if self.slots[rank].is_some() => Some(Refusal::RankTaken { rank }),
            _ => None,
        }
    }

    fn hello(&mut self, id: u64, hello: Hello) -> Step {
        if !self.peers.contains_key(&id) {
            return Step::Go;
        }
        if let Some(refusal) = self.check(&hello) {
            self.refuse(id, &refusal);
            return Step::Go;
        }
        let (rank, world) = (hello.rank as usize, hello.world as usize);
        if self.world.is_none() {
            // The first arrival fixes the world and, with its timeout, when the missing are named.
            self.world = Some(world);
            self.timeout = Duration::from_millis(hello.timeout_ms).max(MIN_TIMEOUT);
            self.deadline = Instant::now().checked_add(self.timeout);
            self.slots = vec![None; world];
            self.round = vec![None; world];
        }
        self.slots[rank] = Some(id);
        if let Some(peer) = self.peers.get_mut(&id) {
            peer.rank = Some(rank);
            peer.here = hello.flags & IN_ROOT_PROCESS != 0;
            let _ = peer.stream.set_write_timeout(Some(self.timeout));
        }
        if self.slots.iter().any(Option::is_none) {
            return Step::Go;
        }
        self.running = true;
        self.deadline = None;
        let welcome = welcome_bytes(self.nonce);
        self.send_every_rank(WELCOME, &[&welcome])
    }

    fn gather(&mut self, id: u64, bytes: Vec<u8>) -> Step {
        let Some(rank) = self.peers.get(&id).and_then(|p| p.rank) else { return Step::Go };
        if !self.running || self.round[rank].is_some() {
            let why = if self.running {
                "it sent two contributions to one round"
            } else {
                "it sent a contribution before the group was complete"
            };
            return self.leave(id, None, Some(why.into()));
        }
        self.round[rank] = Some(bytes);
        self.arrived += 1;
        if self.arrived < self.round.len() {
            return Step::Go;
        }
        let parts: Vec<Vec<u8>> = self.round.iter_mut().map(|p| p.take().unwrap_or_default()).collect();
        self.arrived = 0;
        let table: Vec<u8> = parts.iter().flat_map(|p| (p.len() as u64).to_le_bytes()).collect();
        let mut frame: Vec<&[u8]> = vec![&table];
        frame.extend(parts.iter().map(Vec::as_slice));
        self.send_every_rank(RESULT, &frame)
    }

    /// Writes one frame to every rank, those in the root's process last (see [`ROOTS_HERE`]); a
    /// rank that cannot be written to has left.
    fn send_every_rank(&mut self, kind: u8, frame: &[&[u8]]) -> Step {
        for here in [false, true] {
            for (rank, slot) in self.slots.iter().enumerate() {
                let Some(id) = *slot else { continue };
                let Some(peer) = self.peers.get_mut(&id) else { continue };
                if peer.here != here {
                    continue;
                }
                if write_frame(&mut peer.stream, kind, frame).is_err() {
                    self.peers.remove(&id);
                    return Step::End(Refusal::PeerLeft { rank });
                }
            }
        }
        Step::Go
    }

    /// A connection ended (`garbage`: with something the root refuses) or its rank gave up
    /// (`aborted`).
    fn leave(&mut self, id: u64, aborted: Option<String>, garbage: Option<String>) -> Step {
        if let Some(why) = &garbage {
            self.refuse(id, &Refusal::Protocol { why: why.clone() });
        }
        let Some(peer) = self.peers.remove(&id) else { return Step::Go };
        let _ = peer.stream.shutdown(Shutdown::Write);
        let Some(rank) = peer.rank else { return Step::Go };
        if !self.running {
            // Before the group is complete a rank may leave and come back (a restarted process).
            self.slots[rank] = None;
            return Step::Go;
        }
        match (aborted, garbage) {
            (Some(why), _) => Step::End(Refusal::PeerAborted { rank, why }),
            (None, Some(why)) => Step::End(Refusal::PeerAborted { rank, why: format!("the root dropped it: {why}") }),
            (None, None) => Step::End(Refusal::PeerLeft { rank }),
        }
    }

    /// Tells one connection why it is refused and half-closes it; its rank, if any, keeps its slot
    /// until the connection is gone (`leave`).
    fn refuse(&mut self, id: u64, refusal: &Refusal) {
        if let Some(peer) = self.peers.get_mut(&id) {
            send_refusal(&mut peer.stream, refusal);
            let _ = peer.stream.shutdown(Shutdown::Write);
            if peer.rank.is_none() {
                self.peers.remove(&id);
            }
        }
    }
}

fn send_refusal(stream: &mut TcpStream, refusal: &Refusal) {
    if let Ok(text) = serde_json::to_vec(refusal) {
        let _ = write_frame(stream, REFUSAL, &[&text]);
    }
}

// ------------------------------------------------------------------------------------------------
// TcpBootstrap
// ------------------------------------------------------------------------------------------------

/// A rank of a group that meets at a root over TCP: ranks in any processes, on any hosts.
///
/// Calls are serialised: from several threads, each call is one round. Dropping it closes the
/// connection; the root then tells the ranks still in the group that this one left.
pub struct TcpBootstrap {
    rank: usize,
    world: usize,
    timeout: Duration,
    root: SocketAddr,
    conn: Mutex<Conn>,
}

/// A failed round: the error, and whether to tell the root (not when the root sent it, nor after a
/// frame cut short, where another frame would read as garbage).
struct Failure {
    error: BootstrapError,
    tell_root: bool,
}

impl Failure {
    fn tell(error: BootstrapError) -> Failure {
        Failure { error, tell_root: true }
    }

    fn quiet(error: BootstrapError) -> Failure {
        Failure { error, tell_root: false }
    }
}

struct Conn {
    stream: TcpStream,
    rounds: u64,
    /// Set by the first failed call: the connection is closed and the rank has left.
    broken: Option<String>,
}

impl fmt::Debug for TcpBootstrap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TcpBootstrap")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("root", &self.root)
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl TcpBootstrap {
    /// Joins the group of `world` ranks at the root `id` names as `rank`, and returns once every rank
    /// has joined. Refused connections are retried until `timeout` (the root may start a little
    /// later). `timeout` also bounds every later wait: a call fails with
    /// [`BootstrapError::Timeout`] when no byte moved for that long (waiting for the other ranks
    /// included). The first rank to reach the root sets how long the root waits for the rest.
    pub fn new(id: &Id, rank: usize, world: usize, timeout: Duration) -> Result<TcpBootstrap, BootstrapError> {
        check_world(rank, world)?;
        let timeout = timeout.max(MIN_TIMEOUT);
        let root = id.addr;
        let mut stream = connect(root, timeout)?;
        let setup =
            |source| BootstrapError::Io { what: format!("setting up the connection to the root at {root}"), source };
        stream.set_nodelay(true).map_err(setup)?;
        stream.set_write_timeout(Some(timeout)).map_err(setup)?;
        let flags = if lock(&ROOTS_HERE).contains(&id.nonce) { IN_ROOT_PROCESS } else { 0 };
        let hello = Hello {
            version: PROTOCOL_VERSION,
            nonce: id.nonce,
            rank: rank as u64,
            world: world as u64,
            timeout_ms: millis(timeout),
            flags,
        };
        write_frame(&mut stream, HELLO, &[&hello.encode()]).map_err(|e| {
            wire_error(e, root, timeout, || format!("sending rank {rank}'s hello to the root at {root}"))
        })?;
        let wait = timeout.saturating_add(WELCOME_GRACE);
        stream.set_read_timeout(Some(wait)).map_err(setup)?;
        let waiting = || format!("waiting at the root {root} for all {world} ranks to join (this is rank {rank})");
        let (kind, len) = read_header(&mut stream).map_err(|e| wire_error(e, root, wait, waiting))?;
        match kind {
            WELCOME if len == WELCOME_LEN as u64 => {
                let mut welcome = [0u8; WELCOME_LEN];
                stream.read_exact(&mut welcome).map_err(|e| wire_error(e, root, wait, waiting))?;
                if welcome != welcome_bytes(id.nonce) {
                    let why = format!("the welcome from {root} is not this protocol's or names another run");
                    return Err(BootstrapError::Protocol { why });
                }
            }
            REFUSAL => return Err(read_refusal(&mut stream, len, root, wait)),
            _ => {
                let why = format!("{root} answered the hello with a frame of kind {kind:#04x}, {len} bytes");
                return Err(BootstrapError::Protocol { why });
            }
        }
        stream.set_read_timeout(Some(timeout)).map_err(setup)?;
        Ok(TcpBootstrap { rank, world, timeout, root, conn: Mutex::new(Conn { stream, rounds: 0, broken: None }) })
    }

    /// Joins the group a torchrun-style environment describes ([`LaunchEnv::from_env`]): see
    /// [`TcpBootstrap::from_launch_env`].
    pub fn from_env(timeout: Duration) -> Result<TcpBootstrap, BootstrapError> {
        TcpBootstrap::from_launch_env(&LaunchEnv::from_env()?, timeout)
    }

    /// Joins the group `env` describes: rank 0 starts the root, listening on every interface at
    /// [`LaunchEnv::root_port`] (as torch's store does: `MASTER_ADDR` may name the host by an address
    /// that is not one of its interfaces'), and every rank joins at `MASTER_ADDR` with the Id
    /// [`LaunchEnv::id`] derives, which all ranks agree on without talking. A port another process
    /// holds is [`BootstrapError::Bind`]: set [`PORT_VAR`] (`OXCCL_BOOTSTRAP_PORT`) to a free one.
    pub fn from_launch_env(env: &LaunchEnv, timeout: Duration) -> Result<TcpBootstrap, BootstrapError> {
        let id = env.id()?;
        if env.rank == 0 {
            let any: IpAddr =
                if id.addr.is_ipv4() { Ipv4Addr::UNSPECIFIED.into() } else { Ipv6Addr::UNSPECIFIED.into() };
            let addr = SocketAddr::new(any, id.addr.port());
            let listener = TcpListener::bind(addr).map_err(|source| BootstrapError::Bind { addr, source })?;
            start_root(listener, id.nonce)?;
        }
        TcpBootstrap::new(&id, env.rank, env.world, timeout)
    }

    /// The root's address.
    pub fn root(&self) -> SocketAddr {
        self.root
    }

    /// The timeout every wait is bounded by.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// One round.
    fn round(&self, conn: &mut Conn, mine: &[u8]) -> Result<Vec<Vec<u8>>, Failure> {
        if mine.len() > MAX_MESSAGE_BYTES {
            return Err(Failure::tell(BootstrapError::TooLarge { len: mine.len(), max: MAX_MESSAGE_BYTES }));
        }
        let (root, rank, n) = (self.root, self.rank, conn.rounds);
        let stream = &mut conn.stream;
        if let Err(e) = write_frame(stream, GATHER, &[mine]) {
            // The root may have ended the group and closed: its reason, if it came, says more.
            let _ = stream.set_read_timeout(Some(Duration::from_millis(100)));
            if let Ok((REFUSAL, len)) = read_header(stream) {
                return Err(Failure::quiet(read_refusal(stream, len, root, self.timeout)));
            }
            let what = || format!("sending rank {rank}'s bytes for round {n} to the root at {root}");
            return Err(Failure::quiet(wire_error(e, root, self.timeout, what)));
        }
        let waiting = || format!("waiting for the other ranks' bytes in round {n} (rank {rank}, root {root})");
        let (kind, len) = read_header(stream).map_err(|e| {
            // A timeout here leaves the stream at a frame boundary: the root can still be told.
            let tell_root = matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut);
            Failure { error: wire_error(e, root, self.timeout, waiting), tell_root }
        })?;
        let cut = |e| Failure::quiet(wire_error(e, root, self.timeout, waiting));
        match kind {
            RESULT => {}
            REFUSAL => return Err(Failure::quiet(read_refusal(stream, len, root, self.timeout))),
            _ => {
                let why = format!("the root at {root} answered round {n} with a frame of kind {kind:#04x}");
                return Err(Failure::quiet(BootstrapError::Protocol { why }));
            }
        }
        let table_len = 8 * self.world as u64;
        if len < table_len {
            let why = format!("the root at {root} sent a round's result of {len} bytes, shorter than its table");
            return Err(Failure::quiet(BootstrapError::Protocol { why }));
        }
        let mut table = vec![0u8; table_len as usize];
        stream.read_exact(&mut table).map_err(cut)?;
        let lens: Vec<u64> = table
            .chunks_exact(8)
            .map(|c| {
                let mut x = [0u8; 8];
                x.copy_from_slice(c);
                u64::from_le_bytes(x)
            })
            .collect();
        if let Some((r, l)) = lens.iter().enumerate().find(|(_, l)| **l > MAX_MESSAGE_BYTES as u64) {
            let why =
                format!("the root at {root} announced {l} bytes from rank {r}, over the limit of {MAX_MESSAGE_BYTES}");
            return Err(Failure::quiet(BootstrapError::Protocol { why }));
        }
        // No overflow: at most MAX_WORLD lengths of at most 2^30 each.
        if lens.iter().sum::<u64>() + table_len != len {
            let why = format!("the root at {root} sent a round's result whose lengths do not add up to its size");
            return Err(Failure::quiet(BootstrapError::Protocol { why }));
        }
        let mut all = Vec::with_capacity(self.world);
        for (r, &l) in lens.iter().enumerate() {
            let mut bytes = buffer(l as usize, || format!("rank {r}'s bytes")).map_err(Failure::quiet)?;
            stream.read_exact(&mut bytes).map_err(cut)?;
            all.push(bytes);
        }
        conn.rounds += 1;
        Ok(all)
    }
}

impl Bootstrap for TcpBootstrap {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn all_gather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>, BootstrapError> {
        let mut conn = lock(&self.conn);
        if let Some(why) = &conn.broken {
            return Err(BootstrapError::Broken { why: why.clone() });
        }
        match self.round(&mut conn, mine) {
            Ok(all) => Ok(all),
            Err(Failure { error, tell_root }) => {
                // Leave the group: tell the root why (so the others learn it at once, not after
                // their own timeouts), then close.
                if tell_root {
                    let _ = conn.stream.set_write_timeout(Some(self.timeout.min(Duration::from_secs(1))));
                    let _ = write_frame(&mut conn.stream, ABORT, &[error.to_string().as_bytes()]);
                }
                let _ = conn.stream.shutdown(Shutdown::Both);
                conn.broken = Some(error.to_string());
                Err(error)
            }
        }
    }
}

// ------------------------------------------------------------------------------------------------
// Torchrun's environment
// ------------------------------------------------------------------------------------------------

/// A torchrun-style launch: what `torchrun` (or `torch.distributed.launch`, or a scheduler script
/// that mimics them) tells each process through its environment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchEnv {
    /// `RANK`: this process's rank among all.
    pub rank: usize,
    /// `WORLD_SIZE`: the number of ranks.
    pub world: usize,
    /// `LOCAL_RANK` (default: `RANK`): this process's rank on its host.
    pub local_rank: usize,
    /// `LOCAL_WORLD_SIZE` (default: `WORLD_SIZE`): the ranks on this host.
    pub local_world: usize,
    /// `MASTER_ADDR`: the host of rank 0 (a name or an IP address).
    pub master_addr: String,
    /// `MASTER_PORT`: torch's store's port.
    pub master_port: u16,
    /// Where oxccl's root listens: `OXCCL_BOOTSTRAP_PORT` if set; else `MASTER_PORT + 1` when
    /// `TORCHELASTIC_USE_AGENT_STORE` is `True` (torchrun's agent then already holds `MASTER_PORT`
    /// with its store); else `MASTER_PORT`. Set `OXCCL_BOOTSTRAP_PORT` when the processes also start
    /// torch.distributed without torchrun's agent store: rank 0's own store then holds `MASTER_PORT`.
    pub root_port: u16,
    /// `TORCHELASTIC_RUN_ID`, if set: part of the derived Id, so runs sharing a port tell each other
    /// apart.
    pub run_id: Option<String>,
}

impl LaunchEnv {
    /// Reads this process's environment; a missing or malformed variable is
    /// [`BootstrapError::Env`] naming it.
    pub fn from_env() -> Result<LaunchEnv, BootstrapError> {
        LaunchEnv::from_lookup(|var| std::env::var_os(var).map(|v| v.to_string_lossy().into_owned()))
    }

    /// Reads the variables through `lookup` (a variable's value, `None` if unset) instead of the
    /// process's environment.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<LaunchEnv, BootstrapError> {
        let get = |var: &'static str| lookup(var).ok_or_else(|| BootstrapError::Env { var, why: "not set".into() });
        let number = |var: &'static str, text: String| {
            text.trim()
                .parse::<usize>()
                .map_err(|_| BootstrapError::Env { var, why: format!("{text:?} is not a non-negative integer") })
        };
        let port = |var: &'static str, text: String| match text.trim().parse::<u16>() {
            Ok(p) if p > 0 => Ok(p),
            _ => Err(BootstrapError::Env { var, why: format!("{text:?} is not a port number from 1 to 65535") }),
        };
        let rank = number("RANK", get("RANK")?)?;
        let world = number("WORLD_SIZE", get("WORLD_SIZE")?)?;
        if world == 0 || world > MAX_WORLD {
            return Err(BootstrapError::Env {
                var: "WORLD_SIZE",
                why: format!("{world}: a group has 1 to {MAX_WORLD} ranks"),
            });
        }
        if rank >= world {
            return Err(BootstrapError::Env { var: "RANK", why: format!("{rank} is not below WORLD_SIZE {world}") });
        }
        let local_rank = lookup("LOCAL_RANK").map_or(Ok(rank), |t| number("LOCAL_RANK", t))?;
        let local_world = lookup("LOCAL_WORLD_SIZE").map_or(Ok(world), |t| number("LOCAL_WORLD_SIZE", t))?;
        if local_rank >= local_world {
            let why = format!("{local_rank} is not below LOCAL_WORLD_SIZE {local_world}");
            return Err(BootstrapError::Env { var: "LOCAL_RANK", why });
        }
        let master_addr = get("MASTER_ADDR")?;
        if master_addr.trim().is_empty() {
            return Err(BootstrapError::Env { var: "MASTER_ADDR", why: "empty".into() });
        }
        let master_port = port("MASTER_PORT", get("MASTER_PORT")?)?;
        let root_port = match lookup(PORT_VAR) {
            Some(text) => port(PORT_VAR, text)?,
            None if lookup("TORCHELASTIC_USE_AGENT_STORE").is_some_and(|v| v.trim() == "True") => {
                master_port.checked_add(1).ok_or_else(|| BootstrapError::Env {
                    var: "MASTER_PORT",
                    why: format!(
                        "{master_port} leaves no port above it for oxccl's root (torchrun's agent holds \
                         MASTER_PORT): set {PORT_VAR}"
                    ),
                })?
            }
            None => master_port,
        };
        Ok(LaunchEnv {
            rank,
            world,
            local_rank,
            local_world,
            master_addr: master_addr.trim().to_string(),
            master_port,
            root_port,
            run_id: lookup("TORCHELASTIC_RUN_ID"),
        })
    }

    /// The root's address: `MASTER_ADDR` resolved (its first IPv4 address, else its first) at
    /// [`LaunchEnv::root_port`].
    pub fn root_addr(&self) -> Result<SocketAddr, BootstrapError> {
        resolve(&self.master_addr, self.root_port).map_err(|why| BootstrapError::Env { var: "MASTER_ADDR", why })
    }

    /// The Id every rank of this launch derives alike: [`LaunchEnv::root_addr`], and a nonce hashed
    /// (FNV-1a, 128 bits) from the run id, `MASTER_ADDR` as written and the root's port.
    pub fn id(&self) -> Result<Id, BootstrapError> {
        let run: &[u8] = match &self.run_id {
            Some(id) => id.as_bytes(),
            None => &[0xff],
        };
        let nonce =
            fnv1a_128(&[b"oxccl-bootstrap-v1", run, self.master_addr.as_bytes(), &self.root_port.to_le_bytes()]);
        Ok(Id::from_parts(self.root_addr()?, nonce))
    }
}

// ------------------------------------------------------------------------------------------------
// LocalBootstrap
// ------------------------------------------------------------------------------------------------

/// A rank of a group whose ranks are threads of one process: no sockets, no size limit. Same
/// semantics as [`TcpBootstrap`]: a member that is dropped, or whose call fails, leaves the group
/// and the others' calls fail naming it ([`BootstrapError::PeerLeft`],
/// [`BootstrapError::PeerAborted`]); a call waits for the others at most the group's timeout.
pub struct LocalBootstrap {
    rank: usize,
    world: usize,
    timeout: Duration,
    shared: Arc<Shared>,
    /// Serialises this member's calls from several threads: each is one round.
    busy: Mutex<()>,
}

struct Shared {
    state: Mutex<LocalState>,
    changed: Condvar,
}

struct LocalState {
    round: Vec<Option<Vec<u8>>>,
    arrived: usize,
    /// Completed rounds; `done` is the last one's result.
    generation: u64,
    done: Arc<Vec<Vec<u8>>>,
    /// The first member to leave, and why (`None`: dropped).
    left: Option<(usize, Option<String>)>,
}

impl fmt::Debug for LocalBootstrap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LocalBootstrap")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl LocalBootstrap {
    /// A group of `world` members, ranks `0..world` in order, each a call waits for the others at
    /// most `timeout`. Hand one to each thread.
    pub fn group(world: usize, timeout: Duration) -> Vec<LocalBootstrap> {
        let shared = Arc::new(Shared {
            state: Mutex::new(LocalState {
                round: vec![None; world],
                arrived: 0,
                generation: 0,
                done: Arc::new(Vec::new()),
                left: None,
            }),
            changed: Condvar::new(),
        });
        (0..world)
            .map(|rank| LocalBootstrap { rank, world, timeout, shared: shared.clone(), busy: Mutex::new(()) })
            .collect()
    }

    fn left_error(&self, left: &(usize, Option<String>)) -> BootstrapError {
        match left {
            (rank, _) if *rank == self.rank => {
                BootstrapError::Broken { why: "this member's earlier call failed".into() }
            }
            (rank, None) => BootstrapError::PeerLeft { rank: *rank },
            (rank, Some(why)) => BootstrapError::PeerAborted { rank: *rank, why: why.clone() },
        }
    }
}

impl Bootstrap for LocalBootstrap {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn all_gather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>, BootstrapError> {
        let _busy = lock(&self.busy);
        let mut state = lock(&self.shared.state);
        if let Some(left) = &state.left {
            return Err(self.left_error(left));
        }
        let generation = state.generation;
        state.round[self.rank] = Some(mine.to_vec());
        state.arrived += 1;
        if state.arrived == self.world {
            let all: Vec<Vec<u8>> = state.round.iter_mut().map(|p| p.take().unwrap_or_default()).collect();
            state.done = Arc::new(all);
            state.arrived = 0;
            state.generation += 1;
            self.shared.changed.notify_all();
            return Ok(state.done.to_vec());
        }
        let deadline = Instant::now().checked_add(self.timeout);
        loop {
            // The round's result first: a member that finished and dropped must not spoil it.
            if state.generation != generation {
                return Ok(state.done.to_vec());
            }
            if let Some(left) = &state.left {
                return Err(self.left_error(left));
            }
            match deadline {
                None => state = self.shared.changed.wait(state).unwrap_or_else(|e| e.into_inner()),
                Some(deadline) => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        let error = BootstrapError::Timeout {
                            what: format!("waiting for the other ranks in round {generation} (rank {})", self.rank),
                            waited: self.timeout,
                        };
                        state.left = Some((self.rank, Some(error.to_string())));
                        self.shared.changed.notify_all();
                        return Err(error);
                    }
                    state = self.shared.changed.wait_timeout(state, left).unwrap_or_else(|e| e.into_inner()).0;
                }
            }
        }
    }
}

impl Drop for LocalBootstrap {
    fn drop(&mut self) {
        let mut state = lock(&self.shared.state);
        if state.left.is_none() {
            state.left = Some((self.rank, None));
            self.shared.changed.notify_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v4(a: [u8; 4], port: u16) -> SocketAddr {
        SocketAddr::new(Ipv4Addr::from(a).into(), port)
    }

    #[test]
    fn id_round_trips_through_bytes_and_text() {
        let ids = [
            Id::from_parts(v4([10, 1, 2, 3], 29500), 0x0123_4567_89ab_cdef_0011_2233_4455_6677),
            Id::from_parts("[::1]:7".parse().expect("addr"), u128::MAX),
            Id::from_parts(SocketAddr::V6(SocketAddrV6::new("fe80::1".parse().expect("ip"), 65535, 0, 3)), 0),
        ];
        for id in ids {
            let bytes = id.to_bytes();
            assert_eq!(Id::from_bytes(&bytes).expect("bytes"), id);
            let text = id.to_string();
            assert!(text.starts_with(ID_PREFIX) && text.len() == ID_PREFIX.len() + 2 * ID_BYTES, "{text}");
            assert_eq!(text.parse::<Id>().expect("text"), id);
            assert_eq!(text.to_uppercase().replace("OXCCL-ID-V1:", ID_PREFIX).parse::<Id>().expect("upper"), id);
        }
        // Version, family, the IPv4 address and its padding, the port, the scope id, the nonce.
        let pinned = concat!(
            "oxccl-id-v1:",
            "01",
            "04",
            "0a010203",
            "000000000000000000000000",
            "733c",
            "00000000",
            "0123456789abcdef0011223344556677"
        );
        assert_eq!(ids[0].to_string(), pinned);
    }

    #[test]
    fn bad_id_bytes_are_named() {
        let good = Id::from_parts(v4([127, 0, 0, 1], 1234), 5).to_bytes();
        let why = |b: &[u8]| match Id::from_bytes(b) {
            Err(BootstrapError::BadId { why }) => why,
            other => panic!("expected BadId, got {other:?}"),
        };
        assert!(why(&good[..39]).contains("39 bytes"));
        assert!(why(&[]).contains("0 bytes"));
        let mut b = good;
        b[0] = 2;
        assert!(why(&b).contains("layout version 2"));
        let mut b = good;
        b[1] = 5;
        assert!(why(&b).contains("family 5"));
        let mut b = good;
        b[10] = 1;
        assert!(why(&b).contains("padding"));
        let mut b = good;
        b[18..20].fill(0);
        assert!(why(&b).contains("port 0"));
    }

    #[test]
    fn bad_id_strings_are_named() {
        let good = Id::from_parts(v4([127, 0, 0, 1], 1234), 5).to_string();
        let why = |s: &str| match s.parse::<Id>() {
            Err(BootstrapError::BadId { why }) => why,
            other => panic!("expected BadId for {s:?}, got {other:?}"),
        };
        assert!(why("").contains("expected"));
        assert!(why("nccl-id:1234").contains("nccl-id:1234"));
        assert!(why(&good[..good.len() - 1]).contains("79 characters"));
        assert!(why(&format!("{good}0")).contains("81 characters"));
        let mut garbled = good.clone();
        garbled.replace_range(20..21, "g");
        assert!(why(&garbled).contains(&format!("byte {}", 20 - ID_PREFIX.len())), "{}", why(&garbled));
        // A multi-byte character is refused, not sliced through.
        let mut accented = good.clone();
        accented.replace_range(ID_PREFIX.len()..ID_PREFIX.len() + 2, "é");
        assert!(why(&accented).contains("not a hex digit"));
        assert!(why(&format!(" {good}")).contains("expected"), "no trimming in FromStr");
    }

    #[test]
    fn hello_and_refusals_round_trip() {
        let h = Hello { version: 1, nonce: 99, rank: 3, world: 8, timeout_ms: 1500, flags: IN_ROOT_PROCESS };
        assert_eq!(Hello::decode(&h.encode()), Some(h));
        let mut b = h.encode();
        b[0] ^= 1;
        assert_eq!(Hello::decode(&b), None);
        let root = v4([1, 2, 3, 4], 5);
        let r = Refusal::Missing { ranks: vec![2, 5], world: 8, waited_ms: 1000 };
        let text = serde_json::to_vec(&r).expect("json");
        let back: Refusal = serde_json::from_slice(&text).expect("json");
        let e = back.into_error(root);
        assert!(matches!(&e, BootstrapError::Missing { ranks, world: 8, .. } if ranks == &[2, 5]), "{e:?}");
        assert_eq!(e.to_string(), "ranks 2, 5 of 8 never joined within 1s");
        let e = Refusal::StaleId.into_error(root);
        assert!(e.to_string().contains("1.2.3.4:5") && e.to_string().contains("stale"), "{e}");
    }

    #[test]
    fn derived_nonces_are_stable_and_distinct() {
        // Pinned: ranks built by different compilers must agree.
        assert_eq!(fnv1a_128(&[]), 0x6c62_272e_07bb_0142_62b8_2175_6295_c58d);
        assert_eq!(fnv1a_128(&[b"a"]), fnv1a_128(&[b"a"]));
        assert_ne!(fnv1a_128(&[b"ab", b"c"]), fnv1a_128(&[b"a", b"bc"]));
        let env = |run: Option<&str>| LaunchEnv {
            rank: 0,
            world: 2,
            local_rank: 0,
            local_world: 2,
            master_addr: "127.0.0.1".into(),
            master_port: 29500,
            root_port: 29500,
            run_id: run.map(Into::into),
        };
        let a = env(Some("job-1")).id().expect("id");
        assert_eq!(a, env(Some("job-1")).id().expect("id"));
        assert_ne!(a.nonce(), env(Some("job-2")).id().expect("id").nonce());
        assert_ne!(env(None).id().expect("id").nonce(), env(Some("")).id().expect("id").nonce());
        assert_eq!(a.addr(), v4([127, 0, 0, 1], 29500));
    }

    #[test]
    fn host_port_text_parses() {
        assert_eq!(parse_host_port("10.0.0.1:80"), Ok(v4([10, 0, 0, 1], 80)));
        assert_eq!(parse_host_port(" 10.0.0.1 "), Ok(v4([10, 0, 0, 1], 0)));
        assert_eq!(parse_host_port("[::1]:9"), Ok("[::1]:9".parse().expect("addr")));
        assert_eq!(parse_host_port("::1"), Ok("[::1]:0".parse().expect("addr")));
        assert_eq!(parse_host_port("[::1]"), Ok("[::1]:0".parse().expect("addr")));
        assert_eq!(parse_host_port("localhost:81").map(|a| (a.ip().is_loopback(), a.port())), Ok((true, 81)));
        assert!(parse_host_port("10.0.0.1:http").expect_err("port").contains("\"http\""));
        assert!(parse_host_port("10.0.0.1:70000").expect_err("port").contains("70000"));
        assert!(parse_host_port("").is_err());
        assert!(parse_host_port("no-such-host.invalid").expect_err("dns").contains("no-such-host.invalid"));
    }

    #[test]
    fn advertised_address_is_never_unspecified() {
        let a = advertised(SocketAddr::new(Ipv4Addr::UNSPECIFIED.into(), 4000));
        assert!(!a.ip().is_unspecified() && a.is_ipv4() && a.port() == 4000, "{a}");
        assert_eq!(advertised(v4([10, 9, 8, 7], 1)), v4([10, 9, 8, 7], 1));
    }

    /// A fake root that answers a hello with `reply` (after reading the hello), then keeps the
    /// connection open for a moment.
    fn fake_root(reply: Vec<u8>) -> Id {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("bind");
        let addr = listener.local_addr().expect("addr");
        thread::spawn(move || {
            let (mut s, _) = listener.accept().expect("accept");
            let mut hello = [0u8; HEADER_LEN + HELLO_LEN];
            s.read_exact(&mut hello).expect("hello");
            s.write_all(&reply).expect("reply");
            let mut rest = Vec::new();
            let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
            let _ = s.read_to_end(&mut rest);
        });
        Id::from_parts(addr, 7)
    }

    fn frame(kind: u8, payload: &[u8]) -> Vec<u8> {
        let mut v = Vec::new();
        write_frame(&mut v, kind, &[payload]).expect("frame");
        v
    }

    const SHORT: Duration = Duration::from_secs(2);

    #[test]
    fn garbage_from_the_root_is_a_protocol_error() {
        let e = TcpBootstrap::new(&fake_root(b"HTTP/1.1 400 Bad Request\r\n\r\n".to_vec()), 0, 1, SHORT)
            .expect_err("garbage");
        assert!(matches!(e, BootstrapError::Protocol { .. }), "{e:?}");
        let e = TcpBootstrap::new(&fake_root(frame(WELCOME, &welcome_bytes(8))), 0, 1, SHORT).expect_err("nonce");
        assert!(matches!(&e, BootstrapError::Protocol { why } if why.contains("another run")), "{e:?}");
        let e = TcpBootstrap::new(&fake_root(frame(REFUSAL, b"{not json")), 0, 1, SHORT).expect_err("json");
        assert!(matches!(&e, BootstrapError::Protocol { why } if why.contains("unreadable")), "{e:?}");
    }

    #[test]
    fn a_root_that_closes_or_lies_about_lengths_is_named() {
        // A table announcing more than the limit: refused before anything is allocated.
        let mut reply = frame(WELCOME, &welcome_bytes(7));
        let huge = (MAX_MESSAGE_BYTES as u64 + 1).to_le_bytes();
        let mut result = vec![RESULT];
        result.extend_from_slice(&(8 + MAX_MESSAGE_BYTES as u64 + 1).to_le_bytes());
        result.extend_from_slice(&huge);
        reply.extend_from_slice(&result);
        let boot = TcpBootstrap::new(&fake_root(reply), 0, 1, SHORT).expect("welcome");
        let e = boot.all_gather(b"x").expect_err("oversize");
        assert!(matches!(&e, BootstrapError::Protocol { why } if why.contains("over the limit")), "{e:?}");
        let e = boot.barrier().expect_err("broken");
        assert!(matches!(&e, BootstrapError::Broken { why } if why.contains("over the limit")), "{e:?}");

        // Lengths that do not add up to the frame's size.
        let mut reply = frame(WELCOME, &welcome_bytes(7));
        let mut result = vec![RESULT];
        result.extend_from_slice(&(8u64 + 5).to_le_bytes());
        result.extend_from_slice(&3u64.to_le_bytes());
        result.extend_from_slice(b"abcde");
        reply.extend_from_slice(&result);
        let boot = TcpBootstrap::new(&fake_root(reply), 0, 1, SHORT).expect("welcome");
        let e = boot.all_gather(b"x").expect_err("lengths");
        assert!(matches!(&e, BootstrapError::Protocol { why } if why.contains("add up")), "{e:?}");
    }

    #[test]
    fn a_root_whose_process_ends_is_root_closed() {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("bind");
        let id = Id::from_parts(listener.local_addr().expect("addr"), 7);
        thread::spawn(move || {
            let (mut s, _) = listener.accept().expect("accept");
            let mut hello = [0u8; HEADER_LEN + HELLO_LEN];
            s.read_exact(&mut hello).expect("hello");
            s.write_all(&frame(WELCOME, &welcome_bytes(7))).expect("welcome");
            let mut gather = [0u8; HEADER_LEN + 1];
            s.read_exact(&mut gather).expect("gather");
            // Dropped here without an answer, as when the root's process ends.
        });
        let boot = TcpBootstrap::new(&id, 0, 1, SHORT).expect("welcome");
        let e = boot.all_gather(b"x").expect_err("closed");
        assert!(matches!(e, BootstrapError::RootClosed { root } if root == id.addr()), "{e:?}");
    }

    /// A raw connection to a real root: sends `bytes`, returns what the root answers.
    fn raw(id: &Id, bytes: &[u8]) -> Vec<u8> {
        let mut s = TcpStream::connect(id.addr()).expect("connect");
        s.set_read_timeout(Some(SHORT)).expect("timeout");
        s.write_all(bytes).expect("write");
        let mut answer = Vec::new();
        let _ = s.read_to_end(&mut answer);
        answer
    }

    fn refusal_of(answer: &[u8]) -> Refusal {
        assert!(answer.len() > HEADER_LEN && answer[0] == REFUSAL, "not a refusal: {answer:?}");
        serde_json::from_slice(&answer[HEADER_LEN..]).expect("refusal json")
    }

    #[test]
    fn the_root_refuses_what_ranks_check_themselves_and_strays() {
        let id = Id::new_on(v4([127, 0, 0, 1], 0)).expect("root");
        let hello = |version: u32, rank: u64, world: u64| {
            frame(HELLO, &Hello { version, nonce: id.nonce(), rank, world, timeout_ms: 2000, flags: 0 }.encode())
        };
        // What TcpBootstrap::new refuses before connecting, the root refuses too.
        assert_eq!(refusal_of(&raw(&id, &hello(1, 2, 2))), Refusal::RankOutOfRange { rank: 2, world: 2 });
        assert_eq!(refusal_of(&raw(&id, &hello(1, 0, 0))), Refusal::World { world: 0 });
        assert_eq!(refusal_of(&raw(&id, &hello(1, 0, 1 << 40))), Refusal::World { world: 1 << 40 });
        assert!(
            matches!(refusal_of(&raw(&id, &hello(2, 0, 2))), Refusal::Protocol { why } if why.contains("version 2"))
        );
        // Strays: an HTTP request, a wrong magic.
        let answer = raw(&id, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n");
        assert!(matches!(refusal_of(&answer), Refusal::Protocol { why } if why.contains("not an oxccl")));
        let mut bad_magic = hello(1, 0, 2);
        bad_magic[HEADER_LEN] ^= 1;
        assert!(matches!(refusal_of(&raw(&id, &bad_magic)), Refusal::Protocol { why } if why.contains("magic")));
        // None of it disturbed the root: a real group still forms and gathers.
        let ranks: Vec<_> = (0..2)
            .map(|rank| thread::spawn(move || TcpBootstrap::new(&id, rank, 2, SHORT)?.all_gather(&[rank as u8])))
            .collect();
        for r in ranks {
            assert_eq!(r.join().expect("thread").expect("gather"), vec![vec![0], vec![1]]);
        }
    }

    #[test]
    fn a_member_sending_garbage_is_dropped_and_named() {
        let id = Id::new_on(v4([127, 0, 0, 1], 0)).expect("root");
        let other = thread::spawn(move || {
            let boot = TcpBootstrap::new(&id, 1, 2, SHORT)?;
            boot.all_gather(b"ok")
        });
        let mut s = TcpStream::connect(id.addr()).expect("connect");
        s.set_read_timeout(Some(SHORT)).expect("timeout");
        s.write_all(&frame(
            HELLO,
            &Hello { version: 1, nonce: id.nonce(), rank: 0, world: 2, timeout_ms: 2000, flags: 0 }.encode(),
        ))
        .expect("hello");
        let mut welcome = [0u8; HEADER_LEN + WELCOME_LEN];
        s.read_exact(&mut welcome).expect("welcome");
        assert_eq!(welcome[0], WELCOME);
        s.write_all(&[0x7f; 16]).expect("garbage");
        let mut answer = Vec::new();
        let _ = s.read_to_end(&mut answer);
        assert!(matches!(refusal_of(&answer), Refusal::Protocol { why } if why.contains("unknown kind 0x7f")));
        let e = other.join().expect("thread").expect_err("peer dropped");
        assert!(matches!(&e, BootstrapError::PeerAborted { rank: 0, why } if why.contains("0x7f")), "{e:?}");
    }

    #[test]
    fn errors_read_as_sentences() {
        let addr = v4([10, 0, 0, 1], 29500);
        let e = BootstrapError::Bind { addr, source: io::Error::from(ErrorKind::AddrInUse) };
        assert!(e.to_string().contains("10.0.0.1:29500") && e.to_string().contains(PORT_VAR), "{e}");
        assert!(std::error::Error::source(&e).is_some());
        let e = BootstrapError::WorldMismatch { rank: 3, expected: 8, got: 4 };
        assert_eq!(e.to_string(), "rank 3 joined with a world of 4 rank(s), but the first rank to arrive said 8");
        assert!(std::error::Error::source(&e).is_none());
        let e = BootstrapError::Missing { ranks: vec![7], world: 8, waited: Duration::from_millis(1500) };
        assert_eq!(e.to_string(), "rank 7 of 8 never joined within 1.5s");
        let e = BootstrapError::Env { var: "RANK", why: "not set".into() };
        assert_eq!(e.to_string(), "environment variable RANK: not set");
    }
}
