//! The bootstrap (`oxccl::bootstrap`) on the CPU: ranks as threads and as processes (this test
//! binary re-executed as each child, see `child_process_entry`), over TCP and in process, and every
//! misuse a launch can make: a wrong world size, a rank given twice, a stale Id, a rank that never
//! comes, a process that dies, a message over the limit, malformed Ids and environments.
//!
//! Timeouts are short (1 s where a test waits for one) so the file runs in a few seconds; every root
//! listens on port 0 (a free port) or on a port the OS just handed out, since tests run in parallel.

use oxccl::bootstrap::{
    ADDR_VAR, Bootstrap, BootstrapError, ID_BYTES, Id, LaunchEnv, LocalBootstrap, MAX_MESSAGE_BYTES, MAX_WORLD,
    PORT_VAR, TcpBootstrap,
};
use std::collections::HashMap;
use std::fs::File;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread;
use std::time::{Duration, Instant};

/// Generous where nothing should time out: a slow CI machine must not fail the test.
const LONG: Duration = Duration::from_secs(20);
/// Where a test waits for a timeout on purpose.
const SHORT: Duration = Duration::from_secs(1);

// The child processes' instructions, set only through `Command::env`.
const ROLE: &str = "OXCCL_BOOTSTRAP_TEST_ROLE";
const ID_VAR: &str = "OXCCL_BOOTSTRAP_TEST_ID";
const ID_FILE_VAR: &str = "OXCCL_BOOTSTRAP_TEST_ID_FILE";
const RANK_VAR: &str = "OXCCL_BOOTSTRAP_TEST_RANK";
const WORLD_VAR: &str = "OXCCL_BOOTSTRAP_TEST_WORLD";
const ROUNDS_VAR: &str = "OXCCL_BOOTSTRAP_TEST_ROUNDS";
/// `rank:round`: that rank's process exits (status 17, no destructors) at the start of that round.
const DIE_VAR: &str = "OXCCL_BOOTSTRAP_TEST_DIE";
/// `ok`, `peer-left:R` or `root-closed`: how the child's rounds must end.
const EXPECT_VAR: &str = "OXCCL_BOOTSTRAP_TEST_EXPECT";
const DIED: i32 = 17;

fn loopback_root() -> Id {
    Id::new_on((Ipv4Addr::LOCALHOST, 0).into()).expect("start a root on 127.0.0.1")
}

/// A rank's bytes in a round: distinct for every (rank, round), lengths from 0 to 299.
fn payload(rank: usize, round: usize) -> Vec<u8> {
    let len = (rank * 37 + round * 101) % 300;
    (0..len).map(|i| (rank * 31 + round * 7 + i) as u8).collect()
}

/// `rounds` rounds of an all-gather and a barrier, checking every rank's bytes. `die`: (rank,
/// round) at whose start that rank's process exits.
fn exercise(boot: &dyn Bootstrap, rounds: usize, die: Option<(usize, usize)>) -> Result<(), BootstrapError> {
    let me = boot.rank();
    for round in 0..rounds {
        if die == Some((me, round)) {
            std::process::exit(DIED);
        }
        let all = boot.all_gather(&payload(me, round))?;
        assert_eq!(all.len(), boot.world(), "rank {me} round {round}: one entry per rank");
        for (r, bytes) in all.iter().enumerate() {
            assert_eq!(bytes, &payload(r, round), "rank {me} round {round}: rank {r}'s bytes");
        }
        boot.barrier()?;
    }
    Ok(())
}

fn var(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("child: {name} is not set"))
}

/// Not a test by itself: the body of the child processes the multi-process tests start (this
/// binary re-executed with `--exact child_process_entry`, its role in `OXCCL_BOOTSTRAP_TEST_ROLE`).
/// In a normal run it returns at once. A child that meets an outcome other than the one it was told
/// to expect panics, which fails its process and so the parent's test.
#[test]
fn child_process_entry() {
    let Ok(role) = std::env::var(ROLE) else { return };
    if role == "addr-var" {
        return child_addr_var();
    }
    if role == "threads-end" {
        return child_threads_end();
    }
    let rank: usize = var(RANK_VAR).parse().expect("rank");
    let world: usize = var(WORLD_VAR).parse().expect("world");
    let rounds: usize = var(ROUNDS_VAR).parse().expect("rounds");
    let die = std::env::var(DIE_VAR).ok().map(|d| {
        let (r, n) = d.split_once(':').expect("rank:round");
        (r.parse().expect("die rank"), n.parse().expect("die round"))
    });
    let boot = match role.as_str() {
        "torchrun" => {
            let env = LaunchEnv::from_env().expect("LaunchEnv::from_env");
            assert_eq!((env.rank, env.world, env.local_rank, env.local_world), (rank, world, rank, world));
            assert_eq!(Some(env.root_port), env.master_port.checked_add(1), "the agent store holds MASTER_PORT");
            TcpBootstrap::from_env(LONG)
        }
        "id" => TcpBootstrap::new(&var(ID_VAR).parse().expect("Id string"), rank, world, LONG),
        "id-file" => {
            let path = var(ID_FILE_VAR);
            let id = if rank == 0 {
                // The default address: every interface, advertising the host's address.
                let id = Id::new().expect("Id::new");
                id.write_file(&path).expect("write the Id file");
                id
            } else {
                Id::wait_for_file(&path, LONG).expect("the Id file")
            };
            TcpBootstrap::new(&id, rank, world, LONG)
        }
        other => panic!("child: unknown role {other}"),
    }
    .unwrap_or_else(|e| panic!("child rank {rank}: joining failed: {e}"));
    let outcome = exercise(&boot, rounds, die);
    let expect = var(EXPECT_VAR);
    match (expect.as_str(), &outcome) {
        ("ok", Ok(())) | ("root-closed", Err(BootstrapError::RootClosed { .. })) => {}
        (e, Err(BootstrapError::PeerLeft { rank: left })) if e == format!("peer-left:{left}") => {}
        _ => panic!("child rank {rank}: expected {expect}, got {outcome:?}"),
    }
    println!("child rank {rank}: {expect} as expected");
}

/// `Id::new` reads `OXCCL_BOOTSTRAP_ADDR` (only ever set in a child's environment).
fn child_addr_var() {
    let given = var(ADDR_VAR);
    match given.as_str() {
        "127.0.0.1" => {
            let id = Id::new().expect("Id::new on a host");
            assert_eq!(id.addr().ip(), Ipv4Addr::LOCALHOST);
            assert_ne!(id.addr().port(), 0, "port 0 becomes the port bound");
            // The root it started serves a group.
            let b = TcpBootstrap::new(&id, 0, 1, LONG).expect("join");
            assert_eq!(b.all_gather(b"solo").expect("gather"), vec![b"solo".to_vec()]);
        }
        "localhost:notaport" => match Id::new() {
            Err(BootstrapError::Env { var, why }) => assert!(var == ADDR_VAR && why.contains("notaport"), "{why}"),
            other => panic!("expected an Env error naming {ADDR_VAR}, got {other:?}"),
        },
        other => {
            // host:port, exactly that port.
            let want: SocketAddr = other.parse().expect("ip:port");
            assert_eq!(Id::new().expect("Id::new on host:port").addr(), want);
        }
    }
    println!("child: {ADDR_VAR}={given} as expected");
}

/// The threads of this process whose names start with `oxccl-bootst` (the root's threads), from
/// Linux's `/proc`.
fn root_threads() -> usize {
    let tasks = std::fs::read_dir("/proc/self/task").expect("/proc/self/task");
    tasks
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|name| name.starts_with("oxccl-bootst"))
        .count()
}

/// Every root thread of this process ends within a few seconds of its group's end.
fn assert_root_threads_end(after: &str) {
    let start = Instant::now();
    while root_threads() > 0 {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "{} root thread(s) still running after {after}",
            root_threads()
        );
        thread::sleep(Duration::from_millis(10));
    }
}

/// The root's threads end with its group: after a group that completed, one that failed, and a
/// refused connection.
fn child_threads_end() {
    assert_eq!(root_threads(), 0, "a fresh process has no root threads");
    let id = loopback_root();
    // A root is an accepting thread and a coordinator (each names itself once it runs).
    let start = Instant::now();
    while root_threads() < 2 {
        assert!(start.elapsed() < Duration::from_secs(5), "the root's threads did not start");
        thread::sleep(Duration::from_millis(1));
    }
    let handles: Vec<_> =
        (0..4).map(|rank| thread::spawn(move || exercise(&TcpBootstrap::new(&id, rank, 4, LONG)?, 3, None))).collect();
    for h in handles {
        h.join().expect("thread").expect("rounds");
    }
    assert_root_threads_end("a completed group");

    let id = loopback_root();
    let stale = Id::from_parts(id.addr(), !id.nonce());
    assert!(matches!(TcpBootstrap::new(&stale, 0, 2, LONG), Err(BootstrapError::StaleId { .. })));
    assert!(matches!(TcpBootstrap::new(&id, 0, 2, SHORT / 4), Err(BootstrapError::Missing { .. })));
    assert_root_threads_end("a group that never formed");
    println!("child: the root's threads ended");
}

/// A child of this test binary running `child_process_entry` with `envs`, its output in a file.
struct Kid {
    rank: usize,
    child: Child,
    log: PathBuf,
}

fn scratch_dir() -> PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "oxccl-bootstrap-test-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    ));
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

fn spawn_kid(dir: &std::path::Path, rank: usize, envs: &[(&str, String)]) -> Kid {
    let log = dir.join(format!("rank{rank}.log"));
    let out = File::create(&log).expect("log file");
    let err = out.try_clone().expect("log file");
    let mut cmd = Command::new(std::env::current_exe().expect("test binary"));
    cmd.args(["--exact", "child_process_entry", "--nocapture", "--test-threads=1"])
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err);
    // Nothing the parent's environment happens to hold may steer the child.
    for v in [ADDR_VAR, PORT_VAR, "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RUN_ID", DIE_VAR] {
        cmd.env_remove(v);
    }
    cmd.env(RANK_VAR, rank.to_string());
    for (k, v) in envs {
        cmd.env(k, v);
    }
    Kid { rank, child: cmd.spawn().expect("spawn a child"), log }
}

/// Waits for every child (killing any still running after `limit`) and returns (rank, exit code,
/// output) for each.
fn reap(kids: Vec<Kid>, limit: Duration) -> Vec<(usize, Option<i32>, String)> {
    let start = Instant::now();
    kids.into_iter()
        .map(|mut kid| {
            let code = loop {
                if let Some(status) = kid.child.try_wait().expect("wait") {
                    break status.code();
                }
                if start.elapsed() > limit {
                    let _ = kid.child.kill();
                    let _ = kid.child.wait();
                    break None;
                }
                thread::sleep(Duration::from_millis(5));
            };
            (kid.rank, code, std::fs::read_to_string(&kid.log).unwrap_or_default())
        })
        .collect()
}

/// Every child exited 0, except `died` with the status `exercise` gives a dying rank.
fn assert_exits(results: &[(usize, Option<i32>, String)], died: Option<usize>) {
    for (rank, code, log) in results {
        let want = if Some(*rank) == died { DIED } else { 0 };
        assert_eq!(*code, Some(want), "child rank {rank} exited with {code:?} (want {want}); its output:\n{log}");
    }
}

/// The root at `addr` has ended: its listener is closed (connections are refused).
fn assert_root_gone(addr: SocketAddr) {
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(5) {
        match TcpStream::connect_timeout(&addr, Duration::from_millis(500)) {
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => return,
            _ => thread::sleep(Duration::from_millis(10)),
        }
    }
    panic!("the root at {addr} still accepts connections after its group ended");
}

fn common_envs(world: usize, rounds: usize, expect: &str) -> Vec<(&'static str, String)> {
    vec![(WORLD_VAR, world.to_string()), (ROUNDS_VAR, rounds.to_string()), (EXPECT_VAR, expect.to_string())]
}

#[test]
fn processes_gather_and_barrier() {
    let id = loopback_root();
    let dir = scratch_dir();
    let world = 12;
    let mut envs = common_envs(world, 4, "ok");
    envs.extend([(ROLE, "id".to_string()), (ID_VAR, id.to_string())]);
    let kids = (0..world).map(|r| spawn_kid(&dir, r, &envs)).collect();
    assert_exits(&reap(kids, LONG), None);
    // Every rank has gone: the root has ended and closed its listener.
    assert_root_gone(id.addr());
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn root_in_rank_zero_found_through_a_file() {
    let dir = scratch_dir();
    let world = 8;
    let mut envs = common_envs(world, 3, "ok");
    envs.extend([(ROLE, "id-file".to_string()), (ID_FILE_VAR, dir.join("id").display().to_string())]);
    // The ranks that read the file start first: they wait for it.
    let kids = (0..world).rev().map(|r| spawn_kid(&dir, r, &envs)).collect();
    assert_exits(&reap(kids, LONG), None);
    let id = Id::read_file(dir.join("id")).expect("the file rank 0 wrote");
    assert_root_gone(id.addr());
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_dead_process_is_named_peer_left() {
    let id = loopback_root();
    let dir = scratch_dir();
    let (world, dead) = (8, 5);
    let mut envs = common_envs(world, 4, &format!("peer-left:{dead}"));
    envs.extend([(ROLE, "id".to_string()), (ID_VAR, id.to_string()), (DIE_VAR, format!("{dead}:2"))]);
    let start = Instant::now();
    let kids = (0..world).map(|r| spawn_kid(&dir, r, &envs)).collect();
    assert_exits(&reap(kids, LONG), Some(dead));
    // Learned from the closed connection, not from a timeout (LONG).
    assert!(start.elapsed() < Duration::from_secs(10), "took {:?}", start.elapsed());
    assert_root_gone(id.addr());
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_dead_root_process_is_root_closed() {
    let dir = scratch_dir();
    let world = 6;
    let mut envs = common_envs(world, 4, "root-closed");
    envs.extend([
        (ROLE, "id-file".to_string()),
        (ID_FILE_VAR, dir.join("id").display().to_string()),
        (DIE_VAR, "0:1".to_string()),
    ]);
    let start = Instant::now();
    let kids = (0..world).map(|r| spawn_kid(&dir, r, &envs)).collect();
    assert_exits(&reap(kids, LONG), Some(0));
    assert!(start.elapsed() < Duration::from_secs(10), "took {:?}", start.elapsed());
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn torchrun_environment_across_processes() {
    // torchrun's agent holds MASTER_PORT with its store: the root goes one above.
    let (agent, port) = (0..20)
        .find_map(|_| {
            let agent = TcpListener::bind((Ipv4Addr::UNSPECIFIED, 0)).ok()?;
            let port = agent.local_addr().ok()?.port();
            TcpListener::bind((Ipv4Addr::UNSPECIFIED, port.checked_add(1)?)).ok()?;
            Some((agent, port))
        })
        .expect("two free consecutive ports");
    let dir = scratch_dir();
    let world = 4;
    let mut envs = common_envs(world, 3, "ok");
    envs.extend([
        (ROLE, "torchrun".to_string()),
        ("WORLD_SIZE", world.to_string()),
        ("MASTER_ADDR", "localhost".to_string()),
        ("MASTER_PORT", port.to_string()),
        ("TORCHELASTIC_USE_AGENT_STORE", "True".to_string()),
        ("TORCHELASTIC_RUN_ID", format!("oxccl-test-{}", std::process::id())),
    ]);
    let kids = (0..world)
        .map(|r| {
            let mut envs = envs.clone();
            envs.push(("RANK", r.to_string()));
            spawn_kid(&dir, r, &envs)
        })
        .collect();
    assert_exits(&reap(kids, LONG), None);
    drop(agent);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn id_new_reads_the_address_variable() {
    let dir = scratch_dir();
    let free = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("bind").local_addr().expect("addr");
    let values = ["127.0.0.1".to_string(), "localhost:notaport".to_string(), free.to_string()];
    let kids = values
        .iter()
        .enumerate()
        .map(|(i, v)| spawn_kid(&dir, i, &[(ROLE, "addr-var".to_string()), (ADDR_VAR, v.clone())]))
        .collect();
    assert_exits(&reap(kids, LONG), None);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn the_root_threads_end_with_the_group() {
    if !std::path::Path::new("/proc/self/task").is_dir() {
        eprintln!("skipped: no /proc/self/task to count threads in (the_root_threads_end_with_the_group)");
        return;
    }
    let dir = scratch_dir();
    let kid = spawn_kid(&dir, 0, &[(ROLE, "threads-end".to_string())]);
    assert_exits(&reap(vec![kid], LONG), None);
    let _ = std::fs::remove_dir_all(dir);
}

/// Each rank on a thread, joining through `id`, running `f`.
fn tcp_threads<T: Send + 'static>(
    id: Id,
    world: usize,
    timeout: Duration,
    f: impl Fn(TcpBootstrap) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let f = std::sync::Arc::new(f);
    let handles: Vec<_> = (0..world)
        .map(|rank| {
            let f = f.clone();
            thread::spawn(move || f(TcpBootstrap::new(&id, rank, world, timeout).expect("join")))
        })
        .collect();
    handles.into_iter().map(|h| h.join().expect("rank thread")).collect()
}

#[test]
fn threads_gather_over_tcp() {
    let id = loopback_root();
    let done = tcp_threads(id, 16, LONG, move |boot| {
        assert_eq!((boot.world(), boot.root(), boot.timeout()), (16, id.addr(), LONG));
        exercise(&boot, 5, None)
    });
    assert!(done.iter().all(Result::is_ok), "{done:?}");
    assert_root_gone(id.addr());
}

#[test]
fn threads_gather_over_ipv6() {
    let Ok(id) = Id::new_on((Ipv6Addr::LOCALHOST, 0).into()) else {
        eprintln!("skipped: no IPv6 loopback (threads_gather_over_ipv6)");
        return;
    };
    assert!(id.addr().is_ipv6());
    let parsed: Id = id.to_string().parse().expect("an IPv6 Id parses");
    let done = tcp_threads(parsed, 3, LONG, |boot| exercise(&boot, 2, None));
    assert!(done.iter().all(Result::is_ok), "{done:?}");
}

#[test]
fn local_group_gathers_on_threads() {
    let group = LocalBootstrap::group(8, LONG);
    let handles: Vec<_> = group.into_iter().map(|boot| thread::spawn(move || exercise(&boot, 6, None))).collect();
    for h in handles {
        h.join().expect("thread").expect("rounds");
    }
    assert!(LocalBootstrap::group(0, LONG).is_empty());
    let solo = LocalBootstrap::group(1, LONG).pop().expect("one");
    assert_eq!(solo.all_gather(b"me").expect("gather"), vec![b"me".to_vec()]);
}

#[test]
fn barrier_meets_all_gather() {
    let id = loopback_root();
    let a = thread::spawn(move || {
        let b = TcpBootstrap::new(&id, 0, 2, LONG)?;
        b.barrier()?;
        b.all_gather(b"second")
    });
    let b = TcpBootstrap::new(&id, 1, 2, LONG).expect("join");
    assert_eq!(b.all_gather(b"x").expect("round"), vec![vec![], b"x".to_vec()]);
    b.barrier().expect("second round");
    assert_eq!(a.join().expect("thread").expect("rank 0"), vec![b"second".to_vec(), vec![]]);

    let mut local = LocalBootstrap::group(2, LONG);
    let one = local.pop().expect("rank 1");
    let zero = local.pop().expect("rank 0");
    let t = thread::spawn(move || one.all_gather(b"y"));
    zero.barrier().expect("barrier");
    assert_eq!(t.join().expect("thread").expect("gather"), vec![vec![], b"y".to_vec()]);
}

#[test]
fn world_mismatch_is_refused_and_the_group_still_forms() {
    let id = loopback_root();
    // Rank 0 says 2 ranks, rank 1 says 3: whichever arrives second is refused, naming itself and the
    // first arrival's world; the group the first arrival started then still forms.
    let (tx, rx) = std::sync::mpsc::channel();
    for (rank, world) in [(0, 2), (1, 3)] {
        let tx = tx.clone();
        thread::spawn(move || {
            let joined = TcpBootstrap::new(&id, rank, world, LONG).and_then(|b| b.all_gather(&[rank as u8]));
            tx.send((rank, joined)).expect("send");
        });
    }
    let (refused_rank, refused) = rx.recv_timeout(LONG).expect("one refusal before the group forms");
    let (kept_rank, world, others) = match refused {
        Err(BootstrapError::WorldMismatch { rank: 1, expected: 2, got: 3 }) if refused_rank == 1 => (0, 2, vec![1]),
        Err(BootstrapError::WorldMismatch { rank: 0, expected: 3, got: 2 }) if refused_rank == 0 => (1, 3, vec![0, 2]),
        other => panic!("expected WorldMismatch for rank {refused_rank}, got {other:?}"),
    };
    let joiners: Vec<_> = others
        .into_iter()
        .map(|rank| thread::spawn(move || TcpBootstrap::new(&id, rank, world, LONG)?.all_gather(&[rank as u8])))
        .collect();
    let want: Vec<Vec<u8>> = (0..world as u8).map(|r| vec![r]).collect();
    for j in joiners {
        assert_eq!(j.join().expect("thread").expect("joins the first arrival's group"), want);
    }
    let (rank, kept) = rx.recv_timeout(LONG).expect("the first arrival");
    assert_eq!((rank, kept.expect("first arrival's round")), (kept_rank, want));
}

#[test]
fn a_rank_taken_twice_is_refused() {
    let id = loopback_root();
    let (tx, rx) = std::sync::mpsc::channel();
    for _ in 0..2 {
        let tx = tx.clone();
        thread::spawn(move || {
            let joined = TcpBootstrap::new(&id, 0, 2, LONG).and_then(|b| b.all_gather(b"zero"));
            tx.send(joined).expect("send");
        });
    }
    // The later of the two is refused at once; the earlier waits for rank 1.
    let refused = rx.recv_timeout(LONG).expect("one answer before rank 1 joins");
    assert!(matches!(refused, Err(BootstrapError::RankTaken { rank: 0 })), "{refused:?}");
    let one = TcpBootstrap::new(&id, 1, 2, LONG).expect("rank 1 joins");
    assert_eq!(one.all_gather(b"one").expect("round"), vec![b"zero".to_vec(), b"one".to_vec()]);
    let kept = rx.recv_timeout(LONG).expect("the other rank 0");
    assert_eq!(kept.expect("the first rank 0"), vec![b"zero".to_vec(), b"one".to_vec()]);
}

#[test]
fn a_stale_id_is_refused() {
    let id = loopback_root();
    let text = id.to_string();
    // Another run's Id for the same address: the last hex digit (in the nonce) changed.
    let last = text.chars().last().expect("digit");
    let stale: Id =
        format!("{}{}", &text[..text.len() - 1], if last == '0' { '1' } else { '0' }).parse().expect("parses");
    assert_eq!((stale.addr(), stale.nonce() ^ id.nonce() != 0), (id.addr(), true));
    match TcpBootstrap::new(&stale, 0, 1, LONG) {
        Err(BootstrapError::StaleId { root }) => assert_eq!(root, id.addr()),
        other => panic!("expected StaleId, got {other:?}"),
    }
    // The root still serves its own run.
    let b = TcpBootstrap::new(&id, 0, 1, LONG).expect("this run's Id");
    assert_eq!(b.all_gather(b"a").expect("round"), vec![b"a".to_vec()]);
}

#[test]
fn ranks_and_worlds_out_of_range_are_refused_before_connecting() {
    // Nothing listens there: these must fail before connecting (else they would time out).
    let nowhere = Id::from_parts((Ipv4Addr::LOCALHOST, 9).into(), 1);
    let start = Instant::now();
    let e = TcpBootstrap::new(&nowhere, 2, 2, LONG).expect_err("rank 2 of 2");
    assert!(matches!(e, BootstrapError::RankOutOfRange { rank: 2, world: 2 }), "{e:?}");
    assert_eq!(e.to_string(), "rank 2 is out of range for a world of 2 rank(s)");
    let e = TcpBootstrap::new(&nowhere, 0, 0, LONG).expect_err("world 0");
    assert!(matches!(e, BootstrapError::World { world: 0, .. }), "{e:?}");
    let e = TcpBootstrap::new(&nowhere, 0, MAX_WORLD + 1, LONG).expect_err("world too large");
    assert!(matches!(e, BootstrapError::World { world, max: MAX_WORLD } if world == MAX_WORLD + 1), "{e:?}");
    assert!(start.elapsed() < SHORT, "{:?}", start.elapsed());
}

#[test]
fn a_rank_that_never_arrives_is_named() {
    let id = loopback_root();
    let start = Instant::now();
    let ranks: Vec<_> =
        [0, 2].into_iter().map(|rank| thread::spawn(move || TcpBootstrap::new(&id, rank, 3, SHORT))).collect();
    for r in ranks {
        match r.join().expect("thread") {
            Err(BootstrapError::Missing { ranks, world: 3, waited }) => {
                assert_eq!((ranks, waited), (vec![1], SHORT));
            }
            other => panic!("expected Missing, got {other:?}"),
        }
    }
    let took = start.elapsed();
    assert!(took >= SHORT - Duration::from_millis(50) && took < 2 * SHORT, "took {took:?}");
    assert_root_gone(id.addr());
}

#[test]
fn a_connection_to_no_root_times_out() {
    let port = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("bind").local_addr().expect("addr").port();
    let nowhere = Id::from_parts((Ipv4Addr::LOCALHOST, port).into(), 1);
    let start = Instant::now();
    match TcpBootstrap::new(&nowhere, 0, 2, Duration::from_millis(300)) {
        Err(BootstrapError::Timeout { what, .. }) => assert!(what.contains(&nowhere.addr().to_string()), "{what}"),
        other => panic!("expected Timeout, got {other:?}"),
    }
    let took = start.elapsed();
    assert!(took >= Duration::from_millis(290) && took < SHORT, "took {took:?}");
}

#[test]
fn an_oversize_message_is_refused_and_peers_told() {
    let id = loopback_root();
    let other = thread::spawn(move || TcpBootstrap::new(&id, 1, 2, LONG)?.all_gather(b"small"));
    let b = TcpBootstrap::new(&id, 0, 2, LONG).expect("join");
    // Zeroed pages the allocator maps lazily: cheap, and refused before anything is sent.
    let huge = vec![0u8; MAX_MESSAGE_BYTES + 1];
    match b.all_gather(&huge) {
        Err(BootstrapError::TooLarge { len, max }) => {
            assert_eq!((len, max), (MAX_MESSAGE_BYTES + 1, MAX_MESSAGE_BYTES))
        }
        other => panic!("expected TooLarge, got {:?}", other.map(|v| v.len())),
    }
    drop(huge);
    match other.join().expect("thread") {
        Err(BootstrapError::PeerAborted { rank: 0, why }) => assert!(why.contains("limit"), "{why}"),
        other => panic!("expected PeerAborted by rank 0, got {other:?}"),
    }
    assert!(matches!(b.barrier(), Err(BootstrapError::Broken { .. })));
    // The limit itself is fine.
    let group = LocalBootstrap::group(1, LONG);
    assert_eq!(group[0].all_gather(&[7; 1000]).expect("local has no limit")[0].len(), 1000);
}

#[test]
fn a_rank_that_stops_calling_times_out_its_peers() {
    let id = loopback_root();
    let waiting = thread::spawn(move || {
        let b = TcpBootstrap::new(&id, 0, 2, SHORT)?;
        let start = Instant::now();
        let round = b.all_gather(b"waits");
        Ok::<_, BootstrapError>((round, start.elapsed()))
    });
    let late = TcpBootstrap::new(&id, 1, 2, SHORT).expect("join");
    let (round, took) = waiting.join().expect("thread").expect("rank 0 joins");
    match round {
        Err(BootstrapError::Timeout { waited, what }) => assert!(waited == SHORT && what.contains("round 0"), "{what}"),
        other => panic!("expected Timeout, got {other:?}"),
    }
    assert!(took >= SHORT - Duration::from_millis(50) && took < 2 * SHORT, "took {took:?}");
    // Rank 0 gave up and left; rank 1 learns it at once. Rank 0 had sent its bytes before giving
    // up, so the root may complete that round for rank 1 first (the root reads each connection on
    // its own thread): then rank 1's next call reports it.
    let start = Instant::now();
    let mut outcome = late.all_gather(b"late");
    if let Ok(all) = &outcome {
        assert_eq!(all, &vec![b"waits".to_vec(), b"late".to_vec()]);
        outcome = late.barrier().map(|()| Vec::new());
    }
    match outcome {
        Err(BootstrapError::PeerAborted { rank: 0, why }) => assert!(why.contains("timed out"), "{why}"),
        other => panic!("expected PeerAborted by rank 0, got {other:?}"),
    }
    assert!(start.elapsed() < SHORT / 2, "{:?}", start.elapsed());
}

#[test]
fn a_dropped_rank_is_named() {
    let id = loopback_root();
    let results = tcp_threads(id, 3, LONG, |boot| {
        exercise(&boot, 1, None)?;
        if boot.rank() == 2 {
            drop(boot);
            return Ok(());
        }
        boot.all_gather(b"after").map(drop)
    });
    for (rank, r) in results.iter().enumerate().take(2) {
        assert!(matches!(r, Err(BootstrapError::PeerLeft { rank: 2 })), "rank {rank}: {r:?}");
    }

    let mut group = LocalBootstrap::group(3, LONG);
    drop(group.pop());
    let start = Instant::now();
    for b in &group {
        assert!(matches!(b.all_gather(b"x"), Err(BootstrapError::PeerLeft { rank: 2 })));
    }
    assert!(start.elapsed() < SHORT);
}

#[test]
fn a_local_member_that_times_out_leaves_the_group() {
    let mut group = LocalBootstrap::group(2, Duration::from_millis(200));
    let one = group.pop().expect("rank 1");
    let zero = group.pop().expect("rank 0");
    let start = Instant::now();
    match zero.all_gather(b"alone") {
        Err(BootstrapError::Timeout { waited, .. }) => assert_eq!(waited, Duration::from_millis(200)),
        other => panic!("expected Timeout, got {other:?}"),
    }
    assert!(start.elapsed() >= Duration::from_millis(190), "{:?}", start.elapsed());
    assert!(matches!(zero.barrier(), Err(BootstrapError::Broken { .. })));
    match one.all_gather(b"late") {
        Err(BootstrapError::PeerAborted { rank: 0, why }) => assert!(why.contains("timed out"), "{why}"),
        other => panic!("expected PeerAborted by rank 0, got {other:?}"),
    }
}

fn launch_env(rank: usize, world: usize, port: u16) -> LaunchEnv {
    LaunchEnv {
        rank,
        world,
        local_rank: rank,
        local_world: world,
        master_addr: "127.0.0.1".into(),
        master_port: port,
        root_port: port,
        run_id: Some(format!("threads-{}", std::process::id())),
    }
}

#[test]
fn ranks_started_before_the_root_retry() {
    let port = TcpListener::bind((Ipv4Addr::UNSPECIFIED, 0)).expect("bind").local_addr().expect("addr").port();
    let early: Vec<_> = (1..4)
        .map(|rank| thread::spawn(move || TcpBootstrap::from_launch_env(&launch_env(rank, 4, port), LONG)))
        .collect();
    // The others are retrying refused connections meanwhile.
    thread::sleep(Duration::from_millis(200));
    let zero = TcpBootstrap::from_launch_env(&launch_env(0, 4, port), LONG).expect("rank 0 starts the root");
    let zero = thread::spawn(move || exercise(&zero, 2, None));
    let rest: Vec<_> = early
        .into_iter()
        .map(|h| h.join().expect("thread").expect("join"))
        .map(|b| thread::spawn(move || exercise(&b, 2, None)))
        .collect();
    zero.join().expect("thread").expect("rank 0");
    for h in rest {
        h.join().expect("thread").expect("rounds");
    }
}

#[test]
fn a_held_port_is_a_bind_error_naming_it() {
    let held = TcpListener::bind((Ipv4Addr::UNSPECIFIED, 0)).expect("bind");
    let port = held.local_addr().expect("addr").port();
    let e = TcpBootstrap::from_launch_env(&launch_env(0, 2, port), LONG).expect_err("the port is held");
    let BootstrapError::Bind { addr, source } = &e else { panic!("expected Bind, got {e:?}") };
    assert_eq!((addr.port(), source.kind()), (port, std::io::ErrorKind::AddrInUse));
    assert!(e.to_string().contains(&format!(":{port}")) && e.to_string().contains(PORT_VAR), "{e}");
    assert!(std::error::Error::source(&e).is_some());
    drop(held);
}

fn lookup(vars: &[(&str, &str)]) -> Result<LaunchEnv, BootstrapError> {
    let map: HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    LaunchEnv::from_lookup(|name| map.get(name).cloned())
}

#[test]
fn launch_env_reads_torchrun_variables() {
    let base = [("RANK", "3"), ("WORLD_SIZE", "8"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")];
    let env = lookup(&base).expect("minimal");
    assert_eq!(
        env,
        LaunchEnv {
            rank: 3,
            world: 8,
            local_rank: 3,
            local_world: 8,
            master_addr: "127.0.0.1".into(),
            master_port: 29500,
            root_port: 29500,
            run_id: None,
        }
    );
    assert_eq!(env.root_addr().expect("addr"), "127.0.0.1:29500".parse().expect("addr"));
    let with = |extra: &[(&'static str, &'static str)]| {
        let mut vars = base.to_vec();
        vars.retain(|(k, _)| !extra.iter().any(|(e, _)| e == k));
        vars.extend_from_slice(extra);
        lookup(&vars)
    };
    let env = with(&[("LOCAL_RANK", "1"), ("LOCAL_WORLD_SIZE", "4"), ("TORCHELASTIC_USE_AGENT_STORE", "True")])
        .expect("torchrun");
    assert_eq!((env.local_rank, env.local_world, env.root_port), (1, 4, 29501));
    assert_eq!(with(&[("TORCHELASTIC_USE_AGENT_STORE", "False")]).expect("no agent").root_port, 29500);
    let env = with(&[(PORT_VAR, "4000"), ("TORCHELASTIC_USE_AGENT_STORE", "True")]).expect("override");
    assert_eq!(env.root_port, 4000);
    // Every rank derives one Id; another run's differs.
    let a = with(&[("TORCHELASTIC_RUN_ID", "a")]).expect("run a");
    assert_eq!(a.run_id.as_deref(), Some("a"));
    let a1 = with(&[("TORCHELASTIC_RUN_ID", "a"), ("RANK", "0")]).expect("rank 0");
    assert_eq!(a.id().expect("id"), a1.id().expect("id"));
    assert_ne!(a.id().expect("id"), with(&[("TORCHELASTIC_RUN_ID", "b")]).expect("run b").id().expect("id"));

    let refused = |extra: &[(&'static str, &'static str)], drop_var: Option<&str>| {
        let mut vars = base.to_vec();
        vars.retain(|(k, _)| Some(*k) != drop_var && !extra.iter().any(|(e, _)| e == k));
        vars.extend_from_slice(extra);
        match lookup(&vars) {
            Err(BootstrapError::Env { var, why }) => (var, why),
            other => panic!("expected Env for {extra:?} / without {drop_var:?}, got {other:?}"),
        }
    };
    for missing in ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"] {
        assert_eq!(refused(&[], Some(missing)), (missing, "not set".to_string()));
    }
    // (variables set over the base, the variable named, a word the reason must contain)
    type Case<'a> = (&'a [(&'a str, &'a str)], &'a str, &'a str);
    let cases: &[Case] = &[
        (&[("RANK", "three")], "RANK", "three"),
        (&[("RANK", "-1")], "RANK", "-1"),
        (&[("RANK", "8")], "RANK", "WORLD_SIZE 8"),
        (&[("WORLD_SIZE", "0")], "WORLD_SIZE", "1 to"),
        (&[("WORLD_SIZE", "8.0")], "WORLD_SIZE", "8.0"),
        (&[("LOCAL_RANK", "x")], "LOCAL_RANK", "\"x\""),
        (&[("LOCAL_RANK", "4"), ("LOCAL_WORLD_SIZE", "4")], "LOCAL_RANK", "LOCAL_WORLD_SIZE 4"),
        (&[("LOCAL_WORLD_SIZE", "")], "LOCAL_WORLD_SIZE", "\"\""),
        (&[("MASTER_ADDR", " ")], "MASTER_ADDR", "empty"),
        (&[("MASTER_PORT", "70000")], "MASTER_PORT", "70000"),
        (&[("MASTER_PORT", "0")], "MASTER_PORT", "1 to 65535"),
        (&[(PORT_VAR, "abc")], PORT_VAR, "abc"),
        (&[("MASTER_PORT", "65535"), ("TORCHELASTIC_USE_AGENT_STORE", "True")], "MASTER_PORT", PORT_VAR),
    ];
    for (extra, var, says) in cases {
        let (got_var, why) = refused(extra, None);
        assert_eq!(got_var, *var, "{extra:?}: {why}");
        assert!(why.contains(says), "{extra:?}: {why:?} should mention {says:?}");
    }
    // A host that does not resolve is named when the Id is derived.
    let env = with(&[("MASTER_ADDR", "no-such-host.invalid")]).expect("read");
    assert!(matches!(env.id(), Err(BootstrapError::Env { var: "MASTER_ADDR", .. })));
}

#[test]
fn ids_travel_as_text_bytes_serde_and_files() {
    let id = loopback_root();
    assert_eq!(id.to_bytes().len(), ID_BYTES);
    assert_eq!(Id::from_bytes(&id.to_bytes()).expect("bytes"), id);
    assert_eq!(id.to_string().parse::<Id>().expect("text"), id);
    let json = serde_json::to_string(&id).expect("serialize");
    assert_eq!(json, format!("\"{id}\""));
    assert_eq!(serde_json::from_str::<Id>(&json).expect("deserialize"), id);
    let e = serde_json::from_str::<Id>("\"oxccl-id-v1:00\"").expect_err("short");
    assert!(e.to_string().contains("not an oxccl bootstrap Id"), "{e}");
    assert!(serde_json::from_str::<Id>("17").is_err());
    for bad in ["", "oxccl-id-v2:00", "oxccl-id-v1:", "oxccl-id-v1:zz"] {
        assert!(matches!(bad.parse::<Id>(), Err(BootstrapError::BadId { .. })), "{bad:?}");
    }

    let dir = scratch_dir();
    let path = dir.join("id");
    id.write_file(&path).expect("write");
    assert_eq!(std::fs::read_to_string(&path).expect("read"), format!("{id}\n"));
    assert_eq!(Id::read_file(&path).expect("read"), id);
    std::fs::write(&path, format!("  {id}\r\n\n")).expect("write");
    assert_eq!(Id::read_file(&path).expect("whitespace around it"), id);
    std::fs::write(&path, "hello").expect("write");
    assert!(matches!(Id::read_file(&path), Err(BootstrapError::BadId { .. })));
    match Id::read_file(dir.join("absent")) {
        Err(e @ BootstrapError::Io { .. }) => assert!(e.to_string().contains("absent"), "{e}"),
        other => panic!("expected Io, got {other:?}"),
    }
    let start = Instant::now();
    match Id::wait_for_file(dir.join("absent"), Duration::from_millis(100)) {
        Err(BootstrapError::Timeout { what, .. }) => assert!(what.contains("absent"), "{what}"),
        other => panic!("expected Timeout, got {other:?}"),
    }
    assert!(start.elapsed() < SHORT);
    let later = dir.join("later");
    let writer = {
        let later = later.clone();
        thread::spawn(move || {
            thread::sleep(Duration::from_millis(50));
            id.write_file(later)
        })
    };
    assert_eq!(Id::wait_for_file(&later, LONG).expect("appears"), id);
    writer.join().expect("thread").expect("write");
    let _ = std::fs::remove_dir_all(dir);
}
