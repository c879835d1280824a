//! `oxccl launch`: starts one process per rank on this host with the variables torchrun sets, so
//! that each rank builds its communicator from its environment; passes the launcher's signals on,
//! and stops the whole group when one rank fails.
//!
//! ```text
//! oxccl launch -n 8 -- ./train --steps 100
//! oxccl launch -n 4 --gpus 0-1 --tag -- python3 worker.py
//! ```
//!
//! Linux only: each rank is a process-group leader that dies with the launcher
//! (`PR_SET_PDEATHSIG`), and the launcher takes its signals with `sigwait`.

use std::ffi::OsString;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{Ipv4Addr, TcpListener};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use libc::{c_int, pid_t, sigset_t};

/// Most processes (ranks) one launch starts; a limit of the launcher, not of a communicator.
pub const MAX_PROCESSES: usize = 1024;

/// Longest `--gpus` list, ranges expanded: one GPU per rank at most is ever used.
const MAX_GPUS: usize = MAX_PROCESSES;

/// The launcher's signals that are passed on to every rank.
const PASSED_ON: [c_int; 3] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP];

/// Longest wait between two looks at the ranks: SIGCHLD wakes the launcher when one ends, so this
/// only bounds the cost of a missed wake-up.
const WAKE: Duration = Duration::from_secs(1);

/// Sleep between looks where nothing wakes the launcher (the signal thread gone, output draining).
const POLL: Duration = Duration::from_millis(20);

/// How long `nvidia-smi -L` may take before the GPUs are taken as unknown: a launcher must not hang
/// on a wedged driver.
const SMI_TIMEOUT: Duration = Duration::from_secs(10);

/// How long `--tag`'s forwarding threads may take, after the last rank ended, to pass on what is
/// left in the pipes (a process a rank left behind can hold them open for ever).
const DRAIN: Duration = Duration::from_secs(1);

/// Longest piece of a `--tag`ged line passed on at once: a rank printing without newlines must not
/// grow the launcher's buffer without bound.
const MAX_LINE: u64 = 64 << 10;

/// Stack of each thread the launcher starts: they only copy bytes or wait, and `--tag` starts two
/// per rank (2048 at most).
const THREAD_STACK: usize = 64 << 10;

/// What `oxccl launch --help` adds after the flags.
const ABOUT_ENV: &str = "\
Each rank's environment (torchrun's variables, for one host):
  RANK, LOCAL_RANK, ROLE_RANK                     the rank, 0 to N-1
  WORLD_SIZE, LOCAL_WORLD_SIZE, ROLE_WORLD_SIZE   N
  GROUP_RANK=0, GROUP_WORLD_SIZE=1                this host is the only node
  MASTER_ADDR=127.0.0.1, MASTER_PORT              a free TCP port found at start, or --master-port
  CUDA_VISIBLE_DEVICES, OXCCL_GPU                 the rank's GPU (CUDA ordinal 0 inside the rank)

GPUs: rank r gets entry r mod len of --gpus. Without --gpus, every visible GPU in turn: the entries
of the launcher's CUDA_VISIBLE_DEVICES when it is set, else the GPUs `nvidia-smi -L` lists; when
neither tells, CUDA_VISIBLE_DEVICES and OXCCL_GPU are left unset and each rank sees what CUDA shows
it. With CUDA_VISIBLE_DEVICES set, --gpus counts within it (--gpus 0 is its first entry). Ranks
sharing a GPU (-n 8 --gpus 0) run kernels side by side only under MPS (nvidia-cuda-mps-control -d).

Ending: when a rank exits non-zero or is killed, the others get SIGTERM, then SIGKILL after
--grace-secs, and the launcher exits with that rank's status (128+signal if it was killed).
SIGINT, SIGTERM and SIGHUP sent to the launcher are passed to every rank, which then has
--grace-secs before SIGKILL; the launcher exits 128+signal. Each rank runs in a process group of
its own, so signals reach what it started too, and a stop ends with SIGKILL to every group: nothing
a stopped rank started is left running. Ranks read /dev/null and are killed if the launcher dies.";

/// Flags of `oxccl launch`.
#[derive(clap::Args, Debug)]
#[command(override_usage = "oxccl launch [OPTIONS] -n <N> [--] <CMD> [ARGS]...", after_long_help = ABOUT_ENV)]
pub struct Args {
    /// Processes (ranks) to start, 1 to 1024.
    #[arg(
        short = 'n',
        long = "nproc-per-node",
        alias = "nproc_per_node",
        value_name = "N",
        value_parser = clap::value_parser!(u16).range(1..=MAX_PROCESSES as i64),
        allow_negative_numbers = true
    )]
    pub nproc: u16,
    /// GPUs to deal the ranks to, round-robin: device numbers and ranges, e.g. `0,1,2,3`, `0-3`,
    /// `0-1,4-5`. Default: every visible GPU (see --help). Ranks sharing a GPU need MPS to run
    /// kernels side by side.
    #[arg(long, value_name = "LIST", value_parser = parse_gpus)]
    pub gpus: Option<GpuList>,
    /// MASTER_PORT for the ranks (default: a free TCP port on 127.0.0.1, found at start).
    #[arg(long, value_name = "PORT", value_parser = clap::value_parser!(u16).range(1..), allow_negative_numbers = true)]
    pub master_port: Option<u16>,
    /// Seconds a rank has after SIGTERM (or a passed-on signal) before SIGKILL; decimals allowed.
    #[arg(long, value_name = "SECS", default_value = "5", value_parser = parse_grace, allow_negative_numbers = true)]
    pub grace_secs: Duration,
    /// Prefix each line the ranks print with `[RANK] ` (otherwise they write straight to the
    /// launcher's stdout and stderr, their lines interleaving).
    #[arg(long)]
    pub tag: bool,
    /// The command every rank runs, with its arguments (after `--`).
    #[arg(value_name = "CMD", trailing_var_arg = true, required = true)]
    pub command: Vec<OsString>,
}

/// A `--gpus` list: the device numbers in the order ranks are dealt to them, ranges expanded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuList {
    /// The list as given, for messages.
    pub text: String,
    /// The device numbers, one per entry, ranges expanded.
    pub gpus: Vec<u32>,
}

/// Parses a `--gpus` list: comma-separated device numbers and inclusive ranges (`0-3,6`), at most
/// [`MAX_PROCESSES`] entries once expanded. The error names the entry at fault.
pub fn parse_gpus(text: &str) -> Result<GpuList, String> {
    const EXAMPLE: &str = "give device numbers like 0,1,2,3 or ranges like 0-3";
    let number = |t: &str| {
        let t = t.trim();
        t.parse::<u32>().map_err(|_| format!("{t:?} is not a device number ({EXAMPLE})"))
    };
    let mut gpus = Vec::new();
    for entry in text.split(',').map(str::trim) {
        if entry.is_empty() {
            return Err(format!("an empty entry ({EXAMPLE})"));
        }
        let (first, last) = match entry.split_once('-') {
            Some((a, b)) => (number(a)?, number(b)?),
            None => (number(entry)?, number(entry)?),
        };
        if first > last {
            return Err(format!("the range {entry} runs backwards (write {last}-{first})"));
        }
        // Counted before expanding, so `0-4000000000` is refused without filling memory.
        if u64::from(last - first) + 1 > (MAX_GPUS - gpus.len()) as u64 {
            return Err(format!("more than {MAX_GPUS} GPUs once ranges are expanded"));
        }
        gpus.extend(first..=last);
    }
    Ok(GpuList { text: text.to_string(), gpus })
}

/// Parses `--grace-secs`: a finite, non-negative number of seconds, decimals allowed.
pub fn parse_grace(text: &str) -> Result<Duration, String> {
    text.trim()
        .parse::<f64>()
        .ok()
        .and_then(|s| Duration::try_from_secs_f64(s).ok())
        .ok_or_else(|| format!("{text:?} is not a number of seconds (give e.g. 5 or 0.5)"))
}

/// The GPUs ranks are dealt to, as `CUDA_VISIBLE_DEVICES` names them: rank r gets entry r mod len.
/// `visible` is the launcher's `CUDA_VISIBLE_DEVICES`; when it is set, `--gpus` counts within it
/// (as a CUDA ordinal would) so a launcher confined to some GPUs keeps its ranks on them. `nvidia_smi`
/// is asked only when neither `--gpus` nor `visible` tells. `Ok(None)`: nothing tells which GPUs
/// there are, or `visible` names none, and the ranks are left to see what CUDA shows them.
fn gpu_deal(
    asked: Option<&GpuList>,
    visible: Option<&str>,
    nvidia_smi: impl FnOnce() -> Option<usize>,
) -> Result<Option<Vec<String>>, String> {
    let Some(visible) = visible else {
        return Ok(match asked {
            Some(list) => Some(list.gpus.iter().map(u32::to_string).collect()),
            None => nvidia_smi().filter(|&n| n > 0).map(|n| (0..n).map(|g| g.to_string()).collect()),
        });
    };
    let entries: Vec<&str> = visible.split(',').map(str::trim).filter(|e| !e.is_empty()).collect();
    let Some(list) = asked else {
        return Ok((!entries.is_empty()).then(|| entries.iter().map(|e| e.to_string()).collect()));
    };
    list.gpus
        .iter()
        .map(|&g| {
            entries.get(g as usize).map(|e| e.to_string()).ok_or_else(|| {
                format!(
                    "--gpus {}: GPU {g} is not visible: CUDA_VISIBLE_DEVICES={visible:?} shows {} GPU(s), \
                     and --gpus counts within it, from 0",
                    list.text,
                    entries.len()
                )
            })
        })
        .collect::<Result<_, _>>()
        .map(Some)
}

/// How many GPUs `nvidia-smi -L` lists (its `GPU n: ...` lines; MIG instances are not counted),
/// without initialising CUDA in the launcher. `None` if it is missing, fails, or takes more than
/// [`SMI_TIMEOUT`].
fn nvidia_smi_gpus() -> Option<usize> {
    let mut smi = Command::new("nvidia-smi")
        .arg("-L")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    let until = Instant::now() + SMI_TIMEOUT;
    let status = loop {
        match smi.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() < until => thread::sleep(POLL),
            _ => {
                // Killed and reaped so no process is left behind; errors mean it is already gone.
                let _ = smi.kill();
                let _ = smi.wait();
                return None;
            }
        }
    };
    let mut listing = String::new();
    smi.stdout.take()?.read_to_string(&mut listing).ok()?;
    status.success().then(|| listing.lines().filter(|l| l.starts_with("GPU ")).count())
}

/// A TCP port free on 127.0.0.1 now: bound as port 0, read back, and released for rank 0 to bind.
fn free_port() -> io::Result<u16> {
    Ok(TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?.local_addr()?.port())
}

/// The variables rank `rank` of `ranks` is given (see [`ABOUT_ENV`]), its GPU's among them when
/// it has one.
fn rank_env(rank: usize, ranks: usize, port: u16, gpu: Option<&str>) -> Vec<(&'static str, String)> {
    let mut env = vec![
        ("RANK", rank.to_string()),
        ("LOCAL_RANK", rank.to_string()),
        ("ROLE_RANK", rank.to_string()),
        ("WORLD_SIZE", ranks.to_string()),
        ("LOCAL_WORLD_SIZE", ranks.to_string()),
        ("ROLE_WORLD_SIZE", ranks.to_string()),
        ("GROUP_RANK", "0".to_string()),
        ("GROUP_WORLD_SIZE", "1".to_string()),
        ("MASTER_ADDR", Ipv4Addr::LOCALHOST.to_string()),
        ("MASTER_PORT", port.to_string()),
    ];
    if let Some(gpu) = gpu {
        env.push(("CUDA_VISIBLE_DEVICES", gpu.to_string()));
        env.push(("OXCCL_GPU", gpu.to_string()));
    }
    env
}

/// A signal set holding `signals`.
fn signal_set(signals: &[c_int]) -> sigset_t {
    // SAFETY: sigset_t is plain data, and sigemptyset makes the zeroed set a valid empty one;
    // sigaddset is given valid signal numbers (libc's constants), so neither can fail.
    unsafe {
        let mut set: sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for &s in signals {
            libc::sigaddset(&mut set, s);
        }
        set
    }
}

/// Blocks [`PASSED_ON`] and SIGCHLD in the calling thread (and so in every thread it starts after)
/// and starts a thread that takes them with `sigwait` and sends their numbers down the returned
/// channel: the supervising loop sees a signal, or a rank's end, as a message, with no
/// async-signal-safety to mind. Also returns the mask as it was, for the ranks to start with.
fn watch_signals() -> io::Result<(Receiver<c_int>, sigset_t)> {
    let set = signal_set(&[PASSED_ON[0], PASSED_ON[1], PASSED_ON[2], libc::SIGCHLD]);
    let mut old = signal_set(&[]);
    // SAFETY: `set` and `old` are valid sigsets; the call changes only this thread's mask.
    let rc = unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, &mut old) };
    if rc != 0 {
        return Err(io::Error::from_raw_os_error(rc));
    }
    let (tx, rx) = mpsc::channel();
    thread::Builder::new().name("oxccl-launch-signals".into()).stack_size(THREAD_STACK).spawn(move || {
        loop {
            let mut sig: c_int = 0;
            // SAFETY: `set` is a valid sigset whose signals are blocked in this thread (inherited),
            // as sigwait requires; `sig` is a valid place for the number.
            let rc = unsafe { libc::sigwait(&set, &mut sig) };
            // The receiver is gone once the launch is over: nothing is left to tell.
            if rc != 0 || tx.send(sig).is_err() {
                return;
            }
        }
    })?;
    Ok((rx, old))
}

/// Starts `argv` as a rank with `env` (and without `unset`): in a process group of its own, stdin
/// from /dev/null, stdout and stderr inherited or (with `tag`) piped, `mask` as its signal mask,
/// and set to die with the launcher.
fn spawn_rank(
    argv: &[OsString],
    env: &[(&'static str, String)],
    unset: &[&str],
    mask: sigset_t,
    tag: bool,
) -> io::Result<Child> {
    let mut cmd = Command::new(&argv[0]);
    cmd.args(&argv[1..]).stdin(Stdio::null()).process_group(0);
    for name in unset {
        cmd.env_remove(name);
    }
    cmd.envs(env.iter().map(|(k, v)| (k, v)));
    if tag {
        cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    }
    // SAFETY: getpid has no preconditions.
    let launcher = unsafe { libc::getpid() };
    let in_child = move || {
        // The launcher blocks its signals to take them with sigwait; a rank must not inherit that.
        // SAFETY: `mask` is a valid sigset; pthread_sigmask is async-signal-safe.
        let rc = unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &mask, std::ptr::null_mut()) };
        if rc != 0 {
            return Err(io::Error::from_raw_os_error(rc));
        }
        // The launcher passes these on, so a rank takes them as a program started alone does: one
        // it inherited ignored (a launcher started under `nohup`) could not even trap them.
        for sig in PASSED_ON {
            // SAFETY: a zeroed sigaction is SIG_DFL with no flags and an empty mask; sigaction is
            // async-signal-safe.
            let default: libc::sigaction = unsafe { std::mem::zeroed() };
            if unsafe { libc::sigaction(sig, &default, std::ptr::null_mut()) } != 0 {
                return Err(io::Error::last_os_error());
            }
        }
        // A rank dies with the launcher, however the launcher ends (SIGKILL included): nothing is
        // left running that no one supervises. The kernel reads the signal as an unsigned long.
        // SAFETY: prctl(PR_SET_PDEATHSIG, sig) takes one integer argument; async-signal-safe.
        if unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // The launcher may have gone between fork and prctl, and then no signal would come.
        // SAFETY: getppid has no preconditions and is async-signal-safe.
        if unsafe { libc::getppid() } != launcher {
            return Err(io::Error::from_raw_os_error(libc::ESRCH));
        }
        Ok(())
    };
    // SAFETY: `in_child` runs between fork and exec, where only async-signal-safe calls are allowed:
    // it makes only such calls (pthread_sigmask, sigaction, prctl, getppid, errno) and allocates
    // nothing.
    unsafe {
        cmd.pre_exec(in_child);
    }
    cmd.spawn()
}

/// Copies a rank's output `from` to `to` line by line, each line prefixed `[rank] ` and written in
/// one call (so lines of different ranks do not cut into each other), a line longer than
/// [`MAX_LINE`] in pieces, a last line without newline given one.
fn forward_tagged(from: impl Read, mut to: impl Write, rank: usize) {
    let prefix = format!("[{rank}] ");
    let mut from = BufReader::new(from);
    let mut line = Vec::new();
    loop {
        line.clear();
        line.extend_from_slice(prefix.as_bytes());
        match (&mut from).take(MAX_LINE).read_until(b'\n', &mut line) {
            Ok(0) | Err(_) => return,
            Ok(_) => {
                if line.last() != Some(&b'\n') {
                    line.push(b'\n');
                }
                // A failing output must not stall the rank on a full pipe: keep draining it.
                let _ = to.write_all(&line);
            }
        }
    }
}

/// Starts the `--tag` threads forwarding `rank`'s piped stdout and stderr.
fn tag_output(child: &mut Child, rank: usize, threads: &mut Vec<JoinHandle<()>>) -> io::Result<()> {
    let thread = |name: String| thread::Builder::new().name(name).stack_size(THREAD_STACK);
    if let Some(out) = child.stdout.take() {
        threads.push(thread(format!("rank{rank}-stdout")).spawn(move || forward_tagged(out, io::stdout(), rank))?);
    }
    if let Some(err) = child.stderr.take() {
        threads.push(thread(format!("rank{rank}-stderr")).spawn(move || forward_tagged(err, io::stderr(), rank))?);
    }
    Ok(())
}

/// A signal's name (`SIGTERM`), or `signal N` for one without a common name.
fn signal_name(sig: c_int) -> String {
    let name = match sig {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGILL => "SIGILL",
        libc::SIGTRAP => "SIGTRAP",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGUSR1 => "SIGUSR1",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGUSR2 => "SIGUSR2",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGALRM => "SIGALRM",
        libc::SIGTERM => "SIGTERM",
        _ => return format!("signal {sig}"),
    };
    name.to_string()
}

/// The status the launcher exits with for a rank that ended with `status`: its exit code, or
/// 128 + the signal that killed it, as a shell reports.
fn exit_code(status: ExitStatus) -> u8 {
    match (status.code(), status.signal()) {
        (Some(code), _) => u8::try_from(code).unwrap_or(1),
        (None, Some(sig)) => u8::try_from(128 + sig).unwrap_or(u8::MAX),
        (None, None) => 1,
    }
}

/// How a rank ended, for the launcher's one line: `exited with status 1`, `was killed by SIGSEGV`.
fn how_it_ended(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exited with status {code}"),
        (None, Some(sig)) if status.core_dumped() => format!("was killed by {} (core dumped)", signal_name(sig)),
        (None, Some(sig)) => format!("was killed by {}", signal_name(sig)),
        (None, None) => format!("ended ({status})"),
    }
}

/// A list of ranks for a message: `rank 3`, `ranks 1, 2, 5`, the first 8 and a count after.
fn name_ranks(ranks: &[usize]) -> String {
    const SHOWN: usize = 8;
    let mut names: Vec<String> = ranks.iter().take(SHOWN).map(usize::to_string).collect();
    if ranks.len() > SHOWN {
        names.push(format!("and {} more", ranks.len() - SHOWN));
    }
    format!("{} {}", if ranks.len() == 1 { "rank" } else { "ranks" }, names.join(", "))
}

/// How `child` ended, if it has, read without reaping it: an unreaped rank's pid still names its
/// process group, so what the rank left behind can still be signalled.
fn peek(child: &Child) -> io::Result<Option<ExitStatus>> {
    // SAFETY: siginfo_t is plain data, valid zeroed; waitid writes it (and leaves si_pid 0 when
    // WNOHANG finds nothing to report), and with WNOWAIT reaps nothing.
    unsafe {
        let mut info: libc::siginfo_t = std::mem::zeroed();
        let options = libc::WEXITED | libc::WNOHANG | libc::WNOWAIT;
        if libc::waitid(libc::P_PID, child.id(), &mut info, options) != 0 {
            return Err(io::Error::last_os_error());
        }
        if info.si_pid() == 0 {
            return Ok(None);
        }
        // The wait status waitpid would give: the exit code in bits 8-15, else the signal and
        // the core-dump bit.
        let status = info.si_status();
        Ok(match info.si_code {
            libc::CLD_EXITED => Some(ExitStatus::from_raw((status & 0xff) << 8)),
            libc::CLD_KILLED => Some(ExitStatus::from_raw(status & 0x7f)),
            libc::CLD_DUMPED => Some(ExitStatus::from_raw((status & 0x7f) | 0x80)),
            // Stopped or continued: not asked for, and not an end.
            _ => None,
        })
    }
}

/// One started rank.
struct Rank {
    /// The process; its pid is also its process group's id.
    child: Child,
    /// How it ended, once it has.
    ended: Option<ExitStatus>,
    /// Whether it has been reaped: from then on its pid names nothing of ours.
    reaped: bool,
}

impl Rank {
    /// Sends `sig` to the rank's process group: the rank and whatever it started (a shell's
    /// children). Only while the rank is unreaped, when its pid still names that group and no
    /// other; errors ignored, since a group that is gone needs no signal.
    fn signal(&self, sig: c_int) {
        if !self.reaped
            && let Ok(pgid) = pid_t::try_from(self.child.id())
        {
            // SAFETY: kill has no memory preconditions; -pgid addresses the rank's own group.
            unsafe {
                libc::kill(-pgid, sig);
            }
        }
    }
}

/// The started ranks in rank order. Those not yet reaped are killed (process group, SIGKILL) and
/// reaped on drop, so no early return or error leaves one running.
struct Ranks(Vec<Rank>);

impl Ranks {
    /// The ranks that have not ended.
    fn running(&self) -> Vec<usize> {
        (0..self.0.len()).filter(|&r| self.0[r].ended.is_none()).collect()
    }

    /// Sends `sig` to every unreaped rank's process group.
    fn signal(&self, sig: c_int) {
        self.0.iter().for_each(|r| r.signal(sig));
    }

    /// Notes every rank that has ended since the last look, without reaping it; returns them, in
    /// rank order, with how they ended.
    fn look(&mut self) -> io::Result<Vec<(usize, ExitStatus)>> {
        let mut ended = Vec::new();
        for (r, rank) in self.0.iter_mut().enumerate() {
            if rank.ended.is_none()
                && let Some(status) = peek(&rank.child)?
            {
                rank.ended = Some(status);
                ended.push((r, status));
            }
        }
        Ok(ended)
    }

    /// Reaps every rank that has ended (at once: they are zombies).
    fn reap_ended(&mut self) -> io::Result<()> {
        for rank in self.0.iter_mut().filter(|r| r.ended.is_some() && !r.reaped) {
            rank.child.wait()?;
            rank.reaped = true;
        }
        Ok(())
    }
}

impl Drop for Ranks {
    fn drop(&mut self) {
        self.signal(libc::SIGKILL);
        for rank in self.0.iter_mut().filter(|r| !r.reaped) {
            // SIGKILLed just above: the wait is short; an error means it was reaped already.
            let _ = rank.child.wait();
        }
    }
}

/// Waits for the ranks, stopping them all when one fails or a signal comes (see [`ABOUT_ENV`]);
/// returns the status the launcher exits with once none is left.
///
/// A rank that ends well is reaped at once. Once a stop has begun, ended ranks stay unreaped so
/// that their process groups can still be named, and the stop ends with SIGKILL to every group:
/// nothing a stopped rank started outlives it.
fn supervise(ranks: &mut Ranks, signals: &Receiver<c_int>, grace: Duration) -> io::Result<u8> {
    // The exit status, fixed by the first failure or signal; with it, the stop has begun.
    let mut outcome: Option<u8> = None;
    // When the ranks still running get SIGKILL, and the signal they were stopped with.
    let mut deadline: Option<(Instant, c_int)> = None;
    let mut killed = false;
    let mut signals_lost = false;
    loop {
        for (r, status) in ranks.look()? {
            if outcome.is_none() && !status.success() {
                outcome = Some(exit_code(status));
                let others = ranks.running().len();
                if others == 0 {
                    eprintln!("oxccl launch: rank {r} {}", how_it_ended(status));
                } else {
                    eprintln!("oxccl launch: rank {r} {}; stopping the other {others}", how_it_ended(status));
                }
                // The failed rank's group too: what it left behind is stopped with the rest.
                ranks.signal(libc::SIGTERM);
                deadline = Some((Instant::now() + grace, libc::SIGTERM));
            }
        }
        if outcome.is_none() {
            ranks.reap_ended()?;
        }
        let running = ranks.running();
        if running.is_empty() {
            break;
        }
        if let Some((at, sig)) = deadline
            && !killed
            && Instant::now() >= at
        {
            eprintln!(
                "oxccl launch: {} still running {:.1} s after {}; sending SIGKILL",
                name_ranks(&running),
                grace.as_secs_f64(),
                signal_name(sig)
            );
            ranks.signal(libc::SIGKILL);
            killed = true;
        }
        let wait = match deadline {
            Some((at, _)) if !killed => at.saturating_duration_since(Instant::now()).min(WAKE),
            _ => WAKE,
        };
        if signals_lost {
            thread::sleep(wait.min(POLL));
            continue;
        }
        match signals.recv_timeout(wait) {
            Ok(libc::SIGCHLD) | Err(RecvTimeoutError::Timeout) => {}
            Ok(sig) => {
                let n = running.len();
                let s = if n == 1 { "" } else { "s" };
                eprintln!("oxccl launch: got {}; passing it to the {n} running rank{s}", signal_name(sig));
                ranks.signal(sig);
                if outcome.is_none() {
                    outcome = Some(u8::try_from(128 + sig).unwrap_or(u8::MAX));
                    deadline = Some((Instant::now() + grace, sig));
                }
            }
            // The signal thread has stopped (sigwait failed): look at the ranks every POLL instead.
            Err(RecvTimeoutError::Disconnected) => signals_lost = true,
        }
    }
    if outcome.is_some() {
        ranks.signal(libc::SIGKILL);
    }
    ranks.reap_ended()?;
    Ok(outcome.unwrap_or(0))
}

/// Lets the `--tag` threads pass on what the ranks left in their pipes, for at most [`DRAIN`].
fn drain(threads: &[JoinHandle<()>]) {
    let until = Instant::now() + DRAIN;
    while threads.iter().any(|t| !t.is_finished()) && Instant::now() < until {
        thread::sleep(POLL);
    }
}

/// Starts the ranks and supervises them until all have ended; returns the status to exit with: 0
/// when every rank exited 0, else the first failing rank's (128 + signal if it was killed), or
/// 128 + the signal that stopped the launcher. Errors (a command that cannot be started, a GPU list
/// that does not fit) come with every rank already started stopped.
///
/// Blocks SIGINT, SIGTERM, SIGHUP and SIGCHLD in the calling thread and leaves a thread taking them:
/// meant for a process's main thread, as `oxccl launch` calls it.
pub fn run(a: Args) -> Result<u8, Box<dyn std::error::Error>> {
    let n = usize::from(a.nproc);
    let visible = std::env::var_os("CUDA_VISIBLE_DEVICES").map(|v| v.to_string_lossy().into_owned());
    let gpus = gpu_deal(a.gpus.as_ref(), visible.as_deref(), nvidia_smi_gpus)?;
    let port = match a.master_port {
        Some(port) => port,
        None => free_port().map_err(|e| format!("finding a free TCP port for MASTER_PORT: {e}"))?,
    };
    // Blocked before any rank starts, so no signal or rank's end between two spawns is missed.
    let (signals, mask) = watch_signals().map_err(|e| format!("setting up signal handling: {e}"))?;
    let mut ranks = Ranks(Vec::with_capacity(n));
    for r in 0..n {
        let gpu = gpus.as_ref().map(|g| g[r % g.len()].as_str());
        // A stale OXCCL_GPU from the launcher's own environment would name the wrong GPU.
        let unset: &[&str] = if gpu.is_none() { &["OXCCL_GPU"] } else { &[] };
        let env = rank_env(r, n, port, gpu);
        // On an error, dropping `ranks` kills those already started: they have done nothing yet.
        let child = spawn_rank(&a.command, &env, unset, mask, a.tag)
            .map_err(|e| format!("cannot start {:?} (rank {r} of {n}): {e}", a.command[0]))?;
        ranks.0.push(Rank { child, ended: None, reaped: false });
    }
    // Started after every fork: each thread's stack is one more mapping that a fork copies, and
    // 2048 of them would make starting 1024 ranks take seconds. A rank's pipe holds its first
    // 64 KiB meanwhile.
    let mut tag_threads = Vec::new();
    for (r, rank) in ranks.0.iter_mut().enumerate().filter(|_| a.tag) {
        tag_output(&mut rank.child, r, &mut tag_threads)
            .map_err(|e| format!("starting the threads that tag rank {r}'s output: {e}"))?;
    }
    let status = supervise(&mut ranks, &signals, a.grace_secs)?;
    drain(&tag_threads);
    Ok(status)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_lists_expand_ranges_in_order() {
        assert_eq!(parse_gpus("0,1,2,3").unwrap().gpus, [0, 1, 2, 3]);
        assert_eq!(parse_gpus("0-3").unwrap().gpus, [0, 1, 2, 3]);
        assert_eq!(parse_gpus(" 4-5, 0 ,2-2,0").unwrap().gpus, [4, 5, 0, 2, 0]);
    }

    #[test]
    fn bad_gpu_lists_name_the_entry() {
        assert!(parse_gpus("0,,1").unwrap_err().contains("empty entry"));
        assert!(parse_gpus("").unwrap_err().contains("empty entry"));
        assert!(parse_gpus("0,x").unwrap_err().contains("\"x\" is not a device number"));
        assert!(parse_gpus("-1").unwrap_err().contains("\"\" is not a device number"));
        assert!(parse_gpus("3-1").unwrap_err().contains("3-1 runs backwards (write 1-3)"));
        assert!(parse_gpus("0-4000000000").unwrap_err().contains("more than 1024 GPUs"));
        assert!(parse_gpus("0-1023").is_ok() && parse_gpus("0-1023,0").is_err());
    }

    #[test]
    fn grace_takes_decimals_and_refuses_the_rest() {
        assert_eq!(parse_grace("0.25"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_grace("5"), Ok(Duration::from_secs(5)));
        for bad in ["-1", "nan", "inf", "x", ""] {
            assert!(parse_grace(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn gpus_are_dealt_from_the_visible_list() {
        let list = |t| parse_gpus(t).unwrap();
        let none = || -> Option<usize> { panic!("nvidia-smi asked although the GPUs were known") };
        let some = |v: &[&str]| Some(v.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        assert_eq!(gpu_deal(Some(&list("0-1")), None, none), Ok(some(&["0", "1"])));
        assert_eq!(gpu_deal(Some(&list("2,0")), Some("4,5,6"), none), Ok(some(&["6", "4"])));
        assert_eq!(gpu_deal(None, Some("GPU-a, GPU-b"), none), Ok(some(&["GPU-a", "GPU-b"])));
        assert_eq!(gpu_deal(None, Some(""), none), Ok(None));
        assert!(gpu_deal(Some(&list("0-2")), Some("4,5"), none).unwrap_err().contains("GPU 2 is not visible"));
        assert_eq!(gpu_deal(None, None, || Some(3)), Ok(some(&["0", "1", "2"])));
        assert_eq!(gpu_deal(None, None, || Some(0)), Ok(None));
        assert_eq!(gpu_deal(None, None, || None), Ok(None));
    }

    #[test]
    fn exit_codes_follow_the_shell() {
        assert_eq!(exit_code(ExitStatus::from_raw(3 << 8)), 3);
        assert_eq!(exit_code(ExitStatus::from_raw(libc::SIGKILL)), 137);
        assert_eq!(how_it_ended(ExitStatus::from_raw(libc::SIGSEGV)), "was killed by SIGSEGV");
        assert_eq!(name_ranks(&[3]), "rank 3");
        assert_eq!(name_ranks(&(0..10).collect::<Vec<_>>()), "ranks 0, 1, 2, 3, 4, 5, 6, 7, and 2 more");
    }
}
