//! Transfer programs on the GPU (`Communicator::run_program`): ring AllReduce (4 and 8 ranks),
//! hierarchical-mesh AllReduce and AllGather (2×4, 2×8 as 8 and 16 virtual ranks), the bundled
//! MSCCL files and pipelined chain Broadcast and Reduce programs (the generators', rooted at 0, and
//! from text, rooted mid-chain), each level of a program one launch of the collectives' engine, against the CPU
//! executor of the same lowering (`oxccl_host::compile::direct`, which `host/tests/compile_direct.rs`
//! checks against the collectives' references); then misuse, as typed errors.
//!
//! Skips loudly without a Hopper GPU. `OXCCL_MSCCL_DIR` names the MSCCL files' folder when the
//! binary runs away from its checkout.

mod common;

use cudarc::driver::CudaStream;
use oxccl::Error;
use oxccl_host::compile::direct::{DirectOptions, lower_direct};
use oxccl_host::lowered::HostBuffers;
use oxccl_host::program::Program;
use oxccl_host::program::generators::Algorithm;
use oxccl_host::program::msccl::import;
use oxccl_kernels::abi::{DType, slot};
use std::sync::Arc;

/// The first byte where two memories differ, named.
fn first_difference(what: &str, a: &[u8], b: &[u8]) -> Option<String> {
    if a == b {
        return None;
    }
    if a.len() != b.len() {
        return Some(format!("{what}: {} bytes on the GPU, {} on the CPU", a.len(), b.len()));
    }
    let i = a.iter().zip(b).position(|(x, y)| x != y).unwrap_or(0);
    let n = a.iter().zip(b).filter(|(x, y)| x != y).count();
    Some(format!("{what}: {n} bytes differ, first at byte {i} (GPU {:#04x}, CPU {:#04x})", a[i], b[i]))
}

/// The algorithms: (name, program).
fn programs() -> Vec<(String, Program)> {
    let mut v = Vec::new();
    for n in [4, 8] {
        v.push((format!("ring-allreduce 1x{n}"), Algorithm::RingAllReduce.generate(1, n).unwrap()));
    }
    for algo in [Algorithm::HmAllReduce, Algorithm::HmAllGather] {
        for (nodes, gpus) in [(2, 4), (2, 8)] {
            let mut p = algo.generate(nodes, gpus).unwrap();
            p.ranks_per_node = Some(gpus);
            v.push((format!("{algo} {nodes}x{gpus}"), p));
        }
    }
    for algo in [Algorithm::ChainBroadcast, Algorithm::ChainReduce] {
        v.push((format!("{algo} 1x8"), algo.generate(1, 8).unwrap()));
    }
    for (ranks, root, in_place) in [(4, 2, false), (8, 5, true)] {
        for (what, p) in
            [("broadcast", chain(true, ranks, root, in_place)), ("reduce", chain(false, ranks, root, in_place))]
        {
            v.push((format!("chain {what} {ranks} ranks from root {root}"), p));
        }
    }
    let dir = common::msccl_dir();
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "xml"))
        .collect();
    files.sort();
    assert!(files.len() >= 5, "MSCCL files missing in {}", dir.display());
    for f in files {
        let name = f.file_name().unwrap().to_string_lossy().into_owned();
        let p = import(&std::fs::read_to_string(&f).unwrap()).unwrap_or_else(|e| panic!("{name}: {e}")).program;
        v.push((name, p));
    }
    v
}

/// A pipelined chain over `ranks` ranks in the text format, four chunks: a Broadcast from `root`
/// (root, root+1, ... forward each chunk) or a Reduce into `root` (root+1, root+2, ... each add
/// their partial into the next; the root copies the sum out).
fn chain(broadcast: bool, ranks: u32, root: u32, in_place: bool) -> Program {
    use std::fmt::Write;
    let (chunks, kind) = (4, if broadcast { "broadcast" } else { "reduce" });
    let placement = if in_place { "inplace" } else { "outofplace" };
    let mut t = format!(
        "program chain_{kind}\ncollective {kind} ranks={ranks} chunks={chunks} root={root} {placement}\nscratch 0\n"
    );
    let at = |k: u32| (root + k) % ranks;
    let (mut ops, mut n) = (Vec::new(), 0);
    for c in 0..chunks {
        let local = if in_place { None } else { Some(format!("copy r{root} in[{c}] -> out[{c}]")) };
        if broadcast {
            ops.extend(local.map(|l| (l, 0)));
            for k in 0..ranks - 1 {
                ops.push((format!("xfer r{} out[{c}] -> r{} out[{c}] recv", at(k), at(k + 1)), k + 1));
            }
        } else {
            // From the rank after the root around to the root.
            for k in 1..ranks {
                ops.push((format!("xfer r{} in[{c}] -> r{} in[{c}] rrc", at(k), at((k + 1) % ranks)), k));
            }
            ops.extend(local.map(|l| (l, ranks)));
        }
        for (op, step) in ops.drain(..) {
            let _ = writeln!(t, "op{n} = {op} ch=0 chunk={c} step={step} stage=0");
            n += 1;
        }
    }
    oxccl_host::program::text::parse(&t).and_then(|p| p.check().map(|()| p)).unwrap_or_else(|e| panic!("{t}\n{e}"))
}

/// Every program of the matrix on the collective engine (`Communicator::run_program`) on virtual
/// ranks, f32 and i32 sums at three chunk sizes (one 16-byte grain, an odd multiple of 16, 64 KiB),
/// twice each on the same buffers: every byte of every rank's receive buffer must equal the CPU
/// executor's run of the program's lowering on the same inputs. Then misuse: typed errors.
#[test]
fn programs_run_on_the_collective_engine() {
    use cudarc::driver::CudaSlice;
    let Some(stream) = common::gpu("programs_run_on_the_collective_engine") else { return };
    let mut rng = common::rng(11);
    let mut ran = 0;
    for (name, program) in programs() {
        let p = program.ranks() as usize;
        let comm = oxccl::Communicator::virtual_ranks(&stream, p, oxccl::Config::default()).unwrap();
        let (send_slot, recv_slot) =
            if program.layout.in_place { (slot::OUTPUT, slot::OUTPUT) } else { (slot::INPUT, slot::OUTPUT) };
        for dtype in [DType::F32, DType::I32] {
            for chunk_bytes in [16u64, 4112, 65536] {
                let what = format!("{name} {} {chunk_bytes} B chunks", dtype.nccl_name());
                let staged = lower_direct(&program, &DirectOptions::new(chunk_bytes, dtype, 1))
                    .unwrap_or_else(|e| panic!("{what}: {e}"));
                let mut cpu = staged.host_buffers();
                for k in 0..2 {
                    for bufs in cpu.iter_mut() {
                        for s in [send_slot, recv_slot] {
                            let n = bufs[s as usize].len();
                            bufs[s as usize] = common::small_integers(dtype, n, &mut rng);
                        }
                    }
                    let slots = (send_slot as usize, recv_slot as usize);
                    let got: Vec<Vec<u8>> = match dtype {
                        DType::F32 => run_program_on::<f32>(&comm, &stream, &program, &cpu, slots),
                        _ => run_program_on::<i32>(&comm, &stream, &program, &cpu, slots),
                    }
                    .unwrap_or_else(|e| panic!("{what} run {k}: {e}"));
                    staged.execute(&mut cpu).unwrap_or_else(|e| panic!("{what}: the CPU executor: {e}"));
                    for (r, g) in got.iter().enumerate() {
                        if let Some(d) =
                            first_difference(&format!("{what} run {k} rank {r}"), g, &cpu[r][recv_slot as usize])
                        {
                            panic!("{d}");
                        }
                    }
                    ran += 1;
                }
            }
        }
    }
    // Misuse: the wrong layout, a chunk off 16 bytes, a short buffer, the wrong rank count.
    let ring = Algorithm::RingAllReduce.generate(1, 4).unwrap();
    let comm = oxccl::Communicator::virtual_ranks(&stream, 4, oxccl::Config::default()).unwrap();
    let s = &stream;
    let send: Vec<CudaSlice<f32>> = (0..4).map(|_| s.alloc_zeros::<f32>(64).unwrap()).collect();
    let mut recv: Vec<CudaSlice<f32>> = (0..4).map(|_| s.alloc_zeros::<f32>(64).unwrap()).collect();
    let in_place = ring.layout.in_place;
    let e = if in_place {
        comm.run_program(&ring, &send, &mut recv, oxccl::ReduceOp::Sum).unwrap_err()
    } else {
        comm.run_program_in_place(&ring, &mut recv, oxccl::ReduceOp::Sum).unwrap_err()
    };
    assert!(matches!(e, Error::Config { field: "program", .. }), "{e}");
    let mut odd: Vec<CudaSlice<f32>> = (0..4).map(|_| s.alloc_zeros::<f32>(4 * 3).unwrap()).collect();
    let e = if in_place {
        comm.run_program_in_place(&ring, &mut odd, oxccl::ReduceOp::Sum).unwrap_err()
    } else {
        comm.run_program(&ring, &odd.clone(), &mut odd, oxccl::ReduceOp::Sum).unwrap_err()
    };
    assert!(matches!(e, Error::Config { field: "program", .. }), "{e}");
    let mut short: Vec<CudaSlice<f32>> =
        (0..4).map(|r| s.alloc_zeros::<f32>(if r == 2 { 60 } else { 64 }).unwrap()).collect();
    let e = if in_place {
        comm.run_program_in_place(&ring, &mut short, oxccl::ReduceOp::Sum).unwrap_err()
    } else {
        comm.run_program(&ring, &send, &mut short, oxccl::ReduceOp::Sum).unwrap_err()
    };
    assert!(matches!(e, Error::Length { rank: 2, .. }), "{e}");
    let eight = Algorithm::RingAllReduce.generate(1, 8).unwrap();
    let e = if in_place {
        comm.run_program_in_place(&eight, &mut recv, oxccl::ReduceOp::Sum).unwrap_err()
    } else {
        comm.run_program(&eight, &send, &mut recv, oxccl::ReduceOp::Sum).unwrap_err()
    };
    assert!(matches!(e, Error::Config { field: "program", .. }), "{e}");
    eprintln!("{ran} program runs on the collective engine matched the CPU executor");
}

/// One run of `program` on `comm`'s virtual ranks over cudarc buffers holding `cpu`'s slots
/// `(send, recv)` of every rank (the same slot in place); every rank's output bytes.
fn run_program_on<T: oxccl::Element + bytemuck::Pod>(
    comm: &oxccl::Communicator,
    stream: &Arc<CudaStream>,
    program: &Program,
    cpu: &HostBuffers,
    (send_slot, recv_slot): (usize, usize),
) -> oxccl::Result<Vec<Vec<u8>>> {
    let up = |b: &[u8]| stream.clone_htod(&bytemuck::pod_collect_to_vec::<u8, T>(b)).unwrap();
    let p = program.ranks() as usize;
    let send: Vec<_> = (0..p).map(|r| up(&cpu[r][send_slot])).collect();
    let mut recv: Vec<_> = (0..p).map(|r| up(&cpu[r][recv_slot])).collect();
    if program.layout.in_place {
        comm.run_program_in_place(program, &mut recv, oxccl::ReduceOp::Sum)?;
    } else {
        comm.run_program(program, &send, &mut recv, oxccl::ReduceOp::Sum)?;
    }
    comm.synchronize()?;
    Ok(recv.iter().map(|b| bytemuck::cast_slice(&stream.clone_dtoh(b).unwrap()).to_vec()).collect())
}

/// The matrix itself, on the CPU: every program holds its collective's postcondition (the chain
/// programs are built here from text, so a mistake in them shows without a GPU).
#[test]
fn the_programs_hold_their_postconditions() {
    let all = programs();
    for (name, p) in &all {
        p.check().unwrap_or_else(|e| panic!("{name}: {e}"));
    }
    let rooted = all.iter().filter(|(_, p)| p.layout.collective.root().is_some()).count();
    assert_eq!(rooted, 6);
}
