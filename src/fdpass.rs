//! File descriptors between the processes of one communicator: a small request/response service on
//! a Linux abstract Unix socket.
//!
//! Ranks share GPU memory by exporting CUDA virtual-memory allocations as POSIX file descriptors
//! (`cuMemExportToShareableHandle`) and passing the descriptors to peers, which import them. Each
//! rank runs a [`Service`]; a peer's [`Client`] sends it bytes and descriptors ("map this") and gets
//! reply bytes back. This module is the transport only: no CUDA.
//!
//! Names live in the abstract namespace (`\0oxccl/<nonce>/<rank>`): nothing is left in the file
//! system, and a dead process's name disappears with its socket. Any process in the same network
//! namespace can connect to an abstract name, so names carry a random nonce and handlers validate
//! what they are sent.
//!
//! A frame is a 12-byte header, then the payload:
//!
//! | bytes | field |
//! |---|---|
//! | 0..4  | magic `b"oxfd"` |
//! | 4..8  | payload length, `u32` little-endian, at most [`MAX_BYTES`] |
//! | 8..12 | descriptor count, `u32` little-endian, at most [`MAX_FDS`] |
//!
//! The descriptors ride as one `SCM_RIGHTS` control message on the `sendmsg` that carries the
//! frame's first byte, so the receiver gets them with the header. A request frame is answered by
//! one reply frame (no descriptors) on the same connection; requests on one connection are served
//! in order, connections in parallel (one thread each).
//!
//! Every socket is non-blocking and every wait is a `poll` with a deadline (a client's) or the
//! service's stop pipe (the service's idle waits), so nothing blocks without bound: a peer that dies
//! mid-call is [`FdPassError::PeerClosed`], one that stalls is [`FdPassError::Timeout`].
//!
//! Linux only: the module is absent elsewhere (abstract names and `MSG_CMSG_CLOEXEC` are Linux's).

use std::fmt;
use std::io::{self, PipeReader, PipeWriter, Write};
use std::mem::{offset_of, size_of};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

/// The longest payload a frame carries (16 MiB), either way.
pub(crate) const MAX_BYTES: usize = 16 << 20;

/// The most descriptors one message carries.
pub(crate) const MAX_FDS: usize = 16;

/// The longest name: `sun_path` holds 108 bytes, the first of them the NUL that marks the abstract
/// namespace.
pub(crate) const MAX_NAME: usize = 107;

/// The first header word; anything else on the socket is not this protocol.
const MAGIC: [u8; 4] = *b"oxfd";

/// Header bytes: magic, payload length, descriptor count.
const HEADER: usize = 12;

/// How long the service gives a request that has started arriving to finish, and a reply to be
/// taken: a client that stalls mid-frame must not hold its connection thread forever.
const SERVICE_IO_TIMEOUT: Duration = Duration::from_secs(30);

/// Bytes of control buffer a received message needs for [`MAX_FDS`] descriptors; a peer that sends
/// more gets `MSG_CTRUNC`.
// SAFETY: `CMSG_SPACE` is arithmetic on its argument, which fits a `c_uint`.
const RECV_CMSG_SPACE: usize = unsafe { libc::CMSG_SPACE((MAX_FDS * size_of::<libc::c_int>()) as u32) } as usize;

/// A request as the service's handler gets it: the bytes and the descriptors sent with them, now
/// open in this process (close-on-exec; closed when dropped).
#[derive(Debug)]
pub(crate) struct Message {
    /// The payload.
    pub(crate) bytes: Vec<u8>,
    /// The descriptors, in the order the client passed them.
    pub(crate) fds: Vec<OwnedFd>,
}

/// What went wrong passing a message.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub(crate) enum FdPassError {
    /// A socket call failed.
    #[error("descriptor passing: {what} failed: {source}")]
    Io {
        /// The step (`"bind"`, `"connect"`, `"poll"`, `"request"`, `"reply"`, ...).
        what: &'static str,
        /// The system's error.
        source: io::Error,
    },
    /// A deadline passed: no service bound the name in time (`"connect"`), or the request could not
    /// be sent (`"request"`) or its reply did not arrive (`"reply"`) within the call's timeout.
    #[error("descriptor passing: {what} timed out after {waited:?}")]
    Timeout {
        /// The step that waited.
        what: &'static str,
        /// The time it was given.
        waited: Duration,
    },
    /// The peer closed the connection, or its process ended, before the exchange was complete.
    #[error("descriptor passing: the peer closed the connection (or exited)")]
    PeerClosed,
    /// A payload over [`MAX_BYTES`]: refused before sending, or announced by the peer's header.
    #[error("descriptor passing: a {bytes}-byte message, the limit is {max}")]
    TooLarge {
        /// The payload's length.
        bytes: usize,
        /// The limit.
        max: usize,
    },
    /// More than [`MAX_FDS`] descriptors: refused before sending, or announced by the peer.
    #[error("descriptor passing: {fds} descriptors in one message, the limit is {max}")]
    TooManyFds {
        /// The descriptors given or announced.
        fds: usize,
        /// The limit.
        max: usize,
    },
    /// The peer broke the framing (bad magic, descriptors other than announced, truncated control
    /// data, descriptors on a reply).
    #[error("descriptor passing: protocol error: {0}")]
    Protocol(String),
    /// The name cannot be an abstract socket name.
    #[error("descriptor passing: socket name {name:?}: {why}")]
    BadName {
        /// The name given.
        name: String,
        /// What is wrong with it.
        why: &'static str,
    },
    /// An earlier call on this client failed part-way, so the connection may be out of step with the
    /// service (a late reply would answer the next request); the client closed it. Connect again.
    #[error("descriptor passing: an earlier call on this connection failed and it was closed; connect again")]
    Broken,
    /// The service is being dropped. Only its own threads see this (it is how their waits end); no
    /// client call returns it.
    #[error("descriptor passing: the service is stopping")]
    Stopped,
}

/// Maps an io error of step `what`.
fn io_err(what: &'static str) -> impl FnOnce(io::Error) -> FdPassError {
    move |source| FdPassError::Io { what, source }
}

/// The request handler a service runs.
type Handler = dyn Fn(Message) -> Vec<u8> + Send + Sync;

/// How a service's threads learn to end: the flag, and a pipe whose read end every one of their
/// polls watches (`Service::drop` writes a byte and closes the write end; nobody reads, so the pipe
/// stays readable and every later poll returns at once).
struct Stop {
    /// Set first, so a thread that wakes for another reason still sees it.
    flag: AtomicBool,
    /// The read end.
    wake: PipeReader,
}

/// Serves requests on an abstract socket until dropped; each request is answered by the handler.
/// The name shows in `Debug` (a rank's service and its connections are named after the
/// communicator and the rank).
impl fmt::Debug for Service {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Service").field("name", &self.name).finish_non_exhaustive()
    }
}

impl fmt::Debug for Client {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Client").field("name", &self.name).finish_non_exhaustive()
    }
}

pub(crate) struct Service {
    /// The abstract name (without the leading NUL).
    name: String,
    /// Shared with the threads.
    stop: Arc<Stop>,
    /// The stop pipe's write end; `None` once dropped.
    waker: Option<PipeWriter>,
    /// The accept thread, which joins the connection threads before it ends.
    accept: Option<JoinHandle<()>>,
}

impl Service {
    /// Binds the abstract socket `name` and serves it from background threads: one accepts, one per
    /// connection reads requests, calls `handler` and sends its reply.
    ///
    /// A reply longer than [`MAX_BYTES`] reaches the caller as [`FdPassError::TooLarge`]. A panic in
    /// the handler closes that connection (the caller sees [`FdPassError::PeerClosed`]); the others
    /// go on. A name already bound (by this or another process) is an `Io` error of kind `AddrInUse`.
    pub(crate) fn start(
        name: &str,
        handler: impl Fn(Message) -> Vec<u8> + Send + Sync + 'static,
    ) -> Result<Service, FdPassError> {
        check_name(name)?;
        let addr = SocketAddr::from_abstract_name(name.as_bytes()).map_err(io_err("socket name"))?;
        let listener = UnixListener::bind_addr(&addr).map_err(io_err("bind"))?;
        listener.set_nonblocking(true).map_err(io_err("set_nonblocking"))?;
        let (wake, waker) = io::pipe().map_err(io_err("pipe"))?;
        let stop = Arc::new(Stop { flag: AtomicBool::new(false), wake });
        let handler: Arc<Handler> = Arc::new(handler);
        let accept = thread::Builder::new()
            .name("oxccl-fdpass".into())
            .spawn({
                let stop = stop.clone();
                move || accept_loop(listener, &stop, &handler)
            })
            .map_err(io_err("spawn"))?;
        Ok(Service { name: name.to_owned(), stop, waker: Some(waker), accept: Some(accept) })
    }

    /// The abstract name it serves (without the leading NUL).
    #[cfg(test)]
    pub(crate) fn name(&self) -> &str {
        &self.name
    }
}

/// Stops the service and waits for its threads: the name is unbound and every connection closed
/// when it returns, and no handler call runs after it (one running when `drop` starts is waited
/// for, so handlers should be short).
impl Drop for Service {
    fn drop(&mut self) {
        self.stop.flag.store(true, Ordering::SeqCst);
        if let Some(mut waker) = self.waker.take() {
            // The byte wakes every poll even if a forked child holds a copy of the write end (which
            // would keep the close below from raising POLLHUP). The pipe is empty, so it cannot
            // fail short of a closed read end, which the threads hold.
            let _ = waker.write_all(&[1]);
        }
        if let Some(accept) = self.accept.take() {
            // A panic there has been reported by the panic hook; there is nothing to add.
            let _ = accept.join();
        }
    }
}

/// Accepts connections until stopped, one thread each; then closes the listener (unbinding the
/// name) and joins the connection threads.
fn accept_loop(listener: UnixListener, stop: &Arc<Stop>, handler: &Arc<Handler>) {
    let mut connections: Vec<JoinHandle<()>> = Vec::new();
    loop {
        if wait(listener.as_fd(), libc::POLLIN, Deadline::never(), Some(stop.wake.as_fd()), "accept").is_err() {
            break;
        }
        match listener.accept() {
            Ok((stream, _)) => {
                // Non-blocking is not inherited from the listener on Linux.
                if stream.set_nonblocking(true).is_err() {
                    continue;
                }
                let sock = OwnedFd::from(stream);
                connections.retain(|c| !c.is_finished());
                let (stop, handler) = (stop.clone(), handler.clone());
                // If the thread cannot start, the closure (and the socket in it) is dropped: the
                // client sees the connection closed.
                if let Ok(t) = thread::Builder::new()
                    .name("oxccl-fdpass-conn".into())
                    .spawn(move || serve_connection(&sock, &stop, &*handler))
                {
                    connections.push(t);
                }
            }
            Err(e) => match e.raw_os_error() {
                // Spurious wake-ups, and a client that gave up before we accepted.
                Some(libc::EAGAIN | libc::EINTR | libc::ECONNABORTED | libc::EPROTO) => {}
                // Out of descriptors or memory: the backlog waits; try again shortly.
                Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM) => {
                    thread::sleep(Duration::from_millis(10))
                }
                // Anything else means the listener itself is unusable.
                _ => break,
            },
        }
    }
    // Unbind first: from here a connect is refused instead of queueing on a listener nobody accepts.
    drop(listener);
    for c in connections {
        // A handler's panic ended that connection; it has been reported by the panic hook.
        let _ = c.join();
    }
}

/// Serves one connection's requests in order until the client closes it, it breaks the protocol or
/// the service stops. Returning closes the socket, which is how the client learns of any of these.
fn serve_connection(sock: &OwnedFd, stop: &Stop, handler: &Handler) {
    let stop_fd = Some(stop.wake.as_fd());
    loop {
        // Idle between requests: no deadline (a peer may call rarely), only the stop pipe.
        if wait(sock.as_fd(), libc::POLLIN, Deadline::never(), stop_fd, "request").is_err() {
            return;
        }
        let Ok(request) = recv_message(sock.as_fd(), Deadline::after(SERVICE_IO_TIMEOUT), stop_fd, "request") else {
            return;
        };
        if stop.flag.load(Ordering::SeqCst) {
            return;
        }
        let reply = handler(request);
        if send_message(sock.as_fd(), &reply, &[], Deadline::after(SERVICE_IO_TIMEOUT), stop_fd, "reply").is_err() {
            return;
        }
    }
}

/// A connection to a peer's [`Service`].
pub(crate) struct Client {
    /// The socket; `None` once a call failed part-way ([`FdPassError::Broken`]).
    sock: Option<OwnedFd>,
    /// The service's name.
    name: String,
}

impl Client {
    /// Connects to the service bound to `name`, retrying while nobody has bound it yet (the peer may
    /// start later) or its backlog is full, until `timeout` ([`FdPassError::Timeout`]).
    pub(crate) fn connect(name: &str, timeout: Duration) -> Result<Client, FdPassError> {
        check_name(name)?;
        let (addr, len) = abstract_addr(name);
        let deadline = Deadline::after(timeout);
        let mut pause = Duration::from_millis(1);
        loop {
            match connect_once(&addr, len) {
                Ok(sock) => return Ok(Client { sock: Some(sock), name: name.to_owned() }),
                // Not bound (yet), backlog full, or interrupted: all worth another try.
                Err(e) if matches!(e.raw_os_error(), Some(libc::ECONNREFUSED | libc::EAGAIN | libc::EINTR)) => {}
                Err(e) => return Err(FdPassError::Io { what: "connect", source: e }),
            }
            let Some(left) = deadline.remaining() else {
                return Err(FdPassError::Timeout { what: "connect", waited: timeout });
            };
            thread::sleep(pause.min(left));
            pause = (pause * 2).min(Duration::from_millis(20));
        }
    }

    /// The service's name.
    #[cfg(test)]
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// Sends `bytes` and `fds` as one request and returns the reply, all within `timeout`.
    ///
    /// The descriptors are borrowed: the kernel duplicates them into the service's process, so they
    /// stay open here. Too many bytes or descriptors are refused before anything is sent (the client
    /// stays usable). Any failure after that closes the connection (later calls return
    /// [`FdPassError::Broken`]): a timed-out request's reply could otherwise answer the next one.
    pub(crate) fn call(
        &mut self,
        bytes: &[u8],
        fds: &[BorrowedFd<'_>],
        timeout: Duration,
    ) -> Result<Vec<u8>, FdPassError> {
        if bytes.len() > MAX_BYTES {
            return Err(FdPassError::TooLarge { bytes: bytes.len(), max: MAX_BYTES });
        }
        if fds.len() > MAX_FDS {
            return Err(FdPassError::TooManyFds { fds: fds.len(), max: MAX_FDS });
        }
        let sock = self.sock.as_ref().ok_or(FdPassError::Broken)?;
        let deadline = Deadline::after(timeout);
        let reply = send_message(sock.as_fd(), bytes, fds, deadline, None, "request")
            .and_then(|()| recv_message(sock.as_fd(), deadline, None, "reply"))
            .and_then(|reply| match reply.fds.len() {
                0 => Ok(reply.bytes),
                n => Err(FdPassError::Protocol(format!("a reply carried {n} descriptors"))),
            });
        if reply.is_err() {
            self.sock = None;
        }
        reply
    }
}

/// Refuses names that are not a usable abstract name: empty (that would ask the kernel to pick
/// one), too long, or with a NUL (which would read as a shorter name in tools).
fn check_name(name: &str) -> Result<(), FdPassError> {
    let why = if name.is_empty() {
        "empty"
    } else if name.len() > MAX_NAME {
        "longer than 107 bytes"
    } else if name.contains('\0') {
        "contains a NUL byte"
    } else {
        return Ok(());
    };
    Err(FdPassError::BadName { name: name.to_owned(), why })
}

/// The abstract address of `name` (checked by [`check_name`]) and its length: a NUL, then the name,
/// with no terminator, as `SocketAddr::from_abstract_name` builds it (abstract names compare by
/// length too, so both sides must agree).
fn abstract_addr(name: &str) -> (libc::sockaddr_un, libc::socklen_t) {
    // SAFETY: `sockaddr_un` is a plain C struct for which all zeros is valid.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (dst, &src) in addr.sun_path[1..].iter_mut().zip(name.as_bytes()) {
        *dst = src as libc::c_char;
    }
    let len = offset_of!(libc::sockaddr_un, sun_path) + 1 + name.len();
    (addr, len as libc::socklen_t)
}

/// One non-blocking connect attempt on a fresh socket (a socket whose connect failed is not reused).
fn connect_once(addr: &libc::sockaddr_un, len: libc::socklen_t) -> io::Result<OwnedFd> {
    // SAFETY: plain socket creation; the result is checked before use.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by `socket` and nothing else owns it.
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: `addr` is a valid `sockaddr_un` of which the first `len` bytes are the address
    // (`len` comes from `abstract_addr`, at most its size).
    let rc = unsafe { libc::connect(sock.as_raw_fd(), (addr as *const libc::sockaddr_un).cast(), len) };
    // On a non-blocking Unix stream socket connect completes at once or fails (`EAGAIN` when the
    // backlog is full); there is no `EINPROGRESS` to wait out.
    if rc < 0 { Err(io::Error::last_os_error()) } else { Ok(sock) }
}

/// When a wait gives up: an instant, or never (the service's idle waits, ended by its stop pipe).
#[derive(Clone, Copy, Debug)]
struct Deadline {
    /// `None`: never.
    at: Option<Instant>,
    /// The timeout it was made from, for [`FdPassError::Timeout`].
    limit: Duration,
}

impl Deadline {
    /// `limit` from now (never, if that does not fit an `Instant`).
    fn after(limit: Duration) -> Deadline {
        Deadline { at: Instant::now().checked_add(limit), limit }
    }

    /// No deadline.
    fn never() -> Deadline {
        Deadline { at: None, limit: Duration::MAX }
    }

    /// Time left, `None` once passed.
    fn remaining(&self) -> Option<Duration> {
        match self.at {
            None => Some(Duration::MAX),
            Some(at) => Some(at.saturating_duration_since(Instant::now())).filter(|d| !d.is_zero()),
        }
    }
}

/// Waits until `sock` is ready for `events` (`POLLIN` or `POLLOUT`; a hang-up or error counts as
/// ready, so the next call reports it), the deadline passes ([`FdPassError::Timeout`] naming
/// `what`) or the stop pipe becomes readable ([`FdPassError::Stopped`]). Retries on `EINTR`.
fn wait(
    sock: BorrowedFd<'_>,
    events: libc::c_short,
    deadline: Deadline,
    stop: Option<BorrowedFd<'_>>,
    what: &'static str,
) -> Result<(), FdPassError> {
    loop {
        let ms = match deadline.remaining() {
            None => return Err(FdPassError::Timeout { what, waited: deadline.limit }),
            Some(Duration::MAX) => -1,
            // Rounded up, so a sub-millisecond remainder waits instead of spinning.
            Some(left) => left.as_nanos().div_ceil(1_000_000).min(libc::c_int::MAX as u128) as libc::c_int,
        };
        let mut fds = [
            libc::pollfd { fd: sock.as_raw_fd(), events, revents: 0 },
            // poll skips a negative descriptor.
            libc::pollfd { fd: stop.map_or(-1, |s| s.as_raw_fd()), events: libc::POLLIN, revents: 0 },
        ];
        // SAFETY: `fds` is an array of two initialized `pollfd`, borrowed mutably for the call;
        // both descriptors are borrowed, so open for its duration.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(FdPassError::Io { what: "poll", source: e });
        }
        // Stop wins: a stopping service answers nothing more, even if data is waiting.
        if fds[1].revents != 0 {
            return Err(FdPassError::Stopped);
        }
        if fds[0].revents != 0 {
            return Ok(());
        }
        // Timed out (or woke early): the loop checks the deadline again.
    }
}

/// The error of a failed send or receive: a dead or departed peer is `PeerClosed`, the rest `Io`.
fn transfer_err(what: &'static str, e: io::Error) -> FdPassError {
    match e.raw_os_error() {
        Some(libc::EPIPE | libc::ECONNRESET | libc::ENOTCONN) => FdPassError::PeerClosed,
        _ => FdPassError::Io { what, source: e },
    }
}

/// Sends one frame: header, `bytes`, and `fds` with the first byte sent. Handles short writes and
/// `EINTR`; waits for buffer space under `deadline` and `stop`. Does not check the limits (the
/// callers do: a client before sending, a receiver on the header).
fn send_message(
    sock: BorrowedFd<'_>,
    bytes: &[u8],
    fds: &[BorrowedFd<'_>],
    deadline: Deadline,
    stop: Option<BorrowedFd<'_>>,
    what: &'static str,
) -> Result<(), FdPassError> {
    let too_large = || FdPassError::TooLarge { bytes: bytes.len(), max: u32::MAX as usize };
    let mut header = [0u8; HEADER];
    header[0..4].copy_from_slice(&MAGIC);
    header[4..8].copy_from_slice(&u32::try_from(bytes.len()).map_err(|_| too_large())?.to_le_bytes());
    header[8..12].copy_from_slice(&(fds.len() as u32).to_le_bytes());
    let total = HEADER + bytes.len();
    let mut sent = 0;
    while sent < total {
        let (head, body) = match sent < HEADER {
            true => (&header[sent..], bytes),
            false => (&[][..], &bytes[sent - HEADER..]),
        };
        // The kernel attaches the descriptors to the first chunk it takes; once any byte has gone,
        // they have gone with it.
        let rights = if sent == 0 { fds } else { &[] };
        match send_some(sock, head, body, rights) {
            Ok(n) if n > 0 => sent += n,
            Ok(_) => wait(sock, libc::POLLOUT, deadline, stop, what)?,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => wait(sock, libc::POLLOUT, deadline, stop, what)?,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(transfer_err(what, e)),
        }
    }
    Ok(())
}

/// One `sendmsg` of `head` then `body`, with `fds` as an `SCM_RIGHTS` message when there are any.
/// `MSG_NOSIGNAL`: a closed peer is `EPIPE`, not a SIGPIPE that kills the process.
fn send_some(sock: BorrowedFd<'_>, head: &[u8], body: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<usize> {
    // `sendmsg` only reads through `iov_base`; the `*mut` is the C type.
    let mut iov = [
        libc::iovec { iov_base: head.as_ptr() as *mut libc::c_void, iov_len: head.len() },
        libc::iovec { iov_base: body.as_ptr() as *mut libc::c_void, iov_len: body.len() },
    ];
    // SAFETY: `msghdr` is a plain C struct (with private padding on some targets) for which all
    // zeros is valid: no name, no iovecs, no control data.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_mut_ptr();
    msg.msg_iovlen = iov.len() as _;
    let rights_len = size_of::<libc::c_int>() * fds.len();
    // u64 words keep the buffer aligned for `cmsghdr`; it must live until `sendmsg` returns.
    let mut control: Vec<u64> = Vec::new();
    if !fds.is_empty() {
        // SAFETY: arithmetic on the length, which fits a `c_uint` (the callers send a handful).
        let space = unsafe { libc::CMSG_SPACE(rights_len as libc::c_uint) } as usize;
        control.resize(space.div_ceil(size_of::<u64>()), 0);
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        // SAFETY: `msg_control` points at `space` zeroed, aligned bytes, enough for one header and
        // `fds.len()` descriptors (`CMSG_SPACE`), so `CMSG_FIRSTHDR` is non-null and the header and
        // data writes stay inside the buffer (unaligned writes for the data, which has no alignment
        // promise).
        unsafe {
            let cmsg = libc::CMSG_FIRSTHDR(&msg);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN(rights_len as libc::c_uint) as _;
            let data = libc::CMSG_DATA(cmsg).cast::<libc::c_int>();
            for (i, fd) in fds.iter().enumerate() {
                data.add(i).write_unaligned(fd.as_raw_fd());
            }
        }
    }
    // SAFETY: `msg` points at the two iovecs (valid for reads of their lengths for the call, borrowed
    // from `head` and `body`) and at the control buffer filled above; the descriptors in it are
    // borrowed, so open.
    let n = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT) };
    if n < 0 { Err(io::Error::last_os_error()) } else { Ok(n as usize) }
}

/// Receives one frame under `deadline` and `stop`: the header, checked against the limits, then the
/// payload, with the descriptors that came along. Descriptors received before an error are closed.
fn recv_message(
    sock: BorrowedFd<'_>,
    deadline: Deadline,
    stop: Option<BorrowedFd<'_>>,
    what: &'static str,
) -> Result<Message, FdPassError> {
    let mut fds = Vec::new();
    let mut header = [0u8; HEADER];
    recv_exact(sock, &mut header, &mut fds, deadline, stop, what)?;
    let word = |i: usize| u32::from_le_bytes(header[i..i + 4].try_into().expect("a 4-byte slice")) as usize;
    if header[0..4] != MAGIC {
        return Err(FdPassError::Protocol(format!(
            "bad magic {:02x?} (not an oxccl descriptor socket)",
            &header[0..4]
        )));
    }
    let (len, nfds) = (word(4), word(8));
    if len > MAX_BYTES {
        return Err(FdPassError::TooLarge { bytes: len, max: MAX_BYTES });
    }
    if nfds > MAX_FDS {
        return Err(FdPassError::TooManyFds { fds: nfds, max: MAX_FDS });
    }
    let mut bytes = vec![0u8; len];
    recv_exact(sock, &mut bytes, &mut fds, deadline, stop, what)?;
    if fds.len() != nfds {
        return Err(FdPassError::Protocol(format!("the header announced {nfds} descriptors, {} arrived", fds.len())));
    }
    Ok(Message { bytes, fds })
}

/// Fills `buf` (short reads, `EINTR`), appending any descriptors that arrive to `fds`, which then
/// own them. End of stream before `buf` is full is [`FdPassError::PeerClosed`].
fn recv_exact(
    sock: BorrowedFd<'_>,
    buf: &mut [u8],
    fds: &mut Vec<OwnedFd>,
    deadline: Deadline,
    stop: Option<BorrowedFd<'_>>,
    what: &'static str,
) -> Result<(), FdPassError> {
    let mut got = 0;
    while got < buf.len() {
        match recv_some(sock, &mut buf[got..], fds) {
            Ok(r) => {
                if r.truncated {
                    return Err(FdPassError::Protocol(format!(
                        "control data truncated: more than {MAX_FDS} descriptors sent, or this process is out of \
                         descriptors"
                    )));
                }
                if let Some((level, kind)) = r.unexpected {
                    return Err(FdPassError::Protocol(format!(
                        "unexpected control message (level {level}, type {kind})"
                    )));
                }
                if fds.len() > MAX_FDS {
                    return Err(FdPassError::TooManyFds { fds: fds.len(), max: MAX_FDS });
                }
                if r.bytes == 0 {
                    return Err(FdPassError::PeerClosed);
                }
                got += r.bytes;
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => wait(sock, libc::POLLIN, deadline, stop, what)?,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(transfer_err(what, e)),
        }
    }
    Ok(())
}

/// What one `recvmsg` returned besides the descriptors.
struct Received {
    /// Payload bytes read (0: end of stream).
    bytes: usize,
    /// `MSG_CTRUNC`: descriptors did not fit (the kernel closed those that did not).
    truncated: bool,
    /// A control message other than `SCM_RIGHTS` (level, type).
    unexpected: Option<(libc::c_int, libc::c_int)>,
}

/// Control buffer for [`recv_some`], aligned for `cmsghdr`.
#[repr(C, align(8))]
struct RecvControl([u8; RECV_CMSG_SPACE]);

/// One non-blocking `recvmsg` into `buf` with `MSG_CMSG_CLOEXEC` (received descriptors are
/// close-on-exec from the start, so a concurrent fork+exec elsewhere in the process cannot leak
/// them). Every descriptor received is pushed to `fds` before anything is judged, so none leaks.
fn recv_some(sock: BorrowedFd<'_>, buf: &mut [u8], fds: &mut Vec<OwnedFd>) -> io::Result<Received> {
    let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    let mut control = RecvControl([0; RECV_CMSG_SPACE]);
    // SAFETY: all zeros is a valid `msghdr` (see `send_some`).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.0.as_mut_ptr().cast();
    msg.msg_controllen = RECV_CMSG_SPACE as _;
    // SAFETY: `msg` points at one iovec over `buf` (writable, `buf.len()` bytes) and at the
    // aligned control buffer of `msg_controllen` bytes; both outlive the call.
    let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC | libc::MSG_DONTWAIT) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut unexpected = None;
    // SAFETY: the kernel wrote `msg_controllen` bytes of well-formed control messages into the
    // buffer; `CMSG_FIRSTHDR`/`CMSG_NXTHDR` stay within it and return null at its end, so each
    // `cmsg` read is of an aligned header inside it, and its data (`cmsg_len` bytes from the header,
    // read unaligned) too. The descriptors in an `SCM_RIGHTS` message were installed in this
    // process for us and nothing else owns them.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            let (level, kind) = ((*cmsg).cmsg_level, (*cmsg).cmsg_type);
            if level == libc::SOL_SOCKET && kind == libc::SCM_RIGHTS {
                let data_len = ((*cmsg).cmsg_len as usize).saturating_sub(libc::CMSG_LEN(0) as usize);
                let data = libc::CMSG_DATA(cmsg).cast::<libc::c_int>();
                for i in 0..data_len / size_of::<libc::c_int>() {
                    fds.push(OwnedFd::from_raw_fd(data.add(i).read_unaligned()));
                }
            } else {
                unexpected = Some((level, kind));
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    Ok(Received { bytes: n as usize, truncated: msg.msg_flags & libc::MSG_CTRUNC != 0, unexpected })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::File;
    use std::io::Read;
    use std::os::unix::fs::FileExt;
    use std::os::unix::net::UnixStream;
    use std::process::{Child, Command, Stdio};
    use std::sync::atomic::AtomicUsize;
    use std::sync::{Barrier, mpsc};

    /// Timeout for steps that should succeed at once (generous: a loaded CI machine).
    const T: Duration = Duration::from_secs(5);

    /// Environment variable that makes [`child_process`] act: `"<role> <name>"`.
    const CHILD_ENV: &str = "OXCCL_FDPASS_TEST_CHILD";

    /// A name no other test (or concurrent test binary) uses.
    fn unique_name(label: &str) -> String {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        format!("oxccl-test/{}/{}/{label}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed))
    }

    /// An anonymous in-memory file holding `content`.
    fn memfd(content: &[u8]) -> File {
        // SAFETY: a NUL-terminated name and valid flags; the result is checked.
        let fd = unsafe { libc::memfd_create(c"oxccl-fdpass-test".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0, "memfd_create: {}", io::Error::last_os_error());
        // SAFETY: a fresh descriptor nobody else owns.
        let file = unsafe { File::from_raw_fd(fd) };
        file.write_all_at(content, 0).unwrap();
        file
    }

    /// The whole content of a file, read at offset 0 (not moving the shared offset).
    fn contents(file: &File) -> Vec<u8> {
        let mut out = vec![0u8; file.metadata().unwrap().len() as usize];
        file.read_exact_at(&mut out, 0).unwrap();
        out
    }

    /// Everything readable from `r` until end of file, or `None` if that does not come within
    /// `timeout` (a writer still open somewhere).
    fn read_to_eof_within(r: &mut PipeReader, timeout: Duration) -> Option<Vec<u8>> {
        let deadline = Deadline::after(timeout);
        let mut out = Vec::new();
        loop {
            wait(r.as_fd(), libc::POLLIN, deadline, None, "test pipe").ok()?;
            let mut buf = [0u8; 256];
            match r.read(&mut buf).unwrap() {
                0 => return Some(out),
                n => out.extend_from_slice(&buf[..n]),
            }
        }
    }

    /// Drops `service` on another thread and returns how long that took; panics (instead of hanging
    /// the test) if it takes over `timeout`.
    fn drop_within(service: Service, timeout: Duration) -> Duration {
        let (done_tx, done) = mpsc::channel();
        thread::spawn(move || {
            let start = Instant::now();
            drop(service);
            done_tx.send(start.elapsed()).unwrap();
        });
        done.recv_timeout(timeout).expect("dropping the service hung")
    }

    /// An echo service.
    fn echo(name: &str) -> Service {
        Service::start(name, |m| m.bytes).unwrap()
    }

    /// A plain blocking stream to `name`, for writing frames by hand.
    fn raw_stream(name: &str) -> UnixStream {
        let s = UnixStream::connect_addr(&SocketAddr::from_abstract_name(name).unwrap()).unwrap();
        s.set_read_timeout(Some(T)).unwrap();
        s
    }

    #[test]
    fn bytes_round_trip() {
        let name = unique_name("bytes");
        let service = Service::start(&name, |m| m.bytes.iter().rev().copied().collect()).unwrap();
        assert_eq!(service.name(), name);
        let mut client = Client::connect(&name, T).unwrap();
        assert_eq!(client.name(), name);
        assert_eq!(client.call(b"hello", &[], T).unwrap(), b"olleh");
        assert_eq!(client.call(b"", &[], T).unwrap(), b"");
    }

    #[test]
    fn descriptors_round_trip() {
        let name = unique_name("fds");
        // fds[0]: a pipe's write end to write through; fds[1..3]: files to read; fds[3]: a file to write.
        let service = Service::start(&name, |m| {
            let mut fds = m.fds.into_iter().map(File::from);
            let (mut pipe, a, b, out) =
                (fds.next().unwrap(), fds.next().unwrap(), fds.next().unwrap(), fds.next().unwrap());
            let cloexec = [&pipe, &a, &b, &out].iter().all(|f| {
                // SAFETY: F_GETFD on an open descriptor.
                let flags = unsafe { libc::fcntl(f.as_raw_fd(), libc::F_GETFD) };
                flags >= 0 && flags & libc::FD_CLOEXEC != 0
            });
            pipe.write_all(b"through the pipe").unwrap();
            out.write_all_at(b"written by the handler", 0).unwrap();
            let mut reply = contents(&a);
            reply.push(b'|');
            reply.extend(contents(&b));
            reply.extend(format!("|cloexec={cloexec}").bytes());
            reply
        })
        .unwrap();
        let (mut r, w) = io::pipe().unwrap();
        let (a, b, out) = (memfd(b"alpha"), memfd(b"beta"), memfd(b""));
        let mut client = Client::connect(&name, T).unwrap();
        let reply = client.call(b"", &[w.as_fd(), a.as_fd(), b.as_fd(), out.as_fd()], T).unwrap();
        assert_eq!(String::from_utf8(reply).unwrap(), "alpha|beta|cloexec=true");
        assert_eq!(contents(&out), b"written by the handler");
        // End of file comes only once the handler's copy of the write end is closed too.
        drop(w);
        assert_eq!(read_to_eof_within(&mut r, T).as_deref(), Some(&b"through the pipe"[..]));
        drop(service);
    }

    #[test]
    fn descriptor_limit() {
        let name = unique_name("fd-limit");
        let _service = Service::start(&name, |m| m.fds.len().to_string().into_bytes()).unwrap();
        let file = memfd(b"x");
        let mut client = Client::connect(&name, T).unwrap();
        let max = vec![file.as_fd(); MAX_FDS];
        assert_eq!(client.call(b"", &max, T).unwrap(), MAX_FDS.to_string().as_bytes());
        let over = vec![file.as_fd(); MAX_FDS + 1];
        assert!(matches!(client.call(b"", &over, T), Err(FdPassError::TooManyFds { fds: 17, max: MAX_FDS })));
        // Refused before sending: the connection is still good.
        assert_eq!(client.call(b"", &[], T).unwrap(), b"0");
    }

    /// A peer that sends more descriptors than fit: the service drops the connection and closes the
    /// descriptors it got (the kernel closes the rest), so nothing leaks.
    #[test]
    fn truncated_descriptors_are_closed() {
        let name = unique_name("ctrunc");
        let _service = echo(&name);
        let (mut r, w) = io::pipe().unwrap();
        let mut stream = raw_stream(&name);
        let rights = vec![w.as_fd(); MAX_FDS + 1];
        send_message(stream.as_fd(), b"", &rights, Deadline::after(T), None, "test").unwrap();
        let mut buf = [0u8; 1];
        assert_eq!(stream.read(&mut buf).unwrap(), 0, "the service should close the connection");
        drop(w);
        assert_eq!(read_to_eof_within(&mut r, T).as_deref(), Some(&b""[..]), "a received write end was leaked");
    }

    #[test]
    fn many_requests_on_one_connection() {
        let name = unique_name("many");
        let _service = Service::start(&name, |m| {
            let mut reply = m.bytes;
            reply.iter_mut().for_each(|b| *b = b.wrapping_add(1));
            reply
        })
        .unwrap();
        let mut client = Client::connect(&name, T).unwrap();
        // Sizes from empty to several socket buffers' worth, so sends and receives come in pieces.
        let sizes = (0..300).map(|i| (i * 7919) % 70_000).chain([1 << 20, 3 << 20, MAX_BYTES]);
        for (i, len) in sizes.enumerate() {
            let request: Vec<u8> = (0..len).map(|j| (i + j) as u8).collect();
            let reply = client.call(&request, &[], T).unwrap();
            assert_eq!(reply.len(), len);
            assert!(reply.iter().zip(&request).all(|(r, q)| *r == q.wrapping_add(1)), "request {i}");
        }
    }

    /// Clients that each hold their connection until every client has had an answer: a service that
    /// served one connection at a time would leave all but one unanswered (`Timeout`).
    #[test]
    fn several_clients_at_once() {
        const CLIENTS: usize = 8;
        let name = unique_name("clients");
        let _service = echo(&name);
        let barrier = Arc::new(Barrier::new(CLIENTS));
        let answered = Arc::new(AtomicUsize::new(0));
        let threads: Vec<_> = (0..CLIENTS)
            .map(|c| {
                let (name, barrier, answered) = (name.clone(), barrier.clone(), answered.clone());
                thread::spawn(move || {
                    let mut client = Client::connect(&name, T).unwrap();
                    barrier.wait();
                    for i in 0..100 {
                        let request = format!("client {c} call {i}").into_bytes();
                        assert_eq!(client.call(&request, &[], T).unwrap(), request);
                    }
                    answered.fetch_add(1, Ordering::SeqCst);
                    let deadline = Instant::now() + T;
                    while answered.load(Ordering::SeqCst) < CLIENTS {
                        assert!(Instant::now() < deadline, "other clients got no answer while this one was connected");
                        thread::sleep(Duration::from_millis(1));
                    }
                    drop(client);
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
    }

    #[test]
    fn connect_waits_for_a_late_service() {
        let name = unique_name("late");
        let caller = thread::spawn({
            let name = name.clone();
            move || Client::connect(&name, T)?.call(b"early", &[], T)
        });
        thread::sleep(Duration::from_millis(100));
        let _service = echo(&name);
        assert_eq!(caller.join().unwrap().unwrap(), b"early");
    }

    #[test]
    fn connect_to_an_unbound_name_times_out() {
        let start = Instant::now();
        let timeout = Duration::from_millis(200);
        match Client::connect(&unique_name("nobody"), timeout) {
            Err(FdPassError::Timeout { what: "connect", waited }) => assert_eq!(waited, timeout),
            other => panic!("expected a connect timeout, got {other:?}"),
        }
        let took = start.elapsed();
        assert!(took >= timeout && took < timeout + Duration::from_secs(1), "took {took:?}");
    }

    #[test]
    fn bad_names_and_taken_names() {
        for name in ["", "a\0b", &"x".repeat(MAX_NAME + 1)] {
            assert!(matches!(Client::connect(name, T), Err(FdPassError::BadName { .. })), "{name:?}");
            assert!(matches!(Service::start(name, |m| m.bytes), Err(FdPassError::BadName { .. })), "{name:?}");
        }
        let longest =
            format!("{}/{}", unique_name("long"), "x".repeat(MAX_NAME)).chars().take(MAX_NAME).collect::<String>();
        let _service = echo(&longest);
        assert_eq!(Client::connect(&longest, T).unwrap().call(b"ok", &[], T).unwrap(), b"ok");
        match Service::start(&longest, |m| m.bytes) {
            Err(FdPassError::Io { what: "bind", source }) => assert_eq!(source.kind(), io::ErrorKind::AddrInUse),
            other => panic!("expected AddrInUse, got {:?}", other.map(|s| s.name().to_owned())),
        }
    }

    #[test]
    fn oversize_messages_are_refused() {
        let name = unique_name("oversize");
        let _service =
            Service::start(&name, |m| if m.bytes == b"big" { vec![0; MAX_BYTES + 1] } else { m.bytes }).unwrap();
        let mut client = Client::connect(&name, T).unwrap();
        let big = vec![0u8; MAX_BYTES + 1];
        assert!(
            matches!(client.call(&big, &[], T), Err(FdPassError::TooLarge { bytes, max: MAX_BYTES }) if bytes == big.len())
        );
        // Refused before sending: the connection is still good.
        assert_eq!(client.call(b"ok", &[], T).unwrap(), b"ok");
        // A reply over the limit is refused on its header, and the connection closed.
        assert!(matches!(client.call(b"big", &[], T), Err(FdPassError::TooLarge { .. })));
        assert!(matches!(client.call(b"ok", &[], T), Err(FdPassError::Broken)));
        // A header announcing too much: the service drops the connection without reading on.
        let mut stream = raw_stream(&name);
        let mut header = MAGIC.to_vec();
        header.extend(((MAX_BYTES + 1) as u32).to_le_bytes());
        header.extend(0u32.to_le_bytes());
        stream.write_all(&header).unwrap();
        let mut buf = [0u8; 1];
        assert_eq!(stream.read(&mut buf).unwrap(), 0);
    }

    #[test]
    fn garbage_is_a_protocol_error() {
        let name = unique_name("garbage");
        // A "service" that answers anything with bytes that are not a frame.
        let listener = UnixListener::bind_addr(&SocketAddr::from_abstract_name(&name).unwrap()).unwrap();
        let server = thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let mut header = [0u8; HEADER];
            s.read_exact(&mut header).unwrap();
            s.write_all(b"HTTP/1.1 400 Bad Request\r\n").unwrap();
        });
        let mut client = Client::connect(&name, T).unwrap();
        assert!(matches!(client.call(b"", &[], T), Err(FdPassError::Protocol(_))));
        server.join().unwrap();
    }

    /// A call whose reply is late times out, and the client will not read that reply as the next
    /// call's.
    #[test]
    fn slow_reply_times_out_and_breaks_the_client() {
        let name = unique_name("slow");
        let _service = Service::start(&name, |m| {
            thread::sleep(Duration::from_millis(300));
            m.bytes
        })
        .unwrap();
        let mut client = Client::connect(&name, T).unwrap();
        let start = Instant::now();
        let timeout = Duration::from_millis(50);
        assert!(matches!(client.call(b"slow", &[], timeout), Err(FdPassError::Timeout { what: "reply", .. })));
        assert!(start.elapsed() < Duration::from_millis(250), "took {:?}", start.elapsed());
        assert!(matches!(client.call(b"next", &[], T), Err(FdPassError::Broken)));
    }

    /// Dropping the service ends its threads promptly, with an idle connection and one stalled
    /// mid-frame; afterwards connections are closed, the name is free and no handler runs.
    #[test]
    fn drop_stops_the_service() {
        let name = unique_name("drop");
        let calls = Arc::new(AtomicUsize::new(0));
        let service = Service::start(&name, {
            let calls = calls.clone();
            move |m| {
                calls.fetch_add(1, Ordering::SeqCst);
                m.bytes
            }
        })
        .unwrap();
        let mut idle = Client::connect(&name, T).unwrap();
        assert_eq!(idle.call(b"1", &[], T).unwrap(), b"1");
        let mut stalled = raw_stream(&name);
        stalled.write_all(&MAGIC[..3]).unwrap();
        let took = drop_within(service, T);
        assert!(took < Duration::from_millis(500), "drop took {took:?}");
        assert!(matches!(idle.call(b"2", &[], T), Err(FdPassError::PeerClosed)));
        // Closed, or reset if the service had not accepted it yet.
        let mut buf = [0u8; 1];
        match stalled.read(&mut buf) {
            Ok(0) => {}
            Err(e) if e.kind() == io::ErrorKind::ConnectionReset => {}
            other => panic!("expected the stalled connection closed, got {other:?}"),
        }
        assert!(matches!(Client::connect(&name, Duration::from_millis(100)), Err(FdPassError::Timeout { .. })));
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        // The name can be bound again.
        let _again = echo(&name);
    }

    /// A handler running when the service is dropped finishes before `drop` returns.
    #[test]
    fn drop_waits_for_a_running_handler() {
        let name = unique_name("drop-running");
        let (entered_tx, entered) = mpsc::channel();
        let finished = Arc::new(AtomicBool::new(false));
        let service = Service::start(&name, {
            let finished = finished.clone();
            move |m| {
                entered_tx.send(()).unwrap();
                thread::sleep(Duration::from_millis(200));
                finished.store(true, Ordering::SeqCst);
                m.bytes
            }
        })
        .unwrap();
        let caller = thread::spawn({
            let name = name.clone();
            move || Client::connect(&name, T)?.call(b"x", &[], T)
        });
        entered.recv_timeout(T).unwrap();
        drop_within(service, T);
        assert!(finished.load(Ordering::SeqCst), "drop returned while a handler ran");
        // The reply was sent or the connection closed; either way the caller does not hang.
        let result = caller.join().unwrap();
        assert!(matches!(result, Ok(_) | Err(FdPassError::PeerClosed)), "{result:?}");
    }

    #[test]
    fn io_errors_have_a_source() {
        use std::error::Error as _;
        let e = FdPassError::Io { what: "bind", source: io::Error::from(io::ErrorKind::AddrInUse) };
        assert!(e.source().is_some());
        assert!(e.to_string().contains("bind"));
        assert!(FdPassError::PeerClosed.source().is_none());
    }

    /// A child process running this test binary in role `role` ([`child_process`]), killed if
    /// dropped before it has been waited for.
    struct ChildProcess(Child);

    impl ChildProcess {
        fn spawn(role: &str, name: &str) -> ChildProcess {
            let child = Command::new(std::env::current_exe().unwrap())
                .args(["--exact", "fdpass::tests::child_process", "--ignored", "--nocapture", "--test-threads=1"])
                .env(CHILD_ENV, format!("{role} {name}"))
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap();
            ChildProcess(child)
        }

        /// Waits (bounded) for the child to exit; its status and its output.
        fn finish(mut self) -> (std::process::ExitStatus, String) {
            let deadline = Instant::now() + T;
            let status = loop {
                if let Some(status) = self.0.try_wait().unwrap() {
                    break status;
                }
                assert!(Instant::now() < deadline, "the child process did not exit");
                thread::sleep(Duration::from_millis(5));
            };
            let mut output = String::new();
            self.0.stdout.take().unwrap().read_to_string(&mut output).unwrap();
            self.0.stderr.take().unwrap().read_to_string(&mut output).unwrap();
            (status, output)
        }
    }

    impl Drop for ChildProcess {
        fn drop(&mut self) {
            if let Ok(None) = self.0.try_wait() {
                let _ = self.0.kill();
                let _ = self.0.wait();
            }
        }
    }

    /// The child's side of the two-process tests; does nothing unless [`CHILD_ENV`] is set (run by
    /// [`ChildProcess::spawn`]; ignored in the normal run).
    ///
    /// - `serve <name>`: serves `name`: `write` (with one descriptor) writes into it and replies
    ///   with this pid; `abort` aborts the process mid-call; `exit` replies and ends the child.
    /// - `call <name>`: sends the service at `name` a memfd holding `from child <pid>`.
    #[test]
    #[ignore = "the child process of the two-process tests; does nothing on its own"]
    fn child_process() {
        let Ok(spec) = std::env::var(CHILD_ENV) else { return };
        let (role, name) = spec.split_once(' ').unwrap();
        match role {
            "serve" => {
                let (exit_tx, exit) = mpsc::channel();
                let service = Service::start(name, move |m| match &m.bytes[..] {
                    b"write" => {
                        File::from(m.fds.into_iter().next().unwrap()).write_all_at(b"written by the child", 0).unwrap();
                        format!("pid {}", std::process::id()).into_bytes()
                    }
                    b"abort" => {
                        // No core dump: writing one would hold the socket open (and take time).
                        // SAFETY: PR_SET_DUMPABLE with 0 only changes this process's dump flag.
                        unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0) };
                        std::process::abort()
                    }
                    b"exit" => {
                        exit_tx.send(()).unwrap();
                        b"bye".to_vec()
                    }
                    other => panic!("unknown request {other:?}"),
                })
                .unwrap();
                exit.recv_timeout(T).expect("the parent never said exit");
                drop(service);
            }
            "call" => {
                let file = memfd(format!("from child {}", std::process::id()).as_bytes());
                let mut client = Client::connect(name, T).unwrap();
                assert_eq!(client.call(b"take", &[file.as_fd()], T).unwrap(), b"taken");
            }
            other => panic!("unknown child role {other}"),
        }
    }

    #[test]
    fn descriptor_to_a_child_process() {
        let name = unique_name("child-serves");
        let child = ChildProcess::spawn("serve", &name);
        let mut client = Client::connect(&name, T).unwrap();
        let file = memfd(b"");
        let reply = client.call(b"write", &[file.as_fd()], T).unwrap();
        assert_eq!(String::from_utf8(reply).unwrap(), format!("pid {}", child.0.id()));
        assert_eq!(contents(&file), b"written by the child");
        assert_eq!(client.call(b"exit", &[], T).unwrap(), b"bye");
        let (status, output) = child.finish();
        assert!(status.success(), "child: {status}\n{output}");
    }

    #[test]
    fn descriptor_from_a_child_process() {
        let name = unique_name("child-calls");
        let (tx, rx) = mpsc::channel();
        let _service = Service::start(&name, move |m| {
            let file = File::from(m.fds.into_iter().next().unwrap());
            tx.send(String::from_utf8(contents(&file)).unwrap()).unwrap();
            b"taken".to_vec()
        })
        .unwrap();
        let child = ChildProcess::spawn("call", &name);
        let got = rx.recv_timeout(T).expect("the child never called");
        assert_eq!(got, format!("from child {}", child.0.id()));
        let (status, output) = child.finish();
        assert!(status.success(), "child: {status}\n{output}");
    }

    #[test]
    fn service_dying_mid_call_is_peer_closed() {
        let name = unique_name("child-dies");
        let child = ChildProcess::spawn("serve", &name);
        let mut client = Client::connect(&name, T).unwrap();
        let start = Instant::now();
        let result = client.call(b"abort", &[], T);
        assert!(matches!(result, Err(FdPassError::PeerClosed)), "{result:?}");
        assert!(start.elapsed() < T, "took {:?}", start.elapsed());
        let (status, output) = child.finish();
        assert!(!status.success(), "the child should have aborted\n{output}");
    }
}
