//! `oxccl launch`: the torchrun variables and GPU each rank sees, how the group ends when a rank
//! fails or the launcher is signalled, and refused arguments. CPU only: the ranks are `sh` scripts,
//! which find their scratch directory in `$DIR`.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// Longer than any launch here should take, far shorter than the `sleep 30` ranks that must be
/// stopped: a launch that waits for them fails the test.
const PROMPT: Duration = Duration::from_secs(10);

/// A scratch directory for one test, removed at the end.
struct Scratch(PathBuf);

impl Scratch {
    fn new(test: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("oxccl-launch-{test}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).expect("create the scratch directory");
        Scratch(dir)
    }

    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// `oxccl launch ARGS`, with no `CUDA_VISIBLE_DEVICES` from the test's environment, `DIR` set to
/// `dir`, and the outputs captured.
fn launch(args: &[&str], dir: &Path) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_oxccl"));
    cmd.arg("launch").args(args).env_remove("CUDA_VISIBLE_DEVICES").env("DIR", dir);
    cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    cmd
}

/// Runs `cmd`; returns its output, stdout and stderr as text, and how long it took.
fn finish(mut cmd: Command) -> (Output, String, String, Duration) {
    let start = Instant::now();
    let out = cmd.output().expect("run oxccl launch");
    let took = start.elapsed();
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    let (o, e) = (text(&out.stdout), text(&out.stderr));
    (out, o, e, took)
}

/// The lines of `text`, sorted: ranks print in any order.
fn sorted_lines(text: &str) -> Vec<String> {
    let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
    lines.sort();
    lines
}

/// Whether process `pid` runs: it exists and is no zombie (one a launcher's rank left behind is
/// reaped by whoever inherits it, a moment after it dies).
fn alive(pid: i32) -> bool {
    // The state follows the parenthesised command name: `pid (comm) S ...`.
    fs::read_to_string(format!("/proc/{pid}/stat"))
        .is_ok_and(|stat| stat.rsplit_once(')').is_some_and(|(_, rest)| !rest.trim_start().starts_with('Z')))
}

/// Waits until every file in `names` exists under `dir` (the ranks are ready), at most [`PROMPT`].
fn wait_for_files(dir: &Scratch, names: &[String], launcher: &mut Child) {
    let until = Instant::now() + PROMPT;
    while !names.iter().all(|n| dir.path(n).exists()) {
        assert!(Instant::now() < until, "ranks not ready after {PROMPT:?}");
        assert!(launcher.try_wait().unwrap().is_none(), "the launcher ended before its ranks were ready");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn every_rank_sees_the_torchrun_variables_and_its_gpu() {
    let dir = Scratch::new("vars");
    let script = "echo $RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $ROLE_RANK $ROLE_WORLD_SIZE \
                  $GROUP_RANK $GROUP_WORLD_SIZE $MASTER_ADDR $CUDA_VISIBLE_DEVICES $OXCCL_GPU $MASTER_PORT";
    let (out, stdout, stderr, _) = finish(launch(&["-n", "4", "--gpus", "0,1", "--", "sh", "-c", script], &dir.0));
    assert!(out.status.success(), "{stderr}");
    let lines = sorted_lines(&stdout);
    let port = lines[0].rsplit(' ').next().unwrap().to_string();
    assert!(port.parse::<u16>().is_ok_and(|p| p > 0), "MASTER_PORT {port:?}");
    let want: Vec<String> =
        (0..4).map(|r| format!("{r} 4 {r} 4 {r} 4 0 1 127.0.0.1 {gpu} {gpu} {port}", gpu = r % 2)).collect();
    assert_eq!(lines, want, "{stderr}");
    assert!(stderr.is_empty(), "a clean launch prints nothing of its own: {stderr}");
}

#[test]
fn master_port_is_honoured_and_torchruns_spelling_taken() {
    let dir = Scratch::new("port");
    for n in ["--nproc-per-node", "--nproc_per_node", "-n"] {
        // No `--`: the command's own flags (`-c`) still go to it.
        let (out, stdout, stderr, _) =
            finish(launch(&[n, "2", "--master-port", "29517", "sh", "-c", "echo $RANK $MASTER_PORT"], &dir.0));
        assert!(out.status.success(), "{n}: {stderr}");
        assert_eq!(sorted_lines(&stdout), ["0 29517", "1 29517"], "{n}");
    }
}

#[test]
fn gpu_ranges_are_dealt_round_robin() {
    let dir = Scratch::new("ranges");
    let args = ["-n", "6", "--gpus", "0-2,5", "--", "sh", "-c", "echo $RANK $CUDA_VISIBLE_DEVICES"];
    let (out, stdout, stderr, _) = finish(launch(&args, &dir.0));
    assert!(out.status.success(), "{stderr}");
    assert_eq!(sorted_lines(&stdout), ["0 0", "1 1", "2 2", "3 5", "4 0", "5 1"]);
}

#[test]
fn gpus_count_within_the_launchers_cuda_visible_devices() {
    let dir = Scratch::new("visible");
    let script = ["--", "sh", "-c", "echo $RANK $CUDA_VISIBLE_DEVICES $OXCCL_GPU"];
    let run = |args: &[&str]| {
        let mut cmd = launch(&[args, &script[..]].concat(), &dir.0);
        cmd.env("CUDA_VISIBLE_DEVICES", "4,5,6");
        finish(cmd)
    };
    let (out, stdout, stderr, _) = run(&["-n", "3", "--gpus", "2,0"]);
    assert!(out.status.success(), "{stderr}");
    assert_eq!(sorted_lines(&stdout), ["0 6 6", "1 4 4", "2 6 6"]);
    let (out, stdout, stderr, _) = run(&["-n", "4"]);
    assert!(out.status.success(), "{stderr}");
    assert_eq!(sorted_lines(&stdout), ["0 4 4", "1 5 5", "2 6 6", "3 4 4"]);
    let (out, stdout, stderr, _) = run(&["-n", "2", "--gpus", "1-3"]);
    assert!(!out.status.success() && stdout.is_empty(), "{stdout}");
    assert!(stderr.contains("--gpus 1-3: GPU 3 is not visible: CUDA_VISIBLE_DEVICES=\"4,5,6\" shows 3"), "{stderr}");
}

#[test]
fn without_a_gpu_list_every_gpu_nvidia_smi_lists_is_dealt() {
    let dir = Scratch::new("smi");
    let bin = dir.path("bin");
    fs::create_dir(&bin).unwrap();
    // A stand-in nvidia-smi: two GPUs, one with a MIG instance (not a GPU of its own).
    let smi = bin.join("nvidia-smi");
    fs::write(
        &smi,
        "#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-a)'\necho 'GPU 1: NVIDIA H200 (UUID: GPU-b)'\n\
         echo '  MIG 1g.18gb     Device  0: (UUID: MIG-c)'\n",
    )
    .unwrap();
    fs::set_permissions(&smi, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let script = "echo $RANK ${CUDA_VISIBLE_DEVICES-unset} ${OXCCL_GPU-unset}";
    let mut cmd = launch(&["-n", "3", "--", "/bin/sh", "-c", script], &dir.0);
    cmd.env("PATH", &bin);
    let (out, stdout, stderr, _) = finish(cmd);
    assert!(out.status.success(), "{stderr}");
    assert_eq!(sorted_lines(&stdout), ["0 0 0", "1 1 1", "2 0 0"]);

    // No nvidia-smi and no CUDA_VISIBLE_DEVICES: nothing set, and a stale OXCCL_GPU taken away.
    fs::remove_file(&smi).unwrap();
    let mut cmd = launch(&["-n", "2", "--", "/bin/sh", "-c", script], &dir.0);
    cmd.env("PATH", &bin).env("OXCCL_GPU", "7");
    let (out, stdout, stderr, _) = finish(cmd);
    assert!(out.status.success(), "{stderr}");
    assert_eq!(sorted_lines(&stdout), ["0 unset unset", "1 unset unset"]);
}

#[test]
fn a_failing_rank_stops_the_others_at_once() {
    let dir = Scratch::new("fail");
    // Each rank leaves its pid (that of `sleep`, which it becomes); rank 2 fails once all are up.
    let script = "echo $$ > \"$DIR/pid$RANK\"
        if [ $RANK = 2 ]; then
            while [ $(ls \"$DIR\" | wc -l) -lt 4 ]; do sleep 0.02; done
            exit 7
        fi
        exec sleep 30";
    let (out, _, stderr, took) = finish(launch(&["-n", "4", "--", "sh", "-c", script], &dir.0));
    assert_eq!(out.status.code(), Some(7), "{stderr}");
    assert!(took < PROMPT, "the launcher took {took:?}: it waited for the sleeping ranks");
    assert!(stderr.contains("oxccl launch: rank 2 exited with status 7; stopping the other 3\n"), "{stderr}");
    assert!(!stderr.contains("SIGKILL"), "sleep ends on SIGTERM: {stderr}");
    for r in [0, 1, 3] {
        let pid: i32 = fs::read_to_string(dir.path(&format!("pid{r}"))).unwrap().trim().parse().unwrap();
        assert!(!alive(pid), "rank {r} (pid {pid}) outlived the launcher");
    }
}

#[test]
fn what_a_failed_rank_left_running_is_stopped_too() {
    let dir = Scratch::new("left");
    // Rank 0 fails leaving a `sleep` behind, which holds the launcher's stdout open while it lives.
    let script = "if [ $RANK = 0 ]; then sleep 30 & echo $! > \"$DIR/left\"; exit 4; fi; exec sleep 30";
    let (out, _, stderr, took) = finish(launch(&["-n", "2", "--", "sh", "-c", script], &dir.0));
    assert_eq!(out.status.code(), Some(4), "{stderr}");
    assert!(took < PROMPT, "{took:?}: the left-behind sleep kept running");
    let pid: i32 = fs::read_to_string(dir.path("left")).unwrap().trim().parse().unwrap();
    assert!(!alive(pid), "the sleep rank 0 left (pid {pid}) outlived the launcher");
}

#[test]
fn a_rank_killed_by_a_signal_gives_128_plus_its_number() {
    let dir = Scratch::new("killed");
    let script = "if [ $RANK = 1 ]; then kill -KILL $$; fi; exec sleep 30";
    let (out, _, stderr, took) = finish(launch(&["-n", "3", "--", "sh", "-c", script], &dir.0));
    assert_eq!(out.status.code(), Some(128 + 9), "{stderr}");
    assert!(took < PROMPT, "{took:?}");
    assert!(stderr.contains("oxccl launch: rank 1 was killed by SIGKILL; stopping the other 2\n"), "{stderr}");
}

#[test]
fn a_rank_ignoring_sigterm_is_killed_after_the_grace_period() {
    let dir = Scratch::new("grace");
    let script = "if [ $RANK = 0 ]; then
            while [ ! -e \"$DIR/ready\" ]; do sleep 0.02; done
            exit 3
        fi
        trap '' TERM
        touch \"$DIR/ready\"
        exec sleep 30";
    let (out, _, stderr, took) = finish(launch(&["-n", "2", "--grace-secs", "0.5", "--", "sh", "-c", script], &dir.0));
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    assert!(took >= Duration::from_millis(500), "SIGKILL before the grace period was over: {took:?}");
    assert!(took < PROMPT, "{took:?}");
    assert!(stderr.contains("rank 0 exited with status 3; stopping the other 1\n"), "{stderr}");
    assert!(stderr.contains("rank 1 still running 0.5 s after SIGTERM; sending SIGKILL\n"), "{stderr}");
}

#[test]
fn signals_to_the_launcher_reach_every_rank() {
    for (sig, name) in [(libc::SIGTERM, "SIGTERM"), (libc::SIGINT, "SIGINT"), (libc::SIGHUP, "SIGHUP")] {
        let dir = Scratch::new(&format!("signal{sig}"));
        // The trap writes which signal came; `sleep &` + `wait` lets it run at once. It appends: a
        // signal that reaches the forked `sleep` before it drops the shell's traps runs the trap
        // there too, and a truncating write of that copy could empty the file after the rank ended.
        let script = "trap 'echo INT >> \"$DIR/got$RANK\"; kill $!; exit 0' INT
            trap 'echo TERM >> \"$DIR/got$RANK\"; kill $!; exit 0' TERM
            trap 'echo HUP >> \"$DIR/got$RANK\"; kill $!; exit 0' HUP
            touch \"$DIR/ready$RANK\"
            sleep 30 &
            wait";
        let start = Instant::now();
        let mut launcher = launch(&["-n", "3", "--", "sh", "-c", script], &dir.0).spawn().unwrap();
        let ready: Vec<String> = (0..3).map(|r| format!("ready{r}")).collect();
        wait_for_files(&dir, &ready, &mut launcher);
        // SAFETY: signals the launcher this test started and has not yet reaped.
        assert_eq!(unsafe { libc::kill(launcher.id() as i32, sig) }, 0);
        let out = launcher.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(128 + sig), "{name}: {stderr}");
        assert!(start.elapsed() < PROMPT, "{name}: {:?}", start.elapsed());
        assert!(stderr.contains(&format!("oxccl launch: got {name}; passing it to the 3 running ranks\n")), "{stderr}");
        for r in 0..3 {
            let got = fs::read_to_string(dir.path(&format!("got{r}"))).unwrap_or_default();
            let lines: Vec<&str> = got.lines().collect();
            assert!(
                !lines.is_empty() && lines.iter().all(|l| *l == &name[3..]),
                "{name}: rank {r} wrote {got:?}; {stderr}"
            );
        }
    }
}

#[test]
fn ranks_take_a_signal_the_launcher_was_started_ignoring() {
    // As under `nohup`: the launcher starts with SIGHUP ignored, which exec keeps; it still passes
    // SIGHUP on, and its ranks must be able to take it.
    let dir = Scratch::new("ignored-hup");
    let script = "trap 'echo HUP >> \"$DIR/got$RANK\"; kill $!; exit 0' HUP
        touch \"$DIR/ready$RANK\"
        sleep 30 &
        wait";
    let mut cmd = launch(&["-n", "2", "--", "sh", "-c", script], &dir.0);
    // SAFETY: only sigaction (async-signal-safe) between fork and exec.
    unsafe {
        use std::os::unix::process::CommandExt;
        cmd.pre_exec(|| {
            let mut ignore: libc::sigaction = std::mem::zeroed();
            ignore.sa_sigaction = libc::SIG_IGN;
            if libc::sigaction(libc::SIGHUP, &ignore, std::ptr::null_mut()) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut launcher = cmd.spawn().unwrap();
    wait_for_files(&dir, &["ready0".to_string(), "ready1".to_string()], &mut launcher);
    // SAFETY: signals the launcher this test started and has not yet reaped.
    assert_eq!(unsafe { libc::kill(launcher.id() as i32, libc::SIGHUP) }, 0);
    let out = launcher.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(128 + libc::SIGHUP), "{stderr}");
    for r in 0..2 {
        let got = fs::read_to_string(dir.path(&format!("got{r}"))).unwrap_or_default();
        assert!(got.lines().next() == Some("HUP"), "rank {r} wrote {got:?}; {stderr}");
    }
}

#[test]
fn a_command_that_cannot_start_is_named() {
    let dir = Scratch::new("missing");
    for cmd in ["/nonexistent/oxccl-no-such-command", "oxccl-no-such-command"] {
        let (out, _, stderr, took) = finish(launch(&["-n", "3", "--", cmd, "x"], &dir.0));
        assert!(!out.status.success(), "{cmd}");
        assert!(took < PROMPT, "{took:?}");
        assert!(
            stderr.contains(&format!("cannot start \"{cmd}\" (rank 0 of 3): No such file or directory")),
            "{stderr}"
        );
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
}

#[test]
fn bad_counts_gpu_lists_and_grace_are_named() {
    let dir = Scratch::new("bad");
    let cases: &[(&[&str], &str)] = &[
        (&["-n", "0"], "invalid value '0' for '--nproc-per-node <N>': 0 is not in 1..=1024"),
        (&["-n", "1025"], "invalid value '1025' for '--nproc-per-node <N>'"),
        (&["-n", "-1"], "invalid value '-1' for '--nproc-per-node <N>'"),
        (&["-n", "x"], "invalid value 'x' for '--nproc-per-node <N>'"),
        (&["-n", "2", "--gpus", "0,,1"], "invalid value '0,,1' for '--gpus <LIST>': an empty entry"),
        (&["-n", "2", "--gpus", "0,a"], "invalid value '0,a' for '--gpus <LIST>': \"a\" is not a device number"),
        (&["-n", "2", "--gpus", "3-1"], "for '--gpus <LIST>': the range 3-1 runs backwards"),
        (&["-n", "2", "--gpus", "0-99999"], "for '--gpus <LIST>': more than 1024 GPUs"),
        (&["-n", "2", "--grace-secs", "-1"], "invalid value '-1' for '--grace-secs <SECS>'"),
        (&["-n", "2", "--master-port", "0"], "invalid value '0' for '--master-port <PORT>'"),
    ];
    for (args, want) in cases {
        let mut all = args.to_vec();
        all.extend(["--", "sh", "-c", "touch \"$DIR/started\""]);
        let (out, _, stderr, _) = finish(launch(&all, &dir.0));
        assert!(!out.status.success() && stderr.contains(want), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
    let (out, _, stderr, _) = finish(launch(&["-n", "2", "--"], &dir.0));
    assert!(!out.status.success() && stderr.contains("<CMD>..."), "no command: {stderr}");
    assert!(!dir.path("started").exists(), "a refused launch started a rank");
}

#[test]
fn tag_prefixes_every_line_with_its_rank() {
    let dir = Scratch::new("tag");
    let script = "echo out $RANK; echo err $RANK >&2; printf 'no newline'";
    let (out, stdout, stderr, _) = finish(launch(&["-n", "2", "--tag", "--", "sh", "-c", script], &dir.0));
    assert!(out.status.success(), "{stderr}");
    assert_eq!(sorted_lines(&stdout), ["[0] no newline", "[0] out 0", "[1] no newline", "[1] out 1"]);
    assert_eq!(sorted_lines(&stderr), ["[0] err 0", "[1] err 1"]);
}
