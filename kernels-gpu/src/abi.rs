//! The host/device ABI: `#[repr(C)]` descriptors defined once and compiled for both sides.
//!
//! The host lowers a plan into an array of [`TbProgram`]s (one per CTA of the launch) and an array of
//! [`Task`]s, uploads both once per cached plan, and launches the mover's kernel ([`kernel_name`]) with a
//! [`LaunchArgs`]
//! by value. Buffers are named symbolically in tasks (rank, [`slot`], byte offset) and resolved through
//! the per-call buffer table in [`LaunchArgs::buffers`], so a cached plan serves any user buffers.
//!
//! Every struct's size and alignment is asserted at compile time; the asserts run on both targets.

use bytemuck::{Pod, Zeroable};

/// Most ranks one launch can address (a bit mask of ranks fits a `u32`).
pub const MAX_RANKS: usize = 16;
/// Buffer slots per rank in the buffer table; see [`slot`].
pub const BUFFER_SLOTS: usize = 4;
/// Most CTAs one rank may use in a launch (sizes the barrier slots of the workspace).
pub const MAX_CTAS_PER_RANK: usize = 256;
/// Barrier slots of each pair of ranks for point-to-point launches, above the collectives'
/// [`MAX_CTAS_PER_RANK`]: a CTA whose [`TbProgram::cta`] is `MAX_CTAS_PER_RANK + k` meets one peer
/// only, and counts its calls with that peer alone ([`private_slot`]), so that transfers between
/// two ranks match in order whatever each rank exchanges with others in between.
pub const PAIR_CTAS: usize = 64;
/// Barrier slots per sender in a workspace's `arrive` and `done` tables: the collectives', then
/// the pair slots, rounded up to a power of two (the flags' offsets are then shifts).
pub const FLAG_SLOTS: usize = (MAX_CTAS_PER_RANK + PAIR_CTAS).next_power_of_two();
/// Private slots of a rank (call counts and announcements): the collectives' CTAs, then
/// [`PAIR_CTAS`] for each possible peer.
pub const PRIVATE_SLOTS: usize = MAX_CTAS_PER_RANK + MAX_RANKS * PAIR_CTAS;

/// The private slot (`Workspace::seq`, `Workspace::announce`) of barrier slot `cta` of a rank
/// towards `other`: `cta` itself for a collective's CTA, met by every peer alike; for pair slot
/// `k` (`cta = MAX_CTAS_PER_RANK + k`) one of its own per peer, so that the call count and the
/// announced buffers of the pair are the pair's alone. A rank reads its peer `q`'s announcement at
/// `private_slot(cta, its own rank)` in `q`'s workspace.
#[inline(always)]
pub const fn private_slot(cta: usize, other: usize) -> usize {
    if cta < MAX_CTAS_PER_RANK { cta } else { MAX_CTAS_PER_RANK + other * PAIR_CTAS + (cta - MAX_CTAS_PER_RANK) }
}

/// Whether a program of `rank` with barrier slot `cta` meeting `barrier_ranks` fits the
/// workspace: a collective slot, or a pair slot meeting exactly one other rank (both below
/// [`MAX_RANKS`]).
#[inline(always)]
pub const fn barrier_slot_fits(rank: u32, cta: u32, barrier_ranks: u32) -> bool {
    let cta = cta as usize;
    if cta < MAX_CTAS_PER_RANK {
        return true;
    }
    let others = barrier_ranks & !(1u32 << (rank % 32));
    (rank as usize) < MAX_RANKS
        && cta < MAX_CTAS_PER_RANK + PAIR_CTAS
        && others.count_ones() == 1
        && (others.trailing_zeros() as usize) < MAX_RANKS
}
/// Most issuing warps of a TMA CTA ([`LaunchArgs::issuers`]): one per SM sub-partition scheduler.
pub const MAX_ISSUERS: u32 = 4;

/// Most pipeline stages of the TMA mover (one mbarrier each).
pub const MAX_STAGES: usize = 16;

/// Items the TMA mover's refill of a stage lags behind its consumer in a ring of `stages`
/// (1..=[`MAX_STAGES`]): half the ring, at least one.
#[inline(always)]
pub const fn refill_lag(stages: u32) -> u32 {
    let lag = stages / 2;
    if lag == 0 { 1 } else { lag }
}

/// Buffer slots of the per-call buffer table.
pub mod slot {
    /// The collective's send buffer (input).
    pub const INPUT: u8 = 0;
    /// The collective's receive buffer (output).
    pub const OUTPUT: u8 = 1;
    /// A scratch buffer owned by the communicator.
    pub const SCRATCH: u8 = 2;
    /// A second scratch buffer.
    pub const SCRATCH2: u8 = 3;
}

macro_rules! abi_enum {
    ($(#[$doc:meta])* $name:ident : $repr:ty { $($(#[$vdoc:meta])* $variant:ident = $value:expr),+ $(,)? }) => {
        $(#[$doc])*
        #[repr($repr)]
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum $name { $($(#[$vdoc])* $variant = $value),+ }

        impl $name {
            /// Every variant, in declaration order.
            pub const ALL: &'static [$name] = &[$($name::$variant),+];

            /// Decodes the ABI value; `None` for a value no variant has.
            #[inline(always)]
            pub const fn from_raw(v: $repr) -> Option<Self> {
                match v { $(x if x == $value => Some($name::$variant),)+ _ => None }
            }

            /// The ABI value.
            #[inline(always)]
            pub const fn raw(self) -> $repr {
                self as $repr
            }
        }
    };
}

abi_enum!(
    /// Element types the engine reduces.
    DType: u8 {
        /// IEEE binary32.
        F32 = 0,
        /// IEEE binary16.
        F16 = 1,
        /// bfloat16.
        Bf16 = 2,
        /// Two's-complement 32-bit.
        I32 = 3,
        /// Unsigned 32-bit.
        U32 = 4,
        /// Unsigned 8-bit (sums wrap); also how copies move any element type of another size
        /// byte for byte.
        U8 = 5,
        /// IEEE binary64.
        F64 = 6,
        /// Two's-complement 64-bit.
        I64 = 7,
        /// Unsigned 64-bit.
        U64 = 8,
        /// Two's-complement 8-bit.
        I8 = 9,
        /// FP8 E4M3 (OCP "FN": no infinities, largest finite 448).
        F8e4m3 = 10,
        /// FP8 E5M2 (largest finite 57344).
        F8e5m2 = 11,
    }
);

impl DType {
    /// Size of one element in bytes.
    #[inline(always)]
    pub const fn size(self) -> usize {
        match self {
            DType::F64 | DType::I64 | DType::U64 => 8,
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::F16 | DType::Bf16 => 2,
            DType::U8 | DType::I8 | DType::F8e4m3 | DType::F8e5m2 => 1,
        }
    }

    /// Whether the type is a floating-point one.
    pub const fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::F16 | DType::Bf16 | DType::F8e4m3 | DType::F8e5m2)
    }

    /// Lower-case name as nccl-tests prints it (`float`, `half`, `bfloat16`, `int32`, `uint32`,
    /// `uint8`, `double`, `int64`, `uint64`, `int8`, `fp8_e4m3`, `fp8_e5m2`).
    pub const fn nccl_name(self) -> &'static str {
        match self {
            DType::F32 => "float",
            DType::F16 => "half",
            DType::Bf16 => "bfloat16",
            DType::I32 => "int32",
            DType::U32 => "uint32",
            DType::U8 => "uint8",
            DType::F64 => "double",
            DType::I64 => "int64",
            DType::U64 => "uint64",
            DType::I8 => "int8",
            DType::F8e4m3 => "fp8_e4m3",
            DType::F8e5m2 => "fp8_e5m2",
        }
    }
}

abi_enum!(
    /// Reduction operators.
    RedOp: u8 {
        /// Sum.
        Sum = 0,
        /// Minimum (for floats: if one operand is NaN, the other).
        Min = 1,
        /// Maximum (for floats: if one operand is NaN, the other).
        Max = 2,
        /// Product (wrapping for the integer types).
        Prod = 3,
        /// Average: the sum, then each complete result divided by the number of contributions
        /// ([`Task::divisor`]): floats multiplied by the f32 nearest `1/n` (f16 and bf16 through f32,
        /// one rounding back), the wrapped integer sum divided truncating toward zero.
        Avg = 4,
    }
);

impl RedOp {
    /// Name as nccl-tests prints it.
    pub const fn nccl_name(self) -> &'static str {
        match self {
            RedOp::Sum => "sum",
            RedOp::Min => "min",
            RedOp::Max => "max",
            RedOp::Prod => "prod",
            RedOp::Avg => "avg",
        }
    }
}

/// Whether the engine reduces `dtype` with `op` by `cp.reduce.async.bulk` (PTX ISA 8.0: add for f32,
/// f16, bf16, u32, s32; min/max for u32, s32, f16, bf16 — not for f32; no multiply; nothing on
/// bytes or FP8). The 8-byte types, which the instruction also takes for add, min and max, reduce
/// in registers until their bulk forms are probed on the device. Where it cannot, the engine
/// reduces in registers.
#[inline(always)]
pub const fn tma_can_reduce(dtype: DType, op: RedOp) -> bool {
    if dtype.size() != 4 && dtype.size() != 2 {
        return false;
    }
    match op {
        RedOp::Sum => true,
        RedOp::Min | RedOp::Max => !matches!(dtype, DType::F32),
        // No bulk multiply; an average's division needs the complete sum in registers.
        RedOp::Prod | RedOp::Avg => false,
    }
}

abi_enum!(
    /// What a [`Task`] does.
    TaskKind: u8 {
        /// For every rank `d` in `dst_ranks`: `dst_d[dst_offset..][..bytes] = ⊕ src_s[src_offset..][..bytes]`
        /// over the ranks `s` in `src_ranks`, combined in ascending rank order (one source: a copy; one
        /// destination per source set: a gather-reduce; several destinations: a broadcast of the result).
        Move = 1,
        /// The single rank `d` in `dst_ranks` accumulates every source: `dst_d ⊕= src_s` for each `s` in
        /// `src_ranks`. With [`ReduceMode::Tma`] and an operation the hardware supports, each source is
        /// reduced into `dst_d` by `cp.reduce.async.bulk` (element-wise atomic; the order between sources
        /// is not fixed); otherwise `dst_d` and the sources are combined in registers, `dst_d` first, then
        /// sources in ascending rank order.
        ReduceInto = 2,
    }
);

abi_enum!(
    /// The data mover of a launch.
    Mover: u8 {
        /// One elected thread issues bulk copies through a ring of shared-memory stages.
        Tma = 0,
        /// Every thread moves 16-byte vectors with several loads in flight.
        Simt = 1,
        /// Every thread moves one vector (or element) at a time, its loads from all sources in
        /// flight together: for moves bound by memory latency, not bandwidth (small ones).
        Latency = 2,
    }
);

/// Threads per CTA the latency mover's kernels are compiled for (`.maxntid`) and launched with.
pub const LATENCY_THREADS: u32 = 256;

impl Mover {
    /// The most threads per CTA the mover's kernels are compiled for (the SIMT and latency
    /// kernels' `.maxntid`, which `build.rs` writes; the TMA kernels take the hardware's 1024).
    pub const fn max_threads(self) -> u32 {
        match self {
            Mover::Tma => 1024,
            Mover::Simt => 512,
            Mover::Latency => LATENCY_THREADS,
        }
    }

    /// The mover's name, as in its kernels' names (`oxccl_run_{name}_…`).
    pub const fn name(self) -> &'static str {
        match self {
            Mover::Tma => "tma",
            Mover::Simt => "simt",
            Mover::Latency => "latency",
        }
    }
}

/// Invokes `$m!` with every engine kernel: (TMA kernel, SIMT kernel, latency kernel: dtype,
/// operator, the engine's `Combine` type). The one list both sides read: the device defines these entry points from it, the
/// host looks kernel names up in [`KERNELS`].
macro_rules! engine_kernels {
    ($m:ident) => {
        $m! {
            oxccl_run_tma_f32_sum, oxccl_run_simt_f32_sum, oxccl_run_latency_f32_sum: F32, Sum, SumF32;
            oxccl_run_tma_f32_min, oxccl_run_simt_f32_min, oxccl_run_latency_f32_min: F32, Min, MinF32;
            oxccl_run_tma_f32_max, oxccl_run_simt_f32_max, oxccl_run_latency_f32_max: F32, Max, MaxF32;
            oxccl_run_tma_f16_sum, oxccl_run_simt_f16_sum, oxccl_run_latency_f16_sum: F16, Sum, SumF16;
            oxccl_run_tma_f16_min, oxccl_run_simt_f16_min, oxccl_run_latency_f16_min: F16, Min, MinF16;
            oxccl_run_tma_f16_max, oxccl_run_simt_f16_max, oxccl_run_latency_f16_max: F16, Max, MaxF16;
            oxccl_run_tma_bf16_sum, oxccl_run_simt_bf16_sum, oxccl_run_latency_bf16_sum: Bf16, Sum, SumBf16;
            oxccl_run_tma_bf16_min, oxccl_run_simt_bf16_min, oxccl_run_latency_bf16_min: Bf16, Min, MinBf16;
            oxccl_run_tma_bf16_max, oxccl_run_simt_bf16_max, oxccl_run_latency_bf16_max: Bf16, Max, MaxBf16;
            oxccl_run_tma_i32_sum, oxccl_run_simt_i32_sum, oxccl_run_latency_i32_sum: I32, Sum, SumI32;
            oxccl_run_tma_i32_min, oxccl_run_simt_i32_min, oxccl_run_latency_i32_min: I32, Min, MinI32;
            oxccl_run_tma_i32_max, oxccl_run_simt_i32_max, oxccl_run_latency_i32_max: I32, Max, MaxI32;
            oxccl_run_tma_u32_sum, oxccl_run_simt_u32_sum, oxccl_run_latency_u32_sum: U32, Sum, SumI32;
            oxccl_run_tma_u32_min, oxccl_run_simt_u32_min, oxccl_run_latency_u32_min: U32, Min, MinU32;
            oxccl_run_tma_u32_max, oxccl_run_simt_u32_max, oxccl_run_latency_u32_max: U32, Max, MaxU32;
            oxccl_run_tma_f32_prod, oxccl_run_simt_f32_prod, oxccl_run_latency_f32_prod: F32, Prod, ProdF32;
            oxccl_run_tma_f16_prod, oxccl_run_simt_f16_prod, oxccl_run_latency_f16_prod: F16, Prod, ProdF16;
            oxccl_run_tma_bf16_prod, oxccl_run_simt_bf16_prod, oxccl_run_latency_bf16_prod: Bf16, Prod, ProdBf16;
            oxccl_run_tma_i32_prod, oxccl_run_simt_i32_prod, oxccl_run_latency_i32_prod: I32, Prod, ProdI32;
            oxccl_run_tma_u32_prod, oxccl_run_simt_u32_prod, oxccl_run_latency_u32_prod: U32, Prod, ProdI32;
            oxccl_run_tma_f32_avg, oxccl_run_simt_f32_avg, oxccl_run_latency_f32_avg: F32, Avg, AvgF32;
            oxccl_run_tma_f16_avg, oxccl_run_simt_f16_avg, oxccl_run_latency_f16_avg: F16, Avg, AvgF16;
            oxccl_run_tma_bf16_avg, oxccl_run_simt_bf16_avg, oxccl_run_latency_bf16_avg: Bf16, Avg, AvgBf16;
            oxccl_run_tma_i32_avg, oxccl_run_simt_i32_avg, oxccl_run_latency_i32_avg: I32, Avg, AvgI32;
            oxccl_run_tma_u32_avg, oxccl_run_simt_u32_avg, oxccl_run_latency_u32_avg: U32, Avg, AvgU32;
            oxccl_run_tma_u8_sum, oxccl_run_simt_u8_sum, oxccl_run_latency_u8_sum: U8, Sum, SumU8;
            oxccl_run_tma_u8_min, oxccl_run_simt_u8_min, oxccl_run_latency_u8_min: U8, Min, MinU8;
            oxccl_run_tma_u8_max, oxccl_run_simt_u8_max, oxccl_run_latency_u8_max: U8, Max, MaxU8;
            oxccl_run_tma_u8_prod, oxccl_run_simt_u8_prod, oxccl_run_latency_u8_prod: U8, Prod, ProdU8;
            oxccl_run_tma_u8_avg, oxccl_run_simt_u8_avg, oxccl_run_latency_u8_avg: U8, Avg, AvgU8;
            oxccl_run_tma_i8_sum, oxccl_run_simt_i8_sum, oxccl_run_latency_i8_sum: I8, Sum, SumU8;
            oxccl_run_tma_i8_min, oxccl_run_simt_i8_min, oxccl_run_latency_i8_min: I8, Min, MinI8;
            oxccl_run_tma_i8_max, oxccl_run_simt_i8_max, oxccl_run_latency_i8_max: I8, Max, MaxI8;
            oxccl_run_tma_i8_prod, oxccl_run_simt_i8_prod, oxccl_run_latency_i8_prod: I8, Prod, ProdU8;
            oxccl_run_tma_i8_avg, oxccl_run_simt_i8_avg, oxccl_run_latency_i8_avg: I8, Avg, AvgI8;
            oxccl_run_tma_f64_sum, oxccl_run_simt_f64_sum, oxccl_run_latency_f64_sum: F64, Sum, SumF64;
            oxccl_run_tma_f64_min, oxccl_run_simt_f64_min, oxccl_run_latency_f64_min: F64, Min, MinF64;
            oxccl_run_tma_f64_max, oxccl_run_simt_f64_max, oxccl_run_latency_f64_max: F64, Max, MaxF64;
            oxccl_run_tma_f64_prod, oxccl_run_simt_f64_prod, oxccl_run_latency_f64_prod: F64, Prod, ProdF64;
            oxccl_run_tma_f64_avg, oxccl_run_simt_f64_avg, oxccl_run_latency_f64_avg: F64, Avg, AvgF64;
            oxccl_run_tma_i64_sum, oxccl_run_simt_i64_sum, oxccl_run_latency_i64_sum: I64, Sum, SumI64;
            oxccl_run_tma_i64_min, oxccl_run_simt_i64_min, oxccl_run_latency_i64_min: I64, Min, MinI64;
            oxccl_run_tma_i64_max, oxccl_run_simt_i64_max, oxccl_run_latency_i64_max: I64, Max, MaxI64;
            oxccl_run_tma_i64_prod, oxccl_run_simt_i64_prod, oxccl_run_latency_i64_prod: I64, Prod, ProdI64;
            oxccl_run_tma_i64_avg, oxccl_run_simt_i64_avg, oxccl_run_latency_i64_avg: I64, Avg, AvgI64;
            oxccl_run_tma_u64_sum, oxccl_run_simt_u64_sum, oxccl_run_latency_u64_sum: U64, Sum, SumI64;
            oxccl_run_tma_u64_min, oxccl_run_simt_u64_min, oxccl_run_latency_u64_min: U64, Min, MinU64;
            oxccl_run_tma_u64_max, oxccl_run_simt_u64_max, oxccl_run_latency_u64_max: U64, Max, MaxU64;
            oxccl_run_tma_u64_prod, oxccl_run_simt_u64_prod, oxccl_run_latency_u64_prod: U64, Prod, ProdI64;
            oxccl_run_tma_u64_avg, oxccl_run_simt_u64_avg, oxccl_run_latency_u64_avg: U64, Avg, AvgU64;
            oxccl_run_tma_f8e4m3_sum, oxccl_run_simt_f8e4m3_sum, oxccl_run_latency_f8e4m3_sum: F8e4m3, Sum, SumE4m3;
            oxccl_run_tma_f8e4m3_min, oxccl_run_simt_f8e4m3_min, oxccl_run_latency_f8e4m3_min: F8e4m3, Min, MinE4m3;
            oxccl_run_tma_f8e4m3_max, oxccl_run_simt_f8e4m3_max, oxccl_run_latency_f8e4m3_max: F8e4m3, Max, MaxE4m3;
            oxccl_run_tma_f8e4m3_prod, oxccl_run_simt_f8e4m3_prod, oxccl_run_latency_f8e4m3_prod: F8e4m3, Prod, ProdE4m3;
            oxccl_run_tma_f8e4m3_avg, oxccl_run_simt_f8e4m3_avg, oxccl_run_latency_f8e4m3_avg: F8e4m3, Avg, AvgE4m3;
            oxccl_run_tma_f8e5m2_sum, oxccl_run_simt_f8e5m2_sum, oxccl_run_latency_f8e5m2_sum: F8e5m2, Sum, SumE5m2;
            oxccl_run_tma_f8e5m2_min, oxccl_run_simt_f8e5m2_min, oxccl_run_latency_f8e5m2_min: F8e5m2, Min, MinE5m2;
            oxccl_run_tma_f8e5m2_max, oxccl_run_simt_f8e5m2_max, oxccl_run_latency_f8e5m2_max: F8e5m2, Max, MaxE5m2;
            oxccl_run_tma_f8e5m2_prod, oxccl_run_simt_f8e5m2_prod, oxccl_run_latency_f8e5m2_prod: F8e5m2, Prod, ProdE5m2;
            oxccl_run_tma_f8e5m2_avg, oxccl_run_simt_f8e5m2_avg, oxccl_run_latency_f8e5m2_avg: F8e5m2, Avg, AvgE5m2;
        }
    };
}
#[cfg_attr(not(target_arch = "nvptx64"), allow(unused_imports))]
pub(crate) use engine_kernels;

macro_rules! kernel_table {
    ($($tma:ident, $simt:ident, $latency:ident: $dtype:ident, $op:ident, $combine:ident;)+) => {
        /// Every engine kernel: (dtype, operator, its kernel for each mover in [`Mover::ALL`]'s
        /// order). One kernel per mover and (dtype, operator): one kernel holding every combination
        /// needs several times the registers of any one of them.
        pub const KERNELS: &[(DType, RedOp, [&str; 3])] =
            &[$((DType::$dtype, RedOp::$op, [stringify!($tma), stringify!($simt), stringify!($latency)])),+];
    };
}
engine_kernels!(kernel_table);

const _: () = assert!(Mover::ALL.len() == 3, "KERNELS names one kernel per mover");

/// The kernel of `table` for `mover` reducing `dtype` with `op`, if the table has one.
fn find_kernel(
    table: &[(DType, RedOp, [&'static str; 3])],
    mover: Mover,
    dtype: DType,
    op: RedOp,
) -> Option<&'static str> {
    let (_, _, names) = table.iter().find(|(d, o, _)| *d == dtype && *o == op)?;
    names.get(mover.raw() as usize).copied()
}

/// Name of the engine kernel for `mover` reducing `dtype` with `op` (copies use any operator); the
/// engine has one for every pair.
pub fn kernel_name(mover: Mover, dtype: DType, op: RedOp) -> Option<&'static str> {
    find_kernel(KERNELS, mover, dtype, op)
}

abi_enum!(
    /// How [`TaskKind::ReduceInto`] accumulates (TMA mover only).
    ReduceMode: u8 {
        /// Sources and destination are loaded into shared memory and combined by the CTA's threads.
        Registers = 0,
        /// Sources are reduced into the destination by `cp.reduce.async.bulk`, where supported.
        Tma = 1,
    }
);

/// Task flag: before starting this task, wait until every earlier bulk write of this CTA is complete
/// (`cp.async.bulk.wait_group 0`) and every thread's writes are ordered before it (a CTA barrier), so
/// the task may read or reduce into what earlier tasks wrote.
pub const TASK_AFTER_WRITES: u8 = 1;

/// One unit of work of a CTA. 40 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct Task {
    /// A [`TaskKind`].
    pub kind: u8,
    /// A [`DType`].
    pub dtype: u8,
    /// A [`RedOp`] (ignored by a copy).
    pub op: u8,
    /// Buffer slot of the sources ([`slot`]).
    pub src_slot: u8,
    /// Buffer slot of the destinations.
    pub dst_slot: u8,
    /// [`TASK_AFTER_WRITES`] or 0.
    pub flags: u8,
    /// [`RedOp::Avg`]: the task completes its destinations' reductions, and divides each result by
    /// this many contributions. 0 or 1 for every other task (no division).
    pub divisor: u16,
    /// Bit `r` set: rank `r`'s `src_slot` buffer is a source.
    pub src_ranks: u32,
    /// Bit `r` set: rank `r`'s `dst_slot` buffer is a destination.
    pub dst_ranks: u32,
    /// Byte offset of the range in every source buffer.
    pub src_offset: u64,
    /// Byte offset of the range in every destination buffer.
    pub dst_offset: u64,
    /// Length of the range in bytes (a multiple of the element size).
    pub bytes: u64,
}

/// The work of one CTA: a contiguous range of the launch's task array, run in order. 32 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct TbProgram {
    /// The rank this CTA works for.
    pub rank: u32,
    /// This CTA's barrier slot: its index among its rank's CTAs (`< MAX_CTAS_PER_RANK`), or
    /// `MAX_CTAS_PER_RANK + k` (`k < PAIR_CTAS`) for a CTA that meets one peer in a pair slot
    /// ([`private_slot`]).
    pub cta: u32,
    /// Index of the first task in the launch's task array.
    pub first_task: u32,
    /// Number of tasks.
    pub task_count: u32,
    /// Ranks (bit mask, this rank included or not) whose CTA with the same `cta` index this CTA meets
    /// before its first task (start barrier: their buffers are ready) and after its last (end barrier:
    /// all writes into each other's buffers are complete). 0: no barriers.
    pub barrier_ranks: u32,
    /// Where this CTA's own buffers are in [`LaunchArgs::buffers`]: 0, its `rank`'s row; `t > 0`,
    /// row `t - 1` (a launch of one rank, which announces its row to its peers and reads theirs,
    /// may keep several: a point-to-point launch keeps one per peer).
    pub table: u32,
    /// What this CTA's part of the call is (0: the launch's [`LaunchArgs::call_key`]): announced
    /// and compared with the peer CTAs' at the start barrier, like the launch's key, for launches
    /// whose CTAs meet different peers about different transfers.
    pub key: u32,
    /// Zero.
    pub reserved: u32,
}

/// How far a launch's barrier flags must reach: the scope of the fences, flag loads, stores and
/// atomics of its start and end barriers ([`LaunchArgs::peer_scope`]).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PeerScope {
    /// Peers may be on other GPUs (or in host memory): system scope.
    System = 0,
    /// Every rank the launch meets runs on this GPU (threads or processes sharing it): GPU scope,
    /// which orders at the GPU's L2, shared by all of them, at about half a system fence's cost.
    Gpu = 1,
}

/// Kernel parameters of the engine's kernels ([`kernel_name`]), passed by value. Every field is read at a constant offset
/// (dynamic indexing of a kernel parameter would copy it to local memory): the tables are copied to
/// shared memory at entry.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct LaunchArgs {
    /// Device address of the `TbProgram` array, indexed by `blockIdx.x`.
    pub programs: u64,
    /// Device address of the `Task` array.
    pub tasks: u64,
    /// Device address of this launch's [`Status`].
    pub status: u64,
    /// Every wait gives up after this many nanoseconds and records a [`WaitKind`] in the status.
    pub timeout_ns: u64,
    /// Bytes per source per pipeline stage (TMA mover; multiple of 16).
    pub chunk_bytes: u32,
    /// Pipeline stages (TMA mover; 1..=MAX_STAGES).
    pub stages: u32,
    /// Source slots per stage: the most sources any task of the launch combines in registers.
    pub slots: u32,
    /// A [`ReduceMode`].
    pub reduce_mode: u32,
    /// Suspend-time hint for mbarrier waits (ns; 0: plain spin).
    pub wait_suspend_ns: u32,
    /// Issuing warps of a TMA CTA (0 or 1: one). With `W` > 1 (the launch must not combine sources
    /// in registers; `W` divides `stages`, at most the CTA's warps and [`MAX_ISSUERS`]) lane 0 of warp
    /// `w < W` streams items `w, w + W, …` of every task through stages `w·S/W .. (w+1)·S/W`. A value
    /// that does not fit (the host refuses those) runs with one issuer.
    pub issuers: u32,
    /// Non-zero: a task that combines sources into several destinations stores the result from the
    /// combining threads' registers to each (as single-destination combines always do); zero: one
    /// copy in shared memory, bulk-stored to each.
    pub combine_direct: u32,
    /// What the call is (a hash of its collective, count, types and shape; 0: unchecked): announced
    /// with the rank's buffers, and compared with each peer's at the start barrier, so that ranks
    /// that called different collectives stop with `WaitKind::Mismatch` instead of running plans
    /// that do not fit together.
    pub call_key: u32,
    /// A [`PeerScope`]: how far the flags of this launch's barriers must reach.
    pub peer_scope: u32,
    /// Zero (keeps the next field 8-aligned).
    pub reserved: u32,
    /// Device address of [`PhaseTimes`] records, `MAX_RANKS × MAX_CTAS_PER_RANK` of them indexed
    /// by `rank × MAX_CTAS_PER_RANK + cta`, each CTA's issuer adding its call's phases to its own
    /// (0: none kept; a diagnostic).
    pub phase_times: u64,
    /// Peer-visible workspace base of every rank ([`Workspace`] layout).
    pub workspaces: [u64; MAX_RANKS],
    /// `buffers[rank][slot]`: base address of each rank's buffer in each slot (0 if unused): a
    /// device address in this launch's address space, or a [`region_address`] (memory another
    /// process exported), which the engine resolves through the rank's region table
    /// ([`REGIONS_OFFSET`]). A rank that meets peers at barriers announces its own row to them and
    /// reads theirs at the start barrier (`Workspace::announce`), so a launch of one rank needs
    /// only its own row: peers in other launches (other processes) fill in the rest.
    pub buffers: [[u64; BUFFER_SLOTS]; MAX_RANKS],
}

/// Where a CTA's calls spent their time (`%globaltimer` nanoseconds, summed over `calls`), kept
/// where [`LaunchArgs::phase_times`] is set: a diagnostic of the per-call cost. 64 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct PhaseTimes {
    /// Calls recorded.
    pub calls: u64,
    /// From the end of this CTA's previous call to the start of this one (the first call adds 0):
    /// launch gaps, and the host's pace.
    pub gap_ns: u64,
    /// The start barrier (waiting for every peer's arrival) and the buffer resolution.
    pub start_ns: u64,
    /// The tasks.
    pub tasks_ns: u64,
    /// The completion of the tasks' writes (bulk groups, the fence before telling peers, a CTA
    /// barrier).
    pub drain_ns: u64,
    /// The end barrier (waiting for every peer to be done with this rank's buffers).
    pub end_ns: u64,
    /// When the last recorded call ended.
    pub last_end_ns: u64,
    /// The longest gap.
    pub max_gap_ns: u64,
}

/// Bit 63 of a buffer address: the address is `region << REGION_SHIFT | offset`, an offset into
/// region `region` of the rank's exported memory ([`region_address`]). Device addresses never set it
/// (they are below 2^57).
pub const REGION_ADDRESS: u64 = 1 << 63;
/// Where the region number starts in a [`region_address`].
pub const REGION_SHIFT: u32 = 48;
/// Most regions of exported memory per rank (its workspace is region 0).
pub const MAX_REGIONS: usize = 256;

/// A buffer address that any rank of a communicator can resolve: byte `offset` of region `region`
/// of the buffer's rank (memory that rank exported and every peer mapped, each at an address of its
/// own, kept in its region table). `region < MAX_REGIONS`, `offset < 2^48`.
pub const fn region_address(region: u32, offset: u64) -> u64 {
    REGION_ADDRESS | (region as u64) << REGION_SHIFT | offset
}

/// The (region, offset) of a [`region_address`]; `None` for a plain device address.
pub const fn split_region_address(address: u64) -> Option<(u32, u64)> {
    if address & REGION_ADDRESS == 0 {
        return None;
    }
    Some((((address & !REGION_ADDRESS) >> REGION_SHIFT) as u32, address & ((1 << REGION_SHIFT) - 1)))
}

abi_enum!(
    /// Which bounded wait gave up.
    WaitKind: u32 {
        /// Waiting for a peer to reach the collective (start barrier).
        StartBarrier = 1,
        /// Waiting for a peer to finish writing into this rank's buffers (end barrier).
        EndBarrier = 2,
        /// Waiting for a bulk load to land in shared memory (mbarrier phase).
        BulkLoad = 3,
        /// A descriptor the engine cannot execute (unknown kind, dtype or operator; too many sources).
        BadTask = 4,
        /// A peer's barrier flag ran past this rank's call: the ranks' calls are out of step (a
        /// rank skipped a call, or an earlier call was abandoned on some ranks only). `expected` is
        /// this CTA's barrier count (`seq`), `observed` the peer's.
        OutOfStep = 8,
        /// A peer's CTA gave up this call (its own error is counted too) and withdrew from it: this
        /// CTA stopped rather than touch the buffers of a rank that may have moved on. `expected` is
        /// this CTA's `seq`, `observed` the peer's flag: with its [`BARRIER_REVOKED`] or
        /// [`BARRIER_ABORTED`] bit, or already the count of the peer's next call.
        PeerAborted = 9,
        /// A rank's buffer address names a region of exported memory this rank has not mapped
        /// (`peer`: the buffer's rank, `expected`: the region, `observed`: the address as given or
        /// announced); nothing was moved.
        Unmapped = 10,
        /// A peer's call is another collective than this rank's (`peer`: the peer, `expected`: this
        /// rank's call key, `observed`: the peer's): the ranks did not make the same call.
        Mismatch = 11,
        /// A peer left the communicator (its host aborted or dropped it) before reaching this call
        /// (`peer`: the peer, `expected`: this CTA's `seq`); nothing was moved.
        Withdrawn = 12,
    }
);

/// The call count (`seq`) in a barrier flag; the bits above it say how the call ended.
pub const BARRIER_SEQ: u64 = (1 << 62) - 1;
/// In `arrive[src][cta]`: CTA `cta` of rank `src` gave up the call before this rank's CTA took its
/// arrival; it no longer waits, and this CTA must not start the call's tasks (they would touch
/// `src`'s buffers after its kernel may have ended). A take finds the word revoked, or already
/// holding `src`'s next call, and stops.
pub const BARRIER_REVOKED: u64 = 1 << 63;
/// In `arrive[src][cta]`: this rank's CTA passed the start barrier with that arrival and will touch
/// `src`'s buffers, so `src`'s CTA, should it give up, waits for this CTA's `done` before it exits.
pub const BARRIER_TAKEN: u64 = 1 << 62;
/// In `done[src][cta]`: CTA `cta` of rank `src` gave up the call. It touches none of this rank's
/// buffers any more, but its part of the call is missing.
pub const BARRIER_ABORTED: u64 = 1 << 63;

/// What the engine reports back. The first error wins; `errors` counts all of them. 40 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct Status {
    /// Number of errors recorded (0: success).
    pub errors: u32,
    /// The first error's [`WaitKind`].
    pub kind: u32,
    /// The rank whose CTA recorded it.
    pub rank: u32,
    /// That CTA's index within its rank.
    pub cta: u32,
    /// The peer waited for (or the task index for `BadTask`).
    pub peer: u32,
    /// Zero.
    pub reserved: u32,
    /// The value waited for.
    pub expected: u64,
    /// The last value seen.
    pub observed: u64,
}

/// Layout of a rank's peer-visible workspace (device memory every rank of the communicator can
/// address). Counters only grow; "epochs" live here, not in kernel arguments, so captured launches
/// replay correctly.
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
pub struct Workspace {
    /// `arrive[src][cta]`: written by CTA `cta` of rank `src` when it reaches a collective (its
    /// `seq`), then marked [`BARRIER_TAKEN`] by this rank's CTA `cta` as it passes the start
    /// barrier (a compare-and-swap from the clean `seq`), or [`BARRIER_REVOKED`] by `src` if it
    /// gives up (an atomic OR, which sees a take that came first).
    pub arrive: [[u64; FLAG_SLOTS]; MAX_RANKS],
    /// `done[src][cta]`: written by CTA `cta` of rank `src` when it touches this rank's buffers no
    /// more: its writes into this rank are complete (`seq`), or it gave up (`seq` with
    /// [`BARRIER_ABORTED`]).
    pub done: [[u64; FLAG_SLOTS]; MAX_RANKS],
    /// `seq[private_slot(cta, peer)]`: how many calls CTA slot `cta` of this rank has started
    /// (with `peer` alone, for a pair slot; private to that CTA).
    pub seq: [u64; PRIVATE_SLOTS],
    /// `announce[cta][slot]`: this rank's buffers in the current call, as its launch was given
    /// them ([`LaunchArgs::buffers`]), and its call key (word [`BUFFER_SLOTS`]), written by CTA
    /// `cta` before it arrives at the start barrier
    /// and read by the peers' CTA `cta` once they have taken that arrival: how a rank launched
    /// alone learns its peers' buffers without the host exchanging addresses per call.
    pub announce: [[u64; ANNOUNCE_WORDS]; PRIVATE_SLOTS],
    /// `withdrawn[src]`: non-zero once rank `src` has left the communicator (its host aborted or
    /// dropped it), written by `src`'s host into every rank's workspace: a CTA waiting at a start
    /// barrier for `src` gives up at once instead of at its timeout, since `src` will make no
    /// further call.
    pub withdrawn: [u64; MAX_RANKS],
}

/// Words of a CTA's announcement: the rank's [`BUFFER_SLOTS`] buffers, then the call key
/// ([`LaunchArgs::call_key`]).
pub const ANNOUNCE_WORDS: usize = BUFFER_SLOTS + 1;

impl Workspace {
    /// Byte offset of `arrive[src][cta]`.
    pub const fn arrive_offset(src: usize, cta: usize) -> usize {
        (src * FLAG_SLOTS + cta) * 8
    }
    /// Byte offset of `done[src][cta]`.
    pub const fn done_offset(src: usize, cta: usize) -> usize {
        (MAX_RANKS * FLAG_SLOTS + src * FLAG_SLOTS + cta) * 8
    }
    /// Byte offset of `seq[slot]` (a [`private_slot`]).
    pub const fn seq_offset(slot: usize) -> usize {
        (2 * MAX_RANKS * FLAG_SLOTS + slot) * 8
    }
    /// Byte offset of `announce[slot][word]` (`slot` a [`private_slot`]).
    pub const fn announce_offset(slot: usize, word: usize) -> usize {
        Self::seq_offset(PRIVATE_SLOTS) + (slot * ANNOUNCE_WORDS + word) * 8
    }
    /// Byte offset of `withdrawn[src]`.
    pub const fn withdrawn_offset(src: usize) -> usize {
        Self::announce_offset(PRIVATE_SLOTS, 0) + src * 8
    }
}

/// Byte offset, in a communicator's workspace allocation, of its region table: `MAX_RANKS ×
/// MAX_REGIONS` device addresses, rank-major: where this rank mapped region `k` of rank `r` (its
/// own regions too; 0 where nothing is mapped). Written by the host as regions are mapped, read by
/// the engine to resolve [`region_address`]es; a reset leaves it (it zeroes the [`Workspace`]
/// before it).
pub const REGIONS_OFFSET: usize = core::mem::size_of::<Workspace>().next_multiple_of(4096);
/// Bytes of a communicator's workspace allocation: the [`Workspace`], then the region table.
pub const COMM_WORKSPACE_BYTES: usize = REGIONS_OFFSET + MAX_RANKS * MAX_REGIONS * 8;

/// Byte offset of rank `rank`'s region `region` in the region table.
pub const fn region_entry_offset(rank: usize, region: usize) -> usize {
    REGIONS_OFFSET + (rank * MAX_REGIONS + region) * 8
}

/// Layout of the engine's dynamic shared memory: a header, then `stages × slots × chunk_bytes` of
/// pipeline stages.
pub mod smem {
    use super::{BUFFER_SLOTS, MAX_RANKS, MAX_STAGES};
    /// Offset of the buffer table copied from [`super::LaunchArgs::buffers`].
    pub const BUFFERS: usize = 0;
    /// Offset of the workspace table.
    pub const WORKSPACES: usize = BUFFERS + MAX_RANKS * BUFFER_SLOTS * 8;
    /// Offset of the stage mbarriers (one per stage).
    pub const BARRIERS: usize = WORKSPACES + MAX_RANKS * 8;
    /// Offset of the CTA's abort flag (a `u32`; see the engine's `Ctx::set_abort`).
    pub const ABORT: usize = BARRIERS + MAX_STAGES * 8;
    /// Offset of the launch's [`super::PeerScope`] (a `u32` beside the abort flag, written at entry):
    /// kept here, not in a register, which the movers need.
    pub const PEER_SCOPE: usize = ABORT + 4;
    /// Offset of the collective kernels' phase marks (five `u64`s: when the call began, passed
    /// its start barrier, ended its tasks, completed their writes, then
    /// [`super::LaunchArgs::phase_times`], where they are added).
    pub const PHASE_MARKS: usize = ABORT + 8;
    /// Offset of the collective kernels' barrier ranks (a `u32`: the program's `barrier_ranks`,
    /// written at entry): read again after the tasks rather than held in a register through them.
    pub const PEERS: usize = PHASE_MARKS + 40;
    /// Offset of the first stage (1024-byte aligned; tensor boxes need 128).
    pub const STAGES: usize = (BARRIERS + MAX_STAGES * 8).next_multiple_of(1024);

    const _: () = assert!(PHASE_MARKS.is_multiple_of(8) && PEERS + 4 <= STAGES);

    /// Dynamic shared memory a launch needs; `usize::MAX` (which no device allows) where the
    /// product overflows.
    pub const fn bytes(stages: usize, slots: usize, chunk_bytes: usize) -> usize {
        STAGES.saturating_add(stages.saturating_mul(slots).saturating_mul(chunk_bytes))
    }
}

const _: () = {
    use core::mem::{align_of, size_of};
    assert!(size_of::<Task>() == 40 && align_of::<Task>() == 8);
    assert!(size_of::<TbProgram>() == 32 && align_of::<TbProgram>() == 4);
    assert!(size_of::<Status>() == 40 && align_of::<Status>() == 8);
    assert!(size_of::<LaunchArgs>() == 80 + 8 * MAX_RANKS + 8 * MAX_RANKS * BUFFER_SLOTS);
    assert!(size_of::<PhaseTimes>() == 64);
    // Kernel parameters aligned above 16 bytes break the nvptx backend; 8 is what we pass.
    assert!(align_of::<LaunchArgs>() == 8);
    assert!(size_of::<Workspace>() == Workspace::withdrawn_offset(MAX_RANKS));
    assert!(MAX_REGIONS <= 1 << (63 - REGION_SHIFT), "region numbers fit below the tag bit");
    assert!(MAX_RANKS <= 32, "rank masks are u32");
    assert!(smem::STAGES.is_multiple_of(128));
};

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;
    use std::collections::BTreeSet;
    use std::format;
    use std::string::String;

    /// The kernel naming rule, written out independently of [`KERNELS`]:
    /// `oxccl_run_{mover}_{dtype}_{op}`, the names the entry points in `entry.rs` export (and
    /// `tests/ptx.rs` finds as `.entry` lines in the shipped PTX).
    fn expected_name(mover: Mover, dtype: DType, op: RedOp) -> String {
        let mover = match mover {
            Mover::Tma => "tma",
            Mover::Simt => "simt",
            Mover::Latency => "latency",
        };
        let dtype = match dtype {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::Bf16 => "bf16",
            DType::I32 => "i32",
            DType::U32 => "u32",
            DType::U8 => "u8",
            DType::F64 => "f64",
            DType::I64 => "i64",
            DType::U64 => "u64",
            DType::I8 => "i8",
            DType::F8e4m3 => "f8e4m3",
            DType::F8e5m2 => "f8e5m2",
        };
        let op = match op {
            RedOp::Sum => "sum",
            RedOp::Min => "min",
            RedOp::Max => "max",
            RedOp::Prod => "prod",
            RedOp::Avg => "avg",
        };
        format!("oxccl_run_{mover}_{dtype}_{op}")
    }

    #[test]
    fn every_dtype_and_operator_has_its_own_kernels() {
        let mut names = BTreeSet::new();
        for &d in DType::ALL {
            for &o in RedOp::ALL {
                for &m in Mover::ALL {
                    let got = kernel_name(m, d, o).unwrap_or_else(|| panic!("no kernel for {m:?} {d:?} {o:?}"));
                    assert_eq!(got, expected_name(m, d, o), "{m:?} {d:?} {o:?}");
                    assert!(names.insert(got), "{got} names two kernels");
                }
            }
        }
        let engine = DType::ALL.len() * RedOp::ALL.len();
        assert_eq!(names.len(), Mover::ALL.len() * engine);
        assert_eq!(KERNELS.len(), engine);
    }
}
